"""Main-process-only logs (through :mod:`paratrain.tracking`), a progress bar, and throughput accounting."""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, Iterable, Iterator

from ..env.disk import writing
from ..tracking import Trackers

__all__ = ["RunLogger", "Throughput", "progress", "write_atomic"]


class RunLogger:
    """The built-in job's logs: each record to every tracker of ``log_to`` (default ``csv``:
    ``<kind>.csv`` and ``<kind>.jsonl`` in ``log_dir``, ``train`` every few steps, ``eval`` after
    every epoch; ``tensorboard=True`` adds ``tensorboard``), and the run's summary files.

    Pass ``trackers`` (``pt.trackers``) to log through the same backends as ``pt.log``. Only the
    main process writes; on other ranks (or with ``log_dir=None``) it does nothing.
    """

    def __init__(self, log_dir: str | None, enabled: bool = True, append: bool = False,
                 tensorboard: bool = False, log_to: Iterable[str] | None = None,
                 trackers: Trackers | None = None) -> None:
        self.enabled = enabled and log_dir is not None
        self.append = append  # a resumed run continues the existing files
        self.log_dir = log_dir
        if trackers is None:
            names = list(log_to if log_to is not None else ["csv"]) + (["tensorboard"] if tensorboard else [])
            trackers = Trackers(names, log_dir)
        trackers.enabled = trackers.enabled and self.enabled
        trackers.append = append
        self.trackers = trackers
        if self.enabled:
            with writing(log_dir, flag="log_dir"):  # type: ignore[arg-type]
                os.makedirs(log_dir, exist_ok=True)  # type: ignore[arg-type]

    def log(self, record: dict[str, Any], kind: str = "train") -> None:
        metrics = dict(record)
        self.trackers.log(metrics, int(metrics.pop("step", 0)), kind)

    def close(self, ok: bool = True) -> None:
        """Finish the trackers (the CSV/JSONL files are closed after each record)."""
        self.trackers.close(ok)

    def write_text(self, name: str, text: str) -> None:
        """Write ``text`` as ``<log_dir>/<name>``, atomically (main process only)."""
        if self.enabled and self.log_dir is not None:
            write_atomic(os.path.join(self.log_dir, name), text)

    def write_json(self, name: str, obj: Any) -> None:
        """Write ``obj`` as ``<log_dir>/<name>``, atomically: a reader or a crash sees the old file or the new one."""
        if self.enabled:
            write_atomic(os.path.join(self.log_dir, name), json.dumps(obj, indent=2))  # type: ignore[arg-type]


def write_atomic(path: str | os.PathLike, text: str | bytes) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it, rename it over ``path`` and
    fsync the folder: all or nothing, as checkpoints are written. A failed write removes its
    temporary file; a full disk, read-only filesystem or exceeded quota is one line
    (:class:`~paratrain.env.disk.StorageError`)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    data = text.encode() if isinstance(text, str) else text
    with writing(path, len(data), cleanup=lambda: os.remove(tmp), flag="log_dir"):  # a full disk: one line
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a folder
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Throughput:
    """Wraps an iterable to measure time spent waiting for data vs. total step time."""

    def __init__(self) -> None:
        self.data_wait = 0.0
        self.start = time.perf_counter()

    def reset(self) -> None:
        self.data_wait = 0.0
        self.start = time.perf_counter()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (evaluation) does not count as training time."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - t0

    def timed(self, iterable: Iterable[Any]) -> Iterator[Any]:
        it = iter(iterable)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            self.data_wait += time.perf_counter() - t0
            yield item

    def summary(self, samples: int, steps: int) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return {
            "samples_per_s": samples / elapsed,
            "step_time_s": elapsed / max(steps, 1),
            "data_wait_share": self.data_wait / elapsed,
        }


def progress(total: int, enabled: bool, desc: str = "") -> Any:
    """A tqdm bar on the main process; a silent stand-in elsewhere."""
    if enabled:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)

    class _Null:
        def update(self, n: int = 1) -> None: ...
        def set_postfix(self, *a: Any, **k: Any) -> None: ...
        def close(self) -> None: ...

    return _Null()
