"""Test hosts: network namespaces ``pt-h0..`` joined by veths to one bridge, on a private subnet
that exists only inside this machine (:data:`SUBNET`); link conditions with ``tc``; cut and heal."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

# A second lab beside the first (two test runs at once) takes another prefix and subnet.
PREFIX = os.environ.get("PARATRAIN_LAB_PREFIX", "pt-")
BRIDGE = f"{PREFIX}br0"
SUBNET = os.environ.get("PARATRAIN_LAB_SUBNET", "10.77.0")  # /24; host i is SUBNET.(10 + i); nothing outside this machine routes it
IFACE = "eth0"  # each host's interface (the bridge side is pt-v<i>)
ETC_NETNS = Path("/etc/netns")
LAB_DIR = Path(os.environ.get("PARATRAIN_LAB_DIR", "/tmp/paratrain-lab"))


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd``; on failure raise with its stderr in one line."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"lab: {' '.join(cmd)} failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def name(i: int) -> str:
    return f"{PREFIX}h{i}"


def addr(i: int) -> str:
    return f"{SUBNET}.{10 + i}"


def index(host: str | int) -> int:
    """``pt-h1``, ``h1`` or ``1`` -> 1."""
    text = str(host).removeprefix(PREFIX).removeprefix("h")
    if not text.isdigit():
        raise ValueError(f"lab: {host!r} is not a lab host: use pt-hN, hN or N")
    return int(text)


def unavailable() -> str | None:
    """Why the lab cannot run here (one line), or None."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, veths, tc)"
    try:
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    except FileNotFoundError:
        return "no `ip` command (iproute2)"
    if r.returncode != 0:
        return f"`ip netns` does not work here: {r.stderr.strip()}"
    return None


def hosts() -> list[str]:
    """The lab's namespaces, in index order."""
    out = sh("ip", "netns", "list").stdout.split()
    return sorted((n for n in out if n.startswith(f"{PREFIX}h") and n[len(PREFIX) + 1:].isdigit()), key=index)


def up(n: int) -> list[str]:
    """Create ``n`` hosts (after removing an earlier lab); return their addresses."""
    if n < 1:
        raise ValueError("lab: --hosts must be at least 1")
    down()
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "link", "set", BRIDGE, "up")
    for i in range(n):
        ns, veth, peer = name(i), f"{PREFIX}v{i}", f"{PREFIX}p{i}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        sh("ip", "link", "set", peer, "netns", ns)
        sh("ip", "link", "set", veth, "master", BRIDGE)
        sh("ip", "link", "set", veth, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "link", "set", peer, "name", IFACE)
        sh("ip", "-n", ns, "addr", "add", f"{addr(i)}/24", "dev", IFACE)
        sh("ip", "-n", ns, "link", "set", IFACE, "up")
    # `ip netns exec` bind-mounts /etc/netns/NS/* over /etc: the hosts know each other by name,
    # and name lookups never leave the machine (no nameserver is reachable from a lab host anyway).
    for i in range(n):
        etc = ETC_NETNS / name(i)
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{addr(j)} {name(j)}\n" for j in range(n)))
        (etc / "resolv.conf").write_text("# paratrain lab: no nameserver\n")
    return [addr(i) for i in range(n)]


def pids(ns: str) -> list[int]:
    r = sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split()]


def down() -> None:
    """Kill every process in a lab namespace, delete the namespaces, veths and bridge. Idempotent."""
    for ns in hosts():
        for sig in (signal.SIGKILL,):
            for pid in pids(ns):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        while pids(ns) and time.monotonic() < deadline:
            time.sleep(0.05)
        sh("ip", "netns", "del", ns, check=False)
    for etc in ETC_NETNS.glob(f"{PREFIX}h*"):
        shutil.rmtree(etc, ignore_errors=True)
    links = sh("ip", "-o", "link", "show").stdout.splitlines()
    for line in links:
        link = line.split(":")[1].strip().split("@")[0]
        if link.startswith(PREFIX):
            sh("ip", "link", "del", link, check=False)


def netem_available() -> bool:
    """netem (delay) is a module many small kernels leave out; tbf (rate) is nearly always there."""
    config = Path("/proc/config.gz")
    if config.exists():
        import gzip
        text = gzip.decompress(config.read_bytes()).decode()
        return "CONFIG_NET_SCH_NETEM=y" in text or "CONFIG_NET_SCH_NETEM=m" in text
    return True


def net(rate: str | None = None, delay: str | None = None) -> None:
    """Shape both directions of every host's link: ``rate`` (e.g. ``1gbit``) and ``delay``
    (e.g. ``0.2ms``, needs netem); neither resets the links to unlimited."""
    if delay and not netem_available():
        raise RuntimeError("lab: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so no --delay; "
                           "--rate works (tbf)")
    for ns in hosts():
        i = index(ns)
        for dev, prefix in ((f"{PREFIX}v{i}", ()), (IFACE, ("-n", ns))):
            sh("ip", *prefix, "link", "set", dev, "up")  # no-op; checks the link exists
            sh("tc", *prefix, "qdisc", "del", "dev", dev, "root", check=False)
            if delay:
                sh("tc", *prefix, "qdisc", "add", "dev", dev, "root", "netem", "delay", delay,
                   *(("rate", rate) if rate else ()))
            elif rate:
                # burst: at least one jiffy's worth of bytes at the rate, or tbf cannot reach it
                sh("tc", *prefix, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", "256kb", "latency", "100ms")


def cut(host: str | int) -> None:
    """Take ``host``'s link down on the bridge side: its peers see silence, as with a pulled cable."""
    sh("ip", "link", "set", f"{PREFIX}v{index(host)}", "down")


def heal(host: str | int) -> None:
    sh("ip", "link", "set", f"{PREFIX}v{index(host)}", "up")


def exec_argv(host: str | int, cmd: list[str]) -> list[str]:
    """The command line that runs ``cmd`` on ``host``: in its network namespace, and in a UTS
    namespace of its own whose hostname is the host's name (torchrun's c10d agent advertises its
    node by hostname, so the hosts must not share this machine's)."""
    ns = name(index(host))
    return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", f'hostname {ns} && exec "$@"', "sh", *cmd]
