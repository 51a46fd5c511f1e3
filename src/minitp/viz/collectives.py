"""Figures for chapter 00: what each rank holds before and after a collective, the ring all-reduce
step by step, the messages between ranks, and the bytes each rank sent.

Every function takes what a run returned (tensors in rank order, the records of
``minitp.ring.ring_all_reduce``, traced events) and returns a Figure; none runs anything.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from minitp.viz.format import byte_scale, format_bytes
from minitp.viz.style import (
    LEGEND_PT,
    OP_COLORS,
    TEXT_PT,
    figure,
    rank_color,
    rank_text_color,
    text_on,
)

SUM_COLOR = "#DDDDDD"  # a value that is a sum over ranks belongs to no single rank


def _fmt(v: float) -> str:
    return f"{int(v)}" if float(v).is_integer() else f"{v:.3g}"


def _draw_row(ax, y: float, texts: list[str], faces: list, edges: list[str] | None = None,
              widths: list[float] | None = None, fontsize: float = TEXT_PT) -> None:
    """A row of boxes at height y, one per value, text inside (white on dark boxes)."""
    from matplotlib.patches import Rectangle

    for i, (text, face) in enumerate(zip(texts, faces)):
        edge = edges[i] if edges else "white"
        lw = widths[i] if widths else 1.0
        ax.add_patch(Rectangle((i, y - 0.4), 0.96, 0.8, facecolor=face, edgecolor=edge,
                               linewidth=lw))
        ax.text(i + 0.48, y, text, ha="center", va="center", fontsize=fontsize, color=text_on(face))


def _lighten(color: str, amount: float = 0.55) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def _rank_axes(ax, n: int, width: int, title: str) -> None:
    ax.set_xlim(-0.1, max(width, 1) + 0.1)
    ax.set_ylim(n - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_xticks([])
    ax.set_title(title, fontsize=10)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(left=False)


# -- one collective: before and after ------------------------------------------------------------
def before_after(before: list[torch.Tensor], after: list[torch.Tensor], title: str = ""):
    """Each rank's tensor before and after a collective, one row per rank.

    A value takes the colour of the rank that held it before (so a broadcast paints every row in
    the source's colour and an all-gather lays the colours side by side); a value no single rank
    held, such as a sum, is grey. Pick distinct values per rank for the colours to say something.
    """
    n = len(before)
    origin: dict[float, set[int]] = defaultdict(set)
    for rank, t in enumerate(before):
        for v in t.reshape(-1).tolist():
            origin[v].add(rank)

    fig = figure(8.0, 0.45 * n + 0.9)
    axes = fig.subplots(1, 2, width_ratios=[max(t.numel() for t in before),
                                            max(t.numel() for t in after)])
    for ax, tensors, name in ((axes[0], before, "before"), (axes[1], after, "after")):
        _rank_axes(ax, n, max(t.numel() for t in tensors), name)
        for rank, t in enumerate(tensors):
            values = t.reshape(-1).tolist()
            faces = []
            for v in values:
                owners = origin.get(v, set())
                if name == "before" or rank in owners and len(owners) > 1:
                    faces.append(_lighten(rank_color(rank)))
                elif len(owners) == 1:
                    faces.append(_lighten(rank_color(next(iter(owners)))))
                else:
                    faces.append(SUM_COLOR)
            _draw_row(ax, rank, [_fmt(v) for v in values], faces)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


# -- the ring all-reduce, step by step -----------------------------------------------------------
def _contributors(value: float, n: int) -> list[int]:
    v = int(value)
    return [r for r in range(n) if v >> r & 1]


def _step_title(entry: dict) -> str:
    if entry["phase"] == "start":
        return "start"
    return f"{entry['phase'].replace('_', '-')} step {entry['step'] + 1}"


def ring_steps(records: list[list[dict]], steps: list[int] | None = None, contributors: bool = True,
               columns: int | None = None):
    """The ring all-reduce as it ran: one panel per step, ranks down, chunks across.

    records: per rank, the ``record`` list ``minitp.ring.ring_all_reduce`` filled (a start entry,
        then one per step, each with the tensor at that point).
    steps: which entries to draw (all by default; one, for a slider).
    contributors: the run started rank r with 2**r everywhere, so each chunk's value is a bitmask
        of the ranks whose data it holds; a cell then names those ranks and darkens as they add
        up. With False a cell shows the chunk's first value.

    The chunk a rank has just received is outlined in the colour of the rank it came from.
    """
    n = len(records)
    steps = list(range(len(records[0]))) if steps is None else list(steps)
    columns = columns or (min(len(steps), n) if len(steps) > 1 else 1)
    rows = math.ceil(len(steps) / columns)
    fig = figure(2.3 * columns + 0.5, 1.9 * rows + 0.2)
    axes = fig.subplots(rows, columns, squeeze=False).reshape(-1)
    full = OP_COLORS["all_reduce"]
    for i, (ax, k) in enumerate(zip(axes, steps)):
        entry0 = records[0][k]
        _rank_axes(ax, n, n, _step_title(entry0))
        if i % columns:
            ax.set_yticks([])
        ax.set_xticks([i + 0.48 for i in range(n)], [f"c{i}" for i in range(n)], fontsize=TEXT_PT)
        ax.tick_params(bottom=False, labeltop=True, labelbottom=False)
        for rank in range(n):
            entry = records[rank][k]
            chunks = entry["tensor"].reshape(-1).tensor_split(n)
            texts, faces, edges, widths = [], [], [], []
            for c, chunk in enumerate(chunks):
                value = chunk[0].item() if chunk.numel() else 0.0
                if contributors:
                    who = _contributors(value, n)
                    texts.append("+".join(map(str, who)) if len(who) < n else "all")
                    faces.append(full if len(who) == n else _lighten(full,
                                                                     0.85 - 0.6 * len(who) / n))
                else:
                    texts.append(_fmt(value))
                    faces.append(_lighten(rank_color(rank), 0.7))
                got = entry["received"] == c and entry["from"] is not None
                edges.append(rank_color(entry["from"]) if got else "white")
                widths.append(2.5 if got else 1.0)
            _draw_row(ax, rank, texts, faces, edges, widths, fontsize=TEXT_PT)
    for ax in axes[len(steps):]:
        ax.axis("off")
    return fig


# -- messages ------------------------------------------------------------------------------------
def message_graph(events, title: str = "", unit: str = "B"):
    """Ranks on a circle and an arrow for every pair that exchanged point-to-point messages,
    labelled with the number of messages and the bytes sent, summed from the traced sends."""
    from matplotlib.patches import Circle, FancyArrowPatch

    sends = [e for e in events if e.kind == "comm" and e.op == "send"]
    ranks = sorted({r for e in events for r in (e.rank, *e.group)} | {e.peer for e in sends
                                                                      if e.peer is not None})
    n = len(ranks)
    links: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
    for e in sends:
        links[(e.rank, e.peer)][0] += 1
        links[(e.rank, e.peer)][1] += e.bytes

    fig = figure(3.6, 3.4)
    ax = fig.subplots()
    ax.set_aspect("equal")
    ax.axis("off")
    pos = {r: (math.sin(2 * math.pi * i / n), math.cos(2 * math.pi * i / n))
           for i, r in enumerate(ranks)}
    most = max((b for _, b in links.values()), default=1)
    for (src, dst), (count, nbytes) in sorted(links.items()):
        (x0, y0), (x1, y1) = pos[src], pos[dst]
        arrow = FancyArrowPatch((x0, y0), (x1, y1), connectionstyle="arc3,rad=-0.25",
                                arrowstyle="-|>", mutation_scale=14, shrinkA=16, shrinkB=16,
                                color=rank_color(src), linewidth=1 + 2.5 * nbytes / most)
        ax.add_patch(arrow)
        # label just beyond the bulge of the arc (arc3 with rad=-0.25 bends towards (-dy, dx)),
        # anchored on the side facing the arc so the text runs away from it, off the arrows
        mx, my = (x0 + x1) / 2, (y0 + y1) / 2
        length = math.hypot(x1 - x0, y1 - y0) or 1.0
        ux, uy = -(y1 - y0) / length, (x1 - x0) / length
        reach = 0.125 * length + 0.08
        ha = "left" if ux > 0.3 else "right" if ux < -0.3 else "center"
        va = "bottom" if uy > 0.3 else "top" if uy < -0.3 else "center"
        amount = format_bytes(nbytes) if unit == "B" else f"{nbytes:g} {unit}"
        ax.text(mx + reach * ux, my + reach * uy, f"{count} msgs, {amount}", ha=ha, va=va,
                # the sender's colour, darkened where too pale to read on white
                fontsize=TEXT_PT, color=rank_text_color(src))
    for r, (x, y) in pos.items():
        ax.add_patch(Circle((x, y), 0.17, facecolor=rank_color(r), edgecolor="white", zorder=3))
        ax.text(x, y, str(r), ha="center", va="center", color=text_on(rank_color(r)), fontsize=10,
                weight="bold", zorder=4)
    ax.set_xlim(-1.6, 1.6)
    ax.set_ylim(-1.6, 1.6)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def bytes_per_rank(sent: list[float], expected: float | list[float], title: str = "",
                   formula: str = "formula"):
    """Bars: the bytes each rank sent (traced); dashed line or dots: what the formula says.
    The axis counts in bytes, KB, MB or GB (``minitp.viz.format``), whichever suits the largest
    value."""
    n = len(sent)
    values = [*sent, *([expected] if isinstance(expected, (int, float)) else expected)]
    top = max(values, default=0)
    unit, scale = byte_scale(top)
    fig = figure(4.0, 2.6)
    ax = fig.subplots()
    ax.bar(range(n), [s / scale for s in sent], color=[rank_color(r) for r in range(n)],
           label="traced")
    if isinstance(expected, (int, float)):
        ax.axhline(expected / scale, color="black", linestyle="--", linewidth=1, label=formula)
    else:
        ax.plot(range(n), [e / scale for e in expected], "k_", markersize=20, label=formula)
    # "rank 5" under each of 8 bars would run into its neighbours: numbers, and the axis says rank
    if n > 4:
        ax.set_xticks(range(n), [str(r) for r in range(n)])
        ax.set_xlabel("rank")
    else:
        ax.set_xticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_ylabel(f"bytes sent ({unit})")
    ax.set_ylim(0, 1.35 * top / scale if top > 0 else 1)  # room for the legend above the bars
    ax.legend(fontsize=LEGEND_PT, loc="upper center", ncol=2, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


__all__ = ["before_after", "ring_steps", "message_graph", "bytes_per_rank"]
