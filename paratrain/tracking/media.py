"""Images, histograms and tables in the one form every backend gets: an image as an ``H x W x C``
``uint8`` array, a histogram's values as a flat ``float64`` array, a table as columns and rows.

``pt.log_image``, ``pt.log_histogram`` and ``pt.log_table`` check what they are given on every rank
(:func:`check_image`, :func:`table_of`: a bad argument fails everywhere alike) and convert it on the
main process only (:func:`image_array`, :func:`histogram_values`); backends without such a kind write
it with :func:`png_bytes`, :func:`histogram_summary` and :func:`markdown_table`.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .base import scalar

__all__ = ["check_image", "image_array", "histogram_values", "histogram_summary", "table_of", "png_bytes",
           "markdown_table", "media_file"]

HISTOGRAM_BINS = 64
"""Bins of the histograms written by paratrain itself (csv, MLflow), as many as W&B's default."""


def _shape(image: Any) -> tuple[int, ...]:
    if hasattr(image, "shape"):
        return tuple(int(n) for n in image.shape)
    if hasattr(image, "size") and hasattr(image, "mode"):  # a PIL image: (width, height) and a mode
        width, height = image.size
        return (height, width, len(image.getbands()))
    return tuple(np.shape(image))


def check_image(image: Any) -> None:
    """A one-line ``ValueError`` unless ``image`` is ``H x W`` or an image with 1, 3 or 4 channels:
    a tensor ``C x H x W`` (torch's order), a NumPy array ``H x W x C``, or a PIL image."""
    shape = _shape(image)
    channels_first = _is_tensor(image)
    channels = None if len(shape) != 3 else shape[0] if channels_first else shape[2]
    if len(shape) == 2 or channels in (1, 3, 4):
        if 0 in shape:
            raise ValueError(f"log_image: the image is empty (shape {shape})")
        return
    order = "C x H x W" if channels_first else "H x W x C"
    raise ValueError(f"log_image: an image of shape {shape} is neither H x W nor {order} with 1, 3 or 4 channels "
                     f"({'a tensor' if channels_first else 'an array'} is taken as {order})")


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def image_array(image: Any) -> np.ndarray:
    """``image`` as an ``H x W x C`` ``uint8`` array (C: 1, 3 or 4). Floats are taken as 0 to 1
    (clipped), integers as 0 to 255, booleans as black and white."""
    check_image(image)
    if _is_tensor(image):
        tensor = image.detach().cpu()
        if tensor.ndim == 3:
            tensor = tensor.permute(1, 2, 0)
        array = tensor.float().numpy() if tensor.is_floating_point() and tensor.dtype.itemsize < 4 else tensor.numpy()
    else:
        if hasattr(image, "getbands") and image.mode not in ("L", "RGB", "RGBA"):  # PIL: palette, 16-bit, CMYK
            image = image.convert("RGBA" if "A" in image.getbands() or "transparency" in image.info else "RGB")
        array = np.asarray(image)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.dtype == np.bool_:
        return array.astype(np.uint8) * 255
    if np.issubdtype(array.dtype, np.floating):
        return np.round(np.clip(np.nan_to_num(array, nan=0.0), 0.0, 1.0) * 255).astype(np.uint8)
    return np.clip(array, 0, 255).astype(np.uint8)


def histogram_values(values: Any) -> np.ndarray:
    """Any tensor, array or sequence of numbers as a flat ``float64`` array of its finite values."""
    if _is_tensor(values):
        array = values.detach().float().cpu().numpy()
    else:
        array = np.asarray(values, dtype=np.float64)
    array = array.astype(np.float64).ravel()
    return array[np.isfinite(array)]


def histogram_summary(values: np.ndarray, bins: int = HISTOGRAM_BINS) -> dict[str, Any]:
    """``{"min", "max", "num", "sum", "bins" (bins + 1 edges), "counts"}``: a histogram where the
    backend has none (csv, MLflow)."""
    counts, edges = np.histogram(values, bins=bins) if values.size else (np.zeros(0, int), np.zeros(0))
    return {"min": float(values.min()) if values.size else None, "max": float(values.max()) if values.size else None,
            "num": int(values.size), "sum": float(values.sum()), "bins": edges.tolist(), "counts": counts.tolist()}


def table_of(columns: Sequence[Any] | None = None, data: Any = None,
             dataframe: Any = None) -> tuple[list[str], list[list[Any]]]:
    """``(columns, rows)`` from ``columns`` + ``data`` (rows), or ``data`` as a mapping of columns, or
    a pandas ``dataframe``; each cell a plain value (a one-element tensor as its number)."""
    if dataframe is not None:
        if data is not None:
            raise ValueError("log_table: pass data= or dataframe=, not both")
        columns = list(dataframe.columns) if columns is None else columns
        data = dataframe.values.tolist()
    elif isinstance(data, Mapping):
        columns = list(data) if columns is None else columns
        data = list(zip(*data.values()))
    if data is None:
        raise ValueError("log_table: pass data= (rows, or a mapping of columns) or dataframe=")
    rows = [list(row) for row in data]
    if columns is None:
        raise ValueError("log_table: pass columns= with the rows of data=")
    names = [str(c) for c in columns]
    for i, row in enumerate(rows):
        if len(row) != len(names):
            raise ValueError(f"log_table: row {i} has {len(row)} values for {len(names)} columns ({', '.join(names)})")
    return names, [[_cell(v) for v in row] for row in rows]


def _cell(value: Any) -> Any:
    value = scalar(value)
    if isinstance(value, np.generic):
        return value.item()
    return value.tolist() if hasattr(value, "tolist") else value


def png_bytes(image: np.ndarray) -> bytes:
    """An ``H x W x C`` ``uint8`` array (C: 1, 3 or 4) as a PNG file's bytes (no Pillow needed)."""
    height, width, channels = image.shape
    color = {1: 0, 3: 2, 4: 6}[channels]  # greyscale, RGB, RGBA
    raw = b"".join(b"\x00" + np.ascontiguousarray(row).tobytes() for row in image)  # filter 0 on each row

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """The table in Markdown (TensorBoard's text tab shows it as a table)."""
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def media_file(kind: str, name: str, step: int, suffix: str) -> str:
    """``<kind>/<name>/step-XXXXXXXX<suffix>``, a relative path (``name`` may hold ``/``; ``..`` and
    characters other than letters, digits, ``_``, ``-``, ``.`` become ``_``)."""
    parts = [re.sub(r"[^A-Za-z0-9_.-]", "_", p) for p in f"{kind}/{name}".split("/") if p]
    parts = ["_" if p in (".", "..") else p for p in parts]
    return "/".join([*parts, f"step-{step:08d}{suffix}"])
