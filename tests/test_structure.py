"""The house rules of minitp's source as ``../shared/DESIGN.md`` writes them, read with ``ast``: no import
cycle; a strategy imports only the road (comm, regions, trace, layout, mesh) and models, and the helpers
named below as its own; models, measure and viz import no strategy, not even through another module; the
five dimensions are named once (no literal list of them outside ``layout``); the trainer imports none of
the parent's work (launcher, runners, figures, command line); every process group of the trainer is made
by the mesh; nothing is patched onto another object. Each rule is checked on the real
tree, and a planted violation of each is caught by the same function."""

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
STRATEGIES = ("ddp", "fsdp", "tp", "pp", "cp", "ep", "ring")  # DESIGN.md: one strategy each
ROAD = ("comm", "regions", "trace", "layout", "mesh")  # DESIGN.md's road, exactly
# a file that is one strategy's own (or the road's), and who may import it: allowed one by one
OWN_HELPERS = {
    "fsdp_units": {"fsdp"},  # how FSDP lays out its units and shards
    "pp_schedules": {"pp"},  # the pipeline schedules, as data
    "replicas": {"ddp", "fsdp", "cp", "ep"},  # the one data-parallel protocol: no_sync, finish_gradients
    "grid": {"mesh"},  # the mesh's arithmetic
}
NO_STRATEGY = ("models", "measure", "viz")  # plain models; measuring and figures run no strategy


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_of(module: str) -> Path:
    path = SRC / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


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


def planted(**extra: str) -> dict[str, ast.Module]:
    """The real tree, with lines added to some modules' source (``measure__memory=`` for
    ``minitp.measure.memory``)."""
    trees = dict(modules())
    for key, lines in extra.items():
        module = "minitp." + key.replace("__", ".")
        trees[module] = ast.parse(source_of(module).read_text() + "\n" + lines)
    return trees


def test_no_import_cycle_among_minitp_modules():
    assert cycles(graph_of(modules())) == []


def test_a_planted_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


# -- a strategy imports only the road and models ------------------------------------------------------------
def wing(module: str) -> str:
    """The name under minitp: ``minitp.measure.memory`` -> ``measure``."""
    return module.split(".")[1] if "." in module else ""


def road_violations(graph: dict[str, set[str]]) -> list[str]:
    """What a strategy imports beyond the road, models and its own helpers; what the road imports
    beyond the road (and its own helper); what a strategy's helper imports beyond the road and models."""
    found = []
    for name in (*STRATEGIES, *ROAD, *OWN_HELPERS):
        allowed = set(ROAD) | {helper for helper, readers in OWN_HELPERS.items() if name in readers}
        if name not in ROAD:
            allowed.add("models")
        found += [f"minitp.{name} imports {dep}" for dep in sorted(graph[f"minitp.{name}"])
                  if wing(dep) not in allowed]
    return found


def test_strategies_import_only_the_road_models_and_their_own_helpers():
    assert road_violations(graph_of(modules())) == []


def test_a_planted_import_off_the_road_is_found():
    graph = graph_of(planted(
        ddp="from minitp.measure.memory import held_bytes",  # measuring, in a strategy
        tp="from minitp import replicas",  # a helper that is not its own
        fsdp="from minitp import tp",  # another strategy
        comm="from minitp.cost import Device",  # the road off the road
        replicas="import minitp.launcher",  # a helper off the road
    ))
    assert road_violations(graph) == [
        "minitp.ddp imports minitp.measure.memory", "minitp.fsdp imports minitp.tp",
        "minitp.tp imports minitp.replicas", "minitp.comm imports minitp.cost",
        "minitp.replicas imports minitp.launcher"]


