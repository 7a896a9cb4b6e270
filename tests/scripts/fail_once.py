"""Worker for ``paratrain run --max-restarts 1``: rank 1 dies on the first attempt, then all succeed.

Usage: ``paratrain run --nproc-per-node 2 --max-restarts 1 tests/scripts/fail_once.py OUT_DIR``.
"""

import os
import sys

from allreduce import main  # this script's folder is sys.path[0]

if __name__ == "__main__":
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
        os._exit(3)
    main(sys.argv[1])
