"""``python -m paratrain ARGS`` for the test suite, forked from a server that has imported torch and
paratrain once (a "zygote"), instead of a new interpreter importing them again: about 2 s of CPU less
per command on a 2-core machine, for a few hundred commands a run.

What the command sees is what a new interpreter would give it: its own process (a new session, so
its process group can be killed), its argv, environment, working directory and ``sys.path``,
stdin, stdout and stderr, ``OMP_NUM_THREADS``, and a normal interpreter exit (atexit handlers,
threads joined, exit status; a signal's death is ``-SIG`` as for ``subprocess``). The server only
imports (no threads, no OpenMP pool: what ``multiprocessing``'s forkserver does for paratrain's own
workers), and it checks that importing printed nothing, so no output of a fresh start is hidden.

What a new interpreter does that this does not: read environment variables at import. A
``sitecustomize`` on the command's ``PYTHONPATH`` (``tests/faults``: it patches paratrain's functions
when a ``PARATRAIN_TEST_*`` variable asks for a fault) is imported in the command, as ``site`` would
at start-up, before the workers' forkserver starts. A test that asks for ``fresh=True``
(``clitools.start_cli``) starts a new interpreter, as does any command while
``PARATRAIN_TEST_ZYGOTE=0``.

The docs' code blocks (``docs/_tools/run_blocks.py``) use the same server through a ``paratrain``
shim on their ``PATH`` (:func:`write_shim`), and a page's Python process forks from it too. So do the lab's
hosts (``tests/lab``: the shim runs inside a host's network namespace, and the command joins the network,
hostname and mount namespaces of its client, :func:`_enter_namespaces`). A command whose client goes away (a killed test, pytest
process or shim) is killed with its process group.

The workers of a ``paratrain run`` command that forked from the server (torchrun's agent starts each as
``python -u SCRIPT ARGS`` or ``python -u -m MODULE ARGS``) fork from the same server too
(:func:`_fork_workers`), each in its own session with the environment, stdio and directory the agent gave it,
run as ``python`` runs a script (``runpy``; ``sys.path[0]`` the script's folder). Their parent is the
server's helper, not the agent, and a worker outlives its agent as an exec'd one would: it ends by
paratrain's own watch of ``PARATRAIN_AGENT_PID`` (``env.process.die_with_launcher``), not by its helper.
Another program (``python -c``, other flags, another interpreter) starts as always.

Protocol (one Unix socket per server; one connection per command): the client sends a
length-prefixed JSON request (argv, env, cwd) with its three stdio descriptors (and any ``pass_fds``) attached
(``socket.send_fds``); the server forks a helper, which forks the command and answers with two JSON
lines: ``{"pid": N}``, then ``{"status": CODE}`` when the command ends. The request's argv is the
interpreter's (``-m paratrain ARGS``, ``-u SCRIPT ARGS``).
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import json
import multiprocessing.util
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from typing import Any

# what the server imports: what `python -m paratrain` imports for its commands
PRELOAD = ("torch", "torch._dynamo", "paratrain", "paratrain.cli.main", "paratrain.cli.train", "paratrain.loop.train",
           "paratrain.launch.torchrun", "torch.distributed.elastic.multiprocessing.errors")

_server: subprocess.Popen | None = None
_address: str | None = None  # in a command: the server it forked from (its workers fork from it too)
# in the server
_BASE_PATH: list[str] = []  # its sys.path
_SERVER_PYTHONPATH: set[str] = set()  # its $PYTHONPATH's entries (a command has its own)
_spawnv_passfds = multiprocessing.util.spawnv_passfds  # what _fork_forkserver stands in for


def enabled() -> bool:
    return os.environ.get("PARATRAIN_TEST_ZYGOTE", "1") != "0" and hasattr(socket, "send_fds")


def start_server(env: dict[str, str]) -> str:
    """The address of this process's server, started with ``env`` at the first command (a few
    seconds, once); it ends with this process."""
    global _server, _address
    if _address is not None and (_server is None or _server.poll() is None):  # started, or (in a command) given
        return _address
    folder = tempfile.mkdtemp(prefix="paratrain-zygote-")
    address = os.path.join(folder, "z.sock")
    _server = subprocess.Popen([sys.executable, __file__, address, str(os.getpid())], env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    assert _server.stdout is not None
    first = _server.stdout.readline().decode()
    if first.strip() != "ready":  # it printed while importing, or failed: say what, and use no server
        rest = _server.stdout.read(4000).decode(errors="replace") if _server.poll() is not None else ""
        _server.kill()
        raise RuntimeError(f"tests/zygote.py: the server printed {first + rest!r} while importing {PRELOAD}")
    _server.stdout.close()  # the server's output goes nowhere from now on
    _address = address
    atexit.register(_stop)
    return address


def write_shim(folder: str) -> str:
    """Write ``folder/paratrain``: a ``paratrain`` command for shells (the docs' code blocks) whose
    commands fork from the server named by ``$PARATRAIN_ZYGOTE`` (:func:`client_main`). Returns it."""
    path = os.path.join(folder, "paratrain")
    with open(path, "w") as f:  # -S: the shim itself imports the standard library only
        f.write(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n"
                "import zygote\nzygote.client_main()\n")
    os.chmod(path, 0o755)
    return path


_SHIM: list[str] = []


def shim() -> str:
    """This process's ``paratrain`` shim (:func:`write_shim`, in a folder of its own, written once)."""
    if not _SHIM:
        _SHIM.append(write_shim(tempfile.mkdtemp(prefix="paratrain-shim-")))
    return _SHIM[0]


def client_main() -> None:
    """The shim's ``paratrain ARGS``: the command runs in a child of the server, with this process's
    stdio, environment and directory; signals sent here reach it, and this process exits as it did."""
    sock = _request(os.environ["PARATRAIN_ZYGOTE"], ["-m", "paratrain", *sys.argv[1:]], dict(os.environ), os.getcwd(),
                    [0, 1, 2])
    lines = _Lines(sock)
    pid = int(lines.next(None)["pid"])

    def forward(sig: int, _frame: Any) -> None:
        try:
            os.kill(pid, sig)
        except OSError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    status = int(lines.next(None)["status"])
    if status < 0:  # died of a signal: so does this process, as the shell would have seen it
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


def _request(address: str, argv: list[str], env: dict[str, str], cwd: str, stdio: list[int],
             keep: bool = False, pass_fds: tuple[int, ...] = ()) -> socket.socket:
    """Ask the server at ``address`` for ``python ARGV`` with ``stdio`` (``keep``: the command outlives this
    client), and ``pass_fds``, which the command has under the same numbers."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    body = json.dumps({"argv": argv, "env": env, "cwd": cwd, "keep": keep, "address": address,
                       "namespaces_of": os.getpid(), "pass_fds": list(pass_fds)}).encode()
    socket.send_fds(sock, [struct.pack("!Q", len(body))], [*stdio, *pass_fds])
    sock.sendall(body)
    return sock


class _Lines:
    """The server's JSON lines on ``sock``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def next(self, timeout: float | None) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                raise TimeoutError
            chunk = self.sock.recv(4096)
            if not chunk:
                raise RuntimeError("tests/zygote.py: the server ended before the command did")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def _stop() -> None:
    if _server is not None and _server.poll() is None:
        _server.kill()
        _server.wait()


def program(args: Any) -> tuple[str, str, list[str]] | None:
    """``(kind, target, argv)`` of a ``python`` command line the server can run: ``("module", NAME, ARGS)`` for
    ``python [-u] -m NAME ARGS``, ``("script", PATH, ARGS)`` for ``python [-u] PATH ARGS``; None for anything
    else (``-c``, other flags, another program)."""
    if isinstance(args, (str, bytes)) or not args or os.path.realpath(str(args[0])) != os.path.realpath(sys.executable):
        return None
    rest = [str(a) for a in args[1:]]
    while rest and rest[0] == "-u":
        rest = rest[1:]
    if len(rest) >= 2 and rest[0] == "-m":
        return "module", rest[1], rest[2:]
    if rest and not rest[0].startswith("-"):
        return "script", rest[0], rest[1:]
    return None


class ZygotePopen(subprocess.Popen):
    """A ``subprocess.Popen`` of ``python -m paratrain ARGS`` (or any command line :func:`program` takes) whose
    process the zygote forks. Pipes, ``communicate``, ``wait``, ``poll``, ``send_signal`` and ``pid`` work as
    for any ``Popen`` (the exit status comes from the server, which is the command's grandparent)."""

    keep = False  # the command outlives this client (a worker: paratrain's own watch ends it)

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any, pass_fds: Any,
                       cwd: Any, env: Any, startupinfo: Any, creationflags: Any, shell: Any,
                       p2cread: int, p2cwrite: int, c2pread: int, c2pwrite: int, errread: int, errwrite: int,
                       *rest: Any) -> None:
        self._child_created = False  # no os.waitpid: the status comes over the socket
        env = dict(os.environ if env is None else env)
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        try:
            self._zygote = _request(start_server(env), [str(a) for a in args[1:]], env, os.fspath(cwd or os.getcwd()),
                                    fds, self.keep, tuple(pass_fds))
            self._lines = _Lines(self._zygote)
            self.pid = int(self._message(None)["pid"])
        finally:  # the command's ends of the pipes are its own now (subprocess's own rule: not a caller's file)
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]

    def _message(self, timeout: float | None) -> dict[str, Any]:
        try:
            return self._lines.next(timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None

    def _internal_poll(self, *args: Any, **kwargs: Any) -> int | None:
        if self.returncode is None:
            try:
                self._ended(self._message(0))
            except subprocess.TimeoutExpired:
                pass
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self.returncode is None:
            self._ended(self._message(timeout))
        assert self.returncode is not None
        return self.returncode

    def _ended(self, message: dict[str, Any]) -> None:
        self.returncode = int(message["status"])
        self._zygote.close()


# ----------------------------------------------------------------------------------------- the server


MAX_FDS = 16  # stdio and a command's pass_fds


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 8, MAX_FDS)
    while len(head) < 8:
        head += conn.recv(8 - len(head))
    size = struct.unpack("!Q", head)[0]
    body = b""
    while len(body) < size:
        body += conn.recv(size - len(body))
    return json.loads(body), fds


