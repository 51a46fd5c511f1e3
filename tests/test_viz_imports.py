"""The figures read what a run recorded and import no strategy: drawing a DDP trace must not need
DDP, and a strategy can change without a figure silently copying its old arithmetic."""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import minitp.viz

STRATEGIES = {"ddp", "fsdp", "tp", "pp", "mesh", "parallel3d", "runs", "registry"}
VIZ = Path(minitp.viz.__file__).parent


def _minitp_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every ``minitp.X`` a file imports, at the top or inside a function."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("minitp.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "minitp":  # from minitp import tp
                out += [(node.lineno, f"minitp.{a.name}") for a in node.names]
            elif node.module.startswith("minitp."):
                out.append((node.lineno, node.module))
    return out


def test_no_viz_module_imports_a_strategy_even_inside_a_function():
    files = sorted(VIZ.glob("*.py"))
    assert len(files) >= 8  # the check ran over the figures, not over an empty folder
    found = [f"{f.name}:{line} imports {module}" for f in files for line, module in _minitp_imports(f)
             if module.split(".")[1] in STRATEGIES]
    assert found == []


def test_importing_every_viz_module_loads_no_strategy_and_touches_no_notebook():
    names = [f"minitp.viz.{m.name}" for m in pkgutil.iter_modules([str(VIZ)])]
    code = (f"import importlib, sys\nfor name in {names!r}: importlib.import_module(name)\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(('minitp.', 'IPython')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert set(names) <= loaded
    assert sorted(m for m in loaded if m.startswith("minitp.") and m.split(".")[1] in STRATEGIES) == []
    assert sorted(m for m in loaded if m.startswith("IPython")) == []  # no %matplotlib magic on import
