"""``paratrain export``: a run's trained model as ``model.safetensors`` (the model's own keys,
unsharded, whatever the strategy) plus ``paratrain.json`` describing how it was trained.

``SOURCE`` is a run folder (``runs/latest``), its ``checkpoints/`` folder (the newest good
checkpoint is taken) or one checkpoint file. A model larger than ``--max-shard-size`` is written
as HuggingFace does (``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``),
one file's tensors in memory at a time from a sharded (fsdp/tensor) checkpoint. With
``--hf-config`` (the folder ``model.config.save_pretrained`` wrote) the result is a folder
``transformers``' ``from_pretrained`` loads. Load it otherwise with ``paratrain.load_model(DIR)``.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write a run's model as safetensors (any strategy, unsharded)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", nargs="?", default="runs/latest",
                   help="run folder, checkpoint folder or checkpoint file (default: runs/latest)")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default: SOURCE/export)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest weights file, e.g. 5GB, 500MB (default: 5GB, as transformers' save_pretrained)")
    p.add_argument("--hf-config", default=None, metavar="DIR",
                   help="a HuggingFace model folder whose config.json (and generation_config.json) go beside the weights")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    import os

    from ..checkpoint.export import export_checkpoint

    out = args.out or os.path.join(args.source if os.path.isdir(args.source) else os.path.dirname(args.source) or ".",
                                   "export")
    path = export_checkpoint(args.source, out, args.max_shard_size, args.hf_config)
    print(f"exported {path} (+ {os.path.join(os.path.dirname(path), 'paratrain.json')})")
    return 0