def _serve(address: str, client_pid: int) -> tuple[dict[str, Any], list[int]]:
    """The server's loop; returns only in a forked command, with its request."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the helpers are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(64)
    server.settimeout(2.0)
    print("ready", flush=True)
    quiet = os.open(os.devnull, os.O_WRONLY)  # nothing more reaches the client's pipe (it reads one line)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    os.close(quiet)
    while True:
        try:
            conn, _ = server.accept()
        except socket.timeout:
            if os.getppid() != client_pid:  # the pytest process is gone
                os._exit(0)
            continue
        if os.fork() != 0:
            conn.close()
            continue
        # the helper: forks the command, reports its pid and, when it ends, its status
        server.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        conn.settimeout(None)
        request, fds = _receive(conn)
        pid = os.fork()
        if pid == 0:
            conn.close()
            return request, fds
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            status = _watch(pid, conn, request.get("keep", False))
            conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        finally:
            os._exit(0)


def _watch(pid: int, conn: socket.socket, keep: bool) -> int:
    """Wait for the command ``pid``; if the client goes away first (its connection closes: a test or
    its pytest process killed), the command's process group goes with it (SIGKILL), unless ``keep``."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    watched = [conn, wake_r]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        ready, _, _ = select.select(watched, [], [])
        if wake_r in ready:
            os.read(wake_r, 512)
        if conn in ready and not conn.recv(1):
            if keep:  # the command alone now: wait for its end
                watched = [wake_r]
                continue
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


