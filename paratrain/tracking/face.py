"""What a run with trackers offers its loop: ``log``, ``log_image``, ``log_histogram``,
``log_table`` and ``tracker``. :class:`paratrain.Parallel` is one (its ``trackers`` are the
:class:`~paratrain.tracking.Trackers` of its ``log_to``/``loggers``; its ``global_step`` is the
default step)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import Trackers

__all__ = ["TrackedRun"]


class TrackedRun:
    """The tracking half of :class:`paratrain.Parallel`: every record goes to ``self.trackers``,
    at ``self.global_step`` unless a step is given."""

    trackers: Trackers
    global_step: int

    def log(self, metrics: Mapping[str, Any], step: int | None = None, kind: str = "train") -> None:
        """Record ``metrics`` (numbers or one-element tensors) at ``step`` (default: the optimizer
        steps taken, ``global_step``) with every tracker of ``log_to``/``loggers``, as
        ``<kind>/<name>`` (CSV: a row of ``<log_dir>/<kind>.csv``). Main process only: elsewhere,
        and without trackers, nothing happens. The first call starts the backends' runs, with
        this job's parallel config and provenance as their config."""
        self.trackers.log(metrics, self.global_step if step is None else int(step), kind)

    def log_image(self, name: str, image: Any, step: int | None = None, kind: str = "train") -> None:
        """Record ``image`` as ``<kind>/<name>`` at ``step`` (default: ``global_step``): a tensor
        ``C x H x W`` or ``H x W``, a NumPy array ``H x W x C`` or ``H x W``, or a PIL image, with 1,
        3 or 4 channels; floats are taken as 0 to 1, integers as 0 to 255. Main process only, like
        :meth:`log`; a backend without images says so once (csv writes a PNG, see the docs)."""
        self.trackers.log_image(name, image, self.global_step if step is None else int(step), kind)

    def log_histogram(self, name: str, values: Any, step: int | None = None, kind: str = "train") -> None:
        """Record the distribution of ``values`` (a tensor of any shape, an array, numbers) as
        ``<kind>/<name>`` at ``step`` (default: ``global_step``). Main process only, like :meth:`log`."""
        self.trackers.log_histogram(name, values, self.global_step if step is None else int(step), kind)

    def log_table(self, name: str, columns: Any = None, data: Any = None, *, dataframe: Any = None,
                  step: int | None = None, kind: str = "train") -> None:
        """Record a table as ``<kind>/<name>`` at ``step`` (default: ``global_step``): ``columns`` and
        ``data`` (a list of rows, or a mapping of columns), or a pandas ``dataframe``, as in
        Accelerate's and Lightning's ``log_table``. Main process only, like :meth:`log`."""
        self.trackers.log_table(name, columns, data, self.global_step if step is None else int(step), kind, dataframe)

    def tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker ``name`` of ``log_to``/``loggers`` (a :class:`~paratrain.tracking.Tracker`,
        its run started), or with ``unwrap=True`` the backend's own object, as Accelerate's
        ``get_tracker(name, unwrap=True)``: the wandb run, TensorBoard's ``SummaryWriter``, the
        ``MlflowClient`` (the run: ``pt.tracker("mlflow").run_id``), the Comet experiment. On other
        ranks than the main process, where nothing is opened, a :class:`~paratrain.tracking.NoTracker`:
        whatever is done with it does nothing, and it is falsy. A name the run does not log to is a
        one-line ``ValueError`` on every rank."""
        return self.trackers.get(name, unwrap)