# -- models, measure and viz import no strategy -------------------------------------------------------------
def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """What importing ``start`` runs: the modules it imports, followed, and each one's packages."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph.get(name, ())
            todo += [name.rpartition(".")[0]] if "." in name else []
    return seen - {start}


def strategy_importers(graph: dict[str, set[str]]) -> list[str]:
    """The modules of models, measure and viz that import a strategy, directly or through another."""
    strategies = {f"minitp.{s}" for s in STRATEGIES}
    hits = {name: sorted(reached(graph, name) & strategies) for name in sorted(graph) if wing(name) in NO_STRATEGY}
    return [f"{name} imports {', '.join(hit)}" for name, hit in hits.items() if hit]


def test_models_measure_and_viz_import_no_strategy():
    assert strategy_importers(graph_of(modules())) == []


def test_a_planted_strategy_in_models_measure_or_viz_is_found():
    graph = graph_of(planted(
        models__llama="import minitp.tp",
        measure__activations="from minitp.runs.measuring import measure_activations",  # through a runner
        viz__style="from minitp.parallel3d import Parallel3D",  # through the composed model
    ))
    found = dict(line.split(" imports ") for line in strategy_importers(graph))
    assert found["minitp.models.llama"] == found["minitp.models.moe"] == "minitp.tp"  # moe through llama
    assert found["minitp.measure.activations"] == ", ".join(f"minitp.{s}" for s in sorted(STRATEGIES[:6]))
    assert found["minitp.viz.style"] == found["minitp.measure.activations"]


# -- the five dimensions are named once -----------------------------------------------------------------
def dims_assigned(trees: dict[str, ast.Module]) -> list[str]:
    return [name for name, tree in trees.items() for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "DIMS" for t in node.targets)]


def dimension_lists(trees: dict[str, ast.Module]) -> list[tuple[str, str]]:
    """(module, the literal) for each tuple, list or set that writes out three or more of the five
    dimension names, outside ``layout`` (a pair picks two; three or more list them again). A literal
    that also names ddp, fsdp or 3d lists strategies (or their trace tracks), not mesh dimensions."""
    from minitp.layout import DIMS

    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if name == "minitp.layout" or not isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                continue
            words = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            if len(words & set(DIMS)) >= 3 and not words & {"ddp", "fsdp", "3d"}:
                found.append((name, ast.unparse(node)))
    return found


def test_the_five_dimensions_are_named_once():
    assert dims_assigned(modules()) == ["minitp.layout"]
    from minitp import layout
    assert set(layout.DIMS) == {"dp", "pp", "cp", "ep", "tp"}
    assert dimension_lists(modules()) == []


def test_a_planted_list_of_dimensions_is_found():
    trees = {"minitp.layout": ast.parse('DIMS = ("dp", "pp", "tp", "cp", "ep")\nAXES = ("dp", "pp", "tp")\n'),
             "minitp.viz.fake": ast.parse('for d in ("dp", "tp", "pp"):\n    pass\n'
                                          'names = ["tp", "cp", "ep", "steps"]\n'
                                          'pair = ("cp", "ep")\n'  # picks two: not a list of them
                                          'runs = ("ddp", "fsdp", "tp", "pp", "3d")\n'  # strategies
                                          'DIMS = {"dp", "tp"}\n')}
    assert dimension_lists(trees) == [("minitp.viz.fake", "('dp', 'tp', 'pp')"),
                                      ("minitp.viz.fake", "['tp', 'cp', 'ep', 'steps']")]
    assert dims_assigned(trees) == ["minitp.layout", "minitp.viz.fake"]


# -- the trainer is what a step is: the parent's work lives in the wings ------------------------------------
PARENT_WINGS = ("launcher", "runs", "viz", "cli")  # launches, restarts, signals, figures, the command line


def parents_work_in_the_trainer(graph: dict[str, set[str]]) -> list[str]:
    """What importing ``minitp.trainer`` (what a step is) runs from the parent's wings,
    directly or through another module: the restarts, signals, figure, auto-layout and sampling live in
    runs/, viz/ and cli, which may import the trainer, never the other way."""
    return sorted(name for name in reached(graph, "minitp.trainer") if wing(name) in PARENT_WINGS)


def test_the_trainer_imports_none_of_the_parents_work():
    assert parents_work_in_the_trainer(graph_of(modules())) == []


def test_a_planted_runner_in_the_trainer_is_found():
    graph = graph_of(planted(
        trainer="from minitp.runs.common import check_memory",  # the parent's memory check, back home
        checkpoint="from minitp.viz.train import loss_figure",  # a figure, through another module
    ))
    found = parents_work_in_the_trainer(graph)
    assert "minitp.runs.common" in found and "minitp.viz.train" in found


# the rank's loop around the step (signals, the log, the progress bar) is runs/train_rank's
RANK_LOOP_TOOLS = {"signal", "json", "tqdm", "time"}


def rank_loop_in_the_trainer(trees: dict[str, ast.Module]) -> list[str]:
    """The loop's tools ``minitp.trainer`` imports: catching Ctrl-C, writing the log, the bar."""
    tree = trees["minitp.trainer"]
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module}
    return sorted({name.split(".")[0] for name in names} & RANK_LOOP_TOOLS)


