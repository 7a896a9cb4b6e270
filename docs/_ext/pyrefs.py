"""Docstrings as paratrain writes them, rendered without noise.

* Google-style sections (``Args:``, ``Returns:``, ``Raises:``) go through napoleon, but attribute
  docstrings (the dataclass fields of the configs) do not: napoleon would read their first
  ``words: text`` as a type.
* A cross-reference to an object by the module that defines it (``paratrain.config.ParallelConfig``,
  as docstrings and signatures name it) resolves to where the reference documents it
  (``paratrain.ParallelConfig``): the same object, exported under a shorter name.
* References that still resolve nowhere: in the pages (``docs/*.md``) they fail the build, like a
  broken link; in the docstrings of the API reference (objects of torch, the standard library or
  paratrain internals that are not part of the public API) they stay code without a link.
"""

from __future__ import annotations

import importlib

from sphinx.ext.napoleon import Config, GoogleDocstring
from sphinx.util import logging

logger = logging.getLogger(__name__)
_NAPOLEON = Config(napoleon_use_rtype=False, napoleon_use_ivar=True)
API_DOCS = ("reference/api", "reference/modules")


def _process_docstring(app, what, name, obj, options, lines) -> None:
    if what in ("attribute", "property", "data"):
        return
    lines[:] = GoogleDocstring(lines, _NAPOLEON, app, what, name, obj, options).lines()  # type: ignore[arg-type]


def _resolve(dotted: str):
    """The object a dotted name points to, or None."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _documented(env) -> dict[int, str]:
    """id(object) -> the name it is documented under, for every object the reference documents."""
    cache = getattr(env, "_paratrain_documented", None)
    if cache is None:
        cache = {}
        for name in env.get_domain("py").objects:
            obj = _resolve(name)
            if obj is not None and not isinstance(obj, (int, float, str, bool, type(None))):
                cache.setdefault(id(obj), name)
        env._paratrain_documented = cache
    return cache


def _missing_reference(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    candidates = [target]
    module, cls = node.get("py:module"), node.get("py:class")
    if module and "." not in target:
        candidates += [f"{module}.{cls}.{target}" if cls else None, f"{module}.{target}"]
    for candidate in filter(None, candidates):
        obj = _resolve(candidate)
        if obj is None:
            continue
        name = _documented(env).get(id(obj))
        if name:
            return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, node["reftype"], name, node,
                                                     contnode)
    if node.get("refdoc") in API_DOCS:
        return contnode  # a docstring's reference to torch, the standard library or an internal: plain code
    logger.warning("reference target not found: %s (a page names something the API reference does not document)",
                   target, location=node, type="paratrain", subtype="ref")
    return contnode


def setup(app):
    app.connect("autodoc-process-docstring", _process_docstring)
    app.connect("missing-reference", _missing_reference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
