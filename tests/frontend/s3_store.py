"""An S3-compatible store for the tests (moto's standalone server on 127.0.0.1, talked to by
the real boto3 / s3fs clients), and a TCP proxy in front of it that can be made to hang or
to answer 500, so the store's faults are real network behaviour, never a mocked client."""

from __future__ import annotations

import os
import re
import socket
import threading
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
BUCKET = "adapters"
_REQUEST_LINE = re.compile(rb"(GET|HEAD|PUT|POST|DELETE) /")


@contextmanager
def moto_store():
    """(endpoint URL, boto3 client) of a fresh moto server holding an empty BUCKET (and
    nothing an earlier one of this process held)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        # moto's backends live in this process, shared by its servers: start from nothing
        httpx.post(f"{url}/moto-api/reset", timeout=30).raise_for_status()
        client = boto3.client("s3", endpoint_url=url, **_boto_credentials())
        client.create_bucket(Bucket=BUCKET)
        yield url, client
    finally:
        server.stop()


def _boto_credentials() -> dict:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


def put_folder(client, prefix: str, folder: Path) -> None:
    """Every file of `folder` as an object under `prefix/`."""
    for f in sorted(folder.iterdir()):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{f.name}", Body=f.read_bytes())


@contextmanager
def aws_environment(endpoint: str):
    """The process's AWS environment pointed at `endpoint` (restored after)."""
    wanted = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class FaultyProxy:
    """A TCP proxy to `upstream` (host, port) on 127.0.0.1; mode "pass" forwards, "hang"
    accepts and never answers, "error" answers every request 500. requests: the method of
    each request forwarded, in order ("GET", "HEAD", ...)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream, self.mode = upstream, "pass"
        self.requests: list[str] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.mode == "hang":
                self._held.append(conn)  # open, silent
            elif self.mode == "error":
                threading.Thread(target=self._error, args=(conn,), daemon=True).start()
            else:
                up = socket.create_connection(self.upstream)
                for a, b, seen in ((conn, up, self.requests), (up, conn, None)):
                    threading.Thread(target=_pipe, args=(a, b, seen), daemon=True).start()

    @staticmethod
    def _error(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            body = b"<Error><Code>InternalError</Code><Message>down</Message></Error>"
            head = f"HTTP/1.1 500 Internal Server Error\r\nContent-Length: {len(body)}\r\n"
            conn.sendall(head.encode() + b"Connection: close\r\n\r\n" + body)

    def close(self) -> None:
        self.sock.close()
        for c in self._held:
            c.close()


def _pipe(src: socket.socket, dst: socket.socket, requests: list[str] | None = None) -> None:
    """src's bytes to dst; requests: where the method of each request line seen goes (a
    client's request line starts the first chunk it sends for it)."""
    try:
        while data := src.recv(65536):
            if requests is not None and (m := _REQUEST_LINE.match(data)):
                requests.append(m.group(1).decode())
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
