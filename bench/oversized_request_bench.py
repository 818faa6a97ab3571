"""Oversized-request benchmark: the control plane's memory while callers send huge gRPC messages.

Counterpart: istiod's gRPC servers, which take at most 4 MiB per message (its default
`--grpcMaxRecvMsgSize`). The attack of issue 25: an unauthenticated client sends
`IstioCertificateRequest`s whose `csr` is --megabytes large to the CA (over TLS, trusting the
root the control plane writes next to its state), one after another; a second round sends
`DeltaDiscoveryRequest`s of the same size on the xDS stream with a valid token (any workload
has one). The table gives the control plane's RSS before, at its peak (VmHWM) and after each
round, and what status the requests ended with. JSON goes to results/oversized_request.json.

Runs `ambient control` from this checkout as a child process on loopback ports; no root needed.

    .venv/bin/python bench/oversized_request_bench.py [--requests 3] [--megabytes 150]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from envoy.service.discovery.v3 import ads_pb2_grpc  # noqa: E402
from envoy.service.discovery.v3.discovery_pb2 import DeltaDiscoveryRequest  # noqa: E402
from labelled_json import write_run  # noqa: E402

from ambient_mesh.wire.istio.v1.auth import ca_pb2, ca_pb2_grpc  # noqa: E402

READY_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 60.0
SETTLE_S = 1.0
MIB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of `pid` in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def reset_hwm(pid: int) -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (proc(5)); our own child.
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def tls_channel(port: int, root_pem: bytes) -> grpc.aio.Channel:
    """A TLS channel to the control plane that sends and receives messages of any size."""
    return grpc.aio.secure_channel(
        f"127.0.0.1:{port}",
        grpc.ssl_channel_credentials(root_certificates=root_pem),
        options=[
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", -1),
            ("grpc.ssl_target_name_override", "istiod.istio-system.svc"),
        ],
    )


async def send_ca(port: int, root_pem: bytes, size: int) -> str:
    async with tls_channel(port, root_pem) as channel:
        stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)
        request = ca_pb2.IstioCertificateRequest(csr="A" * size, validity_duration=3600)
        try:
            await stub.CreateCertificate(request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            return e.code().name
        return "OK"


async def send_xds(port: int, root_pem: bytes, token: str, size: int) -> str:
    async with tls_channel(port, root_pem) as channel:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        request = DeltaDiscoveryRequest(type_url="A" * size)

        async def requests():  # noqa: ANN202
            yield request
            await asyncio.sleep(SETTLE_S)

        call = stub.DeltaAggregatedResources(
            requests(),
            metadata=(("authorization", f"Bearer {token}"),),
            timeout=CALL_TIMEOUT_S,
        )
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            return e.code().name
        return "OK"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--megabytes", type=int, default=150)
    parser.add_argument("--xds-megabytes", type=int, default=64)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=str(HERE / "results" / "oversized_request.json"))
    args = parser.parse_args()
    size = args.megabytes * 1000 * 1000
    xds_size = args.xds_megabytes * MIB
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="oversized-") as tmp:
        cfg = Path(tmp) / "cfg"
        cfg.mkdir()
        state = Path(tmp) / "state"
        ambient = [sys.executable, "-m", "ambient_mesh"]
        proc = subprocess.Popen(
            [
                *ambient,
                "control",
                "--dir",
                str(cfg),
                "--state-dir",
                str(state),
                "--listen",
                f"127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=ROOT,
        )
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                        break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(
                            f"control plane did not start: {proc.stderr.read().decode()}"
                        ) from None
                    time.sleep(0.1)
            time.sleep(SETTLE_S)
            root_pem = (state / "root-cert.pem").read_bytes()
            token = subprocess.run(
                [*ambient, "control", "token", "--sa", "ns1/sa1", "--state-dir", str(state)],
                check=True,
                capture_output=True,
                text=True,
                cwd=ROOT,
            ).stdout.strip()
            rounds = []
            for name, send, each in (
                ("CA, no token", lambda: send_ca(port, root_pem, size), size),
                ("xDS, workload token", lambda: send_xds(port, root_pem, token, xds_size), xds_size),
            ):
                before, _ = rss_kib(proc.pid)
                reset_hwm(proc.pid)
                statuses = []
                for _ in range(args.requests):
                    statuses.append(asyncio.run(send()))
                time.sleep(SETTLE_S)
                after, peak = rss_kib(proc.pid)
                rounds.append(
                    {
                        "round": name,
                        "requests": args.requests,
                        "request_mib": round(each / MIB, 1),
                        "rss_before_mib": round(before / 1024, 1),
                        "rss_peak_mib": round(peak / 1024, 1),
                        "rss_after_mib": round(after / 1024, 1),
                        "statuses": statuses,
                    }
                )
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    print(f"{'round':<22} {'n x MiB':>10} {'RSS before':>11} {'peak':>9} {'after':>9}  statuses")
    for r in rounds:
        print(
            f"{r['round']:<22} {r['requests']:>3} x {r['request_mib']:>5} {r['rss_before_mib']:>10}M"
            f" {r['rss_peak_mib']:>8}M {r['rss_after_mib']:>8}M  {','.join(r['statuses'])}"
        )
    write_run(args.out, args.label, rounds=rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
