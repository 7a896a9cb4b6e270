"""The parameter server on ``torch.distributed.rpc``.

* :mod:`paratrain.ps.server`: the server's state and the RPC endpoints workers call on it.
* :mod:`paratrain.ps.dedicated`: :func:`run_parameter_server`, the layout where rank 0 only serves.

The ``ps`` strategy behind ``Parallel`` (rank 0 serves *and* trains) is the thin adapter in
``paratrain/strategies/ps.py``.
"""

from .dedicated import PSResult, run_parameter_server
from .server import MODES, PSOptions

__all__ = ["PSOptions", "PSResult", "run_parameter_server", "MODES"]
