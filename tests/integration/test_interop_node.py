"""HBONE against an HTTP/2 stack we did not write: Node.js's http2 module (nghttp2 + OpenSSL).

Both directions: Node as the HBONE client of our inbound (15008), and Node as the HBONE server
our outbound pool connects to. Skipped when `node` is not installed (scripts/setup.sh installs it).
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from pathlib import Path

import pytest

from ambient_mesh.identity.spiffe import Identity
from tests.helpers.tls_key_updates import key_updates_both_ways
from tests.interop.envoy import write_identity as envoy_write_identity

from .mesh import CLIENT_IP, ECHO_PORT, SERVER_IP, echo_handler, local_config, start_proxy

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node (Node.js) is not installed; run scripts/setup.sh")

PAYLOAD_BYTES = 8 * 1024 * 1024

NODE_CLIENT = r"""
const http2 = require('http2'); const fs = require('fs'); const crypto = require('crypto');
const [dir, host, authority, size] = process.argv.slice(1);
const session = http2.connect(`https://${host}:15008`, {
  key: fs.readFileSync(dir + '/key.pem'), cert: fs.readFileSync(dir + '/chain.pem'),
  ca: fs.readFileSync(dir + '/root.pem'), ALPNProtocols: ['h2'], servername: '',
  checkServerIdentity: () => undefined, minVersion: 'TLSv1.3', maxVersion: 'TLSv1.3'});
session.on('error', (e) => { console.error('session error', e.message); process.exit(3); });
const req = session.request({':method': 'CONNECT', ':authority': authority});
req.on('response', (headers) => {
  const status = headers[':status'];
  if (status !== 200) { console.log(JSON.stringify({status})); session.close(); return; }
  const block = crypto.createHash('sha256').update('seed').digest();
  const sent = crypto.createHash('sha256'), got = crypto.createHash('sha256');
  let received = 0, remaining = Number(size);
  req.on('data', (d) => { got.update(d); received += d.length; });
  req.on('end', () => {
    console.log(JSON.stringify({status, received, sent: sent.digest('hex'), got: got.digest('hex'),
      baggage: headers['baggage'] || null}));
    session.close();
  });
  const chunk = Buffer.concat(Array(2048).fill(block));  // 64 KiB
  function write() {
    while (remaining > 0) {
      const piece = chunk.subarray(0, Math.min(chunk.length, remaining));
      remaining -= piece.length; sent.update(piece);
      if (!req.write(piece)) { req.once('drain', write); return; }
    }
    req.end();
  }
  write();
});
"""

NODE_SERVER = r"""
const http2 = require('http2'); const fs = require('fs'); const net = require('net');
const [dir, host] = process.argv.slice(1);
const server = http2.createSecureServer({
  key: fs.readFileSync(dir + '/key.pem'), cert: fs.readFileSync(dir + '/chain.pem'),
  ca: fs.readFileSync(dir + '/root.pem'), requestCert: true, rejectUnauthorized: true,
  ALPNProtocols: ['h2'], minVersion: 'TLSv1.3', maxVersion: 'TLSv1.3'});
server.on('stream', (stream, headers) => {
  if (headers[':method'] !== 'CONNECT') { stream.respond({':status': 400}); stream.end(); return; }
  const peer = stream.session.socket.getPeerCertificate();
  const [h, p] = headers[':authority'].split(':');
  const upstream = net.connect(Number(p), h, () => {
    stream.respond({':status': 200, 'x-peer-uri': String(peer.subjectaltname || '')});
    upstream.pipe(stream); stream.pipe(upstream);
  });
  upstream.on('error', () => { stream.respond({':status': 503}); stream.end(); });
});
server.listen(15008, host, () => console.log('listening'));
"""


def write_identity(directory: Path, identity: Identity) -> Path:
    """The identity's key.pem, chain.pem and root.pem in `directory` (the Envoy tests' writer)."""
    return envoy_write_identity(directory, identity).key.parent


async def run_node(script: str, *args: str, timeout: float = 60) -> str:
    proc = await asyncio.create_subprocess_exec(
        NODE, "-e", script, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, f"node exited {proc.returncode}: {err.decode()}"
    return out.decode()


async def test_node_http2_client_through_our_hbone_server(tmp_path, monkeypatch):
    import json

    certs = write_identity(tmp_path / "client", Identity("cluster.local", "default", "client"))
    echo = await asyncio.start_server(echo_handler, SERVER_IP, ECHO_PORT)
    server = await start_proxy("server", SERVER_IP, local_config())
    try:
        # KeyUpdates both ways inside the transfer (tests/helpers/tls_key_updates.py).
        counts = key_updates_both_ways(monkeypatch)
        out = await run_node(
            NODE_CLIENT, str(certs), SERVER_IP, f"{SERVER_IP}:{ECHO_PORT}", str(PAYLOAD_BYTES)
        )
        assert counts.ours >= 4 and counts.peers >= 4, counts
        result = json.loads(out)
        assert result["status"] == 200
        assert result["received"] == PAYLOAD_BYTES
        assert result["sent"] == result["got"]
        assert "k8s.namespace.name=default" in result["baggage"]
        # and a refused CONNECT reaches Node as a plain HTTP/2 status
        out = await run_node(NODE_CLIENT, str(certs), SERVER_IP, f"{SERVER_IP}:9", "0")
        assert json.loads(out) == {"status": 503}
    finally:
        await server.drain(0.5)
        echo.close()
        await echo.wait_closed()


async def test_our_hbone_client_through_a_node_http2_server(tmp_path, monkeypatch):
    certs = write_identity(tmp_path / "server", Identity("cluster.local", "default", "server"))
    echo = await asyncio.start_server(echo_handler, SERVER_IP, ECHO_PORT)
    counts = key_updates_both_ways(monkeypatch)  # KeyUpdates both ways (tests/helpers/tls_key_updates.py)
    node = await asyncio.create_subprocess_exec(
        NODE, "-e", NODE_SERVER, str(certs), SERVER_IP, stdout=asyncio.subprocess.PIPE
    )
    client = None
    try:
        assert (await asyncio.wait_for(node.stdout.readline(), 20)).strip() == b"listening"
        client = await start_proxy("client", CLIENT_IP, local_config())
        socks = client.listeners["socks5"].bound_address
        reader, writer = await asyncio.open_connection(str(socks.ip), socks.port)
        writer.write(b"\x05\x01\x00\x05\x01\x00\x01" + bytes([127, 0, 0, 3]) + ECHO_PORT.to_bytes(2, "big"))
        await reader.readexactly(12)
        block = hashlib.sha256(b"x").digest() * 2048
        sent, got = hashlib.sha256(), hashlib.sha256()

        async def send():
            for _ in range(PAYLOAD_BYTES // len(block)):
                writer.write(block)
                sent.update(block)
                await writer.drain()
            writer.write_eof()

        async def receive():
            n = 0
            while data := await reader.read(1 << 20):
                got.update(data)
                n += len(data)
            return n

        _, n = await asyncio.wait_for(asyncio.gather(send(), receive()), 60)
        assert n == PAYLOAD_BYTES and sent.hexdigest() == got.hexdigest()
        assert counts.ours >= 4 and counts.peers >= 4, counts
        writer.close()
    finally:
        if client is not None:
            await client.drain(0.5)
        node.kill()
        await node.wait()
        echo.close()
        await echo.wait_closed()
