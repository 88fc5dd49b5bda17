"""The import graph of a package: cycles between its modules, and modules over a line limit.

Every import counts, including those inside functions (a lazy import is still a dependency: the two
modules cannot be read, tested or split apart on their own), except those under `if TYPE_CHECKING:`. Exits 1 when it finds a cycle or an
oversized module, so CI can run it.

    python scripts/import_graph.py                 # mira_hf, cycles and modules over 500 lines
    python scripts/import_graph.py mira_hf/quant --max-lines 500 --allow mira_hf.quant.triton_kernels
"""

from __future__ import annotations

import argparse
import ast
import os
import sys


def module_name(path: str, root: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def imports_of(path: str, name: str, known: set[str]) -> set[str]:
    """The package modules `path` (module `name`) imports, anywhere in its body."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    typing_only = {  # `if TYPE_CHECKING:` imports are annotations, not dependencies at run time
        id(n) for block in ast.walk(tree) if _is_type_checking(block) for stmt in block.body for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                up = parts[: len(parts) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from . import x` imports the module x; `from .m import y` imports m
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a known `a.b`
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _is_type_checking(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package", nargs="?", default="mira_hf", help="package directory (default mira_hf)")
    ap.add_argument("--max-lines", type=int, default=0, help="also report modules longer than this (0: no limit)")
    ap.add_argument("--allow", action="append", default=[], help="a module exempt from --max-lines (repeatable)")
    args = ap.parse_args(argv)
    root = os.path.normpath(args.package)
    top = root
    while os.path.exists(os.path.join(os.path.dirname(top), "__init__.py")):
        top = os.path.dirname(top)  # a subpackage: module names from the top package
    files = {}
    for d, _, names in os.walk(top):
        for n in names:
            if n.endswith(".py"):
                path = os.path.join(d, n)
                files[module_name(path, top)] = path
    known = set(files)
    graph = {m: imports_of(p, m, known) for m, p in files.items()}
    scope = module_name(os.path.join(root, "__init__.py"), top)
    inside = {m for m in graph if m == scope or m.startswith(scope + ".")}
    bad = 0
    for comp in cycles(graph):
        if set(comp) & inside:
            bad += 1
            print("import cycle: " + " <-> ".join(comp))
    if args.max_lines:
        for m in sorted(inside):
            n = sum(1 for _ in open(files[m], encoding="utf-8"))
            if n > args.max_lines and m not in args.allow:
                bad += 1
                print(f"{m}: {n} lines (over {args.max_lines})")
    print(f"{len(inside)} modules, {sum(len(graph[m]) for m in inside)} imports: " + ("ok" if not bad else f"{bad} problems"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
