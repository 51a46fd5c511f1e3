"""One profiled step of one rank, drawn: minitp's spans, PyTorch's operators inside them coloured by
what they compute, and the messages on each mesh dimension, on one time axis
(``minitp.measure.operators``; ``minitp train --trace-out FILE --profile`` writes the same as a
Chrome trace). Drawn from a run's record, it never runs anything.

The operators' row is coloured, moment by moment, by what the innermost operator running then
computes (``aten::mm``, not the ``aten::linear`` around it), or by the wait when only a wrapper or
nothing runs while a message is in flight (``minitp.measure.operators.category``); white is Python.
Pieces carry a ``gid`` ("span:<op>", "time:<category>", "comm:<dim>") for tests.
"""

from __future__ import annotations

from minitp.measure.operators import CATEGORIES, shares, timeline
from minitp.viz import style
from minitp.viz.style import LEGEND_PT, TEXT_PT

CATEGORY_COLORS = {"matmul": "#0072B2", "attention": "#E69F00", "elementwise": "#009E73",
                   "optimizer": "#CC79A7", "communication": "#D55E00"}  # python: white
SPAN_SHADES = {"forward": "#DDDDDD", "backward": "#AAAAAA", "optimizer": "#777777"}


def step_profile(per_rank, *, title: str = "", width: float = 9.0):
    """One panel per rank (its events, or its ``Trace``), on one time axis (the ranks of one
    machine share the clock). In each, top to bottom: the spans, the operators (coloured by
    ``timeline``'s categories), one row of messages per mesh dimension the step used, in the
    colour of waiting: a message the operators' row shows in that colour too was waited for, one
    under other colours was hidden behind compute. Each panel's title gives the rank's shares."""
    from matplotlib.patches import Patch

    per_rank = [list(getattr(r, "events", r)) for r in per_rank]
    if not any(e.kind == "op" for events in per_rank for e in events):
        raise ValueError("no operators in these events: profile the step first "
                         "(minitp.measure.operators, or Settings(profile=True))")
    timed = [e for events in per_rank for e in events if e.kind in ("compute", "op")]
    t0 = min(e.start for e in timed)
    tmax = max(e.end for events in per_rank for e in events)
    dims = sorted({e.dim or "comm" for events in per_rank for e in events if e.kind == "comm"})
    rows = ["spans", "operators", *dims]
    fig = style.figure(width, (0.42 * len(rows) + 0.5) * len(per_rank) + 0.9)
    axes = fig.subplots(len(per_rank), 1, sharex=True, squeeze=False)[:, 0]
    y = {name: len(rows) - 1 - i for i, name in enumerate(rows)}
    names = {"spans": "spans", "operators": "operators", "comm": "world messages"}
    for rank, (ax, events) in enumerate(zip(axes, per_rank)):
        def bar(a: float, b: float, row: str, color: str, gid: str, ax=ax):
            ax.barh(y[row], (b - a) * 1e3, left=(a - t0) * 1e3, height=0.7, color=color,
                    edgecolor="none", gid=gid)

        for sp in (e for e in events if e.kind == "compute"):
            shade = SPAN_SHADES.get(sp.op, "#BBBBBB")
            bar(sp.start, sp.end, "spans", shade, f"span:{sp.op}")
            if style.text_fits((sp.end - sp.start) / (tmax - t0) * width * 72 * 0.8, sp.op):
                ax.text(((sp.start + sp.end) / 2 - t0) * 1e3, y["spans"], sp.op, ha="center",
                        va="center", fontsize=TEXT_PT, color=style.text_on(shade))
        # thousands of operators: one collection per kind and row, not a bar each
        pieces: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for a, b, kind in timeline(events):
            if kind != "python":
                pieces.setdefault(("operators", kind), []).append(((a - t0) * 1e3, (b - a) * 1e3))
        for e in (e for e in events if e.kind == "comm"):
            pieces.setdefault((e.dim or "comm", "communication"), []).append(
                ((e.start - t0) * 1e3, (e.end - e.start) * 1e3))
        for (row, kind), spans in pieces.items():
            height = 0.7 if row == "operators" else 0.5
            gid = f"time:{kind}" if row == "operators" else f"comm:{row}"
            ax.broken_barh(spans, (y[row] - height / 2, height), facecolors=CATEGORY_COLORS[kind],
                           edgecolor="none", gid=gid)
        ax.set_yticks([y[r] for r in rows], [names.get(r, f"{r} messages") for r in rows],
                      fontsize=TEXT_PT)
        share = shares(events)
        total = sum(share.values()) or 1.0
        ax.set_title(f"rank {rank}: " + ", ".join(f"{c} {share[c] / total:.0%}"
                                                  for c in CATEGORIES if share.get(c)),
                     fontsize=TEXT_PT, loc="left")
        ax.tick_params(axis="x", labelsize=TEXT_PT)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xlim(0, (tmax - t0) * 1e3)
    axes[-1].set_xlabel("ms from the step's first operator", fontsize=TEXT_PT)
    handles = [Patch(color=CATEGORY_COLORS[c], label=c) for c in CATEGORIES
               if c in CATEGORY_COLORS]
    handles.append(Patch(facecolor="white", edgecolor="#888888", label="python"))
    fig.legend(handles=handles, loc="outside lower center", ncol=6, fontsize=LEGEND_PT,
               frameon=False)
    if title:
        fig.suptitle(title, fontsize=LEGEND_PT)
    return fig
