"""Real Slurm on this machine: munged, ``slurmctld`` and ``slurmd`` from Debian's packages, started in
the foreground as processes the lab owns (no systemd), with a minimal ``slurm.conf`` in
``LAB_DIR/slurm``. Point ``SLURM_CONF`` at :func:`conf_path` and ``srun``/``sbatch`` work."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import time
from pathlib import Path

from .hosts import LAB_DIR
from .procs import install, start_daemon, stop_daemons

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DIR = LAB_DIR / "slurm"
MUNGE_DIR = LAB_DIR / "munge"
MUNGE_SOCKET = MUNGE_DIR / "munge.socket.2"
PORTS = (6917, 6918)  # slurmctld, slurmd: away from Slurm's defaults, so a real install is not hit
SRUN_PORTS = (61100, 61400)


def conf_path() -> Path:
    return DIR / "slurm.conf"


def env() -> dict[str, str]:
    """The environment for ``srun``/``sbatch``/``sinfo`` against the lab's Slurm."""
    return {**os.environ, "SLURM_CONF": str(conf_path())}


def slurm_conf(node: str, cpus: int) -> str:
    return f"""# paratrain lab: one node, this machine; no cgroups, no accounting, no systemd
ClusterName=paratrain-lab
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={PORTS[0]}
SlurmdPort={PORTS[1]}
# srun listens outside the kernel's ephemeral range (32768-60999): a port another process picked with
# bind(0) and let go (a test's MASTER_PORT) is never srun's, so no client of that port reaches srun
SrunPortRange={SRUN_PORTS[0]}-{SRUN_PORTS[1]}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={MUNGE_SOCKET}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
StateSaveLocation={DIR}/state
SlurmdSpoolDir={DIR}/spool
SlurmctldPidFile={DIR}/slurmctld.pid
SlurmdPidFile={DIR}/slurmd.pid
SlurmctldLogFile={DIR}/slurmctld.log
SlurmdLogFile={DIR}/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def start_munge() -> None:
    """munged as the ``munge`` user, its socket in the lab's folder."""
    user = pwd.getpwnam("munge")
    key = Path("/etc/munge/munge.key")
    if not key.exists():  # the package's postinst makes one; a minimal image may have skipped it
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_bytes(os.urandom(1024))
        os.chown(key, user.pw_uid, user.pw_gid)
        key.chmod(0o400)
    if MUNGE_DIR.exists():
        shutil.rmtree(MUNGE_DIR)
    MUNGE_DIR.mkdir(parents=True, mode=0o755)
    os.chown(MUNGE_DIR, user.pw_uid, user.pw_gid)
    start_daemon("munged", ["munged", "-F", f"--socket={MUNGE_SOCKET}", f"--key-file={key}",
                            f"--log-file={MUNGE_DIR}/munged.log", f"--pid-file={MUNGE_DIR}/munged.pid",
                            f"--seed-file={MUNGE_DIR}/munged.seed"], user=user.pw_name)
    _wait(lambda: MUNGE_SOCKET.exists(), 10, "munged did not create its socket")


def up() -> str:
    """Install (once), configure and start munged, slurmctld and slurmd; wait until the node is idle.
    Returns the node's name."""
    install(PACKAGES, "slurmctld")
    stop_daemons()
    node = socket.gethostname()
    if DIR.exists():
        shutil.rmtree(DIR)
    for d in ("state", "spool"):
        (DIR / d).mkdir(parents=True)
    conf_path().write_text(slurm_conf(node, os.cpu_count() or 1))
    start_munge()
    start_daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(conf_path())])
    start_daemon("slurmd", ["slurmd", "-D", "-f", str(conf_path()), "-N", node])
    _wait(lambda: _node_state() in ("idle", "mixed"), 30, f"the lab's Slurm node did not become idle; see {DIR}/*.log")
    return node


def _node_state() -> str:
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env(), capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def _wait(ready, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"lab slurm: {message}")
        time.sleep(0.2)
