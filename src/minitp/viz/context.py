"""Figures of context parallel (ring attention), drawn from the layout and from what the ranks
recorded.

* ``attention_work``: the S x S score matrix of causal attention, each (query, key) square coloured
  by the rank that computes it (blank above the diagonal: masked, never computed); beside it the
  positions each rank holds. Contiguous slices vs balanced chunks, side by side, show the uneven
  load.
* ``ring_steps``: one lane per rank, one box per ring step (whose keys and values the rank computed
  with, and for how long), each block sent as an arrow to the rank that received it, from the trace.
* ``rank_times``: measured compute time per rank, one group of bars per layout.

They read traces, ``minitp.layout`` and numbers; they never run anything.
"""

from __future__ import annotations

import numpy as np
from matplotlib.patches import FancyBboxPatch

from minitp.layout import cp_chunks
from minitp.viz import style
from minitp.viz.format import format_bytes
from minitp.viz.style import LEGEND_PT, TEXT_PT


def _owner_grid(seq_len: int, cp: int, balanced: bool, causal: bool = True) -> np.ndarray:
    """(S, S): the rank that computes each (query, key) pair, -1 where the mask leaves nothing."""
    grid = np.full((seq_len, seq_len), -1)
    for rank in range(cp):
        for chunk in cp_chunks(seq_len, cp, rank, balanced):
            grid[chunk.start:chunk.stop, :] = rank
    if causal:
        grid[np.triu_indices(seq_len, 1)] = -1
    return grid


