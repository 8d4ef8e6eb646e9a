"""A real SLURM on this machine for the tests (Debian's ``slurm-wlm`` and ``munge``; root): munged, slurmctld
and a slurmd for the node named after this machine's hostname, plus a second slurmd on the same machine (node
``HOST-2``) so that a job can span two nodes. Four partitions:

    partition  nodes        PriorityTier  PreemptMode  what for
    batch      HOST         1             OFF          the default: jobs that nothing preempts
    spot       HOST         1             REQUEUE      jobs that ``urgent`` preempts (SIGTERM to the step, requeued
                                                       after GraceTime)
    urgent     HOST         2             OFF          the preempting job (``--exclusive``: every spot job must go)
    pair       HOST,HOST-2  1             OFF          jobs of two nodes

Jobs share the CPUs (``OverSubscribe=FORCE``), so that tiny jobs run side by side on a machine of a few cores.
``AuthInfo=cred_expire`` is lowered to the least SLURM accepts: a requeued job may start again only once the
credential of its last start expired (``Reason=BeginTime``), so it sets the requeue delay.

    python -m tests.support.slurm start|stop|status

``start`` reuses daemons that answer; ``stop`` ends the ones this module started (their pid files)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(os.environ.get("TORCHTITAN_RNG_SLURM_DIR", "/tmp/torchtitan_rng_slurm"))
CONF = ROOT / "slurm.conf"
CRED_EXPIRE = 5  # seconds; SLURM refuses less (slurmctld: "AuthInfo=cred_expire=N invalid")
GRACE_TIME = 60  # seconds between the preemption's SIGTERM and its SIGKILL
PACKAGES = ("slurm-wlm", "munge")
SLURMD_PORT = 16818  # the second node's slurmd: the next port


def _pid_file(daemon: str) -> Path:
    return ROOT / f"{daemon}.pid"


def nodes(host: str) -> tuple[str, str]:
    return host, f"{host}-2"


def config(host: str, cpus: int) -> str:
    first, second = nodes(host)
    return f"""\
ClusterName=ttrng
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={ROOT}/munge.socket,cred_expire={CRED_EXPIRE}
StateSaveLocation={ROOT}/ctld
SlurmdSpoolDir={ROOT}/d-%n
SlurmctldPidFile={_pid_file("slurmctld")}
SlurmdPidFile={ROOT}/slurmd-%n.pid
SlurmctldLogFile={ROOT}/slurmctld.log
SlurmdLogFile={ROOT}/slurmd-%n.log
SlurmctldPort=16817
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
MailProg=/bin/true
MinJobAge=3600
KillWait=30
NodeName={first} NodeHostname={host} Port={SLURMD_PORT} CPUs={cpus} State=UNKNOWN
NodeName={second} NodeHostname={host} NodeAddr={host} Port={SLURMD_PORT + 1} CPUs={cpus} State=UNKNOWN
""" + "".join(f"PartitionName={name} MaxTime=INFINITE State=UP {options}\n" for name, options in (
        ("batch", f"Nodes={first} Default=YES PriorityTier=1 PreemptMode=OFF OverSubscribe=FORCE:8"),
        ("spot", f"Nodes={first} PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_TIME} OverSubscribe=FORCE:8"),
        ("urgent", f"Nodes={first} PriorityTier=2 PreemptMode=OFF"),
        ("pair", f"Nodes={first},{second} PriorityTier=1 PreemptMode=OFF OverSubscribe=FORCE:8"),
    ))


def env() -> dict[str, str]:
    """The environment for SLURM's commands (sbatch exports it into the job, so ``scontrol`` works there)."""
    return {**os.environ, "SLURM_CONF": str(CONF)}


def _missing() -> list[str]:
    return [tool for tool in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel")
            if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]


def _answers() -> bool:
    if not CONF.exists():
        return False
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, env=env(), timeout=30)
    return ping.returncode == 0 and "UP" in ping.stdout


def _answered_within(seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not _answers():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)  # polling the controller, not a synchronisation delay
    return True


def _nodes_up() -> bool:
    show = subprocess.run(["scontrol", "show", "node"], capture_output=True, text=True, env=env(), timeout=30)
    states = re.findall(r"State=(\S+)", show.stdout)
    return (show.returncode == 0 and len(states) == 2
            and not any(re.search(r"DOWN|DRAIN|NOT_RESPONDING|UNKNOWN|FAIL", state) for state in states))


