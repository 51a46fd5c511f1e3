"""A live control for a chapter: change a setting, a real run answers, its figures follow.

``explore(run, draw, controls)`` is the one piece of widget plumbing in the course.
``run(**setting)`` launches a real run (through ``minitp.launch`` or a runner of ``minitp.runs``)
and returns what it recorded; ``draw(result, setting)`` turns that into figures and lines of text.
In JupyterLab the panel re-runs on every change of a control (after a short pause, so dragging a
slider launches once), shows which ranks are at which step while the run goes, keeps the previous
figures until the new ones arrive, and shows a failed run's error in the panel.

On the website there is no kernel. A chapter's cell asks for a *static twin* explicitly,
``explore(...).with_twin()``: a small grid of settings, each run for real, stored with the notebook
as HTML whose buttons switch between the stored figures, with no script (radio inputs and CSS), so
it works on any page. Displaying the panel never launches a run of its own. ``make lab`` sets
``MINITP_LIVE=1``: ``with_twin`` is skipped and a learner's cell runs only the setting shown.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import itertools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minitp.launcher import progress as _progress
from minitp.launcher.guard import env_flag

LIVE_ENV = "MINITP_LIVE"  # set by `make lab`: skip the stored grid, the learner has a kernel
DEBOUNCE_S = 0.4  # a change waits this long for the next one before a run starts
MAX_STATIC = 16  # settings in a static twin: each is a real run when the notebook is stored
_ids = itertools.count()


@dataclass
class Control:
    """One setting a learner can change: its ``options`` (in order) and the ``value`` shown
    first."""

    options: list
    value: Any = None
    label: str | None = None

    def __post_init__(self):
        self.options = list(self.options)
        if not self.options:
            raise ValueError("a control needs at least one option, got none")
        if self.value is None:
            self.value = self.options[0]
        if self.value not in self.options:
            raise ValueError(f"value {self.value!r} is not one of the options {self.options}")

    def widget(self, name: str):
        import ipywidgets as widgets

        label = self.label or name
        if all(isinstance(o, bool) for o in self.options):
            return widgets.ToggleButtons(options=[(_show(o), o) for o in self.options],
                                         value=self.value, description=label,
                                         style={"description_width": "initial"})
        if all(isinstance(o, (int, float)) for o in self.options) and len(self.options) > 2:
            return widgets.SelectionSlider(options=[(_show(o), o) for o in self.options],
                                           value=self.value, description=label,
                                           continuous_update=False,
                                           style={"description_width": "initial"})
        return widgets.ToggleButtons(options=[(_show(o), o) for o in self.options],
                                     value=self.value, description=label,
                                     style={"description_width": "initial"})


def _show(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value)


def render(drawn) -> str:
    """HTML for what ``draw`` returned: a Figure (as a PNG), a string (as preformatted text), or a
    list of them; the figures are closed, so the notebook does not show them a second time."""
    items = drawn if isinstance(drawn, (list, tuple)) else [drawn]
    parts = []
    for item in items:
        if item is None:
            continue
        if isinstance(item, str):
            parts.append(f'<pre class="minitp-explore-text">{html.escape(item)}</pre>')
        elif hasattr(item, "savefig"):
            buffer = io.BytesIO()
            item.savefig(buffer, format="png", dpi=item.dpi)
            _close(item)
            data = base64.b64encode(buffer.getvalue()).decode("ascii")
            parts.append('<img class="minitp-explore-figure" alt="figure" '
                         f'src="data:image/png;base64,{data}">')
        else:
            raise TypeError(
                f"draw must return Figures, strings or a list of them, got {type(item).__name__}")
    return "\n".join(parts)


def _close(figure) -> None:
    try:
        import matplotlib.pyplot as plt

        plt.close(figure)  # a pyplot figure; a plain Figure (viz.style.figure) is not registered
    except Exception:
        pass


def describe(setting: dict, controls: dict | None = None) -> str:
    """``ranks = 4, bucket MiB = 0.25``: each control's label (else its name) and value."""
    label = lambda k: (controls[k].label if controls and k in controls else None) or k  # noqa: E731
    return ", ".join(f"{label(k)} = {_show(v)}" for k, v in setting.items())


