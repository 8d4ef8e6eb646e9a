"""An object store that fails, does not answer, or cannot be used: one line naming the store and what to do,
exit 2 from the launcher's check, nothing complete lost, nothing created. A real S3-compatible server on this
machine (moto), stopped mid-run; a socket that accepts and never answers; a port nobody listens on."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec.config
import pytest
import torch
from torch.distributed.checkpoint import DefaultSavePlanner

from tests.support.object_store import Relay, relayed, s3, s3_server, server_down
from torchtitan_rng.checkpoint import integrity, layout
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.checkpoint.states import ModelState
from torchtitan_rng.checkpoint.storage import S3_ANSWER, locate
from torchtitan_rng.errors import CheckpointError
from torchtitan_rng.launch import preflight

CONFIG = str(Path(__file__).resolve().parents[2] / "train_configs" / "llama_debug.toml")


def _manager(url: str) -> CheckpointManager:
    return CheckpointManager(url, {"model": ModelState(torch.nn.Linear(4, 4))}, interval=1)


def _preflight(tmp_path: Path, url: str, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = preflight.main(["--job.config_file", CONFIG, "--job.dump_folder", str(tmp_path / "run"),
                           "--checkpoint.enable", "--checkpoint.folder", url])
    return code, capsys.readouterr().err


def _one_line(code: int, err: str) -> str:
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err.removeprefix("error: ").rstrip("\n")


@pytest.fixture
def fresh_s3fs() -> Iterator[None]:
    """s3fs keeps its instances by endpoint and options: each case here opens its own."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_store_that_goes_away_after_a_save_is_one_line_and_nothing_complete_is_lost(fresh_s3fs: None) -> None:
    with s3_server("gone") as env:
        url = "s3://gone/run/checkpoint"
        manager = _manager(url)
        manager.save(1)
        with server_down(env), pytest.raises(CheckpointError) as refused:
            manager.save(2)
        line = str(refused.value)
        assert "\n" not in line and line.startswith(f"the store at {url}") and "failed (EndpointConnectionError" in line
        assert line.endswith("then run the same command again; the complete checkpoints there are kept")
        assert layout.complete_steps(url) == [1] and integrity.verify_integrity(locate(url) / "step-1")
        manager.save(2)  # control: the store back, the run's next save goes through
        assert layout.complete_steps(url) == [1, 2]


def test_a_store_that_does_not_answer_fails_within_a_bounded_wait(monkeypatch: pytest.MonkeyPatch,
                                                                 fresh_s3fs: None) -> None:
    """A server that accepts connections and never answers (a paused one): each request waits read_timeout
    (S3_ANSWER's 15 s, here 1 s through fsspec's own configuration) and is sent 5 times at most."""
    assert S3_ANSWER["config_kwargs"]["read_timeout"] == 15 and S3_ANSWER["config_kwargs"]["retries"] == {
        "total_max_attempts": 1}
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel accepts; nobody reads or answers
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                            ("AWS_DEFAULT_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"read_timeout": 1}})
        folder = locate("s3://quiet/run/checkpoint")
        assert folder.storage.options["config_kwargs"]["read_timeout"] == 1  # the user's setting wins
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=r"^the store at s3://quiet failed \(.*Timeout.*\): check that it "
                                                  "answers"):
            folder.check()
        waited = time.monotonic() - started
    assert waited < 5 * 1 + 10, waited  # 5 sends of 1 s, s3fs's pauses between them (under 2 s), slack


class _PauseWhileWriting:
    """Save hooks: the store pauses once DCP writes the first save (its shard file open, the first item handed
    to it), as a store paused in the middle of an upload."""

    def __init__(self, relay: Relay) -> None:
        self.relay, self.first = relay, True

    def at(self, point: str, step: int) -> None:
        pass

    def save_planner(self, step: int) -> DefaultSavePlanner | None:
        if not self.first:
            return None
        self.first = False
        relay = self.relay

        class Pausing(DefaultSavePlanner):
            def resolve_data(self, write_item: Any) -> Any:
                relay.pause()
                return super().resolve_data(write_item)

        return Pausing()


