"""SHA-256 digests of every file of a checkpoint, in a manifest written last.

``step-00000040.sha256`` lists the checkpoint's files in ``sha256sum`` format (``<hex>  <path>``,
paths relative to the checkpoint directory), so ``sha256sum -c step-00000040.sha256`` run there
checks it by hand too::

    3f1c...  step-00000040.pt
    9a0b...  step-00000040.dcp/.metadata
    51de...  step-00000040.dcp/__0_0.distcp

Digests catch truncation, bit flips and files replaced by other content before torch reads a
byte. They are no signature: whoever can write the checkpoint can write its manifest too, which
is why files are also only ever read by loaders that cannot run pickled code.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from .errors import CheckpointError

__all__ = ["SUFFIX", "file_digest", "format_manifest", "fsync_dir", "verify_manifest"]

SUFFIX = ".sha256"
_LINE = re.compile(r"^([0-9a-f]{64})  (\S+)$")


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename, a new file's name) to disk; a no-op where it cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def format_manifest(digests: dict[str, str]) -> bytes:
    return "".join(f"{digests[name]}  {name}\n" for name in sorted(digests)).encode()


def _parse(manifest: Path) -> dict[str, str]:
    try:
        lines = manifest.read_bytes().decode("ascii").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"manifest {str(manifest)!r} is unreadable or corrupt: {type(e).__name__}") from None
    digests = {}
    for line in lines:
        m = _LINE.match(line)
        if m is None or m.group(2) in digests:
            raise CheckpointError(f"manifest {str(manifest)!r} is corrupt: bad line {line[:80]!r}")
        digests[m.group(2)] = m.group(1)
    return digests


def verify_manifest(manifest: Path, checkpoint: Path, shards: Path) -> None:
    """Check ``checkpoint`` (the ``.pt`` file) and every file under ``shards`` (its ``.dcp``
    directory, if any) against ``manifest``: each present, listed, and with its recorded digest."""
    directory = manifest.parent
    digests = _parse(manifest)
    if checkpoint.name not in digests:
        raise CheckpointError(f"manifest {str(manifest)!r} does not list {checkpoint.name!r}")
    for name in digests:  # only this checkpoint's own files, never a path out of the directory
        if name != checkpoint.name and not (name.startswith(shards.name + "/") and ".." not in name.split("/")):
            raise CheckpointError(f"manifest {str(manifest)!r} lists a file outside the checkpoint: {name!r}")
    if shards.is_dir():
        for f in sorted(shards.rglob("*")):
            rel = f.relative_to(directory).as_posix()
            if f.is_file() and rel not in digests:
                raise CheckpointError(f"checkpoint file {str(f)!r} is not in its manifest {manifest.name!r}")
    for name, expected in digests.items():
        path = directory / name
        try:
            actual = file_digest(path)
        except OSError as e:
            raise CheckpointError(f"checkpoint file {str(path)!r} listed in {manifest.name!r} cannot be read: "
                                  f"{e.strerror or type(e).__name__}") from None
        if actual != expected:
            raise CheckpointError(f"checkpoint file {str(path)!r} fails its SHA-256 check (manifest "
                                  f"{manifest.name!r}): corrupt or changed since it was written")