def error_text(error: BaseException) -> str:
    """The error as a learner needs it: what failed and, for a failed rank, the end of its
    traceback."""
    text = f"{type(error).__name__}: {error}"
    remote = getattr(error, "remote_traceback", "")
    if remote:
        text += "\n\n" + "\n".join(remote.strip().splitlines()[-12:])
    return text


@dataclass
class Explorer:
    """A control panel over real runs; see the module docstring. Build it with :func:`explore`."""

    run: Callable[..., Any]
    draw: Callable[[Any, dict], Any]
    controls: dict[str, Control]
    title: str = ""
    static: dict[str, list] | None = None
    note: str = "each a real run stored when this page was made"
    debounce_s: float = DEBOUNCE_S
    setting: dict = field(default_factory=dict)
    result: Any = None
    shown: str = ""  # the HTML of the figures now shown
    error: str = ""  # the last failed run's error, "" after a run that worked
    runs: int = 0
    twin: str | None = None  # the static twin's HTML, built by with_twin()
    _widget: Any = None
    _parts: dict = field(default_factory=dict)
    _timer: Any = None  # the pending run's handle on the kernel's loop
    _pending: dict = field(default_factory=dict)  # changes not run yet

    def __post_init__(self):
        self.setting = {name: c.value for name, c in self.controls.items()}
        self.id = f"mx{next(_ids)}-" + hashlib.sha1(
            f"{self.title}|{sorted(self.controls)}".encode()).hexdigest()[:6]

    # -- running ---------------------------------------------------------------------------------
    def compute(self, setting: dict) -> str:
        """Run one setting for real and return its figures as HTML (errors propagate)."""
        result = self.run(**setting)
        self.result = result
        return render(self.draw(result, dict(setting)))

    def update(self, **changes) -> bool:
        """Run the current setting with ``changes`` applied and show it; False (and the error in the
        panel, the previous figures kept) when the run failed."""
        unknown = sorted(set(changes) - set(self.controls))
        if unknown:
            raise ValueError(f"no control named {', '.join(unknown)}; the controls are "
                             f"{', '.join(self.controls)}")
        for name, value in changes.items():
            if value not in self.controls[name].options:
                raise ValueError(f"{name} = {value!r} is not one of {self.controls[name].options}")
        self.setting.update(changes)
        self._status(f"running {describe(self.setting, self.controls)} …")
        start = time.perf_counter()
        try:
            with _progress.to(self._status):
                shown = self.compute(self.setting)
        except Exception as error:  # shown in the panel: a widget must never die with its run
            self.error = error_text(error)
            self._status(f"failed after {time.perf_counter() - start:.1f} s: "
                         f"{describe(self.setting, self.controls)}")
            self._show_error(self.error)
            return False
        self.runs += 1
        self.shown, self.error = shown, ""
        self._status(
            f"{describe(self.setting, self.controls)}: ran in {time.perf_counter() - start:.1f} s")
        self._show_error("")
        if self._widget is not None:
            self._parts["figures"].value = shown
        return True

    # -- the static twin ---------------------------------------------------------------------------
    def grid(self) -> list[dict]:
        """The settings stored for the website: every combination of ``static`` (default: of every
        control's options), the shown setting first if it is among them."""
        choose = self.static or {name: c.options for name, c in self.controls.items()}
        unknown = sorted(set(choose) - set(self.controls))
        if unknown:
            raise ValueError(f"static names {', '.join(unknown)}, which are not controls "
                             f"({', '.join(self.controls)})")
        names = list(self.controls)
        axes = [list(choose.get(name, [self.controls[name].value])) for name in names]
        for name, axis in zip(names, axes):
            bad = [v for v in axis if v not in self.controls[name].options]
            if bad:
                raise ValueError(f"static {name} values {bad} are not among its options "
                                 f"{self.controls[name].options}")
        settings = [dict(zip(names, values)) for values in itertools.product(*axes)]
        if len(settings) > MAX_STATIC:
            raise ValueError(
                f"the static twin would store {len(settings)} runs; at most {MAX_STATIC}: "
                "pass static= with fewer values")
        return settings

    def static_html(self, panels: list[tuple[dict, str]]) -> str:
        """The twin: one radio row per control that varies, and one stored panel per setting; CSS
        shows the panel whose every control is checked (no script, so any page can show it)."""
        sid = self.id
        names = [n for n in self.controls if len({p[0][n] for p in panels}) > 1]
        values = {n: sorted({p[0][n] for p in panels}, key=self.controls[n].options.index)
                  for n in names}
        first = panels[0][0]
        inputs, rules = [], []
        for n in names:
            inputs.append(
                f'<span class="mx-name">{html.escape(self.controls[n].label or n)}</span>')
            for i, v in enumerate(values[n]):
                checked = " checked" if v == first[n] else ""
                inputs.append(f'<input type="radio" name="{sid}-{n}" id="{sid}-{n}-{i}"{checked}>'
                              f'<label for="{sid}-{n}-{i}">{html.escape(_show(v))}</label>')
            inputs.append('<span class="mx-break"></span>')
        blocks = []
        for k, (setting, body) in enumerate(panels):
            selector = " ~ ".join(f"#{sid}-{n}-{values[n].index(setting[n])}:checked"
                                  for n in names)
            rules.append(f"#{sid} {selector} ~ .mx-panels .mx-p{k}{{display:block}}" if names else
                         f"#{sid} .mx-p{k}{{display:block}}")
            caption = html.escape(describe(setting, self.controls))
            blocks.append(f'<div class="mx-panel mx-p{k}" data-setting="{caption}">'
                          f'<div class="mx-caption">{caption}</div>\n{body}\n</div>')
        style = (f"#{sid}{{display:flex;flex-wrap:wrap;align-items:center;gap:.3em}}#{sid} "
                 f"input{{position:absolute;opacity:0;width:1px;height:1px}}#{sid} "
                 f"label{{border:1px solid #888;border-radius:4px;padding:.1em "
                 f".6em;cursor:pointer}}#{sid} "
                 f"input:checked+label{{background:#3f51b5;color:#fff;border-color:#3f51b5}}#{sid} "
                 f"input:focus-visible+label{{outline:2px solid #ff6e40}}#{sid} "
                 f".mx-name{{font-weight:600;min-width:8em}}#{sid} "
                 f".mx-break{{flex-basis:100%;height:0}}#{sid} "
                 f".mx-panels{{flex-basis:100%;min-width:0}}#{sid} .mx-panel{{display:none}}#{sid} "
                 f".mx-caption{{font-size:.85em;color:#555;margin:.3em 0}}#{sid} "
                 f"img{{max-width:100%;height:auto}}#{sid} pre{{overflow-x:auto}}"
                 + "".join(rules))
        head = (f'<div class="mx-note">{html.escape(self.title) + ": " if self.title else ""}'
                f"{len(panels)} settings, {html.escape(self.note)}; "
                "in JupyterLab the control re-runs any setting.</div>")
        return (f'<div class="minitp-explore-static">{head}<style>{style}</style>'
                f'<div class="minitp-explore" id="{sid}">' + "".join(inputs)
                + '<div class="mx-panels">' + "".join(blocks) + "</div></div></div>")

    def build_static(self) -> str:
        panels = []
        for setting in self.grid():
            if setting == self.setting and self.shown:
                panels.append((setting, self.shown))
            else:
                panels.append((setting, self.compute(setting)))
        # the shown setting's panel first: it is what the page shows before a click
        panels.sort(key=lambda p: p[0] != self.setting)
        return self.static_html(panels)

    # -- the widget --------------------------------------------------------------------------------
    def widget(self):
        """The ipywidgets panel: controls, a status line, the error box and the figures."""
        if self._widget is None:
            import ipywidgets as widgets

            inputs = {name: c.widget(name) for name, c in self.controls.items()}
            for name, w in inputs.items():
                w.value = self.setting[name]
                w.observe(lambda change, name=name: self._changed(name, change["new"]),
                          names="value")
            status = widgets.HTML(value="")
            error = widgets.HTML(value="")
            figures = widgets.HTML(value=self.shown)
            title = [widgets.HTML(value=f"<b>{html.escape(self.title)}</b>")] if self.title else []
            self._parts = {"inputs": inputs, "status": status, "error": error, "figures": figures}
            self._widget = widgets.VBox(title + list(inputs.values()) + [status, error, figures])
        return self._widget

    def _status(self, text: str) -> None:
        if self._widget is not None:
            self._parts["status"].value = (
                f'<span class="minitp-explore-status">{html.escape(text)}</span>')

    def _show_error(self, text: str) -> None:
        if self._widget is not None:
            self._parts["error"].value = (
                f'<pre style="color:#b00020;white-space:pre-wrap">{html.escape(text)}</pre>'
                if text else "")

    def _changed(self, name: str, value) -> None:
        """A control moved: run after ``debounce_s`` unless another change comes first (it cancels
        this one's pending run and starts the wait again)."""
        self._pending[name] = value
        if self._timer is not None:
            self._timer.cancel()
        loop = _kernel_loop()
        if loop is None or self.debounce_s <= 0:
            self._fire()
        else:
            self._timer = loop.call_later(self.debounce_s, self._fire)

    def _fire(self) -> None:
        pending, self._pending, self._timer = self._pending, {}, None
        self.update(**pending)

    # -- display -----------------------------------------------------------------------------------
    def with_twin(self) -> Explorer:
        """Run the website's grid of settings now, each for real, and keep its static twin to show
        with the live control: an explicit call in the chapter's cell
        (``explore(...).with_twin()``), never a side effect of displaying. Skipped under
        ``MINITP_LIVE`` (the learner has a kernel)."""
        live = env_flag(LIVE_ENV)
        if self.twin is None and not live:
            self.twin = self.build_static()
        return self

    def _repr_mimebundle_(self, include=None, exclude=None):
        data = {}
        try:
            data.update(self.widget()._repr_mimebundle_(include=include, exclude=exclude) or {})
        except ImportError:  # no ipywidgets: the stored figures, or the shown ones
            data["text/html"] = self.shown
        if self.twin:
            data["text/html"] = self.twin
        data["text/plain"] = f"{self.title or 'explorer'}: {describe(self.setting, self.controls)}"
        return data


