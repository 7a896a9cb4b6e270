"""Each worker's output kept in the run folder (``logs/rank-N.log``) as well as shown on the terminal.

torchrun's agent redirects every worker's stdout and stderr into files of its own log folder
(``--redirects 3``; ``<dir>/<run id>/attempt_<k>/<local rank>/stdout.log``), so nothing a worker
writes is lost when it dies. :class:`WorkerLogs` follows those files from the launcher, as
``tail -f`` does, and writes what it reads twice: to the launcher's own stdout or stderr, whole
lines only (a line two workers write at once never fuses: a piece without its end waits for it;
a carriage return, a progress bar's, ends a piece too), and, both streams together, to
``logs/rank-N.log`` in the run folder. torchrun's own ``--tee`` would do the first half, but it
prefixes every line and prints a line read before its end in two pieces.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from typing import IO, Callable

__all__ = ["WorkerLogs"]

_ATTEMPT = re.compile(r"attempt_(\d+)$")


class WorkerLogs:
    """Follow the redirected output under ``source`` (torchrun's ``--log-dir``) into ``folder``'s
    ``rank-N.log`` files and the terminal, from :meth:`start` until :meth:`stop` (which reads the rest)."""

    def __init__(self, source: str, folder: str, rank_of: Callable[[int], int] = lambda local: local,
                 interval_s: float = 0.05) -> None:
        self.source, self.folder, self.rank_of, self.interval_s = source, folder, rank_of, interval_s
        self._offsets: dict[str, int] = {}
        self._pending: dict[str, bytes] = {}
        self._heads: dict[str, bytes] = {}  # each file's first bytes: a file written anew starts otherwise
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="paratrain-worker-logs", daemon=True)
        self._files: dict[int, IO[bytes]] = {}

    def path(self, rank: int) -> str:
        """The file that keeps rank ``rank``'s output."""
        return os.path.join(self.folder, f"rank-{rank}.log")

    def start(self) -> "WorkerLogs":
        os.makedirs(self.folder, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Read what is left (the workers have ended), end each stream's last piece, and close the files."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._read_all(final=True)
        for f in self._files.values():
            f.close()

    def _follow(self) -> None:
        while not self._done.wait(self.interval_s):
            try:
                self._read_all(final=False)
            except OSError:
                pass  # a file that went away (the agent's next attempt): read again next time

    def _streams(self) -> list[tuple[str, int, str]]:
        """``(path, local rank, stdout|stderr)`` of every redirected file so far, oldest attempt first."""
        out: list[tuple[str, int, str, int]] = []
        for root, _, names in os.walk(self.source):
            local = os.path.basename(root)
            attempt = _ATTEMPT.search(os.path.dirname(root))
            if not local.isdigit() or attempt is None:
                continue
            for name in names:
                if name in ("stdout.log", "stderr.log"):
                    out.append((os.path.join(root, name), int(local), name[:-4], int(attempt.group(1))))
        return [(p, local, stream) for p, local, stream, _ in sorted(out, key=lambda x: (x[3], x[1], x[2]))]

    def _read_all(self, final: bool) -> None:
        for path, local, stream in self._streams():
            self._file(self.rank_of(local))  # a rank that printed nothing has its (empty) file too
            with open(path, "rb") as f:
                offset = self._offsets.get(path, 0)
                head = f.read(64)
                if offset and (os.fstat(f.fileno()).st_size < offset or not self._heads.get(path, b"").startswith(
                        head[:len(self._heads.get(path, b""))])):
                    # the agent started this rank's workers again into the same file (a restart after the
                    # hosts changed keeps the attempt's number): the file was truncated, read it anew
                    offset = 0
                    self._pending.pop(path, None)
                f.seek(offset)
                data = f.read()
            if offset == 0:
                self._heads[path] = head
            self._offsets[path] = offset + len(data)
            data = self._pending.pop(path, b"") + data
            cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1  # whole pieces only
            if final:
                cut = len(data)
            whole, rest = data[:cut], data[cut:]
            if rest:
                self._pending[path] = rest
            if whole:
                if final and not whole.endswith((b"\n", b"\r")):
                    whole += b"\n"
                self._write(local, stream, whole)

    def _write(self, local: int, stream: str, data: bytes) -> None:
        dst = sys.stdout if stream == "stdout" else sys.stderr
        try:
            if hasattr(dst, "buffer"):
                dst.flush()  # what this process wrote itself first
                dst.buffer.write(data)
            else:
                dst.write(data.decode(errors="replace"))
            dst.flush()
        except (OSError, ValueError):
            pass  # the terminal went away: the file still keeps it
        f = self._file(self.rank_of(local))
        f.write(data)
        f.flush()

    def _file(self, rank: int) -> IO[bytes]:
        f = self._files.get(rank)
        if f is None:
            os.makedirs(self.folder, exist_ok=True)
            f = self._files[rank] = open(self.path(rank), "ab")
        return f
