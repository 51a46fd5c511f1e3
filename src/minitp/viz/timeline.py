"""What the ranks did over time, what they held, and how their loss compares with one process.

Three figures, each drawn from data a run returned (they never run anything):

* ``timeline``: one lane per rank; in each lane a row of compute spans (grey) under a row of
  messages (coloured by collective), every message labelled with its label and its bytes where every
  message of its collective has room for it (a shorter text, or none, otherwise: never some). Works
  for any strategy's trace: messages that overlap in time (asynchronous buckets, prefetches) are
  stacked in sub-rows, and a compute span that contains other spans (a whole ``backward`` around
  per-block spans) is drawn as a thin bar beneath them.
* ``memory_bars``: per rank, the bytes held in parameters, gradients and optimizer state (as
  measured by ``minitp.measure.memory.held_bytes``) next to what ``minitp.cost`` predicts.
* ``loss_curve``: the loss per step of one or more runs against the one-process reference, with
  the absolute difference on a log scale beside it.

Every drawn piece carries a ``gid`` ("comm:<rank>:<label>", "held:<i>:<kind>", ...) so that tests
(and curious readers) can find it in the figure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from minitp.trace import Event, Trace
from minitp.viz import style
from minitp.viz.format import byte_scale
from minitp.viz.format import format_bytes as format_bytes  # notebooks import it from here
from minitp.viz.style import LEGEND_PT, TEXT_PT, label_totals

KIND_COLORS = {"params": "#0072B2", "grads": "#009E73", "optimizer": "#E69F00"}
ACTIVATION_COLOR = "#CC79A7"  # memory_bars' fourth kind, when the entries have "activations"
COMPUTE_SHADES = {"forward": "#DDDDDD", "backward": "#AAAAAA", "optimizer": "#777777",
                  "wait": "#CC79A7"}  # wait: a posted message not yet arrived (tp_overlap)


# -- the message timeline --------------------------------------------------------------------------
def collect_events(run) -> list[Event]:
    """Events from launch Results, a Trace, a list of Traces or a list of Events."""
    if hasattr(run, "traces"):  # minitp.launch's Results
        return [e for t in run.traces if t is not None for e in t.events]
    if isinstance(run, Trace):
        return list(run.events)
    items = list(run)
    if items and all(isinstance(t, Trace) for t in items):
        return [e for t in items for e in t.events]
    return items


def _stack_rows(events: list[Event]) -> dict[int, int]:
    """Give each message the first sub-row where it does not overlap the previous one."""
    rows_end: list[float] = []
    row_of = {}
    for e in sorted(events, key=lambda e: e.start):
        for i, end in enumerate(rows_end):
            if e.start >= end:
                rows_end[i] = e.end
                row_of[id(e)] = i
                break
        else:
            rows_end.append(e.end)
            row_of[id(e)] = len(rows_end) - 1
    return row_of


def _contains(outer: Event, inner: Event) -> bool:
    return outer is not inner and outer.start <= inner.start and inner.end <= outer.end


def timeline(run, *, label_prefix: str = "", ranks: Iterable[int] | None = None, title: str = "",
             width: float = 8.0, lane_height: float | None = None, text: bool = True):
    """Draw every rank's compute spans and messages over time.

    run: what ``minitp.launch`` returned (its traces), a Trace, a list of Traces or of Events.
    label_prefix: keep only events whose label starts with it (e.g. a ``trace.scope`` name); the
        prefix is left out of the labels drawn.
    ranks: the ranks to draw (all by default). Times start at 0 at the first event kept.
    lane_height: inches per rank (by default it grows a little with the messages stacked).
    """
    events = [e for e in collect_events(run) if e.labelled(label_prefix) and e.end >= e.start]
    if ranks is not None:
        keep = set(ranks)
        events = [e for e in events if e.rank in keep]
    if not events:
        raise ValueError(f"no events to draw (label_prefix={label_prefix!r}); was the run traced?")
    lanes = sorted({e.rank for e in events} if ranks is None else set(ranks))
    t0 = min(e.start for e in events)
    t1 = max(e.end for e in events)
    span_ms = max((t1 - t0) * 1e3, 1e-6)

    # cosmetic: the text drawn, without the prefix every kept label shares
    def shown(label: str) -> str:
        rest = label[len(label_prefix):].lstrip("/") if label_prefix else label
        return rest or label

    comm = [e for e in events if e.kind == "comm"]
    rows = {r: _stack_rows([e for e in comm if e.rank == r]) for r in lanes}
    n_rows = max([1] + [max(v.values()) + 1 for v in rows.values() if v])
    if lane_height is None:
        lane_height = min(0.75 + 0.08 * (n_rows - 1), 1.3)
    fig = style.figure(width, 0.6 + lane_height * len(lanes))
    ax = fig.add_subplot()
    # rough: the axes take the width left of the legend
    points_per_ms = (width - 2.0) * 72 / span_ms
    row_points = 0.46 / n_rows * lane_height * 72  # height of one message row
    ops_seen: dict[str, str] = {}
    # labels are drawn all or none per kind: every message of one collective named, or none of them
    # (shorter texts first: the label without its bytes, then its last part); every span of one name
    # on every rank, or none
    comm_labels: dict[str, list] = {}
    compute_labels: dict[str, list] = {}
    for i, rank in enumerate(lanes):
        base = len(lanes) - 1 - i  # rank 0 on top
        compute = [e for e in events if e.kind == "compute" and e.rank == rank]
        phases = [e for e in compute if any(_contains(e, o) for o in compute)]
        for e in compute:
            is_phase = e in phases
            if is_phase:  # a span around others: a thin bar beneath them
                y, h = base - 0.42, 0.07
            else:
                y, h = (base - 0.33, 0.33) if phases else (base - 0.42, 0.42)
            color = COMPUTE_SHADES.get(e.op, style.OP_COLORS["compute"])
            ops_seen.setdefault(e.op, color)
            x, w = (e.start - t0) * 1e3, max(e.duration * 1e3, span_ms * 1e-3)
            ax.broken_barh([(x, w)], (y, h), facecolors=color, edgecolor="white", linewidth=0.4,
                           gid=f"compute:{rank}:{e.op}:{shown(e.label)}")
            if not is_phase:
                name = shown(e.label) if e.label else e.op
                compute_labels.setdefault(name, []).append((x + w / 2, y + h / 2, w * points_per_ms,
                                                            color))
        h = 0.46 / n_rows
        for e in (e for e in comm if e.rank == rank):
            y = base + 0.02 + rows[rank][id(e)] * h
            color = style.OP_COLORS.get(e.op, "#444444")
            ops_seen.setdefault(e.op, color)
            x, w = (e.start - t0) * 1e3, max(e.duration * 1e3, span_ms * 2e-3)
            ax.broken_barh([(x, w)], (y, h * 0.9), facecolors=color, edgecolor="black",
                           linewidth=0.3, gid=f"comm:{rank}:{e.op}:{shown(e.label)}")
            # cosmetic: the texts to try, longest first; nothing is read from them
            words = shown(e.label)
            comm_labels.setdefault(e.op, []).append(
                (x + 2 * span_ms / 1000, y + h * 0.45, w * points_per_ms, color,
                 [f"{words}  {format_bytes(e.bytes)}", words, words.rpartition("/")[2]]))

    unlabelled = False
    if text:
        for name, spots in compute_labels.items():
            if all(style.text_fits(width_pt, name) for _, _, width_pt, _ in spots):
                for x, y, _, color in spots:
                    ax.text(x, y, name, ha="center", va="center", fontsize=TEXT_PT,
                            color=style.text_on(color), clip_on=True)
        tall = row_points >= TEXT_PT + 1.5  # a message row holds a line of text
        for spots in comm_labels.values():
            for choice in range(3):
                if tall and all(style.text_fits(width_pt, words[choice])
                                for _, _, width_pt, _, words in spots):
                    for x, y, _, color, words in spots:
                        ax.text(x, y, words[choice], ha="left", va="center", fontsize=TEXT_PT,
                                color=style.text_on(color), clip_on=True)
                    break
            else:
                unlabelled = True

    ax.set_yticks(range(len(lanes)), [f"rank {r}" for r in reversed(lanes)])
    ax.set_ylim(-0.55, len(lanes) - 0.45)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time (ms)")
    ax.spines[["top", "right"]].set_visible(False)
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=op.replace("_", "-")) for op, c in ops_seen.items()]
    # some messages too short to name: none of their kind is named, and the legend says so
    if unlabelled:
        handles.append(Patch(color="none", label="(messages too\nshort to label)"))
    ax.legend(handles=handles, fontsize=LEGEND_PT, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


# -- memory per rank -------------------------------------------------------------------------------
def memory_bars(memory, expected: list[dict] | None = None, *, names: list[str] | None = None,
                limit: float | None = None, limit_label: str = "", title: str = "",
                width: float = 6.0):
    """Stacked bars of bytes held in params, grads and optimizer state, one pair per rank.

    memory: a run report (uses its ``memory`` and ``memory_expected``) or a list of
        {"params", "grads", "optimizer"} dicts, one per rank (or per configuration, with ``names``);
        with an "activations" entry too (a plan's ``memory``), a fourth kind is stacked on top.
    expected: the same from ``minitp.cost.memory_per_rank``, drawn hatched beside each measured bar.
    limit: a horizontal line (e.g. a GPU's memory) in bytes, named by ``limit_label``.
    """
    if hasattr(memory, "keys") and "memory" in memory:  # a Report, or its JSON as a dict
        expected = memory.get("memory_expected") if expected is None else expected
        memory = memory["memory"]
    memory = list(memory)
    if expected is not None and len(expected) != len(memory):
        raise ValueError(f"{len(memory)} measured entries but {len(expected)} expected ones")
    names = names or [f"rank {i}" for i in range(len(memory))]
    kinds = dict(KIND_COLORS)
    if any("activations" in m for m in memory):  # a plan's entries: what autograd keeps too
        kinds["activations"] = ACTIVATION_COLOR
    totals = [sum(m.get(k, 0) for k in kinds) for m in memory + list(expected or [])]
    unit, scale = byte_scale(max(totals + [limit or 0]))

    fig = style.figure(width, 3.0)
    ax = fig.add_subplot()
    pairs = [("held", memory, 0.0)] if expected is None else [("held", memory, -0.2),
                                                              ("expected", expected, 0.2)]
    bar_w = 0.7 if expected is None else 0.38
    tops: dict[str, list[float]] = {"held": [], "expected": []}
    for which, entries, shift in pairs:
        for i, m in enumerate(entries):
            bottom = 0.0
            for kind, color in kinds.items():
                value = m.get(kind, 0) / scale
                ax.bar(i + shift, value, bar_w, bottom=bottom, color=color,
                       gid=f"{which}:{i}:{kind}", alpha=1.0 if which == "held" else 0.45, hatch=None
                       if which == "held" else "//",
                       edgecolor="white" if which == "held" else color, linewidth=0.5)
                bottom += value
            tops[which].append(bottom)
    label_totals(ax, tops["held"], tops["expected"])
    if limit is not None:
        ax.axhline(limit / scale, color="#D55E00", linestyle="--", linewidth=1, gid="limit")
        if limit_label:
            ax.text(len(memory) - 0.5, limit / scale, limit_label, ha="right", va="bottom",
                    fontsize=TEXT_PT, color="#D55E00")
    ax.set_xticks(range(len(memory)), names)
    ax.set_ylabel(f"held ({unit})")
    ax.set_ylim(0, max(totals + [limit or 0]) / scale * 1.15)
    ax.spines[["top", "right"]].set_visible(False)
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in kinds.items()]
    # swatches in a colour the bars have: the first kind's, solid and hatched
    if expected is not None:
        first = next(iter(KIND_COLORS.values()))
        handles += [Patch(facecolor=first, edgecolor="white", label="measured (solid)"),
                    Patch(facecolor=first, alpha=0.45, edgecolor=first, hatch="//",
                          label="formula (hatched)")]
    ax.legend(handles=handles, fontsize=LEGEND_PT, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


# -- loss against the reference --------------------------------------------------------------------
def loss_curve(run, reference: list[float] | None = None, *, title: str = "", width: float = 8.0,
               reference_label: str = "one process"):
    """The loss per step of one or more runs next to the one-process reference.

    run: a run report (uses ``loss`` and ``reference_loss``), a list of losses, or
        {name: losses} for several runs.
    reference: the one-process losses (taken from the report when ``run`` is one).
    reference_label: what the reference is called (another run's name: "fp32").
    """
    if hasattr(run, "keys") and "loss" in run and "reference_loss" in run:  # a Report, or its JSON
        reference = run["reference_loss"] if reference is None else reference
        runs = {f"{run.get('strategy', 'run')}, {run.get('world_size', '?')} ranks": run["loss"]}
    elif isinstance(run, dict):
        runs = dict(run)
    else:
        runs = {"run": list(run)}
    fig = style.figure(width, 2.8)
    ax, ax_diff = fig.subplots(
        1, 2, width_ratios=[3, 2]) if reference is not None else (fig.add_subplot(), None)
    if reference is not None:
        ax.plot(range(len(reference)), reference, color="black", linestyle="--", linewidth=1.5,
                label=reference_label, gid="reference", zorder=3)
    for i, (name, losses) in enumerate(runs.items()):
        color = style.RANK_COLORS[(i + 1) % len(style.RANK_COLORS)] if len(
            runs) > 1 else style.RANK_COLORS[0]
        ax.plot(range(len(losses)), losses, marker="o", markersize=4, color=color, label=name,
                gid=f"loss:{name}")
        if ax_diff is not None:
            diffs = [abs(a - b) for a, b in zip(losses, reference)]
            shown = [d if d > 0 else math.nan for d in diffs]
            ax_diff.plot(range(len(shown)), shown, marker="o", markersize=4, color=color,
                         gid=f"diff:{name}")
    from matplotlib.ticker import MaxNLocator

    for a in (ax, ax_diff):
        if a is not None:
            a.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=LEGEND_PT, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    if ax_diff is not None:
        ax_diff.set_yscale("log")
        ax_diff.set_xlabel("step")
        ax_diff.set_ylabel(f"|loss - {reference_label}|")
        ax_diff.spines[["top", "right"]].set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


__all__ = ["timeline", "memory_bars", "loss_curve", "format_bytes", "KIND_COLORS", "COMPUTE_SHADES"]
