"""Benchmark: checkpoint write throughput to an S3-compatible server on this machine vs to a local disk.

The same run's full synchronous save (model, optimizer, RNG, dataloader, train state), through the
CheckpointManager, into a local folder and into ``s3://`` on moto's server (its own process on 127.0.0.1,
reached through ``AWS_ENDPOINT_URL`` as any S3 endpoint). A save on the store is the DCP upload, then
``checksums.json``, whose sums read every file back from the store (the local save sums the page cache),
then the completion marker; the two phases are also timed alone. A file goes up in parts (multipart upload).

    python -m bench.object_store_throughput [--quick] [--flavor bench] [--part-mib N] [--server-log FILE]
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fsspec.config
from fsspec.registry import get_filesystem_class
import torch.distributed.checkpoint as dcp

from bench.common import build_run, config_for, folder_bytes, median, parser, scratch_parent, spread, table, timed
from torchtitan_rng.checkpoint import dcp_io, integrity
from torchtitan_rng.checkpoint.layout import step_dir
from torchtitan_rng.checkpoint.manager import CheckpointManager
from torchtitan_rng.checkpoint.storage import locate


READ_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_s3_server(log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process; returns it once it accepts connections, with its endpoint. Its
    output (one line per request, and any error) goes to ``log``."""
    port = _free_port()
    out = log.open("ab") if log is not None else subprocess.DEVNULL
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto's server did not start (pip install 'moto[server]')") from None
            time.sleep(0.05)  # polling a port that is being opened, not a synchronisation delay


def main() -> None:
    args = parser(__doc__.splitlines()[0])
    args.add_argument("--flavor", default="bench", help="llama flavor (default bench: 979 MiB of state)")
    args.add_argument("--part-mib", type=int, default=0, help="multipart part size in MiB (0: s3fs's, 50 MiB)")
    args.add_argument("--server-log", type=Path, help="where moto's server writes its request log")
    args = args.parse_args()
    repeats = 2 if args.quick else 4
    # moto completes a multipart upload by joining every part in its own memory (several copies of the object)
    # while the client waits: ~20 s for a ~1 GB file on 2 busy cores, past s3fs's default read timeout of 15 s.
    # botocore then sends CompleteMultipartUpload again while the first is still running; the first disposes
    # the parts when it finishes, so the retry fails ("seek of closed file", then an unknown upload id: HTTP
    # 500) and, retries spent, the save with it. A real store answers a complete in seconds; here the
    # timeout is raised, as a user would for a slow store (docs/storage.md).
    s3_options = fsspec.config.conf.setdefault("s3", {})
    s3_options["config_kwargs"] = {"read_timeout": READ_TIMEOUT_S}
    if args.part_mib:
        s3_options["default_block_size"] = args.part_mib * 2**20
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    run = build_run(config_for("--model.flavor", args.flavor))
    mbs: dict[str, list[float]] = {"disk": [], "s3": [], "s3 upload": [], "s3 checksums": []}
    with tempfile.TemporaryDirectory(dir=scratch_parent()) as scratch:
        local = CheckpointManager(Path(scratch) / "checkpoint", run.parts, interval=1)
        for index in range(repeats):
            seconds = timed(lambda: local.save(index))
            size = folder_bytes(step_dir(local.folder, index))
            shutil.rmtree(step_dir(local.folder, index))
            mbs["disk"].append(size / seconds / 1e6)
            # A fresh server for each round: the test server keeps every object in its process.
            server, os.environ["AWS_ENDPOINT_URL"] = start_s3_server(args.server_log)
            get_filesystem_class("s3").clear_instance_cache()  # a cached instance knows the last endpoint
            try:
                bucket = locate("s3://bench/checkpoint")
                bucket.storage.fs.mkdir("bench")
                remote = CheckpointManager(bucket, run.parts, interval=1)
                mbs["s3"].append(size / timed(lambda: remote.save(index)) / 1e6)
                upload = bucket / f"upload-{index}"
                mbs["s3 upload"].append(size / timed(lambda: dcp.save(dict(run.parts), storage_writer=dcp_io.writer(upload)))
                                        / 1e6)
                mbs["s3 checksums"].append(size / timed(lambda: integrity.write_checksums(upload)) / 1e6)
            finally:
                server.terminate()
                server.wait()
    table(
        f"Object storage: checkpoint write throughput, local S3 server (moto) vs local disk (llama {args.flavor}, "
        f"{size / 2**20:.0f} MiB, {repeats} saves each, disk: {scratch_parent()})",
        ["write", "MB/s (median)", "min..max"],
        [["local disk: full save", f"{median(mbs['disk']):.0f}", spread(mbs["disk"])],
         ["s3 (moto): full save", f"{median(mbs['s3']):.0f}", spread(mbs["s3"])],
         ["s3: DCP upload alone", f"{median(mbs['s3 upload']):.0f}", spread(mbs["s3 upload"])],
         ["s3: checksums alone (reads it back)", f"{median(mbs['s3 checksums']):.0f}", spread(mbs["s3 checksums"])],
         ["s3 / disk (full save)", f"**{median(mbs['s3']) / median(mbs['disk']):.2f}**", ""]],
    )


if __name__ == "__main__":
    main()