def attention_work(seq_len: int, cp: int, layouts=(False, True), causal: bool = True):
    """The causal score matrix per layout, each square coloured by the rank that computes it, with
    the count of (query, key) pairs each rank computes in the title."""
    from matplotlib.colors import ListedColormap

    fig = style.figure(4.2 * len(layouts), 4.2)
    axes = fig.subplots(1, len(layouts), squeeze=False)[0]
    cmap = ListedColormap(["#FFFFFF"] + [style.rank_color(r) for r in range(cp)])
    for ax, balanced in zip(axes, layouts):
        grid = _owner_grid(seq_len, cp, balanced, causal)
        ax.imshow(grid + 1, cmap=cmap, vmin=0, vmax=cp, interpolation="nearest",
                  gid=f"work:{int(balanced)}")
        counts = [int((grid == r).sum()) for r in range(cp)]
        name = "balanced: chunks i and 2n-1-i" if balanced else "contiguous slices"
        ax.set_title(f"{name}\npairs per rank: {counts}", fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        for rank in range(cp):
            ax.plot([], [], "s", color=style.rank_color(rank), label=f"rank {rank}")
    axes[-1].legend(loc="upper right", fontsize=LEGEND_PT, frameon=True)
    return fig


def ring_steps(run, prefix: str = "cp/ring/forward", title: str = ""):
    """The ring as it ran, step by step: one lane per rank, one box per step holding the key/value
    block the rank computed with (coloured by the rank it came from, found by following the recorded
    sends back to step 0, with its compute time), and an arrow for each block sent (the bytes of
    each step's blocks written above the lanes, off the arrows).

    prefix: draw the events whose label starts with it (the ring's label and the pass, as
    ``minitp.cp.ring_attention`` named them). Each event's step is its ``Event.ring_step``."""
    traces = sorted((t for t in getattr(run, "traces", run) if t is not None), key=lambda t: t.rank)
    computes, sends = {}, {}
    for t in traces:
        for e in t.events:
            if not e.labelled(prefix) or e.ring_step is None:
                continue
            if e.kind == "compute":
                computes[t.rank, e.ring_step] = e.end - e.start
            elif e.op == "send":  # the block; in backward its gradients follow it, sent after it
                sends.setdefault((t.rank, e.ring_step), e)
    if not computes:
        raise ValueError(
            f"no compute labelled {prefix!r}... in the trace: was ring attention run under it?")
    ranks = [t.rank for t in traces]
    steps = 1 + max(s for _, s in computes)
    origin = {(r, 0): r for r in ranks}  # whose block each rank holds at each step, from the sends
    for s in range(steps - 1):
        for (r, step), e in sends.items():
            if step == s and (r, s) in origin:
                origin[e.peer, s + 1] = origin[r, s]
    fig = style.figure(1.9 * steps + 1.5, 0.85 * len(ranks) + 1.0)
    ax = fig.add_subplot()
    lane = {r: len(ranks) - 1 - i for i, r in enumerate(ranks)}
    for (r, s), seconds in computes.items():
        src = origin.get((r, s))
        face = style.rank_color(src if src is not None else r)
        ax.add_patch(FancyBboxPatch(
            (s - 0.32, lane[r] - 0.28), 0.64, 0.56, boxstyle="round,pad=0.02", gid=f"step:{r}:{s}",
            facecolor=face, alpha=0.85, edgecolor="none"))
        what = f"K,V of {src}" if src is not None else "K,V"
        ink = style.text_on(face)
        ax.text(s, lane[r] + 0.08, what, ha="center", va="center", fontsize=9, color=ink,
                weight="bold")
        ax.text(s, lane[r] - 0.14, f"{seconds * 1e3:.1f} ms", ha="center", va="center",
                fontsize=TEXT_PT, color=ink)
    sent_at: dict[int, set[int]] = {}
    for (r, s), e in sends.items():
        # a block sent on to the next step (not the gradients' last hop)
        if e.peer in lane and s + 1 < steps:
            ax.annotate("", xy=(s + 1 - 0.33, lane[e.peer]), xytext=(s + 0.33, lane[r]),
                        arrowprops=dict(arrowstyle="->", color=style.OP_COLORS["send"], lw=1.3),
                        gid=f"send:{r}:{s}")
            sent_at.setdefault(s, set()).add(e.bytes)
    ink = style.readable(style.OP_COLORS["send"])
    for s, sizes in sent_at.items():  # the bytes of each step's blocks, above the arrows, off them
        words = "sent " + format_bytes(min(sizes)) + ("" if len(sizes) == 1
                                                      else f" to {format_bytes(max(sizes))}")
        ax.text(s + 0.5, len(ranks) - 0.45, words, ha="center", va="bottom", fontsize=TEXT_PT,
                color=ink, gid=f"bytes:{s}")
    ax.set_xlim(-0.6, steps - 0.4)
    # room above the lanes for the bytes
    ax.set_ylim(-0.6, len(ranks) - 0.4 + (0.35 if sent_at else 0))
    ax.set_xticks(range(steps), [f"step {s}" for s in range(steps)])
    ax.set_yticks([lane[r] for r in ranks], [f"rank {r}" for r in ranks])
    ax.set_title(title or "the ring: each step computes with the block held while it travels on",
                 fontsize=10)
    return fig


def rank_times(times: dict[str, list[float]], title: str = "attention compute time per rank"):
    """Bars of measured seconds per rank, one group per layout ({"contiguous": [...], "balanced":
    [...]})."""
    fig = style.figure(6, 2.8)
    ax = fig.add_subplot()
    names = list(times)
    n = max(len(v) for v in times.values())
    width = 0.8 / n
    for rank in range(n):
        ax.bar([i + (rank - (n - 1) / 2) * width for i in range(len(names))],
               [times[name][rank] * 1e3 for name in names], width, color=style.rank_color(rank),
               label=f"rank {rank}", gid=f"time:{rank}")
    ax.set_xticks(range(len(names)), [f"{name}\nmax/min = {max(times[name]) / min(times[name]):.2f}"
                                      for name in names])
    ax.set_ylabel("ms")
    ax.legend(fontsize=LEGEND_PT)
    ax.set_title(title, fontsize=10)
    return fig


__all__ = ["attention_work", "ring_steps", "rank_times"]
