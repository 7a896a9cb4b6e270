"""The record of every collective on every rank, and the one line that says which rank went its own way.

:mod:`.calls` reads a ``torch.distributed`` call's arguments; :mod:`.recorder` keeps each rank's
last collectives in a ring (a file the launcher reads when a rank dies); :mod:`.analyze` compares
the ranks' records and names the first collective where they differ.
"""

from .analyze import Finding, explain, first_divergence
from .recorder import Record, read_dir, read_file

__all__ = ["Record", "read_file", "read_dir", "Finding", "first_divergence", "explain"]
