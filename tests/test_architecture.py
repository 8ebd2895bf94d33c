"""The package's shape: imports go one way (no cycle, deferred imports included), no module
imports another's private names, and the layers keep to their direction (ARCHITECTURE.md)."""
import ast
import os
from typing import Dict, List, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "fastpipe")


def _modules() -> Dict[str, str]:
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[module[:-len(".__init__")] if module.endswith(".__init__") else module] = path
    return found


MODULES = _modules()


def _runtime_imports(tree: ast.AST) -> List[ast.stmt]:
    """Import statements that run (anywhere, functions included), not ``if TYPE_CHECKING:``
    blocks; ``importlib.import_module("fastpipe....")`` calls count as imports too."""
    found: List[ast.stmt] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") \
                and node.args and isinstance(node.args[0], ast.Constant) \
                and str(node.args[0].value).startswith("fastpipe"):
            found.append(ast.Import(names=[ast.alias(name=node.args[0].value)]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _targets(module: str, node: ast.stmt) -> List[Tuple[str, List[str]]]:
    """(imported module, names taken from it) for one import statement."""
    if isinstance(node, ast.Import):
        return [(alias.name, []) for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if not MODULES[module].endswith("__init__.py"):
            package = package[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([node.module] if node.module else []))
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append((sub, []) if sub in MODULES else (base, [alias.name]))
    return out


def _graph() -> Tuple[Dict[str, Set[str]], List[Tuple[str, str, str]]]:
    edges: Dict[str, Set[str]] = {m: set() for m in MODULES}
    private: List[Tuple[str, str, str]] = []
    for module, path in MODULES.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in _runtime_imports(tree):
            for target, names in _targets(module, node):
                if target in MODULES and target != module:
                    edges[module].add(target)
                    private += [(module, target, n) for n in names
                                if n.startswith("_") and not n.startswith("__")]
    return edges, private


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


EDGES, PRIVATE = _graph()


def test_the_import_graph_has_no_cycle():
    assert _cycles(EDGES) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    planted = {m: set(t) for m, t in EDGES.items()}
    planted["fastpipe.schedule.ir"].add("fastpipe.schedule.validate")
    assert any("fastpipe.schedule.ir" in c for c in _cycles(planted))


def test_no_module_imports_another_modules_private_names():
    assert PRIVATE == []


def test_the_private_name_check_sees_a_planted_one():
    tree = ast.parse("from .step import _send")
    (node,) = _runtime_imports(tree)
    assert _targets("fastpipe.skip.exchange", node) == [("fastpipe.skip.step", ["_send"])]


# The layers of ARCHITECTURE.md, bottom first: a module imports its own layer or lower ones.
LAYERS = [
    ("fastpipe.errors", "fastpipe.version", "fastpipe.schedule"),
    ("fastpipe._native", "fastpipe.ops"),
    ("fastpipe.streams",),
    ("fastpipe.skip.api", "fastpipe.skip.layout"),
    ("fastpipe.microbatch", "fastpipe.balance", "fastpipe.placement", "fastpipe.nn",
     "fastpipe.tracing", "fastpipe.materialise", "fastpipe.memory", "fastpipe.outputs",
     "fastpipe.model_loss", "fastpipe.hf_losses", "fastpipe.layer_costs", "fastpipe.model_call",
     "fastpipe.split_points", "fastpipe.graph_cut", "fastpipe.graph_stage"),
    ("fastpipe.planning",),
    ("fastpipe.policies",),
    ("fastpipe.runtime", "fastpipe.skip"),
    ("fastpipe.parallel",),
    ("fastpipe.generation",),
    ("fastpipe.autotune",),
    ("fastpipe.frontdoor",),
    ("fastpipe.pipe", "fastpipe.distributed", "fastpipe.compat"),
    ("fastpipe.diagnosis", "fastpipe.checkpoint"),
    ("fastpipe.integrations",),
    ("fastpipe.apps",),
    ("fastpipe", "fastpipe.__main__"),
]


def _layer(module: str) -> int:
    """The layer of a module: the last (most specific) prefix that names it."""
    matches = [(len(p), i) for i, prefixes in enumerate(LAYERS) for p in prefixes
               if module == p or (p != "fastpipe" and module.startswith(p + "."))]
    assert matches, f"{module} belongs to no layer of ARCHITECTURE.md"
    return max(matches)[1]


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_imports_go_down_the_layers():
    upward = sorted((m, t) for m, targets in EDGES.items() for t in targets
                    if _layer(t) > _layer(m))
    assert upward == []


def test_pure_schedule_logic_imports_nothing_of_the_runtime():
    wrong = sorted((m, t) for m, targets in EDGES.items() if m.startswith("fastpipe.schedule")
                   for t in targets if not t.startswith("fastpipe.schedule"))
    assert wrong == []


def _diagram_layers(text: str) -> List[Set[str]]:
    """The layers of ARCHITECTURE.md's diagram, bottom first: each line of its first code block
    is a layer (an indented line continues the one above), named by its leading paths
    (``fastpipe/x/`` a package, ``x.py`` a module, both relative to ``fastpipe/``)."""
    block = text.split("```")[1].strip("\n").splitlines()
    layers: List[Set[str]] = []
    for line in block:
        names = set()
        for token in line.split():
            if not (token.endswith(".py") or token.endswith("/")):
                break
            path = token[len("fastpipe/"):] if token.startswith("fastpipe/") else token
            dotted = path[:-3] if path.endswith(".py") else path.rstrip("/")
            dotted = dotted.replace("/", ".")
            names.add("fastpipe" if dotted == "__init__" else f"fastpipe.{dotted}")
        if line.startswith(" ") and layers:
            layers[-1] |= names
        else:
            layers.append(names)
    return layers[::-1]


def test_architecture_md_draws_the_layers_this_test_checks():
    text = open(os.path.join(ROOT, "ARCHITECTURE.md"), encoding="utf-8").read()
    assert _diagram_layers(text) == [set(layer) for layer in LAYERS]


def test_the_diagram_reader_reads_packages_modules_and_continued_lines():
    text = ("```\nfastpipe/__init__.py  apps/   top\nfastpipe/a.py  b/   two\n"
            "               c/d.py   more\nfastpipe/errors.py   bottom\n```")
    assert _diagram_layers(text) == [{"fastpipe.errors"},
                                     {"fastpipe.a", "fastpipe.b", "fastpipe.c.d"},
                                     {"fastpipe", "fastpipe.apps"}]
