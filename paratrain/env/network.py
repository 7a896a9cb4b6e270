"""Where a job's processes listen and talk: free ports, the interface towards the master, and
``TCPStore`` servers that listen on loopback only for one-node jobs (torch's own binds every
interface). Used by :mod:`paratrain.env.process`, the launchers and the parameter server."""

from __future__ import annotations

import errno
import os
import random
import socket
import urllib.parse
from datetime import timedelta
from typing import Any, Iterator

import torch.distributed as dist

from .base import UnavailableError

__all__ = ["free_port", "interface_towards", "default_route_interface", "gloo_interface", "is_loopback",
           "loopback_store", "store_init_method", "agent_serves_store"]


def agent_serves_store() -> bool:
    """Whether torchrun's agent serves the job's store at ``MASTER_ADDR:MASTER_PORT`` (its own bind, outliving the
    workers); otherwise rank 0's process does."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for outgoing connections and ``bind(port 0)`` (Linux's default 32768-60999)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now, chosen at random *outside* the kernel's
    ephemeral range where there is room: a port from ``bind(0)`` is one the kernel also gives to
    outgoing connections (gloo opens many), which can take it between this check and the launch's bind."""
    lo, hi = _ephemeral_range()
    spans = [(start, end) for start, end in ((max(1024, lo - 12000), lo), (hi + 1, 65536)) if end - start >= 1000]
    pick = random.SystemRandom()  # not the global RNG: a seeded run's draws stay the same
    for _ in range(64 if spans else 0):
        start, end = pick.choice(spans)
        port = pick.randrange(start, end)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def interface_towards(host: str) -> str | None:
    """Name of the network interface whose IPv4 address this machine uses to reach ``host`` (its
    own address included: then the interface that holds it); None when that cannot be told (IPv6,
    not Linux, no route)."""
    try:
        ip = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))  # a UDP connect sends nothing: it only picks the route and source address
            local = s.getsockname()[0]
        for _, ifname in socket.if_nameindex():
            if _ipv4_address(ifname) == local:
                return ifname
    except (OSError, ImportError):
        pass
    return None


def gloo_interface(master_addr: str, several_nodes: bool) -> str | None:
    """The interface gloo should use (``GLOO_SOCKET_IFNAME``): the one this machine reaches the
    master through. gloo's own choice is the address this machine's hostname resolves to, and
    loopback when that is not a local address: on hosts whose /etc/hosts maps the hostname to
    127.0.x.1 (Debian's default) every rank would advertise 127.0.0.1, which ranks on other hosts
    cannot reach. On the master's own node that name resolves to loopback too: with several nodes
    the interface of the default route is taken instead."""
    if is_loopback(master_addr):
        return "lo"
    ifname = interface_towards(master_addr)
    if ifname == "lo" and several_nodes:
        return default_route_interface()
    return ifname


def default_route_interface() -> str | None:
    """The interface of this machine's default IPv4 route (Linux ``/proc/net/route``), or None."""
    try:
        with open("/proc/net/route") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) > 3 and fields[1] == "00000000" and int(fields[3], 16) & 0x1:  # RTF_UP
                    return fields[0]
    except (OSError, ValueError):
        pass
    return None


def _ipv4_address(ifname: str) -> str | None:
    """The IPv4 address of ``ifname`` (Linux ``SIOCGIFADDR``), None when it has none."""
    import fcntl  # POSIX only: imported where used so that importing paratrain works on Windows
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def is_loopback(host: str) -> bool:
    """Is ``host`` this machine's loopback address (``localhost``, ``127.x.y.z``, ``::1``)?"""
    return host == "localhost" or host.startswith("127.") or host == "::1"


def loopback_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> Any:
    """The process group's ``TCPStore``, listening on the loopback address only, when ``host`` is
    loopback (a one-node job); ``None`` otherwise (torch's ``env://`` store then serves it).

    torch's ``TCPStore`` server binds the wildcard address whatever host it is given, so any
    machine that can reach this one could read and write the job's keys. Its documented
    ``master_listen_fd`` argument takes a socket bound beforehand: rank 0 binds one to ``host``
    and hands it over; the other ranks are clients, as with ``env://``.
    """
    if not is_loopback(host) or agent_serves_store():
        return None  # several nodes, or torchrun's agent serves the store (its own bind)
    global _groups
    _groups += 1  # every rank counts the groups it formed in this process: their keys never meet a former group's
    return dist.PrefixStore(f"paratrain-group-{_groups}", _store_on(host, port, rank, world_size, timeout))


_groups = 0  # process groups formed on a loopback store by this process
_served: set[tuple[str, int]] = set()  # where this process's rank 0 started a store server


def _store_on(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> Any:
    """A ``TCPStore`` whose server (rank 0) listens on ``host`` only; clients elsewhere.

    A server this process started for an earlier group may still run: a DDP model of that group,
    still referenced after ``close()``, keeps the group and its store alive. Rank 0 then shares it
    (``multi_tenant``, as torch's ``env://`` store does), under a new key prefix (above)."""
    addr = "::1" if host == "::1" else ("127.0.0.1" if host == "localhost" else host)
    if rank != 0:
        return dist.TCPStore(addr, port, world_size, False, timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own server does
        sock.bind((addr, port))
        sock.listen(socket.SOMAXCONN)
    except (OSError, OverflowError) as e:
        sock.close()
        if (addr, port) in _served and getattr(e, "errno", None) == errno.EADDRINUSE:
            try:  # this process's own earlier server, if it still runs (else the port is another's)
                return dist.TCPStore(addr, port, world_size, True, timeout, multi_tenant=True)
            except dist.DistError:
                pass
        raise UnavailableError(f"rank 0 cannot listen on {addr}:{port} ({getattr(e, 'strerror', None) or e}): choose "
                               "another MASTER_PORT") from None
    _served.add((addr, port))
    return dist.TCPStore(addr, port, world_size, True, timeout, multi_tenant=True, master_listen_fd=sock.detach())


_LOOPBACK_SCHEME = "paratrain-loopback"


def store_init_method(host: str, port: int) -> str:
    """An ``init_method`` URL for ``rpc.init_rpc`` and the like: ``tcp://host:port``, whose store
    listens on every interface, unless ``host`` is loopback; then a rendezvous registered here
    (``torch.distributed.register_rendezvous_handler``) whose store listens on ``host`` only."""
    if not is_loopback(host):
        return f"tcp://{host}:{port}"
    try:
        dist.register_rendezvous_handler(_LOOPBACK_SCHEME, _loopback_rendezvous)
    except RuntimeError:
        pass  # registered by an earlier call
    return f"{_LOOPBACK_SCHEME}://{host}:{port}"


def _loopback_rendezvous(url: str, timeout: timedelta = timedelta(minutes=10), **kwargs: Any) -> Iterator[Any]:
    parsed = urllib.parse.urlparse(url)
    query = dict(urllib.parse.parse_qsl(parsed.query))
    rank, world_size = int(query["rank"]), int(query["world_size"])
    yield _store_on(parsed.hostname or "127.0.0.1", int(parsed.port or 0), rank, world_size, timeout), rank, world_size
    raise RuntimeError(f"{_LOOPBACK_SCHEME}:// rendezvous cannot be repeated")
