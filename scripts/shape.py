"""The package's shape: the largest classes and functions, and its import graph.

    python scripts/shape.py [--limit-class 250] [--limit-function 50]

Sizes are the lines of a def or class (its decorators included), without the
docstrings of it and of everything inside it; blank lines and comments count.
Imports are those between modules of django_tasklock, at any depth, those under
``TYPE_CHECKING`` too (a type annotation is a dependency as well). A cycle among
them is printed and fails the run, as does a class or function over its limit.

The layers: the order docs/explanation/architecture.rst states between its
``layers-start`` and ``layers-end`` markers, read from there (one layer a line,
``name: module ...``, top first; a module named there covers the modules under
it, ``(package)`` is django_tasklock's ``__init__``). Every module must be in a
layer, and an import may go to its own layer or one below, never above.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "django_tasklock"
ARCHITECTURE = ROOT / "docs" / "explanation" / "architecture.rst"


def layers(text: str) -> list[tuple[str, list[str]]]:
    """The layers the architecture page states, top first: (name, modules)."""
    start, end = text.index(".. layers-start"), text.index(".. layers-end")
    found = []
    for line in text[start:end].splitlines()[1:]:
        name, colon, modules = line.strip().partition(":")
        if colon and modules.strip() and not line.strip().startswith(".."):
            found.append((name.strip(), modules.split()))
    return found


def layer_of(module: str, stated: list[tuple[str, list[str]]]) -> int | None:
    """The index of the layer ``module`` is in (the longest name that covers
    it), or None."""
    best: tuple[int, int] | None = None
    for index, (_name, names) in enumerate(stated):
        for short in names:
            full = PACKAGE if short == "(package)" else f"{PACKAGE}.{short}"
            covers = module == full or (
                short != "(package)" and module.startswith(full + ".")
            )
            if covers and (best is None or len(full) > best[1]):
                best = (index, len(full))
    return None if best is None else best[0]


def layer_violations(
    edges: dict[str, set[str]], stated: list[tuple[str, list[str]]]
) -> list[str]:
    """Every module outside the stated layers, and every import upwards."""
    found = []
    for module in sorted(edges):
        if layer_of(module, stated) is None:
            found.append(f"{module} is in no layer of {ARCHITECTURE.name}")
    for module, targets in sorted(edges.items()):
        here = layer_of(module, stated)
        for target in sorted(targets):
            there = layer_of(target, stated)
            if here is not None and there is not None and there < here:
                found.append(
                    f"{module} ({stated[here][0]}) imports {target}, "
                    f"a layer above ({stated[there][0]})"
                )
    return found


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        ):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                first = body[0]
                lines.update(
                    range(first.lineno, (first.end_lineno or first.lineno) + 1)
                )
    return lines


def code_lines(node: ast.AST, skip: set[int], source: list[str]) -> int:
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    end = node.end_lineno or node.lineno
    return sum(1 for n in range(start, end + 1) if n not in skip)


def _visit(
    node: ast.AST,
    prefix: str,
    where: tuple[str, set[int], list[str]],
    classes: list[tuple[int, str]],
    functions: list[tuple[int, str]],
) -> None:
    name, skip, source = where
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            qual = f"{prefix}{child.name}"
            found = classes if isinstance(child, ast.ClassDef) else functions
            found.append((code_lines(child, skip, source), f"{name}:{qual}"))
            _visit(child, qual + ".", where, classes, functions)
        else:
            _visit(child, prefix, where, classes, functions)


def sizes(paths: list[Path]) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    classes: list[tuple[int, str]] = []
    functions: list[tuple[int, str]] = []
    for path in paths:
        text = path.read_text()
        tree = ast.parse(text)
        skip = docstring_lines(tree)
        source = text.splitlines()
        name = module_name(path)

        _visit(tree, "", (name, skip, source), classes, functions)
    return sorted(classes, reverse=True), sorted(functions, reverse=True)


def imports(path: Path, modules: set[str]) -> set[str]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith(PACKAGE))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.startswith(PACKAGE):
                    # "from package import module" needs the module; the
                    # package itself only for a name that is not a module.
                    for alias in child.names:
                        name_as_module = f"{target}.{alias.name}"
                        found.add(
                            name_as_module if name_as_module in modules else target
                        )
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def graph(paths: list[Path]) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in paths}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {t for t in imports(path, set(modules)) if t in modules}
        targets.discard(name)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def strong(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                strong(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for node in sorted(edges):
        if node not in index:
            strong(node)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-class", type=int, default=250)
    parser.add_argument("--limit-function", type=int, default=50)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--graph", action="store_true", help="print every import edge")
    args = parser.parse_args()
    paths = sorted((ROOT / PACKAGE).rglob("*.py"))
    classes, functions = sizes(paths)
    print(f"largest classes (limit {args.limit_class}):")
    for lines, name in classes[: args.top]:
        print(f"  {lines:5d}  {name}")
    print(f"largest functions (limit {args.limit_function}):")
    for lines, name in functions[: args.top]:
        print(f"  {lines:5d}  {name}")
    edges = graph(paths)
    if args.graph:
        print("imports:")
        for name in sorted(edges):
            print(f"  {name} -> {', '.join(sorted(edges[name])) or '-'}")
    circles = cycles(edges)
    print(f"import circles: {len(circles)}")
    for circle in circles:
        print("  " + " <-> ".join(circle))
    broken = layer_violations(edges, layers(ARCHITECTURE.read_text()))
    print(f"layer violations: {len(broken)}")
    for violation in broken:
        print("  " + violation)
    over = [c for c in classes if c[0] > args.limit_class] + [
        f for f in functions if f[0] > args.limit_function
    ]
    for lines, name in over:
        print(f"over the limit: {name} ({lines} lines)")
    return 1 if over or circles or broken else 0


if __name__ == "__main__":
    sys.exit(main())
