"""Mutation run: break one spot of a source file at a time and see whether the tests notice.

    .venv/bin/python scripts/mutate.py FILE COUNT [--seed N] [--only NAME,NAME] -- TEST COMMAND...

For example, the page pool against its fast tests:

    .venv/bin/python scripts/mutate.py connector/page_pool.py 30 -- \\
        .venv/bin/python -m pytest -q -x -p no:cacheprovider tests/test_page_pool.py tests/test_cache.py

Each mutant changes one node of FILE (inside a function; ``--only``: inside those functions):
a comparison flipped at its boundary or negated (``<`` / ``<=``, ``==`` / ``!=``, ``in`` /
``not in``, ``is`` / ``is not``), ``+`` / ``-`` swapped, an integer constant plus one, ``and`` /
``or`` swapped, a ``not`` dropped, or a statement (a call, an assignment) replaced by ``pass``.
Error messages and docstrings are left alone. COUNT mutants are drawn at random (``--seed``)
and written over FILE in turn (as ``ast.unparse`` prints the module: comments go, code stays);
the test command runs against each, and a mutant whose command exits 0 survived. FILE is
restored after every mutant, also on an interrupt. One JSON line per mutant, then the count of
survivors. A survivor is a test gap or an equivalent mutant (a change no caller can see, say a
fast path taken one size later): read each one.
"""

import argparse
import ast
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

FLIPPED = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
           ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}


def mutation_sites(tree: ast.Module, only: set[str]) -> list[tuple[str, ast.AST, int]]:
    """Every (kind, node, operand index) a mutant can change, in source order."""
    sites = []

    def visit(node: ast.AST, function: str | None, quoted: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        quoted = quoted or isinstance(node, (ast.Raise, ast.JoinedStr))  # error messages stay
        if function and (not only or function in only) and not quoted:
            if isinstance(node, ast.Compare):
                sites.extend(("compare", node, i) for i, op in enumerate(node.ops) if type(op) in FLIPPED)
            elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
                sites.append(("plus-minus", node, 0))
            elif isinstance(node, ast.Constant) and type(node.value) is int:
                sites.append(("constant", node, 0))
            elif isinstance(node, ast.BoolOp):
                sites.append(("and-or", node, 0))
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                sites.append(("drop-not", node, 0))
            elif isinstance(node, (ast.Assign, ast.AugAssign)) or (
                isinstance(node, ast.Expr) and not isinstance(node.value, ast.Constant)
            ):
                sites.append(("delete", node, 0))
        for child in ast.iter_child_nodes(node):
            visit(child, function, quoted)

    visit(tree, None, False)
    return sites


def span(node: ast.AST) -> tuple:
    """Where a node starts and ends: nested nodes of one kind (``a + b + c``) differ here."""
    return tuple(getattr(node, name, None) for name in ("lineno", "col_offset", "end_lineno", "end_col_offset"))


class Mutant(ast.NodeTransformer):
    """Changes the node at one site (found by position: each mutant parses the file anew)."""

    def __init__(self, kind: str, where: tuple[int, int, int, int], index: int) -> None:
        self.kind, self.where, self.index = kind, where, index
        self.before = self.after = ""

    def visit(self, node: ast.AST) -> ast.AST:
        if span(node) != self.where or not self._matches(node):
            return super().visit(node)
        self.before = ast.unparse(node)
        node = self._mutated(node)
        self.after = ast.unparse(node)
        return node

    def _matches(self, node: ast.AST) -> bool:
        return isinstance(node, {
            "compare": ast.Compare, "plus-minus": ast.BinOp, "constant": ast.Constant, "and-or": ast.BoolOp,
            "drop-not": ast.UnaryOp, "delete": (ast.Assign, ast.AugAssign, ast.Expr),
        }[self.kind])

    def _mutated(self, node: ast.AST) -> ast.AST:
        if self.kind == "compare":
            node.ops[self.index] = FLIPPED[type(node.ops[self.index])]()
        elif self.kind == "plus-minus":
            node.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
        elif self.kind == "constant":
            node.value += 1
        elif self.kind == "and-or":
            node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        elif self.kind == "drop-not":
            return node.operand
        else:
            return ast.copy_location(ast.Pass(), node)
        return node


def main() -> int:
    if "--" not in sys.argv:
        sys.exit(__doc__)
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("count", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated function names")
    args = parser.parse_args(sys.argv[1:split])
    command = sys.argv[split + 1 :]
    if not command:
        parser.error("no test command after --")
    source = args.file.read_text()
    only = set(filter(None, args.only.split(",")))
    sites = [(kind, span(node), index) for kind, node, index in mutation_sites(ast.parse(source), only)]
    random.Random(args.seed).shuffle(sites)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # restore FILE in ``finally``
    survivors = 0
    try:
        for kind, where, index in sites[: args.count]:
            mutant = Mutant(kind, where, index)
            tree = ast.fix_missing_locations(mutant.visit(ast.parse(source)))
            args.file.write_text(ast.unparse(tree))
            started = time.monotonic()
            caught = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0
            survivors += not caught
            print(json.dumps({"line": where[0], "kind": kind, "before": mutant.before, "after": mutant.after,
                              "caught": caught, "seconds": round(time.monotonic() - started)}), flush=True)
    finally:
        args.file.write_text(source)
    print(f"survived: {survivors} of {min(args.count, len(sites))} (sites: {len(sites)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
