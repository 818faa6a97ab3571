"""A tiny TCP echo server, run inside a network namespace as a test workload.

    python echo.py --port 8080

Listens dual-stack on [::]:<port>, prints `listening <port>` once, then `accepted <ip> <port>`
for every connection (IPv4 peers unmapped), and echoes each connection until the peer closes.
Counterpart: the ReadWrite echo server of ztunnel's test helpers.
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import socket
import sys
import threading

READ_BYTES = 65536


def serve_one(conn: socket.socket) -> None:
    with conn:
        while True:
            try:
                data = conn.recv(READ_BYTES)
            except OSError:
                return
            if not data:
                return
            conn.sendall(data)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    listener = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    listener.bind(("::", args.port))
    listener.listen(64)
    print(f"listening {args.port}", flush=True)
    while True:
        conn, peer = listener.accept()
        ip = ipaddress.ip_address(peer[0])
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        print(f"accepted {ip} {peer[1]}", flush=True)
        threading.Thread(target=serve_one, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
