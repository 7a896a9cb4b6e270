"""Try bad inputs as a new user would and count the clear answers (issue 14's sweep).

    python scripts/bad_inputs.py            # prints one row per input, then the counts

A clear answer: a non-zero exit, exactly one error line on stderr (warnings, one line each, may
precede it), no traceback, and the line names
the bad value (the ``needle``). Each input runs ``python -m paratrain`` in a fresh process, on
the built-in default data, for at most a step or two.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cases(tmp: Path) -> list[tuple[str, list[str], str]]:
    (tmp / "afile").write_text("x")
    (tmp / "bad.yaml").write_text("model: [cnn\n")
    (tmp / "scalar.toml").write_text("parallel = 5\n")
    (tmp / "unknown.toml").write_text("[parallel]\nwarp = 1\n")
    (tmp / "bad.toml").write_text("model = \n")
    cifar = tmp / "cifar" / "cifar-10-batches-py"
    cifar.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (cifar / name).write_bytes(b"\x06garbage")
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    (ckpt / "step-00000004.pt").write_bytes(os.urandom(200))
    (tmp / "evil.pt").write_bytes(pickle.dumps(os.system))
    train = ["train", "--no-progress", "--max-steps", "1", "--log-dir", str(tmp / "run")]
    return [
        # config values
        ("strategy", [*train, "--strategy", "zero"], "'zero'"),
        ("precision", [*train, "--precision", "fp7"], "'fp7'"),
        ("model", [*train, "--model", "gpt9"], "gpt9"),
        ("dataset", [*train, "--dataset", "imagenet"], "imagenet"),
        ("lr nan", [*train, "--lr", "nan"], "lr nan"),
        ("lr negative", [*train, "--lr", "-1"], "lr -1"),
        ("lr text", [*train, "--lr", "fast"], "fast"),
        ("global batch 0", [*train, "--global-batch", "0"], "global_batch 0"),
        ("global batch not divisible", [*train, "--strategy", "ddp", "--nproc-per-node", "3", "--global-batch", "64"],
         "not divisible"),
        ("accumulation 0", [*train, "--accumulation", "0"], "accumulation"),
        ("epochs -1", [*train, "--epochs", "-1"], "epochs"),
        ("optimizer", [*train, "--optimizer", "lion"], "lion"),
        ("schedule", [*train, "--schedule", "exponential"], "exponential"),
        ("step schedule without step_size", [*train, "--schedule", "step"], "step_size"),
        ("warmup negative", [*train, "--warmup-steps", "-2"], "warmup_steps"),
        ("backend unknown", [*train, "--backend", "pigeon"], "pigeon"),
        ("backend nccl without GPU", [*train, "--backend", "nccl"], "nccl"),
        ("accelerator absent", [*train, "--set", "parallel.accelerator=cuda"], "cuda"),
        ("timeout 0", [*train, "--set", "parallel.timeout_s=0"], "timeout_s"),
        ("one-process strategy on 2", [*train, "--strategy", "dp", "--nproc-per-node", "2"], "one process"),
        ("devices on 2", [*train, "--strategy", "devices", "--nproc-per-node", "2"], "one process"),
        ("fp16-mixed with pipeline", [*train, "--strategy", "pipeline", "--precision", "fp16-mixed"], "fp16-mixed"),
        ("bf16-true with fsdp", [*train, "--strategy", "fsdp", "--precision", "bf16-true"], "bf16-true"),
        ("tensor tp_size", [*train, "--strategy", "tensor", "--nproc-per-node", "2", "--set",
                            "parallel.tensor.tp_size=3"], "tp_size"),
        ("ddp comm hook", [*train, "--strategy", "ddp", "--set", "parallel.ddp.comm_hook=zip"], "zip"),
        ("unknown --set key", [*train, "--set", "parallel.nope=1"], "nope"),
        ("--set without =", [*train, "--set", "parallel.strategy"], "parallel.strategy"),
        ("--set of a section", [*train, "--set", "parallel=3"], "parallel"),
        ("dataset smaller than a batch", [*train, "--dataset", "synthetic", "--set", "data.synthetic_size=2",
                                          "--global-batch", "4"], "fewer than one global batch"),
        # files
        ("config missing", [*train, "--config", str(tmp / "none.toml")], "none.toml"),
        ("config malformed yaml", [*train, "--config", str(tmp / "bad.yaml")], "YAML"),
        ("config malformed toml", [*train, "--config", str(tmp / "bad.toml")], "bad.toml"),
        ("config section as value", [*train, "--config", str(tmp / "scalar.toml")], "parallel"),
        ("config unknown key", [*train, "--config", str(tmp / "unknown.toml")], "warp"),
        ("config is a folder", [*train, "--config", str(tmp)], "folder"),
        ("cifar without data dir", [*train, "--dataset", "cifar10"], "--data-dir"),
        ("cifar dir missing", [*train, "--dataset", "cifar10", "--data-dir", str(tmp / "nowhere")], "nowhere"),
        ("cifar garbage", [*train, "--dataset", "cifar10", "--data-dir", str(tmp / "cifar")], "CIFAR-10"),
        ("log dir is a file", ["train", "--no-progress", "--max-steps", "1", "--log-dir", str(tmp / "afile")],
         "is a file"),
        ("checkpoint dir is a file", [*train, "--checkpoint-dir", str(tmp / "afile"), "--checkpoint-every", "1"],
         "checkpoint"),
        ("resume from random bytes only", ["train", "--no-progress", "--max-steps", "1", "--resume", "--log-dir",
                                           str(tmp / "r"), "--checkpoint-dir", str(ckpt)], "checkpoint"),
        # other commands
        ("bench strategy", ["bench", "--strategies", "warp"], "warp"),
        ("bench precision", ["bench", "--precisions", "fp7"], "fp7"),
        ("bench world size", ["bench", "--world-sizes", "0"], "0"),
        ("verify strategy", ["verify", "--strategy", "zero"], "zero"),
        ("export missing", ["export", str(tmp / "nothing"), "--out", str(tmp / "out")], "nothing"),
        ("export crafted pickle", ["export", str(tmp / "evil.pt"), "--out", str(tmp / "out2")], "evil.pt"),
        ("run missing script", ["run", "--nproc-per-node", "1", str(tmp / "missing.py")], "missing.py"),
        ("run bad nproc", ["run", "--nproc-per-node", "zero", "x.py"], "zero"),
        ("unknown command", ["trian"], "trian"),
        ("unresolvable master", [*train, "--strategy", "ddp", "--nnodes", "2", "--nproc-per-node", "1",
                                 "--master-addr", "no-such-host.invalid"], "no-such-host.invalid"),
    ]


def main() -> int:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    clear = 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        found = cases(tmp)
        for name, args, needle in found:
            start = time.monotonic()
            res = subprocess.run([sys.executable, "-m", "paratrain", *args], cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=120)
            lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("paratrain: warning:")]
            ok = res.returncode != 0 and len(lines) == 1 and "Traceback" not in res.stderr and needle in lines[0]
            clear += ok
            shown = lines[0] if len(lines) == 1 else f"{len(lines)} lines: {lines[-1] if lines else ''}"
            print(f"{'clear' if ok else 'NOT CLEAR':9} rc={res.returncode:<3} {time.monotonic() - start:5.1f}s "
                  f"{name:32} {shown[:150]}", flush=True)
        print(f"\n{clear} of {len(found)} bad inputs got one clear line and a non-zero exit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