@pytest.mark.parametrize("linear", [
    pytest.param(64, id="small-body"),
    pytest.param(2048, id="body-larger-than-the-sockets-hold", marks=pytest.mark.slow),  # CI's tier: 10 s of waits
])
def test_a_store_paused_during_the_first_save_fails_within_a_bounded_wait(monkeypatch: pytest.MonkeyPatch,
                                                                         fresh_s3fs: None, linear: int) -> None:
    """The run's first upload: once botocore waited without end for the store's go-ahead to send a body (a
    small one), and a large body stalled once the store stopped taking it. Each now waits read_timeout (1 s
    here) and is sent 5 times at most, as any request."""
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"read_timeout": 1}})
    with s3_server(f"first-save-{linear}") as env, relayed(env) as relay:
        url = f"s3://first-save-{linear}/run/checkpoint"
        manager = CheckpointManager(url, {"model": ModelState(torch.nn.Linear(linear, linear))}, interval=1,
                                    hooks=_PauseWhileWriting(relay))
        raised: list[BaseException] = []

        def save() -> None:
            try:
                manager.save(1)
            except BaseException as err:  # noqa: BLE001 - handed to the test's thread
                raised.append(err)

        started = time.monotonic()
        saving = threading.Thread(target=save, daemon=True)
        saving.start()
        saving.join(timeout=120)  # a limit that turns the old hang into a failure, not a synchronisation
        waited = time.monotonic() - started
        assert not saving.is_alive(), "the save still waits for the paused store"
        assert len(raised) == 1 and isinstance(raised[0], CheckpointError), raised
        line = str(raised[0])
        assert line.startswith(f"saving step 1 into {url} failed: ") and "\n" not in line, line
        # 5 sends, each given up after 1 s (an answer) or 1 s (TCP: bytes not taken), s3fs's pauses (2 s in all):
        # about 12 s, with slack for a loaded machine; the hang this replaces never ended.
        assert waited < 60, waited
        relay.resume()
        assert layout.complete_steps(url) == []
        manager.save(2)  # control: the store answers again, the run's next save goes through
        assert layout.complete_steps(url) == [2]


def test_a_missing_bucket_is_refused_not_created(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                 fresh_s3fs: None) -> None:
    with s3_server("ckpt-real"):
        line = _one_line(*_preflight(tmp_path, "s3://ckpt-typo/run/checkpoint", capsys))
        assert line == ("checkpoint folder s3://ckpt-typo/run/checkpoint: bucket 'ckpt-typo' does not exist (it is "
                        "not created: a misspelt name would send checkpoints elsewhere): create it, or name an "
                        "existing one")
        with pytest.raises(CheckpointError, match="bucket 'ckpt-typo' does not exist"):
            _manager("s3://ckpt-typo/run/checkpoint").save(1)
        assert not s3().exists("ckpt-typo") and s3().exists("ckpt-real")  # control: the server lists buckets
        assert _preflight(tmp_path, "s3://ckpt-real/run/checkpoint", capsys) == (0, "")


def test_an_invalid_bucket_name_is_refused_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                          fresh_s3fs: None) -> None:
    with s3_server("ckpt-named"):
        line = _one_line(*_preflight(tmp_path, "s3://Ckpt_Run/checkpoint", capsys))
        assert line == ("checkpoint folder s3://Ckpt_Run/checkpoint: 'Ckpt_Run' is not a valid bucket name (3-63 "
                        "lowercase letters, digits, dots and hyphens): name an existing bucket")


def test_an_unreachable_store_is_one_line_at_the_launchers_check(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 fresh_s3fs: None) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        line = _one_line(*_preflight(tmp_path, "s3://ckpt/run/checkpoint", capsys))
    assert line.startswith("the store at s3://ckpt failed (EndpointConnectionError: Could not connect to the "
                           f"endpoint URL: \"http://127.0.0.1:{port}/ckpt")
    assert line.endswith("check that it answers (its endpoint, the network) and the credentials, then run the same "
                         "command again; the complete checkpoints there are kept")


def test_missing_credentials_are_one_line_at_the_launchers_check(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                fresh_s3fs: None) -> None:
    with s3_server("ckpt-keyless"):
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        line = _one_line(*_preflight(tmp_path, "s3://ckpt-keyless/run/checkpoint", capsys))
    assert line.startswith("the store at s3://ckpt-keyless failed (NoCredentialsError: Unable to locate credentials)")
