"""moto's S3 server on 127.0.0.1 in its own process, with a WSGI middleware that counts the
requests it serves: how many at once (the most in flight), and how many of each kind
(``list`` = ListObjects(V2) of a bucket, ``head``, ``get``, ``put``, ``other``).

    python benchmarks/s3server.py            # prints "PORT <n>" once it listens
    GET  http://127.0.0.1:<n>/__counts       # the counts as JSON
    POST http://127.0.0.1:<n>/__counts       # the counts as JSON, then zeroed

Used by tests/pipelines/ingest/test_listing.py and benchmarks/rehearsal.py: a separate process, so
that the driver's heap measured with tracemalloc holds only the client's side.
"""
from __future__ import annotations

import json
import logging
import sys
import threading


class Counting:
    """WSGI middleware: in-flight and per-kind request counts (each request held open until
    its response body is consumed)."""

    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> dict:
        with getattr(self, "lock", threading.Lock()):
            old = getattr(self, "counts", None)
            self.counts = {"in_flight": 0, "max_in_flight": 0, "total": 0, "list": 0, "head": 0, "get": 0,
                           "put": 0, "other": 0}
            return old

    @staticmethod
    def kind(environ) -> str:
        method, path, qs = environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", "")
        bucket_only = path.strip("/").count("/") == 0
        if method == "GET" and bucket_only and ("list-type" in qs or "prefix" in qs or "delimiter" in qs):
            return "list"
        return {"HEAD": "head", "GET": "get", "PUT": "put"}.get(method, "other")

    def __call__(self, environ, start_response):
        if environ.get("PATH_INFO") == "/__counts":
            with self.lock:
                body = json.dumps(self.counts).encode()
                if environ["REQUEST_METHOD"] == "POST":
                    self.counts = {k: 0 for k in self.counts}
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        kind = self.kind(environ)
        with self.lock:
            c = self.counts
            c["in_flight"] += 1
            c["total"] += 1
            c[kind] += 1
            c["max_in_flight"] = max(c["max_in_flight"], c["in_flight"])
        try:
            return list(self.app(environ, start_response))
        finally:
            with self.lock:
                self.counts["in_flight"] -= 1


def serve(port: int = 0) -> None:
    from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = Counting(DomainDispatcherApplication(create_backend_app))
    srv = make_server("127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler)
    print(f"PORT {srv.server_port}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
