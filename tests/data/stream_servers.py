"""Real servers on 127.0.0.1 for the object-storage tests: an HTTP server with byte ranges
(what nginx, S3 and GCS answer; Python's own handler ignores ``Range``) and moto's S3 server.
Both run in a thread of the test process, on a free port."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import urllib.request
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class RangeHandler(SimpleHTTPRequestHandler):
    """Files with ``Range: bytes=a-b`` support; folders as the standard HTML listing."""

    def do_GET(self) -> None:
        self._serve(body=True)

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def _serve(self, body: bool) -> None:
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            return super().do_GET() if body else super().do_HEAD()  # listing or 404
        data = path.read_bytes()
        start, end, status = 0, len(data) - 1, 200
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", ""))
        if m:
            if m.group(1):
                start = int(m.group(1))
                end = min(int(m.group(2)), end) if m.group(2) else end
            else:  # a suffix: the last N bytes
                start = max(len(data) - int(m.group(2)), 0)
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/x-tar")
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.end_headers()
        if body:
            self.wfile.write(data[start : end + 1])

    def log_message(self, *args: object) -> None:  # quiet
        pass


class PlainHandler(SimpleHTTPRequestHandler):
    """Python's own handler (``python -m http.server``): ``Range`` ignored, quiet."""

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def http_server(root: Path, ranges: bool = True) -> Iterator[str]:
    """Serve `root` at the URL this yields (``http://127.0.0.1:PORT``); `ranges=False`:
    Python's own handler, which answers every request with the whole file."""
    kind = RangeHandler if ranges else PlainHandler

    def handler(*args: object) -> SimpleHTTPRequestHandler:
        return kind(*args, directory=str(root))  # type: ignore[arg-type]

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """moto's S3 server; yields the environment that points s3fs (botocore) at it, already
    set in this process (restored after)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    # moto keeps its buckets in this process, across servers: every server starts empty
    urllib.request.urlopen(
        urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")
    ).close()
    env = {**S3_ENV, "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # no client of an earlier endpoint
        yield env
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
