"""A real S3-compatible server on this machine for the object-storage tests: moto's server mode on
127.0.0.1 at a free port, with dummy credentials. Training processes reach it through the standard AWS
environment (``AWS_ENDPOINT_URL``...), as they would reach a bucket on-premises."""

from __future__ import annotations

import os
import socket
import threading
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


class Relay:
    """A TCP relay between the clients and a server that can be paused: paused, it accepts connections and takes
    what a client sends up to what its sockets hold, and passes nothing on either way (a store that stopped
    answering: a process stopped, a machine overloaded). Real sockets, real bytes."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.flowing = threading.Event()
        self.flowing.set()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.target)
            self.sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pass, args=(source, sink), daemon=True).start()

    def _pass(self, source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                data = source.recv(2**16)
                self.flowing.wait()  # paused: the bytes wait here, and the next ones in the sockets
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                sink.sendall(data)
            except OSError:
                return

    def pause(self) -> None:
        self.flowing.clear()

    def resume(self) -> None:
        self.flowing.set()

    def close(self) -> None:
        self.flowing.set()
        for sock in self.sockets:
            sock.close()


@contextmanager
def relayed(env: dict[str, str]) -> Iterator[Relay]:
    """The server of ``env`` reached through a :class:`Relay` (``AWS_ENDPOINT_URL`` names it in the block)."""
    host, port = env["AWS_ENDPOINT_URL"].removeprefix("http://").rsplit(":", 1)
    relay = Relay((host, int(port)))
    saved = os.environ["AWS_ENDPOINT_URL"]
    os.environ["AWS_ENDPOINT_URL"] = relay.endpoint
    _forget_endpoints()
    try:
        yield relay
    finally:
        relay.close()
        os.environ["AWS_ENDPOINT_URL"] = saved
        _forget_endpoints()
