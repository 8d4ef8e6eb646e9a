"""A real S3-compatible server on this machine for the object-storage tests: moto's server mode on
127.0.0.1 at a free port, with dummy credentials. Training processes reach it through the standard AWS
environment (``AWS_ENDPOINT_URL``...), as they would reach a bucket on-premises."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from moto.server import ThreadedMotoServer

_SERVERS: dict[str, ThreadedMotoServer] = {}  # by endpoint: the server answering there now


@contextmanager
def s3_server(bucket: str = "ckpt") -> Iterator[dict[str, str]]:
    """Start the server and create ``bucket``; yields the environment that reaches it (also set in this
    process's own environment while the server runs, for s3fs here)."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    _SERVERS[endpoint] = server
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    _forget_endpoints()
    try:
        s3().mkdir(bucket)
        yield env
    finally:
        _SERVERS.pop(endpoint).stop()
        _forget_endpoints()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def server_down(env: dict[str, str]) -> Iterator[None]:
    """The server of ``env`` (from :func:`s3_server`) stopped for the block: a store that went away. Its
    objects are kept (moto's state lives in this process) and the same endpoint answers again after it."""
    endpoint = env["AWS_ENDPOINT_URL"]
    _SERVERS[endpoint].stop()
    try:
        yield
    finally:
        host, port = endpoint.removeprefix("http://").rsplit(":", 1)
        server = ThreadedMotoServer(ip_address=host, port=int(port), verbose=False)
        server.start()
        _SERVERS[endpoint] = server
        _forget_endpoints()


def _forget_endpoints() -> None:
    """s3fs keeps its instances, each bound to the endpoint it first connected to (another test's server)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def s3() -> Any:
    """A fresh s3fs filesystem (no cached listings) on the server of the environment."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)
