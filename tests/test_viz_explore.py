"""The live control of every chapter (``minitp.viz.explore``): it re-runs for real, keeps the last good
figures when a run fails, waits for the last of quick changes, and stores a static twin whose every
stored setting has its own CSS rule."""

import asyncio
import re

import pytest

from minitp import launch
from minitp.viz import style
from minitp.viz.explore import LIVE_ENV, Control, explore, render, stored_twins, twin_texts


def _sent_bar(result, setting):
    fig = style.figure(3, 2)
    ax = fig.add_subplot()
    ax.bar(range(len(result.sent_bytes())), result.sent_bytes())
    return [fig, f"ranks {setting['nproc']}: sent {result.sent_bytes()}"]


def _ring(numel):
    import torch

    from minitp.ring import ring_all_reduce

    x = torch.ones(numel)
    ring_all_reduce(x)
    return float(x[0])


def _launch_ring(nproc, numel=64):
    return launch(_ring, nproc, numel, echo=False)


def _counting(calls):
    def run(**setting):
        calls.append(dict(setting))
        if setting.get("bad"):
            raise ValueError(f"refused {setting}")
        return setting

    return run


def test_the_first_setting_is_a_real_run_and_each_update_relaunches():
    ex = explore(_launch_ring, _sent_bar, {"nproc": [2, 3]}, title="ring")
    assert list(ex.result) == [2.0, 2.0]  # the sum over 2 ranks of ones
    assert ex.shown.count("<img") == 1 and "ranks 2: sent" in ex.shown
    first = ex.shown
    assert ex.update(nproc=3)
    assert list(ex.result) == [3.0, 3.0, 3.0] and ex.runs == 2
    assert ex.shown != first and "ranks 3" in ex.shown


def test_a_failed_run_shows_its_error_and_keeps_the_previous_figures():
    ex = explore(_launch_ring, _sent_bar, {"nproc": [2], "numel": [64, -1]})
    shown = ex.shown
    ex.widget()
    assert not ex.update(numel=-1)  # torch.ones(-1) raises on every rank
    assert ex.shown == shown
    assert "RankError" in ex.error and "negative" in ex.error  # the rank's own message, from its traceback
    assert "RankError" in ex._parts["error"].value and ex._parts["figures"].value == shown
    assert "failed" in ex._parts["status"].value
    assert ex.update(numel=64) and ex.error == "" and ex._parts["error"].value == ""


def test_bad_settings_and_bad_specs_are_refused_with_what_is_allowed():
    calls = []
    ex = explore(_counting(calls), lambda r, s: str(r), {"a": [1, 2], "b": ["x", "y"]})
    with pytest.raises(ValueError, match=r"a = 5 is not one of \[1, 2\]"):
        ex.update(a=5)
    with pytest.raises(ValueError, match="no control named c; the controls are a, b"):
        ex.update(c=1)
    with pytest.raises(ValueError, match="not one of the options"):
        Control([1, 2], value=3)
    with pytest.raises(ValueError, match="at most 16"):
        explore(_counting([]), lambda r, s: "", {"a": list(range(5)), "b": list(range(4))})
    with pytest.raises(ValueError, match="static names z"):
        explore(_counting([]), lambda r, s: "", {"a": [1]}, static={"z": [1]})
    with pytest.raises(ValueError, match="Python name"):
        explore(_counting([]), lambda r, s: "", {"two words": [1]})
    with pytest.raises(TypeError, match="got int"):
        render(3)
    assert calls == [{"a": 1, "b": "x"}]  # nothing ran for the refused updates


