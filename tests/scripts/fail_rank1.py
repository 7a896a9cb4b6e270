"""Worker for ``paratrain run``: rank 1 raises, rank 0 waits in a barrier that never completes."""

import time

from torch.distributed.elastic.multiprocessing.errors import record

import paratrain


@record  # writes the exception to torchrun's error file, so the launcher can name the root cause
def main() -> None:
    paratrain.init(backend="gloo", timeout_s=120, accelerator="cpu")
    if paratrain.rank() == 1:
        time.sleep(0.5)
        raise RuntimeError("boom rank 1")
    paratrain.barrier()


if __name__ == "__main__":
    main()
