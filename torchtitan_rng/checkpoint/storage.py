"""Where checkpoints are kept: a local folder, or an object store named by a URL (``s3://``, ``gs://``,
``memory://``...), behind one small interface.

:class:`Storage` is the few operations a checkpoint needs, on ``/``-separated paths of one filesystem; a
:class:`Location` is a path on one, with path-like methods (``/``, ``name``, ``read_text``...). Two storages:

* :class:`LocalStorage` — a folder on a local or shared POSIX filesystem (also ``file://``). It renames
  atomically, so a save is written to ``step-N.partial`` and renamed (layout.Renamed). It never follows a link:
  a symlink, or anything that is neither a regular file nor a folder, is an entry of kind ``"other"``.
* :class:`FsspecStorage` — any fsspec filesystem. Object stores have no atomic rename: a save is written in
  place and counts only once its completion marker, written last, is there (layout.Marked). Credentials and
  endpoints come from each backend's own environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...,
  ``GOOGLE_APPLICATION_CREDENTIALS``); its package (s3fs, gcsfs) is imported only when a URL needs it. A store
  that fails or does not answer (a bounded wait: :data:`S3_ANSWER`) is one :class:`CheckpointError` naming it.

The folder a user names is where the checkpoints are, a symlink or not (:func:`checkpoint_folder` follows that
one link); links inside it are never followed.

:func:`locate` is the one place that tells a URL from a path. This module imports none of the checkpoint code:
DCP's readers and writers for each storage are dcp_io.py's.
"""

from __future__ import annotations

import copy
import errno
import functools
import mmap
import os
import re
import shutil
import socket
import stat
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from torchtitan_rng.errors import CheckpointError, first_line

# A URL's scheme (two letters at least: "C:" is a Windows drive, not a scheme).
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+)://")
# A scheme with one slash ("s3:/bucket/x"): a URL mistyped, never a folder anyone meant.
_ONE_SLASH = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+):/(?!/)")
# Which extra installs a backend that fsspec does not bring itself.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_READ_CHUNK = 64 * 2**20  # a multiple of the checksum's block (integrity.BLOCK_BYTES)
# How long an S3 request waits for an answer (connecting, then each read), sent once by botocore: s3fs sends
# it again on a timeout, 5 times in all, so a store that does not answer fails the run after about 5 x 15 s
# (with botocore's own retries too, it took minutes). $FSSPEC_S3, fsspec's own configuration
# ('{"config_kwargs": {"read_timeout": 300}}'), wins over these, key by key. An upload waits as long for the
# store to take its bytes (:func:`_bounded_uploads`).
S3_ANSWER = {"config_kwargs": {"connect_timeout": 15, "read_timeout": 15, "retries": {"total_max_attempts": 1}}}
# S3's rule for a bucket's name: 3-63 lowercase letters, digits, dots and hyphens, a letter or digit at each end.
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_BUCKETED = {"s3", "s3a", "gs", "gcs"}  # stores whose first path component is a bucket that must exist


class Storage(ABC):
    """The operations a checkpoint needs. Paths are strings of this storage; nothing follows a link."""

    # Whether a folder can be renamed atomically (then a save is renamed into place, else marked complete).
    atomic_rename: bool

    @abstractmethod
    def kind(self, path: str) -> str | None:
        """"dir", "file", "other" (a symlink, dangling or not, a loop, a device...), or None: nothing there."""

    @abstractmethod
    def names(self, folder: str) -> list[str]:
        """The names of the entries directly in ``folder`` ([] when it does not exist)."""

    @abstractmethod
    def files(self, folder: str) -> list[str]:
        """Every regular file below ``folder``, relative, ``/``-separated (links not followed)."""

    @abstractmethod
    def size(self, path: str) -> int: ...

    @abstractmethod
    def read(self, path: str) -> bytes: ...

    @abstractmethod
    def write(self, path: str, data: bytes) -> None:
        """Write a whole file (its folder is created when needed)."""

    @abstractmethod
    def create(self, path: str, data: bytes) -> bool:
        """Write a new file only where there is none (its folder is created when needed): False when one is
        there. Of several processes creating one path at once, exactly one succeeds."""

    @abstractmethod
    def chunks(self, path: str) -> Iterator[Any]:
        """The file's bytes as buffers of ``_READ_CHUNK`` bytes (the last one shorter), for its checksum."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Remove a file or a folder with everything below it; nothing there is not an error."""

    @abstractmethod
    def makedirs(self, path: str) -> None: ...

    @abstractmethod
    def rename(self, path: str, new_path: str) -> None:
        """Atomic (only where ``atomic_rename``)."""

    @abstractmethod
    def join(self, folder: str, name: str) -> str: ...

    @abstractmethod
    def display(self, path: str) -> str:
        """How messages name ``path`` (a local path, or a URL)."""

    def check(self, folder: str) -> None:
        """Refuse, in one line, a checkpoint folder this storage cannot keep checkpoints in (before a run)."""


