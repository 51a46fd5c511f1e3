"""The house rules of minitp's source, read with ``ast``: no import cycle, strategies import only the
road, the five dimensions named once, every process group of the trainer made by the mesh, nothing
patched onto another object. Each rule is checked on the real tree, and a planted violation is caught."""

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
STRATEGIES = ("ddp", "fsdp", "tp", "pp", "cp", "ep")
ROAD = {"comm", "regions", "trace", "layout", "mesh", "replicas", "measure", "models", "fsdp_units", "pp_schedules"}
FORBIDDEN = {"launcher", "runs", "viz", "cost", "plan", "exercises", "checkpoint", "parallel3d", "cli"}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=1)
def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted((SRC / "minitp").rglob("*.py"))}


def imported(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The minitp modules ``tree`` imports, anywhere in it (a name imported from a package counts as
    the submodule when there is one, else the package)."""
    package = name if (SRC / Path(*name.split("."))).is_dir() else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("minitp"):
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return out & known


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def graph_of(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    known = set(trees)
    return {name: imported(name, tree, known) - {name} for name, tree in trees.items()}


def test_no_import_cycle_among_minitp_modules():
    assert cycles(graph_of(modules())) == []


def test_a_planted_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_comm_imports_no_cost_and_strategies_import_only_the_road():
    graph = graph_of(modules())
    assert not any(m.startswith("minitp.cost") for m in graph["minitp.comm"])
    for strategy in STRATEGIES:
        for dep in graph[f"minitp.{strategy}"]:
            top = dep.split(".")[1]
            assert top not in FORBIDDEN and top not in STRATEGIES, f"minitp.{strategy} imports {dep}"
            assert top in ROAD, f"minitp.{strategy} imports {dep}, which is not on the road"


def test_the_five_dimensions_are_named_once():
    where = [name for name, tree in modules().items() for node in ast.walk(tree)
             if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "DIMS" for t in node.targets)]
    assert where == ["minitp.layout"]
    from minitp import layout
    assert set(layout.DIMS) == {"dp", "pp", "cp", "ep", "tp"}


def test_only_the_mesh_makes_process_groups_for_the_trainer():
    makers = {name for name, tree in modules().items() for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and node.attr == "new_group"}
    # exercises' checkers build groups to check a learner's answer, and the ep runner its own world's two
    assert makers - {"minitp.exercises.ch06", "minitp.runs.expert_parallel"} == {"minitp.mesh"}


def patches(tree: ast.Module) -> list[str]:
    """Attribute assignments onto another object's forward/attend/cp_group, setattr, and the
    getattr/hasattr probes for split_dims and aux_loss."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for t in targets:
            if (isinstance(t, ast.Attribute) and t.attr in ("forward", "attend", "cp_group")
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")):
                found.append(f"line {node.lineno}: assigns .{t.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "setattr":
                found.append(f"line {node.lineno}: setattr")
            if node.func.id in ("getattr", "hasattr") and len(node.args) > 1 and \
                    isinstance(node.args[1], ast.Constant) and node.args[1].value in ("split_dims", "aux_loss"):
                found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


KNOWN_SETATTR: set[str] = set()


def test_nothing_is_patched_onto_another_object():
    found = {name: patches(tree) for name, tree in modules().items()}
    found = {name: f for name, f in found.items() if f and not (name in KNOWN_SETATTR and
                                                                 all(x.endswith("setattr") for x in f))}
    assert found == {}


def test_a_planted_patch_is_found():
    tree = ast.parse("block.attention.attend = ring\nlinear.forward = f\nsetattr(m, 'w', v)\n"
                     "hasattr(ff, 'aux_loss')\nself.forward = g\n")
    assert len(patches(tree)) == 4


# One interpreter imports torch once, then forks a child per strategy: each child starts with no minitp module
# loaded, imports the strategy and lists what came with it from the launcher, cost, figures or runners.
IMPORTS = """
import os, sys, torch
for name in sys.argv[1:]:
    read, write = os.pipe()
    if os.fork() == 0:
        import importlib
        importlib.import_module("minitp." + name)
        bad = sorted(m for m in sys.modules if m.split(".")[:2] in
                     (["minitp", "launcher"], ["minitp", "cost"], ["minitp", "viz"], ["minitp", "runs"]))
        os.write(write, (name + ": " + ",".join(bad)).encode())
        os._exit(0)
    os.close(write)
    print(os.read(read, 65536).decode())
    os.wait()
"""


def test_a_strategy_module_imports_without_the_launcher_cost_or_figures():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", IMPORTS, *STRATEGIES], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert [line for line in out if line] == [f"{s}: " for s in STRATEGIES]
