"""`minitp grade`: the reference project (notebooks/project.py) meets every criterion, and each planted
mistake, made in a copy of it, fails on the layout that shows it with its own one-line reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from minitp.exercises import grade
from minitp.exercises.student import PROJECT_STUB, write_project_copy

REFERENCE = Path(__file__).parent.parent / "notebooks" / "project.py"


def planted(tmp_path: Path, old: str, new: str) -> str:
    """A copy of the reference with ``old`` (found exactly once) replaced by ``new``."""
    text = REFERENCE.read_text()
    assert text.count(old) == 1, old
    path = tmp_path / "project.py"
    path.write_text(text.replace(old, new))
    return str(path)


ON_SYNTHETIC = tuple(c for c in grade.CRITERIA if c != "text")


def test_the_reference_project_meets_every_criterion_on_synthetic_batches(capsys):
    card = grade.grade(str(REFERENCE), only=ON_SYNTHETIC)
    assert card.ok, str(card)
    assert len(card.lines) == 1 + len(ON_SYNTHETIC)
    assert all(line.startswith("[ok]") for line in card.lines)
    assert "bytes per dimension = the formula" in card.lines[1]
    assert capsys.readouterr().out.count("[ok]") == len(card.lines)  # each line said as decided


MISTAKES = {
    # the tied embedding: the last stage's copy never gets the first stage's gradient
    "tied": (("        mine += theirs\n", "        pass\n"), "pp",
             "the tied embedding's two copies must each get the sum of both stages' gradients"),
    # a LayerNorm's bias split over tp like a column-parallel bias
    "layernorm": (("        self.ln_1, self.ln_2 = block.ln_1, block.ln_2  # whole on every tp rank\n",
                   "        self.ln_1, self.ln_2 = block.ln_1, block.ln_2\n"
                   "        self.ln_1.bias = nn.Parameter(block.ln_1.bias.detach().chunk(mesh.tp)[mesh.coords.tp].clone())\n"),
                  "tp", "h.0.ln_1.bias is (64,) on stage 0, tp rank"),
    # GELU after the row layer's all-reduce instead of on the column layer's output
    "gelu": (("        partial = F.linear(gelu(self.c_fc(x)), self.c_proj.weight)  # GELU before the sum\n"
              "        return regions.reduce_from_parallel(partial, self.group) + self.c_proj.bias\n",
              "        partial = F.linear(self.c_fc(x), self.c_proj.weight)\n"
              "        return gelu(regions.reduce_from_parallel(partial, self.group) + self.c_proj.bias)\n"),
             "tp", "the forward differs"),
    # the row-parallel bias added on every rank, before the sum
    "row bias": (("        return regions.reduce_from_parallel(partial, self.group) + self.c_proj.bias\n"
                  "        ### END SOLUTION\n\n\nclass MLP",
                  "        return regions.reduce_from_parallel(partial + self.c_proj.bias, self.group)\n"
                  "        ### END SOLUTION\n\n\nclass MLP"),
                 "tp", "a row-parallel layer's bias added on every tp rank before the sum counts tp times"),
    # data parallel: no all-reduce of the gradients
    "no dp all-reduce": (("        comm.all_reduce(p.grad, mesh.dp_group, label=\"dp/grad\")\n", ""), "dp",
                         "the dp replicas differ"),
    # data parallel: summed, not averaged
    "dp sum": (("        p.grad /= mesh.dp\n", "        pass\n"), "dp", "summed, not averaged"),
    # clipping counts the LayerNorms and biases every tp rank holds once per tp rank
    "clip twice": (("    if coords.dp != 0 or (replicated_over_tp(name) and coords.tp != 0):\n",
                    "    if coords.dp != 0:\n"),
                   "tp", "an element counted more than once"),
    # the load assumes the layout it was saved on
    "load same layout": (("                state[key] = shard(name, whole, mesh.tp, mesh.coords.tp)\n",
                          "                state[key] = pieces[mesh.coords.tp][key]\n"),
                         "reshard", "a checkpoint loads on any layout"),
    # the optimizer's moments left out of the checkpoint: the parameters load, AdamW starts again
    "no moments": (("            optimizer.state[p] = {\"step\": pieces[0][\"step\"].clone(), **state}\n",
                    "            pass\n"),
                   "reshard", "AdamW's exp_avg is not restored bit for bit"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_planted_mistake_fails_with_its_own_reason(tmp_path, mistake):
    (old, new), criterion, reason = MISTAKES[mistake]
    card = grade.grade(planted(tmp_path, old, new), only=(criterion,), echo=False)
    assert not card.ok and card.failed == [criterion], str(card)
    failed = next(line for line in card.lines if line.startswith("[FAIL]"))
    assert reason in failed, failed
    assert "\n" not in failed  # one line


def test_the_reasons_differ():
    reasons = [reason for _, _, reason in MISTAKES.values()]
    assert len(set(reasons)) == len(reasons) >= 6


def test_a_project_handing_the_work_to_minitp_is_refused_before_it_runs(tmp_path):
    path = planted(tmp_path, "from minitp.pp import Pipeline, StageSpec\n",
                   "from minitp.pp import Pipeline, StageSpec\nfrom minitp.parallel3d import Parallel3D\n")
    card = grade.grade(path, echo=False)
    assert card.failed == ["your own code"] and len(card.lines) == 1
    line = REFERENCE.read_text().splitlines().index("from minitp.pp import Pipeline, StageSpec") + 2
    assert f"line {line}: imports minitp.parallel3d" in card.lines[0]


def test_the_learner_copy_fails_on_one_clear_line_and_keeps_the_learners_work(tmp_path):
    copy = write_project_copy(REFERENCE.parent, tmp_path)
    text = copy.target.read_text()
    assert copy.regions >= 10 and "### BEGIN SOLUTION" not in text and PROJECT_STUB in text
    card = grade.grade(str(copy.target), only=("dp",), echo=False)
    assert card.failed == ["dp"]
    failed = card.lines[-1]
    assert "raised NotImplementedError: Project: write this part, then run: minitp grade" in failed
    assert "\n" not in failed
    copy.target.write_text(text + "\n# my work\n")
    assert write_project_copy(REFERENCE.parent, tmp_path, force=False).kept
    assert copy.target.read_text().endswith("# my work\n")
    assert not write_project_copy(REFERENCE.parent, tmp_path, force=True).kept
    assert copy.target.read_text() == text


def test_a_missing_function_or_file_is_named(tmp_path):
    path = planted(tmp_path, "def load(", "def load_it(")
    card = grade.grade(path, echo=False)
    assert "load missing" in card.lines[0]
    card = grade.grade(str(tmp_path / "nowhere.py"), echo=False)
    assert "no such file" in card.lines[0]
    with pytest.raises(ValueError, match="unknown criteria"):
        grade.grade(str(REFERENCE), only=("ddp",))


def test_the_text_criterion_trains_on_real_text_and_holds_the_project_to_its_bar(monkeypatch):
    """A short run (the grader's own is 300 steps): the weights put together on one process, the
    validation loss measured there, text written; a bar below what the run reaches fails, naming it."""
    monkeypatch.setitem(grade.TEXT, "steps", 12)
    monkeypatch.setitem(grade.TEXT, "warmup", 2)
    run = grade.train_on_text(str(REFERENCE), prompts=("def ",), new_tokens=8)
    assert len(run.losses) == 12 and run.losses[-1] < run.losses[0]
    assert 2.5 < run.val_loss < 5.6  # learning, from ln 256 = 5.55 nats per byte
    assert run.samples["def "].startswith("def ")
    monkeypatch.setattr(grade, "TEXT_TARGET", 2.0)
    card = grade.grade(str(REFERENCE), only=("text",), echo=False)
    assert card.failed == ["text"] and "more than 2.0" in card.lines[-1]


def test_the_command_line_says_what_it_graded_and_exits_by_it(capsys, tmp_path):
    from minitp import cli

    assert cli.main(["grade", str(tmp_path / "nowhere.py")]) == 1
    out = capsys.readouterr().out
    assert "no such file" in out and out.rstrip().endswith("0 of 1 criteria met; failed: your own code")
    assert cli.main(["grade", str(REFERENCE), "--only", "dp,foo"]) == 2
    assert "unknown criteria ['foo']" in capsys.readouterr().err
    assert cli.main(["grade", str(REFERENCE), "--only", "dp"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("2 of 2 criteria met")