class LocalStorage(Storage):
    atomic_rename = True

    def kind(self, path: str) -> str | None:
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):  # nothing there (a parent that is a file holds nothing)
            return None
        except OSError:  # a path through a loop, a name too long...: not ours either way
            return "other"
        return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"

    def names(self, folder: str) -> list[str]:
        if self.kind(folder) != "dir":
            return []
        return sorted(os.listdir(folder))

    def files(self, folder: str) -> list[str]:
        found = []
        for parent, _, names in os.walk(folder):  # os.walk does not descend into links
            found += [os.path.relpath(os.path.join(parent, name), folder).replace(os.sep, "/") for name in names
                      if self.kind(os.path.join(parent, name)) == "file"]
        return sorted(found)

    def size(self, path: str) -> int:
        return os.lstat(path).st_size

    def read(self, path: str) -> bytes:
        return Path(path).read_bytes()

    def write(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        Path(path).write_bytes(data)

    def create(self, path: str, data: bytes) -> bool:
        # Written aside, then linked into place: a reader never sees the file without its bytes, and link()
        # fails where a file is.
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        aside = f"{path}.{os.getpid()}.{threading.get_ident()}.new"
        Path(aside).write_bytes(data)
        try:
            os.link(aside, path)
        except FileExistsError:
            return False
        finally:
            os.unlink(aside)
        return True

    def chunks(self, path: str) -> Iterator[Any]:
        # Memory-mapped: the checksum sums the page cache in place, with no copy.
        if self.size(path) == 0:
            return
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                yield view
            finally:
                view.release()

    def remove(self, path: str) -> None:
        kind = self.kind(path)
        if kind == "dir":
            shutil.rmtree(path, ignore_errors=True)
        elif kind is not None:
            os.unlink(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def rename(self, path: str, new_path: str) -> None:
        os.replace(path, new_path)

    def join(self, folder: str, name: str) -> str:
        return os.path.join(folder, name)

    def display(self, path: str) -> str:
        return path

    def check(self, folder: str) -> None:
        """A checkpoint folder that is there must be a folder: a file, a symlink loop or a link to a file would
        fail only at the first save, hours in."""
        kind = self.kind(folder)
        if kind == "file":
            raise CheckpointError(f"checkpoint folder {folder} is a file, not a folder: move it away, or pass "
                                  "another --checkpoint.folder")
        if kind == "other":
            try:
                os.stat(folder)
                what = "a symlink to a file" if os.path.islink(folder) else "a special file"
            except OSError as err:
                what = "a symlink loop" if err.errno == errno.ELOOP else f"unreadable ({err.strerror})"
            link = f" ({folder} -> {os.readlink(folder)})" if os.path.islink(folder) else ""
            raise CheckpointError(f"checkpoint folder {folder} is {what}{link}, not a folder: point it at a folder, "
                                  "or pass another --checkpoint.folder")


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _answered(method: _Method) -> _Method:
    """A store's failure (unreachable, no answer in time, no credentials, access denied...) as one line naming
    the store; FileNotFoundError (nothing there) is the caller's to read."""
    @functools.wraps(method)
    def asking(self: FsspecStorage, path: str, *args: Any) -> Any:
        try:
            return method(self, path, *args)
        except (FileNotFoundError, CheckpointError):
            raise
        except Exception as err:  # botocore's and the backends' errors share no base but Exception
            raise self.failure(path, err) from None
    return asking  # type: ignore[return-value]


class FsspecStorage(Storage):
    """An fsspec filesystem (``protocol``: its URL scheme). Every listing asks the store again: another
    process (another rank) may have written since."""

    atomic_rename = False

    def __init__(self, protocol: str, fs: Any, options: dict[str, Any]) -> None:
        self.protocol = protocol
        self.fs = fs
        self.options = options  # how fs was opened; DCP's reader and writer open theirs alike (dcp_io.py)

    def failure(self, path: str, err: BaseException) -> CheckpointError:
        """One line for a store that failed at ``path``: which store, what it said, what to do."""
        return CheckpointError(
            f"the store at {self.display(path)} failed ({type(err).__name__}: {first_line(err)}): check that it "
            "answers (its endpoint, the network) and the credentials, then run the same command again; the "
            "complete checkpoints there are kept")

    def check(self, path: str) -> None:
        """Refuse a bucket with an invalid name, or one that does not exist (it is never created: a typo would
        send checkpoints to a new bucket), or a store that cannot be reached with these credentials."""
        if self.protocol not in _BUCKETED:
            return
        bucket = path.split("/", 1)[0]
        url = self.display(path)
        if self.protocol in ("s3", "s3a") and not _S3_BUCKET.match(bucket):
            raise CheckpointError(f"checkpoint folder {url}: {bucket!r} is not a valid bucket name (3-63 lowercase "
                                  "letters, digits, dots and hyphens): name an existing bucket")
        if self.kind(bucket) is None:
            raise CheckpointError(f"checkpoint folder {url}: bucket {bucket!r} does not exist (it is not created: "
                                  "a misspelt name would send checkpoints elsewhere): create it, or name an "
                                  "existing one")

    def _fresh(self, path: str) -> None:
        self.fs.invalidate_cache(path)

    @_answered
    def kind(self, path: str) -> str | None:
        self._fresh(path)
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        return {"directory": "dir", "file": "file"}.get(info.get("type"), "other")

    @_answered
    def names(self, folder: str) -> list[str]:
        self._fresh(folder)
        try:
            entries = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
        return sorted({entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries} - {""})

    @_answered
    def files(self, folder: str) -> list[str]:
        self._fresh(folder)
        root = folder.rstrip("/") + "/"
        return sorted(path[len(root):] for path in self.fs.find(folder) if path.startswith(root))

    @_answered
    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    @_answered
    def read(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    @_answered
    def write(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    @_answered
    def create(self, path: str, data: bytes) -> bool:
        try:  # a conditional write (S3: If-None-Match), which the store decides
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True

    def chunks(self, path: str) -> Iterator[Any]:
        try:
            with self.fs.open(path, "rb", block_size=_READ_CHUNK) as file:
                while chunk := file.read(_READ_CHUNK):
                    yield chunk
        except FileNotFoundError:
            raise
        except Exception as err:  # as _answered, for a generator
            raise self.failure(path, err) from None

    @_answered
    def remove(self, path: str) -> None:
        self._fresh(path)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    @_answered
    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def rename(self, path: str, new_path: str) -> None:
        raise NotImplementedError(f"{self.protocol}:// has no atomic rename")  # layout.py never asks

    def join(self, folder: str, name: str) -> str:
        return f"{folder.rstrip('/')}/{name}"

    def display(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)


@dataclass(frozen=True, eq=False)
class Location:
    """A path on a storage, with the path-like methods the checkpoint code uses. Nothing follows a link.
    Two locations are equal when they name the same path (local) or URL."""

    storage: Storage
    path: str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, name: str) -> Location:
        return Location(self.storage, self.storage.join(self.path, name))

    def __str__(self) -> str:
        return self.storage.display(self.path)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").replace(os.sep, "/").rsplit("/", 1)[-1]

    @property
    def local(self) -> Path | None:
        """The local path, None on an object store."""
        return Path(self.path) if isinstance(self.storage, LocalStorage) else None

    @property
    def native(self) -> Path | Location:
        """What the public API hands a user (``CheckpointManager.save``, ``resolve_checkpoint``, ``ExactResume``): the
        local ``Path`` (used as one), or this location on an object store."""
        return self.local or self

    def kind(self) -> str | None:
        return self.storage.kind(self.path)

    def is_dir(self) -> bool:
        return self.kind() == "dir"

    def is_file(self) -> bool:
        return self.kind() == "file"

    def entries(self) -> list[Location]:
        return [self / name for name in self.storage.names(self.path)]

    def files(self) -> list[str]:
        return self.storage.files(self.path)

    def size(self) -> int:
        return self.storage.size(self.path)

    def read_bytes(self) -> bytes:
        return self.storage.read(self.path)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        self.storage.write(self.path, data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def create_text(self, text: str) -> bool:
        """Write ``text`` here only if nothing is (:meth:`Storage.create`)."""
        return self.storage.create(self.path, text.encode())

    def chunks(self) -> Iterator[Any]:
        return self.storage.chunks(self.path)

    def remove(self) -> None:
        self.storage.remove(self.path)

    def makedirs(self) -> None:
        self.storage.makedirs(self.path)

    def check(self) -> None:
        self.storage.check(self.path)


_LOCAL = LocalStorage()


# What names a place: a local path, a URL, or a location.
Where = str | os.PathLike | Location


def is_url(where: Where) -> bool:
    return isinstance(where, str) and _URL.match(where) is not None


def _refuse_one_slash(where: str) -> None:
    mistyped = _ONE_SLASH.match(where)
    if mistyped:
        scheme, rest = mistyped.group(1), where[mistyped.end():]
        url = f"file:///{rest}" if scheme.lower() == "file" else f"{scheme}://{rest}"
        raise CheckpointError(f"{where!r} is not a URL (one slash after {scheme}:) and is not taken for a folder; "
                              f"write {url}")


def locate(where: Where) -> Location:
    """The location a path (local) or a URL (``file://`` is local; any other scheme through fsspec) names."""
    if isinstance(where, Location):
        return where
    if isinstance(where, str):
        _refuse_one_slash(where)
    if not is_url(where):
        return Location(_LOCAL, os.fspath(where))
    url = str(where)
    protocol = _URL.match(url).group(1).lower()  # type: ignore[union-attr]
    if protocol == "file":
        return Location(_LOCAL, url[len("file://"):])
    try:
        from fsspec.core import url_to_fs  # a dependency of torch; its backends are not
        options = _options(protocol)
        fs, path = url_to_fs(url, **options)
    except ImportError as err:
        extra = _EXTRAS.get(protocol)
        how = f"pip install 'torchtitan_rng[{extra}]'" if extra else f"install fsspec's backend for {protocol}://"
        raise CheckpointError(f"{url} is on {protocol}://, whose fsspec backend is not installed ({err}): {how}") from None
    except ValueError as err:  # an unknown protocol
        raise CheckpointError(f"{url}: fsspec cannot open {protocol}:// ({err}); use a path, or a URL of an "
                              "installed fsspec backend (s3://, gs://, memory://...)") from None
    return Location(FsspecStorage(protocol, fs, options), path.rstrip("/"))


def _options(protocol: str) -> dict[str, Any]:
    """How a store is opened: for S3, :data:`S3_ANSWER` under what fsspec's configuration ($FSSPEC_S3) sets."""
    if protocol not in ("s3", "s3a"):
        return {}
    from fsspec.config import conf

    options = copy.deepcopy(S3_ANSWER)
    given = conf.get("s3", {})
    options["config_kwargs"].update(given.get("config_kwargs", {}))
    options.update({key: value for key, value in given.items() if key != "config_kwargs"})
    _bounded_uploads(options)
    return options


def _bounded_uploads(options: dict[str, Any]) -> None:
    """Bound an upload's wait as ``read_timeout`` bounds a read: botocore sends ``Expect: 100-continue`` before
    a body and aiohttp waits for the store's go-ahead without any timeout (a paused store hung a save for good),
    and a body the store stops taking stalls the write, which no HTTP timeout covers. Without the header the
    body goes at once; TCP_USER_TIMEOUT (Linux) ends a connection whose bytes stay unacknowledged or unsent that
    long; s3fs then sends the request again, as after a read timeout."""
    options.setdefault("session", _session_without_continue(
        tuple(sorted((name, value) for name, value in os.environ.items() if name.startswith("AWS_")))))
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    config = options["config_kwargs"]
    connector = dict(config.get("connector_args") or {})
    if user_timeout is not None and "socket_factory" not in connector:
        connector["socket_factory"] = functools.partial(_socket, int(float(config["read_timeout"]) * 1000))
        config["connector_args"] = connector


@functools.cache
def _session_without_continue(environment: tuple[tuple[str, str], ...]) -> Any:
    """An aiobotocore session without the header, one per AWS environment (a session keeps the credentials it
    found first; s3fs keeps one filesystem per set of options)."""
    from aiobotocore.session import AioSession
    from botocore.handlers import add_expect_header

    session = AioSession()
    session.unregister("before-call.s3", add_expect_header)
    return session


def _socket(user_timeout_ms: int, addr_info: tuple[Any, ...]) -> socket.socket:
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=kind, proto=proto)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_timeout_ms)
    return sock


def folder_location(where: Where) -> Location:
    """The folder a user names (a checkpoint folder): a local symlink there is followed, to where the
    checkpoints are (``DUMP/checkpoint -> /bigger/disk/run1``); nothing below it ever is."""
    folder = locate(where)
    if folder.local is not None and folder.local.is_symlink():
        target = Path(os.path.realpath(folder.local))
        if target.is_dir() or not os.path.lexists(target):  # a folder, or one the first save creates
            return locate(target)
        # A loop, or a link to a file: kept as the link, which check() names.
    return folder


def checkpoint_folder(dump_folder: str | Path, folder: str) -> Location:
    """Where a run's checkpoints go: ``folder`` under the dump folder, or ``folder`` itself when it is a URL."""
    _refuse_one_slash(folder)
    return folder_location(folder if is_url(folder) else Path(dump_folder) / folder)
