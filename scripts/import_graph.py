"""Import graph of paratrain: cycles (strongly connected components of more than one module) and
function-local imports of paratrain modules, the figures of issue 11's "checkpointing is a leaf".

    python scripts/import_graph.py          # prints the figures; exit 0
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "paratrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(current: str, is_package: bool, node: ast.ImportFrom | ast.Import, modules: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "paratrain"]
    base = current if is_package else current.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        base = base.rsplit(".", 1)[0]
    target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
    if not target.startswith("paratrain"):
        return []
    out = []
    for a in node.names:
        sub = f"{target}.{a.name}"
        out.append(sub if sub in modules else target)
    return out


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]], list[tuple[str, int, str]]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    top: dict[str, set[str]] = {m: set() for m in modules}
    every: dict[str, set[str]] = {m: set() for m in modules}
    local: list[tuple[str, int, str]] = []
    for m, p in files.items():
        tree = ast.parse(p.read_text())
        package = p.name == "__init__.py"
        toplevel = set(map(id, tree.body))
        for node in executed(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = [t for t in resolve(m, package, node, modules) if t in modules and t != m]
            for t in targets:
                every[m].add(t)
                if id(node) in toplevel:
                    top[m].add(t)
            if targets and id(node) not in toplevel:
                local.append((m, node.lineno, ", ".join(sorted(set(targets)))))
    return top, every, local


def executed(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:``, which only type checkers read."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def design_graphs() -> tuple[dict[str, set[str]], dict[str, set[str]], list[tuple[str, int, str]]]:
    """:func:`graph` without the edges from a package to its own submodules: a package's
    ``__init__`` re-exporting them is not a cycle of the design."""
    top, every, local = graph()
    for g in (top, every):
        for m in g:
            g[m] = {t for t in g[m] if not t.startswith(m + ".")}
    return top, every, local


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def main() -> None:
    top, every, local = design_graphs()
    for name, g in (("module-level imports", top), ("all imports, function-local included", every)):
        found = cycles(g)
        print(f"{name}: {len(found)} cycle(s)" + "".join(f"\n  {len(c)} modules: {' '.join(c)}" for c in found))
    print(f"function-local imports of paratrain modules: {len(local)}")
    for m, line, t in local:
        print(f"  {m}:{line} -> {t}")


if __name__ == "__main__":
    main()
