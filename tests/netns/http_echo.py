"""An HTTP app for waypoint tests: answers every request with what it received, as JSON.

`python http_echo.py --port P --name N --log FILE`: each request is answered 200 with
{"name", "method", "path", "headers"} and logged to FILE as one JSON line. Paths it acts on:
`/status/<code>` answers that status; `/delay/<ms>` waits that long first (at most 10 s);
`/flaky/<key>/<n>` answers 503 to the first n requests for that key, then 200.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_flaky: dict[str, int] = {}
_lock = threading.Lock()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    log = open(args.log, "a", buffering=1)  # noqa: SIM115 - open for the process's life

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            length = min(int(self.headers.get("content-length") or 0), 1 << 20)
            body = self.rfile.read(length) if length else b""
            record = {
                "name": args.name,
                "method": self.command,
                "path": self.path,
                # Repeated headers joined as one list value (HTTP's own folding).
                "headers": {k.lower(): ",".join(self.headers.get_all(k) or ()) for k in self.headers},
                "body_bytes": len(body),
            }
            with _lock:
                log.write(json.dumps(record) + "\n")
            parts = self.path.split("?", 1)[0].strip("/").split("/")
            status = 200
            if parts[0] == "status" and len(parts) > 1 and parts[1].isdigit():
                status = int(parts[1])
            elif parts[0] == "delay" and len(parts) > 1 and parts[1].isdigit():
                time.sleep(min(int(parts[1]), 10_000) / 1000)
            elif parts[0] == "flaky" and len(parts) > 2 and parts[2].isdigit():
                with _lock:
                    seen = _flaky.get(parts[1], 0)
                    _flaky[parts[1]] = seen + 1
                status = 503 if seen < int(parts[2]) else 200
            data = json.dumps(record).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = do_PATCH = _answer

        def log_message(self, format: str, *a: object) -> None:  # noqa: A002
            pass

    ThreadingHTTPServer(("0.0.0.0", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
