"""The attacker's side of tests/netns/test_local_surfaces.py, run as an unprivileged local user.

Each subcommand makes one attack and prints one JSON object saying what came back; it never
decides whether the attack worked (the test does, from the victim's side too).

    python surface_attacker.py connect PATH [--seqpacket] [--send TEXT]
    python surface_attacker.py ca-oversize PORT ROOT_PEM MEGABYTES COUNT
    python surface_attacker.py ca-token PORT ROOT_PEM TOKEN [CSR_FILE] [--plaintext]
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys

MIB = 1000 * 1000
CALL_TIMEOUT_S = 60.0
SERVER_NAME = "istiod.istio-system.svc"


def connect(path: str, seqpacket: bool, send: str | None) -> dict[str, object]:
    kind = socket.SOCK_SEQPACKET if seqpacket else socket.SOCK_STREAM
    with socket.socket(socket.AF_UNIX, kind) as sock:
        sock.settimeout(10)
        try:
            sock.connect(path)
        except OSError as e:
            return {"connected": False, "error": e.strerror}
        try:
            if send is not None:
                sock.sendall(send.encode())
                if not seqpacket:
                    sock.shutdown(socket.SHUT_WR)
            data = sock.recv(65536)
        except OSError as e:
            return {"connected": True, "error": e.strerror, "received": ""}
        return {"connected": True, "received": data.decode(errors="replace")}


async def create_certificate(port: int, root_pem: bytes, csr: str, token: str | None, plaintext: bool) -> str:
    import grpc

    from ambient_mesh.wire.istio.v1.auth import ca_pb2, ca_pb2_grpc

    options = [
        ("grpc.max_send_message_length", -1),
        ("grpc.max_receive_message_length", -1),
        ("grpc.ssl_target_name_override", SERVER_NAME),
    ]
    target = f"127.0.0.1:{port}"
    if plaintext:
        channel = grpc.aio.insecure_channel(target, options=options)
    else:
        channel = grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(root_pem), options=options)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    async with channel:
        stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)
        try:
            await stub.CreateCertificate(
                ca_pb2.IstioCertificateRequest(csr=csr, validity_duration=3600),
                metadata=metadata,
                timeout=CALL_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"
    return "OK"


def main(argv: list[str]) -> dict[str, object]:
    command, *args = argv
    if command == "connect":
        send = args[args.index("--send") + 1] if "--send" in args else None
        return connect(args[0], "--seqpacket" in args, send)
    if command == "ca-oversize":
        port, root, megabytes, count = int(args[0]), args[1], int(args[2]), int(args[3])
        root_pem = open(root, "rb").read()  # noqa: SIM115 - the root is public
        body = "A" * (megabytes * MIB)
        return {
            "statuses": [
                asyncio.run(create_certificate(port, root_pem, body, None, False)) for _ in range(count)
            ]
        }
    if command == "ca-token":
        port, root, token = int(args[0]), args[1], args[2]
        csr = open(args[3]).read() if len(args) > 3 and not args[3].startswith("--") else "x"  # noqa: SIM115
        root_pem = open(root, "rb").read()  # noqa: SIM115
        return {"status": asyncio.run(create_certificate(port, root_pem, csr, token, "--plaintext" in args))}
    raise SystemExit(f"unknown attack {command!r}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
