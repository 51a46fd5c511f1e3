"""minitp.cost's shape, read from its source with ``ast``: its modules import each other in one order
(no cycle, at the top of each file, never the package from inside it), and nothing in it touches a file
or the environment."""

import ast
from pathlib import Path

import pytest

import minitp.cost

COST = Path(minitp.cost.__file__).parent
PACKAGE = "minitp.cost"


def module_name(path: Path) -> str:
    parts = path.relative_to(COST).with_suffix("").parts
    return ".".join((PACKAGE, *parts)).removesuffix(".__init__")


def cost_sources() -> dict[str, str]:
    """{module name: source} of every file under src/minitp/cost/."""
    return {module_name(p): p.read_text() for p in sorted(COST.rglob("*.py"))}


def cost_imports(module: str, source: str | ast.Module) -> list[tuple[str, ast.stmt]]:
    """Every (minitp.cost* module, import statement) that ``module``'s source imports, at module level
    or inside a function: ``import minitp.cost.X`` and ``from minitp.cost.X import a`` name X,
    ``from minitp.cost import a`` and ``from minitp import cost`` the package (and a submodule, if ``a``
    is one), relative imports resolved."""
    is_package = module == PACKAGE
    found = []
    tree = source if isinstance(source, ast.Module) else ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node) for a in node.names if a.name == PACKAGE or a.name.startswith(PACKAGE + ".")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[:len(here) - node.level + 1]
                base = ".".join(here + ([base] if base else []))
            if base == "minitp" and any(a.name == "cost" for a in node.names):
                found.append((PACKAGE, node))
            elif base == PACKAGE or base.startswith(PACKAGE + "."):
                found.append((base, node))
                found += [(f"{base}.{a.name}", node) for a in node.names
                          if base == PACKAGE and (COST / f"{a.name}.py").exists()]
    return found


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    return {m: {target for target, _ in cost_imports(m, s) if target != m} for m, s in sources.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cost_modules_import_each_other_with_no_cycle():
    graph = import_graph(cost_sources())
    assert len(graph) >= 7 and all(m.startswith(PACKAGE) for m in graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_check_finds_a_cycle_through_a_function_level_or_package_import():
    # a function-local import closes the loop just as well as one at the top
    planted = {"minitp.cost.a": "from minitp.cost.b import f\n",
               "minitp.cost.b": "def f():\n    from minitp.cost.a import g\n"}
    assert find_cycle(import_graph(planted)) == ["minitp.cost.a", "minitp.cost.b", "minitp.cost.a"]
    # the package re-exports its modules: a module reaching back to it through the package is a cycle
    planted = {"minitp.cost": "from minitp.cost.a import f\n", "minitp.cost.a": "from minitp import cost\n"}
    assert find_cycle(import_graph(planted)) == ["minitp.cost", "minitp.cost.a", "minitp.cost"]
    planted = {"minitp.cost": "from .a import f\n", "minitp.cost.a": "from . import b\n", "minitp.cost.b": ""}
    assert import_graph(planted) == {"minitp.cost": {"minitp.cost.a"}, "minitp.cost.a": {"minitp.cost"},
                                     "minitp.cost.b": set()}


def test_each_cost_module_imports_the_others_at_its_top_and_never_the_package():
    for module, source in cost_sources().items():
        tree = ast.parse(source)
        top = {id(node) for node in tree.body}
        for target, node in cost_imports(module, tree):
            assert id(node) in top, f"{module} imports {target} inside a function (line {node.lineno})"
            if module != PACKAGE:
                assert target != PACKAGE, f"{module} imports the package minitp.cost (line {node.lineno})"


FORBIDDEN_MODULES = {"os", "pathlib", "json", "io", "shutil", "tempfile", "glob"}
FORBIDDEN_CALLS = {"open", "getenv"}
FORBIDDEN_ATTRIBUTES = {"os.environ", "os.path", "os.getenv", "json.load", "json.loads", "json.dump", "pathlib.Path"}


def file_access(source: str) -> list[str]:
    """What in ``source`` reads a file or the environment: open(...), os.environ, os.path, pathlib,
    json.load, or an import of a module made for files."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            found.append(f"{node.func.id}(")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            name = f"{node.value.id}.{node.attr}"
            found += [name] if name in FORBIDDEN_ATTRIBUTES else []
    return found


@pytest.mark.parametrize("module", sorted(cost_sources()))
def test_nothing_in_cost_opens_a_file_or_reads_the_environment(module):
    assert file_access(cost_sources()[module]) == []


def test_the_file_access_check_sees_each_way_in():
    planted = ("import json\nimport os.path\nfrom pathlib import Path\n"
               "def f(p):\n    return json.load(open(p)), os.environ['X'], os.path.join(p)\n")
    assert sorted(file_access(planted)) == sorted(["import json", "import os.path", "from pathlib import ...",
                                                   "open(", "json.load", "os.environ", "os.path"])