def test_the_trainer_holds_the_step_not_the_ranks_loop():
    assert rank_loop_in_the_trainer(modules()) == []


def test_a_planted_signal_handler_in_the_trainer_is_found():
    found = rank_loop_in_the_trainer(planted(trainer="import signal\nfrom tqdm import tqdm"))
    assert found == ["signal", "tqdm"]


# -- every process group of the trainer is made by the mesh -------------------------------------------------
def group_makers(trees: dict[str, ast.Module]) -> set[str]:
    return {name for name, tree in trees.items() for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "new_group"}


# exercises' checkers build groups to check a learner's answer, and the ep runner its own world's two
KNOWN_GROUP_MAKERS = {"minitp.exercises.ch06", "minitp.exercises.ch13", "minitp.runs.expert_parallel"}


def test_only_the_mesh_makes_process_groups_for_the_trainer():
    assert group_makers(modules()) - KNOWN_GROUP_MAKERS == {"minitp.mesh"}


def test_a_planted_process_group_is_found():
    trees = planted(pp="group = torch.distributed.new_group([0, 1])")
    assert group_makers(trees) - KNOWN_GROUP_MAKERS == {"minitp.mesh", "minitp.pp"}


# -- nothing is patched onto another object ----------------------------------------------------------------
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


# -- what importing a strategy loads, for real ----------------------------------------------------------------
# One interpreter imports torch once, then forks a child per module: each child starts with no minitp module
# loaded, imports it and lists what came with it from the launcher, cost, figures, runners or measuring.
IMPORTS = """
import os, sys, torch
for name in sys.argv[1:]:
    read, write = os.pipe()
    if os.fork() == 0:
        import importlib
        importlib.import_module("minitp." + name)
        bad = sorted(m for m in sys.modules if m.split(".")[:2] in
                     (["minitp", "launcher"], ["minitp", "cost"], ["minitp", "viz"], ["minitp", "runs"],
                      ["minitp", "measure"]))
        os.write(write, (name + ": " + ",".join(bad)).encode())
        os._exit(0)
    os.close(write)
    print(os.read(read, 65536).decode())
    os.wait()
"""


def test_a_strategy_module_imports_without_the_launcher_cost_figures_runners_or_measuring():
    import subprocess
    import sys
    # plan is planted: it reads minitp.cost, so its line must name it
    out = subprocess.run([sys.executable, "-c", IMPORTS, *STRATEGIES, "plan"], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    lines = [line for line in out if line]
    assert lines[:-1] == [f"{s}: " for s in STRATEGIES]
    assert lines[-1].startswith("plan: ") and "minitp.cost" in lines[-1].removeprefix("plan: ").split(",")


# -- lines a reader can read: ruff (E501 at 100 characters in src/minitp) ----------------------------
def _ruff(*args: str, stdin: str | None = None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=SRC.parent, input=stdin,
                          capture_output=True, text=True)


def test_ruff_is_clean_on_src_tests_benchmarks_tools_and_the_project():
    done = _ruff("check", "src", "tests", "benchmarks", "tools", "notebooks/project.py")
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_planted_line_over_100_characters_in_src_is_found():
    line = "x = " + '"' + "a" * 95 + '"\n'  # 101 characters
    done = _ruff("check", "--select", "E501", "--stdin-filename", "src/minitp/planted.py", "-",
                 stdin=line)
    assert done.returncode == 1 and "E501" in done.stdout, done.stdout + done.stderr
    done = _ruff("check", "--select", "E501", "--stdin-filename", "src/minitp/planted.py", "-",
                 stdin=line.replace("a", "", 1))
    assert done.returncode == 0, done.stdout + done.stderr


# -- rooms a reader can take in: no file over 500 lines outside exercises/ ----------------------------
def _files_over(root: Path, limit: int = 500) -> list[str]:
    return sorted(f"{p.relative_to(root).as_posix()}: {n}" for p in root.rglob("*.py")
                  if "exercises" not in p.relative_to(root).parts
                  and (n := len(p.read_text().splitlines())) > limit)


def test_no_file_of_src_minitp_is_over_500_lines_outside_the_exercises():
    assert _files_over(SRC / "minitp") == []


def test_a_planted_long_file_is_found(tmp_path):
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "ch99.py").write_text("x = 1\n" * 900)  # the checkers may run long
    (tmp_path / "room.py").write_text("x = 1\n" * 501)
    assert _files_over(tmp_path) == ["room.py: 501"]
