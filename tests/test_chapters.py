"""What every chapter offers and how long it reads: at least four exercises and three worked problems
(each problem checked by its chapter's ``PROBLEMS``), at least two exercises that run on several
processes where a chapter composes or splits the hardest machinery (06-08), and at most 4,000 words of
prose (Markdown without code, formulas and HTML tags)."""

import importlib
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
MAX_WORDS = 4000
EXERCISE = re.compile(r"^### Exercise (\d+)\b(.*)$", re.M)
PROBLEM = re.compile(r"^### Problem (\d+)\b", re.M)


def markdown(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def prose_words(text: str) -> int:
    """Words of prose: fenced code, display and inline formulas and HTML tags left out, inline code one word."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"\$\$.*?\$\$", "", text, flags=re.S)
    text = re.sub(r"\$[^$]*\$", "", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"`[^`]*`", "X", text)
    return len(re.findall(r"[A-Za-z0-9][\w'’.-]*", text))


def test_the_word_count_leaves_out_code_formulas_and_tags():
    assert prose_words("Two words `code here` and $x + y = z$ <b>bold</b>\n```python\nx = 1\n```") == 5


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name[:2])
def test_a_chapter_has_four_exercises_three_worked_problems_and_at_most_4000_words(path):
    text = markdown(path)
    exercises = [int(n) for n, _ in EXERCISE.findall(text)]
    problems = [int(n) for n in PROBLEM.findall(text)]
    assert len(exercises) >= 4 and exercises == list(range(1, len(exercises) + 1)), exercises
    assert len(problems) >= 3 and problems == list(range(1, len(problems) + 1)), problems
    module = importlib.import_module(f"minitp.exercises.ch{path.name[:2]}")
    assert sorted(module.PROBLEMS) == problems  # each problem in the text has its checker
    words = prose_words(text)
    assert words <= MAX_WORDS, f"{path.name}: {words} words of prose, more than {MAX_WORDS}"


@pytest.mark.parametrize("number", ["06", "07", "08"])
def test_the_chapters_that_compose_or_split_the_hardest_machinery_have_two_multi_process_exercises(number):
    path = next(p for p in CHAPTERS if p.name.startswith(number))
    on_processes = [n for n, title in EXERCISE.findall(markdown(path)) if re.search(r"\d+ processes\)", title)]
    assert len(on_processes) >= 2, f"{path.name}: exercises on several processes: {on_processes}"
