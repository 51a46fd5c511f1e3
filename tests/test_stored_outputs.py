"""Stored outputs hold on any CPU: no chapter prints a difference or a loss at noise precision.

Two fp32 runs on different CPUs (AVX2, AVX-512, PyTorch's plain kernels) add in different orders,
so their last digits differ. A stored output that prints them fails nbval on a learner's machine.
A chapter prints a verdict against a stated tolerance ("max |ring - one process| <= 1e-05: equal")
or rounds a loss to what survives another CPU (4 decimals on the tiny model's first steps).
"""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb"))

# a difference printed with its digits, below 1e-4 (2.38e-07), or an exact zero so printed (0.00e+00)
NOISE_DIFFERENCE = re.compile(r"(?<![\w.])\d\.\d+e-0*(?:[5-9]|[1-9]\d)\b|(?<![\w.])0\.0+e[-+]0+\b")
# a loss, norm or difference with 5 or more decimals: 4.86648 against 4.86649 on another CPU
COMPARED = re.compile(r"loss|diff|norm|reference|process|\|", re.I)
LONG_DECIMAL = re.compile(r"(?<![\w.])\d+\.\d{5,}(?!\d)")


def exact(number: str) -> bool:
    """A short binary fraction (0.00390625 = 2**-8): the same digits on every CPU."""
    return (float(number) * 2**24).is_integer()


def noise_in(text: str) -> list[str]:
    """The lines of ``text`` (one output) that print a number at noise precision; long decimals
    count when the output compares something (a table's header names it, not each row)."""
    compares = COMPARED.search(text) is not None
    found = []
    for line in text.splitlines():
        long = [n for n in LONG_DECIMAL.findall(line) if not exact(n)]
        if NOISE_DIFFERENCE.search(line) or (compares and long):
            found.append(line.strip())
    return found


def stored_text(path: Path) -> list[tuple[int, str]]:
    """(code cell index, text) of every stored text output of a notebook."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    texts = []
    for i, cell in enumerate(cells):
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain", "")
            texts.append((i, "".join(text)))
    return texts


@pytest.mark.parametrize("line", [
    "max |ring - one process| = 1.4e-06",
    "   1    4.864599    4.864598   2.38e-07",
    "step    4 ranks  1 process\n   0    4.86648    4.86649",
    "20 steps equal the reference (max |diff| 0.0e+00)",
    "loss per step (4 ranks):  [1.00004, 1.000398, 1.003891]",
])
def test_the_scan_finds_noise_written_out(line):
    assert noise_in(line) == [line.splitlines()[-1].strip()]


@pytest.mark.parametrize("line", [
    "max |parameter - reference| <= 1e-05: OK",
    "   1    4.8646     4.8646  <= 1e-05: OK",
    "    dq: max |ring - one process| <= 1e-05: equal",
    "bf16 numbers just below 1.0 are 0.00390625 apart",
    "the weights moved by up to 3.2e-03",
    "peak learning rate 3.00e-03",
])
def test_the_scan_leaves_verdicts_and_exact_numbers_alone(line):
    assert noise_in(line) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_stored_output_prints_a_value_at_noise_precision(path):
    found = [f"code cell {i}: {line}" for i, text in stored_text(path) for line in noise_in(text)]
    assert not found, "printed at noise precision (print a verdict or round it):\n" + "\n".join(found)