def stored_twins(notebook: dict) -> list[str]:
    """The HTML of every static twin a stored notebook (its JSON, as a dict) holds, in cell
    order."""
    shown = ["".join(o.get("data", {}).get("text/html", "")) for c in notebook.get("cells", [])
             for o in c.get("outputs", [])]
    return [h for h in shown if "minitp-explore-static" in h]


def twin_texts(twin: str) -> list[str]:
    """The text each stored setting of a twin shows (what ``draw`` returned as strings), in
    order."""
    return [html.unescape(t) for t in re.findall(r'<pre class="minitp-explore-text">(.*?)</pre>',
                                                 twin, re.S)]


def _kernel_loop():
    """The running asyncio loop of the kernel (the changes arrive on it), else None."""
    import asyncio

    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def explore(run: Callable[..., Any], draw: Callable[[Any, dict], Any], controls: dict, *,
            title: str = "", static: dict[str, list] | None = None, debounce_s: float = DEBOUNCE_S,
            note: str | None = None) -> Explorer:
    """A control panel over real runs; display it (last line of a cell) to use it.

    run: ``run(**setting)`` launches a real run for one setting and returns what it recorded.
    draw: ``draw(result, setting)`` returns a Figure, a string, or a list of them.
    controls: name -> :class:`Control`, or a list of options (the first shown first).
    static: for the website's twin, the options of each control to store (default: all of them;
        at most 16 settings in all, each run once when the notebook is stored).
    note: what the twin says its stored settings are (default: real runs; the planner's are not).

    The first setting runs now, so an error in ``run`` or ``draw`` shows in the cell that builds it.
    """
    if not callable(run) or not callable(draw):
        raise ValueError(
            f"run and draw must be callables, got {type(run).__name__} and {type(draw).__name__}")
    if not controls:
        raise ValueError("explore needs at least one control, got none")
    made = {}
    for name, spec in controls.items():
        if not re.fullmatch(r"[A-Za-z_]\w*", name):
            raise ValueError(
                f"a control name must be a Python name (it is a keyword of run), got {name!r}")
        made[name] = spec if isinstance(spec, Control) else Control(spec)
    explorer = Explorer(run=run, draw=draw, controls=made, title=title, static=static,
                        debounce_s=debounce_s)
    if note is not None:
        explorer.note = note
    explorer.grid()  # a bad static= fails here, before any run
    explorer.shown = explorer.compute(explorer.setting)
    explorer.runs = 1
    return explorer


