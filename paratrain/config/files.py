"""Configs to and from plain data: a TOML/YAML file (:func:`load_config`), dotted overrides
(:func:`apply_overrides`, ``--set`` items by :func:`parse_set`), a typed dataclass from a dict with
one-line errors (:func:`from_dict`), and back to TOML (:func:`to_toml`)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import os
import sys
import types
import typing
from typing import Any, Iterable, Mapping

__all__ = ["as_integer", "from_dict", "load_config", "apply_overrides", "parse_set", "to_toml"]


def as_integer(value: Any, name: str) -> Any:
    """``value`` as an ``int`` (a NumPy integer, or a float such as ``64 / 2``, with no fraction);
    None stays None; anything else is refused in one line naming it."""
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)) and float(value).is_integer():
        return int(float(value))  # 64 / 2, np.float32(64)
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{name}={value!r} must be an integer")



def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert ``value`` (possibly a command-line string) to the annotated type ``tp``."""
    if tp in (str, int, float, bool) and isinstance(value, (Mapping, list)):  # `[model]` table, --set model.x=1
        raise ValueError(f"{where} is a single value, not a "
                         f"{'section' if isinstance(value, Mapping) else 'list'} ({value!r})")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(value, args[0], where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ValueError(f"{where}={value!r} is not a boolean: use true or false")
    if tp in (int, float):
        if isinstance(value, bool):
            raise ValueError(f"{where}={value!r} is not a number")
        try:
            out = tp(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}={value!r} is not {'an integer' if tp is int else 'a number'}") from None
        if tp is int and isinstance(value, float) and value != out:
            raise ValueError(f"{where}={value!r} is not an integer")
        return out
    if tp is str:
        return str(value)
    return value


def from_dict(cls: type, data: Mapping[str, Any], where: str = "config") -> Any:
    """Build dataclass ``cls`` from a mapping, refusing unknown keys with a one-line error."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names, key=str)  # YAML keys may be numbers too
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} in [{where}]: known keys are {', '.join(sorted(names))}")
    kwargs = {}
    for key, value in data.items():
        tp = hints[key]
        name = f"{where}.{key}".removeprefix("config.")  # as --set spells it: parallel.seed
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if isinstance(value, str) and hasattr(tp, "parse"):  # a section with a one-line spelling: --mesh tp=2
                kwargs[key] = tp.parse(value)
                continue
            if not isinstance(value, Mapping):  # [parallel] given as `parallel = 5`, or --set parallel=x
                raise ValueError(f"{name} is a section of settings, not a value ({value!r}): set its keys, "
                                 f"e.g. --set {name}.<key>=<value>")
            kwargs[key] = from_dict(tp, value, name)
        else:
            kwargs[key] = _coerce(value, tp, name)
    return cls(**kwargs)


def load_config(path: str | os.PathLike | None) -> dict[str, Any]:
    """Read a TOML or YAML config file into a plain dict (empty when ``path`` is None)."""
    if path is None:
        return {}
    path = os.fspath(path)
    if not os.path.isfile(path):
        what = "is a folder, not a file" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(f"config file {path!r} {what}")
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"reading {path!r} needs PyYAML: pip install pyyaml, or use a .toml file") from None
        with open(path) as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ValueError(f"config file {path!r} is not valid YAML: {' '.join(str(e).split())}") from None
    else:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10: the same parser, from PyPI
            import tomli as tomllib

        with open(path, "rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"config file {path!r} is not valid TOML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a table of settings")
    return data


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Set dotted keys (``parallel.global_batch``) in a nested dict; returns the same dict."""
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"cannot set {dotted!r}: {p!r} is not a section")
        node[leaf] = value
    return data


def parse_set(items: Iterable[str]) -> dict[str, str]:
    """``--set KEY=VALUE`` items as dotted overrides (values stay strings: :func:`from_dict` converts
    them to each field's type), in the order given; a later item wins over an earlier one with the same key."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r} is not KEY=VALUE, e.g. --set parallel.global_batch=128")
        out[key] = value
    return out


def to_toml(cfg: Any) -> str:
    """``cfg`` (a config dataclass) as TOML that :func:`load_config` reads back into the same config.

    TOML has no null: a field at ``None`` is written as a comment when ``None`` is its default, and
    as ``"none"`` (which the loader reads as ``None``) otherwise.
    """
    head: list[str] = []
    tables: list[str] = []

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v) if not (isinstance(v, float) and not math.isfinite(v)) else ("nan" if v != v else
                                                                                         ("inf" if v > 0 else "-inf"))
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, Mapping):
            return "{" + ", ".join(f"{value(str(k))} = {value(x)}" for k, x in v.items()) + "}"
        raise ValueError(f"cannot write {v!r} ({type(v).__name__}) as TOML")

    def table(obj: Any, name: str | None, out: list[str]) -> None:
        lines = []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                continue
            if v is None:  # TOML has no null: a comment where None is the default, else "none" (read as None)
                lines.append(f"# {f.name} = (unset)" if f.default is None else f'{f.name} = "none"')
            else:
                lines.append(f"{f.name} = {value(v)}")
        if name is not None:
            out.append(f"\n[{name}]")
        out.extend(lines)
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                table(v, f.name if name is None else f"{name}.{f.name}", tables)

    table(cfg, None, head)
    return "\n".join(head + tables).strip() + "\n"