def _become(request: dict[str, Any], fds: list[int]) -> tuple[str, str]:
    """In the forked command: take its session, stdio, directory, environment and argv. Returns what to run
    (:func:`program`'s kind and target)."""
    global _address
    parsed = program([sys.executable, *request["argv"]])
    if parsed is None:  # the clients send only what program() takes
        raise SystemExit(f"tests/zygote.py: the server runs `python [-u] -m NAME ARGS` or `python [-u] SCRIPT ARGS`, "
                         f"not python {' '.join(request['argv'])!r}: start that command as a new process")
    kind, target, args = parsed
    _address = request.get("address")
    os.setsid()
    for std, fd in enumerate(fds[:3]):
        os.dup2(fd, std)
    numbers = request["pass_fds"]  # the others: to the numbers the client had them under, through free ones
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, max([2, *fds, *numbers]) + 1) for fd in fds[3:]]
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    for number, fd in zip(numbers, moved):
        os.dup2(fd, number)
        os.close(fd)
    _enter_namespaces(request["namespaces_of"])  # before the directory: a mount namespace has its own
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # sys.path as python builds it: the working directory (`-m`) or the script's folder, $PYTHONPATH, then the rest
    given = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.getcwd() if kind == "module" else os.path.dirname(os.path.realpath(target))
    sys.path[:] = [first, *given, *(p for p in _BASE_PATH if p not in _SERVER_PYTHONPATH)]
    if os.environ.get("PYTHONUNBUFFERED") or request["argv"][:1] == ["-u"]:  # program() took the leading -u's
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)  # type: ignore[attr-defined]
    from paratrain.launch.forkserver import apply_omp_threads

    apply_omp_threads()  # OpenMP read the server's value at import
    sys.argv = ["-m", *args] if kind == "module" else [target, *args]
    if any(os.path.exists(os.path.join(p, "sitecustomize.py")) for p in given):
        # what `site` imports at start-up (tests/faults: it patches paratrain's functions when a
        # PARATRAIN_TEST_* variable asks for a fault); before the workers' forkserver is forked
        import importlib

        sys.modules.pop("sitecustomize", None)
        importlib.import_module("sitecustomize")
    if enabled() and os.environ.get("PARATRAIN_TEST_ZYGOTE_WORKERS", "1") != "0":
        _fork_workers()
    # every forkserver the command starts (paratrain train's, early; verify's, bench's, selftest's when they launch)
    multiprocessing.util.spawnv_passfds = _fork_forkserver  # type: ignore[assignment]
    if (kind, target) == ("module", "paratrain"):
        from paratrain.launch.forkserver import start_early

        start_early()  # what `import paratrain` does first in a new `python -m paratrain`
    return kind, target