# -- the planner as a control: nothing launched, each setting one call of minitp.plan.plan ---------
def plan_explorer(model: str = "llama3-8b", gpus: int = 64, gpu_memory_gib: float = 80.0,
                  static: dict | None = None) -> Explorer:
    """``minitp.plan.plan`` as a control: pick a model, GPUs, memory per GPU, FSDP or DDP and how
    activations are kept (replicated norms, sequence parallel with or without gathering the linears'
    input again in backward, full recomputation: ``minitp.plan.ACTIVATIONS``); the table of layouts
    (all of them, fitting first) follows. Nothing is launched: a setting is one call of ``plan``.
    Display it: a live panel in JupyterLab (needs ``ipywidgets``, the course extra); in a stored
    notebook, a static twin over ``static`` (default: this model, GPUs and memory, both data
    parallels and the four ways of keeping activations)."""
    from minitp import plan
    from minitp.models import PRESETS

    # the planner's rows, nothing launched
    def run(model, gpus, gpu_memory_gib, data_parallel, activations):
        recompute, sequence_parallel, counted = plan.ACTIVATIONS[activations]
        cfg = PRESETS[model]
        return plan.plan(cfg, gpus, gpu_memory_gib, seq_len=min(cfg.max_seq_len, 8192),
                         data_parallel=data_parallel, recompute=recompute,
                         sequence_parallel=sequence_parallel, include_unfit=True,
                         activations=counted)

    def draw(rows, setting):
        cfg = PRESETS[setting["model"]]
        fit = sum(r["fits"] for r in rows)
        return plan.format_plan(
            rows, f"{setting['model']}: {cfg.num_params() / 1e9:.2f} B parameters, sequences of "
                                      f"{min(cfg.max_seq_len, 8192)}; {fit} of {len(rows)} layouts "
                                      f"fit {setting['gpu_memory_gib']} GiB per GPU")

    memory = list(range(8, 200, 8))  # GiB per GPU
    controls = {
        "model": Control(list(PRESETS), value=model),
        "gpus": Control([2**k for k in range(1, 12)], value=gpus, label="GPUs"),
        "gpu_memory_gib": Control(memory, value=next((m for m in memory if m == gpu_memory_gib),
                                                     gpu_memory_gib),
                                  label="GiB per GPU"),
        "data_parallel": Control(["fsdp", "ddp"], label="data parallel"),
        "activations": Control(list(plan.ACTIVATIONS), label="activations"),
    }
    default = {"data_parallel": ["fsdp", "ddp"], "activations": list(plan.ACTIVATIONS)}
    return explore(run, draw, controls, title="the planner (minitp.plan)",
                   static=default if static is None else static,
                   note="each one call of minitp.plan.plan (nothing is launched), stored when this "
                        "page was made")


__all__ = ["Control", "Explorer", "explore", "plan_explorer", "render", "stored_twins",
           "twin_texts", "LIVE_ENV"]