def _wait(what: str, ready, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            logs = "".join(log.read_text()[-2000:] for log in sorted(ROOT.glob("*.log")))
            raise RuntimeError(f"SLURM: {what} not ready within {timeout} s\n{logs}")
        time.sleep(0.2)  # polling the daemons' state, not a synchronisation delay


def _alive(pid_file: Path) -> bool:
    """Whether the pid file's process runs and is that daemon: a stale file's number may belong to another
    process by now (a test's own), which must never be signalled."""
    daemon = pid_file.stem.split("-")[0]  # munged, slurmctld, slurmd(-NODE)
    try:
        comm = Path(f"/proc/{int(pid_file.read_text().split()[0])}/comm").read_text().strip()
    except (OSError, ValueError):
        return False
    return comm == daemon


@dataclass
class Slurm:
    host: str
    cpus: int
    started: bool  # by this call (else daemons already up were reused)
    conf: Path = CONF


def start() -> Slurm:
    """Start the daemons (or reuse those that answer); fails, with what to do, where SLURM is not installed."""
    missing = _missing()
    if missing:
        raise RuntimeError(f"SLURM: {', '.join(missing)} not found; install Debian's packages as root: "
                           f"apt-get install -y {' '.join(PACKAGES)}")
    host, cpus = socket.gethostname(), os.cpu_count() or 1
    text = config(host, cpus)
    if CONF.exists() and CONF.read_text() == text and (
            _answers() or (_alive(_pid_file("slurmctld")) and _answered_within(60))):
        # Daemons that run are reused, given time to answer on a loaded machine: never stopped under jobs.
        _wait("the nodes", _nodes_up)
        return Slurm(host, cpus, started=False)
    stop()
    for folder in (ROOT, ROOT / "ctld", *(ROOT / f"d-{node}" for node in nodes(host))):
        folder.mkdir(parents=True, exist_ok=True)
    CONF.write_text(text)
    munge_key = Path("/etc/munge/munge.key")
    if not munge_key.exists():
        subprocess.run(["mungekey", "--create", "--keyfile", str(munge_key)], check=True)
    shutil.chown(munge_key, "munge", "munge")
    os.chmod(munge_key, 0o400)
    munge_state = ROOT / "munge"
    munge_state.mkdir(exist_ok=True)
    # munged runs as root here: its own folders, not the package's (/run/munge may not exist).
    subprocess.run(["munged", "--force", "--key-file", str(munge_key), "--socket", str(ROOT / "munge.socket"),
                    "--pid-file", str(_pid_file("munged")), "--log-file", str(ROOT / "munged.log"),
                    "--seed-file", str(munge_state / "seed")], check=True)
    daemon_env = env()
    subprocess.run(["slurmctld", "-f", str(CONF)], check=True, env=daemon_env)
    for node in nodes(host):
        subprocess.run(["slurmd", "-f", str(CONF), "-N", node], check=True, env=daemon_env)
    _wait("slurmctld", _answers)
    _wait("the nodes", _nodes_up)
    return Slurm(host, cpus, started=True)


def stop() -> None:
    """End the daemons this module started (their pid files), the slurmds first."""
    for pid_file in [*sorted(ROOT.glob("slurmd-*.pid")), _pid_file("slurmctld"), _pid_file("munged")]:
        if not pid_file.exists():
            continue
        if _alive(pid_file):
            pid = int(pid_file.read_text().split()[0])
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while _alive(pid_file) and time.monotonic() < deadline:
                time.sleep(0.1)  # polling the daemon's exit
        pid_file.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    action = argv[0] if argv else "status"
    if action == "start":
        slurm = start()
        print(f"SLURM up: nodes {', '.join(nodes(slurm.host))} ({slurm.cpus} CPUs each); SLURM_CONF={slurm.conf}")
    elif action == "stop":
        stop()
    else:
        print("SLURM up" if _answers() else "SLURM down")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def submit(*args: str, job_env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """``sbatch --parsable ARGS`` with ``job_env`` added to the environment it exports; the job's id."""
    done = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, cwd=cwd,
                          env={**env(), **(job_env or {})}, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]


def command(*args: str) -> subprocess.CompletedProcess:
    """A SLURM command (scancel, scontrol, ...) against this cluster; raises with its message on failure."""
    done = subprocess.run(list(args), capture_output=True, text=True, env=env(), timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")
    return done


def job(job_id: str) -> dict[str, str]:
    """``scontrol show job``'s fields (JobState, ExitCode, Restarts, Reason, ...); there is no accounting
    database, and finished jobs stay listed for MinJobAge."""
    text = command("scontrol", "show", "job", "--oneliner", job_id).stdout
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def wait_for(job_id: str, ready, what: str, timeout: float) -> dict[str, str]:
    """Poll the job until ``ready(fields)``; fail, with its fields, if it ends otherwise or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        fields = job(job_id)
        if ready(fields):
            return fields
        if fields["JobState"] in FINAL:
            raise AssertionError(f"job {job_id} ended {fields['JobState']} (exit {fields['ExitCode']}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id}: not {what} within {timeout} s: {fields}")
        time.sleep(0.2)  # polling the job's state, not a synchronisation delay


def wait_until_ended(job_id: str, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while (fields := job(job_id))["JobState"] not in FINAL:
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} not ended within {timeout} s: {fields}")
        time.sleep(0.2)  # polling the job's state
    return fields