NAMESPACES = ("net", "uts", "mnt")
"""The namespaces a command takes from its client: a lab host's (``scripts/lab/hosts.py``: ``ip netns exec``, which
also bind-mounts the host's /etc/hosts, then ``unshare --uts`` for its hostname)."""


def _enter_namespaces(pid: int) -> None:
    """In the forked command (one thread: ``setns`` into a mount namespace needs that): join the namespaces of
    :data:`NAMESPACES` where the client ``pid`` is in another one than the server, as a command the client
    started itself would be. A lab host's ``paratrain`` (the shim) so forks from the server too."""
    libc: ctypes.CDLL | None = None
    for kind in NAMESPACES:
        theirs = f"/proc/{pid}/ns/{kind}"
        if os.stat(theirs).st_ino == os.stat(f"/proc/self/ns/{kind}").st_ino:
            continue
        if libc is None:
            libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(theirs, os.O_RDONLY)
        try:
            if libc.setns(fd, 0) != 0:
                err = ctypes.get_errno()
                raise SystemExit(f"tests/zygote.py: cannot join the client's {kind} namespace ({theirs}): "
                                 f"{os.strerror(err)}: start that command as a new process")
        finally:
            os.close(fd)


class _WorkerPopen(ZygotePopen):
    keep = True


