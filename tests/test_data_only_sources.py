"""The package decodes what it receives and what it reads from checkpoints as data: no unpickling
of a peer's bytes, no ``weights_only=False`` load, no torch object collectives (which unpickle),
no pytree spec loader that imports modules named in its input.

Read from the source (the syntax tree of every module of ``fastpipe``), so a new call is caught
where it is written. The audited exceptions: the checkpoint metadata's restricted unpickler
(``checkpoint/data_only.py``: it builds only ``torch.distributed.checkpoint``'s record types),
the explicit ``trust_pickled=True`` opt-in of ``checkpoint/contents.py``'s ``unpack``, and two
contracts of Lightning's ``Strategy`` API that the Lightning integration keeps as Lightning's
own strategies do: ``broadcast(obj)`` of any object (torch's object collective) and
``load_checkpoint(weights_only=...)`` passed on as the caller gives it.
"""
from __future__ import annotations

import ast
import os
from typing import Iterator, List, Tuple

import fastpipe

PACKAGE = os.path.dirname(fastpipe.__file__)
UNPICKLING = {"loads", "load", "Unpickler"}  # of pickle (or an alias of it)
COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object",
               "scatter_object_list", "recv_object_list", "send_object_list"}
IMPORTING_LOADERS = {"treespec_loads"}  # torch's pytree spec loader imports named modules
RESTRICTED_UNPICKLER = ("checkpoint/data_only.py", "_MetadataUnpickler")
OPT_IN = ("checkpoint/contents.py", "unpack")
FRAMEWORK_CONTRACTS = {("integrations/lightning/ranks.py", "broadcast"): "broadcast_object_list",
                       ("integrations/lightning/checkpoints.py", "load_checkpoint"):
                       "weights_only=weights_only"}


def modules() -> Iterator[Tuple[str, ast.Module]]:
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, PACKAGE), ast.parse(f.read(), path)


def enclosing(tree: ast.Module) -> dict:
    """Each node's innermost enclosing function or class name."""
    owner = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                     ast.ClassDef)) else name
            owner[child] = inner
            visit(child, inner)
    visit(tree, "")
    return owner


def pickle_names(tree: ast.Module) -> set:
    """The names ``pickle`` (or ``_pickle``, ``cPickle``, ``dill``, ``cloudpickle``) is bound
    to in a module."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("pickle", "_pickle", "cPickle", "dill", "cloudpickle"):
                    names.add(alias.asname or alias.name)
    return names


def findings() -> List[str]:
    found = []
    for path, tree in modules():
        owner = enclosing(tree)
        pickles = pickle_names(tree)
        for node in ast.walk(tree):
            where = f"{path}:{getattr(node, 'lineno', '?')} ({owner.get(node, '')})"
            if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "_pickle", "dill",
                                                                   "cloudpickle", "marshal"):
                bad = [a.name for a in node.names if a.name in UNPICKLING | {"loads"}]
                if bad:
                    found.append(f"{where}: from {node.module} import {bad}")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id in pickles and node.attr in UNPICKLING:
                    allowed = (path, owner.get(node)) == RESTRICTED_UNPICKLER or (
                        path == RESTRICTED_UNPICKLER[0] and node.attr == "Unpickler")
                    if not allowed:
                        found.append(f"{where}: {node.value.id}.{node.attr}")
                if node.value.id == "marshal" and node.attr == "loads":
                    found.append(f"{where}: marshal.loads")
            contract = FRAMEWORK_CONTRACTS.get((path, owner.get(node)))
            if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES | IMPORTING_LOADERS:
                if contract != node.attr:
                    found.append(f"{where}: {node.attr}")
            if isinstance(node, ast.keyword) and node.arg == "weights_only" and not (
                    isinstance(node.value, ast.Constant) and node.value.value is True):
                text = f"weights_only={ast.unparse(node.value)}"
                if (path, owner.get(node)) != OPT_IN and contract != text:
                    found.append(f"{where}: {text}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "load" and isinstance(node.func.value, ast.Name) and \
                    node.func.value.id == "torch" and \
                    not any(k.arg == "weights_only" for k in node.keywords):
                found.append(f"{where}: torch.load without weights_only=True")
    return found


def test_nothing_received_or_read_is_unpickled_outside_the_audited_loaders():
    assert findings() == []


def test_the_audited_exceptions_are_what_they_say():
    """The restricted unpickler overrides ``find_class``; the opt-in's unrestricted load sits
    after the check of ``trust_pickled``."""
    trees = dict(modules())
    unpickler = next(n for n in ast.walk(trees[RESTRICTED_UNPICKLER[0]])
                     if isinstance(n, ast.ClassDef) and n.name == RESTRICTED_UNPICKLER[1])
    assert "find_class" in {f.name for f in unpickler.body if isinstance(f, ast.FunctionDef)}
    unpack = next(n for n in ast.walk(trees[OPT_IN[0]])
                  if isinstance(n, ast.FunctionDef) and n.name == OPT_IN[1])
    source = ast.unparse(unpack)
    assert source.index("if not trust_pickled") < source.index("weights_only=False")


def test_the_scan_finds_what_it_forbids(tmp_path, monkeypatch):
    """The scan itself: a module with each forbidden call is reported."""
    bad = tmp_path / "fastpipe"
    bad.mkdir()
    (bad / "bad.py").write_text(
        "import pickle as p\nimport torch\nimport torch.distributed as dist\n"
        "def f(b):\n    p.loads(b)\n    torch.load(b)\n    torch.load(b, weights_only=False)\n"
        "    dist.all_gather_object([], b)\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", str(bad))
    assert len(findings()) == 4
