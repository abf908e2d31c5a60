"""A stand-in single-user server for the crowd benchmarks: answers every GET with 200.

Hundreds of real jupyter servers do not fit on one small machine; the hub only needs a
process that answers at JUPYTERHUB_SERVICE_URL. Arguments (--ServerApp...) are ignored.
"""

import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


url = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
ThreadingHTTPServer((url.hostname or "127.0.0.1", url.port), Handler).serve_forever()