def _fork_workers() -> None:
    """In a command: torchrun's agent (``paratrain run``) starts a ``python`` worker as a fork of the server
    (:class:`_WorkerPopen`); other programs as always. ``PARATRAIN_TEST_ZYGOTE_WORKERS=0``: every worker exec'd."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as handler

    exec_popen = handler.SubprocessHandler._popen

    def _popen(self: Any, args: tuple, env: dict[str, str]) -> subprocess.Popen:
        if program(args) is None:
            return exec_popen(self, args, env)
        return _WorkerPopen(args=list(args), env=env, stdout=self._stdout, stderr=self._stderr, start_new_session=True)

    handler.SubprocessHandler._popen = _popen  # type: ignore[method-assign]



FORK_FAILED = "tests/zygote.py: the command's forkserver could not be forked"


def _fork_forkserver(path: str, args: list[str], passfds: Any) -> int:
    """``multiprocessing.util.spawnv_passfds`` in a command: a workers' forkserver (``paratrain train``'s, started
    early; the one ``paratrain verify``, ``bench`` or ``selftest`` starts when it launches) is forked, not a new
    interpreter that imports torch again (6 s of CPU each on a slow 2-core machine), while the command has one
    thread (a fork copies no other; with more, a new interpreter as always). Like the exec'd one, it keeps stdio
    and the descriptors it is passed, has the default handler of every signal the command caught, and runs its
    ``-c`` code in a process whose environment is the command's (``paratrain.launch.forkserver`` records it as
    the server's, as its import in a new server would)."""
    if "multiprocessing.forkserver import main" not in args[-1] or len(os.listdir("/proc/self/task")) > 1:
        return _spawnv_passfds(path, args, passfds)  # the resource tracker: a new interpreter, as always
    pid = os.fork()
    if pid != 0:
        return pid
    try:
        for sig in signal.valid_signals():  # what exec does: a caught signal's handler is the default again
            handler = signal.getsignal(sig)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        keep = {0, 1, 2, *map(int, passfds)}
        for name in os.listdir("/proc/self/fd"):
            if int(name) not in keep:
                try:
                    os.close(int(name))
                except OSError:
                    pass
        # not `import paratrain.launch.forkserver as server`: `paratrain.launch` is the package's launch function,
        # and that import (which walks the attributes) failed, so every command's early server died at once and
        # its agent started a new interpreter that imported torch again (4.5 s of CPU per command)
        from paratrain.launch import forkserver as server

        server._SERVER_ENV = dict(os.environ)
        server._IMPORTED_IN = os.getpid()
        exec(args[-1], {"__name__": "__main__"})  # `python -c "from multiprocessing.forkserver import main; ..."`
    except BaseException:  # said on the command's stderr (tests/cli/test_train_cli.py), not a silent new interpreter
        import traceback

        os.write(2, f"{FORK_FAILED}:\n{traceback.format_exc()}".encode())
        os._exit(1)
    os._exit(0)


def _main() -> None:
    address, client_pid = sys.argv[1], int(sys.argv[2])
    global _BASE_PATH, _SERVER_PYTHONPATH
    _SERVER_PYTHONPATH = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _BASE_PATH = sys.path[1:]  # without this file's folder (tests/ is not on a command's path)
    sys.path[:] = _BASE_PATH
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from paratrain.cli.main import build_parser

    build_parser()  # imports each subcommand's module (argparse objects only: nothing runs)
    request, fds = _serve(address, client_pid)
    kind, target = _become(request, fds)
    import runpy

    if kind == "module":
        runpy._run_module_as_main(target)  # type: ignore[attr-defined]  # what `python -m NAME` calls
    else:
        runpy.run_path(target, run_name="__main__")  # `python SCRIPT`


if __name__ == "__main__":
    _main()