def test_the_static_twin_has_one_panel_per_setting_each_with_its_own_rule():
    calls = []
    ex = explore(_counting(calls), lambda r, s: f"setting {r}", {"a": [1, 2, 3], "b": ["x", "y"], "c": [True]},
                 static={"a": [1, 3], "b": ["x", "y"]})
    twin = ex.build_static()
    settings = [dict(a=a, b=b, c=True) for a in (1, 3) for b in ("x", "y")]
    assert calls == settings[:1] + settings[1:]  # the shown setting is reused, the others run once each
    panels = re.findall(r'<div class="mx-panel (mx-p\d+)" data-setting="([^"]+)">', twin)
    assert [p[1] for p in panels] == ["a = 1, b = x, c = on", "a = 1, b = y, c = on",
                                      "a = 3, b = x, c = on", "a = 3, b = y, c = on"]
    assert "c-0" not in twin  # a control with one stored value gets no buttons
    for k, (cls, _caption) in enumerate(panels):
        rule = re.search(rf"(#\S+ [^{{}}]*)~ \.mx-panels \.{cls}\{{display:block\}}", twin).group(1)
        checked = re.findall(r"#(mx[\w-]+)-(a|b)-(\d):checked", rule)
        a, b = settings[k]["a"], settings[k]["b"]
        assert sorted((n, int(i)) for _, n, i in checked) == [("a", [1, 3].index(a)), ("b", ["x", "y"].index(b))]
        assert f"setting {settings[k]}" in twin.split(f'class="mx-panel {cls}"')[1].split("</div></div>")[0] \
            .replace("&#x27;", "'")
    assert twin.count('type="radio"') == 4 and twin.count(" checked") == 2  # the shown setting is checked
    assert twin_texts(twin) == [f"setting {s}" for s in settings]  # unescaped, in stored order
    notebook = {"cells": [{"outputs": [{"data": {"text/html": [twin[:50], twin[50:]]}}, {"text": "x"}]}, {}]}
    assert stored_twins(notebook) == [twin]


def test_with_twin_stores_the_twin_unless_live_and_displaying_runs_nothing_more(monkeypatch):
    pytest.importorskip("ipywidgets")
    calls = []
    monkeypatch.delenv(LIVE_ENV, raising=False)
    shown = explore(_counting(calls), lambda r, s: str(r), {"a": [1, 2]})
    assert "minitp-explore" not in shown._repr_mimebundle_().get("text/html", "") and len(calls) == 1
    bundle = shown.with_twin()._repr_mimebundle_()  # the grid runs in the explicit call, not on display
    assert "minitp-explore" in bundle["text/html"] and "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == "explorer: a = 1" and len(calls) == 2
    shown._repr_mimebundle_()
    assert len(calls) == 2  # displaying again launches nothing
    monkeypatch.setenv(LIVE_ENV, "1")
    calls.clear()
    bundle = explore(_counting(calls), lambda r, s: str(r), {"a": [1, 2]}).with_twin()._repr_mimebundle_()
    assert "text/html" not in bundle and len(calls) == 1  # a learner's cell runs only what it shows


def test_quick_changes_run_once_with_the_last_setting():
    pytest.importorskip("ipywidgets")
    calls = []

    async def move_three_times():
        ex = explore(_counting(calls), lambda r, s: str(r), {"a": [1, 2, 3, 4]}, debounce_s=0.1)
        slider = ex.widget().children[0]
        for value in (2, 3, 4):
            slider.value = value  # as the learner drags
            await asyncio.sleep(0.02)
        assert len(calls) == 1  # nothing ran while the control was moving
        await asyncio.sleep(0.3)
        return ex

    ex = asyncio.run(move_three_times())
    assert calls == [{"a": 1}, {"a": 4}] and ex.setting == {"a": 4} and "4" in ex._parts["figures"].value


def test_the_status_line_shows_the_ranks_progress_while_they_run():
    pytest.importorskip("ipywidgets")

    def slow(steps):
        import time

        from minitp.launcher import progress

        for i in range(steps):
            progress.step(i, steps)
            time.sleep(0.4)
        return steps

    ex = explore(lambda steps: launch(slow, 2, steps, echo=False), lambda r, s: str(list(r)), {"steps": [1, 6]})
    seen = []
    ex.widget()
    ex._parts["status"].observe(lambda change: seen.append(change["new"]), names="value")
    assert ex.update(steps=6)
    assert any("running on 2 ranks" in s and "rank 0 step" in s for s in seen), seen
    assert "ran in" in seen[-1] and "[6, 6]" in ex.shown
