"""Figures for tensor parallelism (chapters 03 and 04): which block of a matrix each rank held, and
which messages a tensor-parallel layer sent forward and backward.

* ``locate``: how each rank's tensor sits in the full one: a slice (which rows or columns), the same
  copy on every rank, or a partial sum. Found from the values the ranks returned, never assumed.
* ``matmul_blocks``: Y = X·W drawn as coloured blocks, one colour per rank, from what each rank
  held.
* ``weight_shards``: the weights of a tensor-parallel module (``minitp.tp.local_shards`` of every
  rank), each drawn as the (in, out) matrix of y = x·W, coloured by the rank holding each slice;
  optionally with an attention weight's heads marked off and named.
* ``message_flow``: one rank's messages in the order it sent them, forward above, backward below.

Every drawn piece carries a ``gid`` ("block:<panel>:<rank>:<kind>", "head:<panel>:<i>" for the line
before head i, "msg:<phase>:<i>:<op>") so that tests can find it in the figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minitp.trace import Event, Trace
from minitp.viz.format import format_bytes
from minitp.viz.style import OP_COLORS, TEXT_PT, figure, rank_color

REPLICATED_COLOR = "#DDDDDD"


@dataclass
class Placement:
    """Where one rank's tensor sits in the full tensor."""

    kind: str  # "slice", "replicated", "partial" (a summand of the full tensor) or "unknown"
    dim: int | None = None  # the dimension a slice was cut along
    start: int = 0  # the slice's first index along ``dim``
    stop: int = 0


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().float()
    return t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t


def locate(full: torch.Tensor, shards: list[torch.Tensor], atol: float = 1e-5) -> list[Placement]:
    """Where each rank's ``shards[r]`` sits in ``full`` (2-D, or flattened to (rows, last dim)).

    A shard smaller than ``full`` along one dimension is looked for among the slices of its size
    along that dimension; a shard of the full shape is "replicated" when it equals ``full`` and
    "partial" when it does not but the shards sum to ``full`` (a row-parallel layer before its
    all-reduce).
    """
    full = _as_2d(full)
    shards = [_as_2d(s) for s in shards]
    total = sum(shards)
    out = []
    for s in shards:
        if s.shape == full.shape:
            if torch.allclose(s, full, atol=atol):
                out.append(Placement("replicated"))
            elif len(shards) > 1 and torch.allclose(total, full, atol=atol):
                out.append(Placement("partial"))
            else:
                out.append(Placement("unknown"))
            continue
        placement = Placement("unknown")
        for dim in (0, 1):
            other = 1 - dim
            if s.shape[other] != full.shape[other] or full.shape[dim] % s.shape[dim]:
                continue
            size = s.shape[dim]
            for start in range(0, full.shape[dim], size):
                if torch.allclose(full.narrow(dim, start, size), s, atol=atol):
                    placement = Placement("slice", dim, start, start + size)
                    break
            if placement.kind != "unknown":
                break
        out.append(placement)
    return out


def whole(pieces: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    """The tensor the ranks' pieces make together, pieces in rank order: concatenated along the
    dimension they were split along, or the first piece where every rank holds all of it (None)."""
    return pieces[0] if dim is None else torch.cat(pieces, dim=dim)


def _lighten(color: str, amount: float) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def _draw_panel(ax, name: str, full: torch.Tensor, shards: list[torch.Tensor],
                axis_names: tuple[str, str]):
    """One matrix as a rectangle (rows down, columns across), each rank's part in its colour."""
    from matplotlib.patches import Rectangle

    full2 = _as_2d(full)
    rows, cols = full2.shape
    placements = locate(full2, shards)
    n = len(shards)
    kinds = {p.kind for p in placements}
    if kinds == {"replicated"}:
        ax.add_patch(Rectangle((0, 0), cols, rows, facecolor=REPLICATED_COLOR, edgecolor="black",
                               linewidth=0.6, gid=f"block:{name}:all:replicated"))
        for r in range(n):  # a thin stripe per rank along the top: every rank holds all of it
            ax.add_patch(Rectangle((r * cols / n, -0.09 * rows), cols / n, 0.07 * rows,
                                   facecolor=rank_color(r), edgecolor="none", clip_on=False))
        ax.text(cols / 2, rows / 2, f"the same on\nall {n} ranks", ha="center", va="center",
                fontsize=TEXT_PT)
    elif kinds == {"partial"}:
        step = 0.06
        for r in reversed(range(n)):  # a stack of cards: one full-size partial sum per rank
            off = r * step * min(rows, cols)
            ax.add_patch(Rectangle((off, off), cols, rows, facecolor=_lighten(rank_color(r), 0.45),
                                   edgecolor=rank_color(r), linewidth=1.0,
                                   gid=f"block:{name}:{r}:partial"))
        ax.text(cols / 2, rows / 2, f"{n} partial sums\n(add them: all-reduce)", ha="center",
                va="center", fontsize=TEXT_PT)
    else:
        for r, p in enumerate(placements):
            if p.kind != "slice":
                continue
            x, y, w, h = ((p.start, 0, p.stop - p.start, rows) if p.dim == 1
                          else (0, p.start, cols, p.stop - p.start))
            ax.add_patch(Rectangle((x, y), w, h, facecolor=_lighten(rank_color(r), 0.25),
                                   edgecolor="black", linewidth=0.6, gid=f"block:{name}:{r}:slice"))
            ax.text(x + w / 2, y + h / 2, f"r{r}", ha="center", va="center", fontsize=TEXT_PT,
                    zorder=4, bbox={"facecolor": _lighten(rank_color(r), 0.25), "edgecolor": "none",
                                    "pad": 0.6})
        if "unknown" in kinds:
            ax.add_patch(Rectangle((0, 0), cols, rows, fill=False, edgecolor="#D55E00",
                                   linewidth=1.5, linestyle="--", gid=f"block:{name}:all:unknown"))
    pad = 0.12 * max(rows, cols)
    ax.set_xlim(-0.02 * cols, cols * 1.02 + (pad if "partial" in kinds else 0))
    ax.set_ylim(rows * 1.02 + (pad if "partial" in kinds else 0), -0.12 * rows)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(f"{name}  ({rows}×{cols})", fontsize=TEXT_PT)
    ax.set_xlabel(axis_names[1], fontsize=TEXT_PT)
    ax.set_ylabel(axis_names[0], fontsize=TEXT_PT)
    return placements


def matmul_blocks(x: tuple[torch.Tensor, list[torch.Tensor]],
                  w: tuple[torch.Tensor, list[torch.Tensor]],
                  y: tuple[torch.Tensor, list[torch.Tensor]], *,
                  names: tuple[str, str, str] = ("X", "W", "Y"), dims: tuple[str, str, str] = (
                      "B·S", "D", "F"), title: str = "", width: float = 8.0):
    """Y = X·W as three rectangles, each drawn as (full, [what rank 0, 1, ... held]).

    X is (rows, k), W is (k, m), Y is (rows, m); ``dims`` names rows, k and m. A slice is drawn in
    its rank's colour where it sits, a replicated matrix in grey with a stripe per rank, partial
    sums as a stack of full-size cards.
    """
    fig = figure(width, 2.6)
    axes = fig.subplots(1, 3, width_ratios=[x[0].shape[-1], w[0].shape[-1], y[0].shape[-1]])
    rows, k, m = dims
    for ax, name, (full, shards), axis_names in zip(axes, names, (x, w, y),
                                                    ((rows, k), (k, m), (rows, m))):
        _draw_panel(ax, name, full, shards, axis_names)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _mark_heads(ax, panel: str, shape: tuple[int, int], placements: list[Placement],
                heads: list[str], groups: list[str] | None = None):
    """Cut the split dimension of one drawn matrix into ``len(heads)`` equal runs (attention heads:
    a head's features are contiguous) with dotted lines, and name each run along that edge;
    ``groups`` names equal runs of heads on a second line (the query heads that share a key/value
    head), split by solid lines."""
    dims = {p.dim for p in placements if p.kind == "slice"}
    if len(dims) != 1:
        raise ValueError(
            f"{panel}: heads are marked along the dimension the ranks split, found {sorted(dims)}")
    dim = dims.pop()
    rows, cols = shape
    size = shape[dim]
    groups = groups or []
    if size % len(heads):
        raise ValueError(f"{panel}: {size} features do not make {len(heads)} equal heads")
    if groups and len(heads) % len(groups):
        raise ValueError(f"{panel}: {len(heads)} heads do not make {len(groups)} equal groups")
    step = size // len(heads)
    per_group = len(heads) // len(groups) if groups else len(heads)
    for i in range(1, len(heads)):
        xs, ys = ([i * step] * 2, [0, rows]) if dim == 1 else ([0, cols], [i * step] * 2)
        solid = groups and i % per_group == 0
        ax.plot(xs, ys, color="black", linewidth=0.6, linestyle="-" if solid else (0, (1, 1.5)),
                gid=f"head:{panel}:{i}")
    axis = ax.xaxis if dim == 1 else ax.yaxis
    axis.set_ticks([step * (i + 0.5) for i in range(len(heads))], heads, fontsize=TEXT_PT)
    if groups:
        axis.set_ticks([step * per_group * (g + 0.5) for g in range(len(groups))], groups,
                       minor=True, fontsize=TEXT_PT)
    ax.tick_params(which="major", length=0, pad=1.5)
    ax.tick_params(which="minor", length=0, pad=10)


def weight_shards(per_rank: list[dict], names: list[str], *, labels: list[str] | None = None,
                  title: str = "", width: float = 8.0, height: float = 2.4,
                  heads: dict[str, list[str]] | None = None,
                  head_groups: dict[str, list[str]] | None = None):
    """The weights ``names`` of a tensor-parallel module as each rank held them.

    per_rank: ``minitp.tp.local_shards(module)`` of every rank, in rank order: {name: (this rank's
        piece, the dim it was split along or None)}. Each weight is drawn as the (in, out) matrix of
        y = x·W (the transpose of ``nn.Linear.weight``), so a column-parallel layer shows vertical
        slices and a row-parallel layer horizontal ones.
    heads: {name: a label for each head} to mark an attention weight's heads, equal runs of features
        along the dimension the ranks split (columns of W_Q, W_K, W_V; rows of W_O), each named
        along the edge.
    head_groups: {name: a label for each group of heads}, on a second line under the heads' names:
        e.g. the key/value head that each group of query heads reads.
    """
    fig = figure(width, height)
    mats = [whole([r[n][0] for r in per_rank], per_rank[0][n][1]).T for n in names]
    axes = fig.subplots(1, len(names), width_ratios=[m.shape[1] for m in mats])
    axes = [axes] if len(names) == 1 else list(axes)
    labels = labels or names
    for ax, name, label, mat in zip(axes, names, labels, mats):
        placements = _draw_panel(ax, label, mat, [r[name][0].T for r in per_rank], ("in", "out"))
        if heads and name in heads:
            _mark_heads(ax, label, tuple(mat.shape), placements, heads[name],
                        (head_groups or {}).get(name))
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


# -- the messages of a tensor-parallel layer -------------------------------------------------------
def _events(run, rank: int) -> list[Event]:
    if hasattr(run, "traces"):
        run = run.traces
    if isinstance(run, Trace):
        return run.comm()
    items = list(run)
    if items and isinstance(items[0], Trace):
        return next(t for t in items if t.rank == rank).comm()
    return [e for e in items if e.kind == "comm" and e.rank == rank]


def phase_of(event: Event) -> str:
    """'backward' for a message sent in backward (``Event.phase``, set where it was sent: f's
    all-reduce, split's all-gather, ...), else 'forward'."""
    return "backward" if event.phase == "backward" else "forward"


def _box_text(event: Event, prefix: str) -> str:
    """Cosmetic only: the label as drawn in a small box, without the ``label_prefix`` that picked it
    and without the phase the box's row already shows ("f.backward" -> "f"), where and what on two
    lines ("attention/sequence_gather.forward" -> "attention\nsequence_gather"). Nothing is read
    from the text: the row comes from ``Event.phase``, and so does the suffix left out."""
    text = event.label[len(prefix):].lstrip("/") if prefix else event.label
    where, _, what = text.rpartition("/")
    if event.phase:
        what = what.removesuffix(f".{event.phase}")
    return f"{where}\n{what}" if where else what


def message_flow(run, *, rank: int = 0, label_prefix: str = "", title: str = "",
                 width: float = 8.0):
    """One rank's messages in the order they were sent: forward on the top row, backward below.

    run: launch Results, a list of Traces, a Trace or Events. Each box: the collective (colour), its
    label (without ``label_prefix``) and the bytes of its buffer.
    """
    from matplotlib.patches import FancyBboxPatch

    events = [e for e in _events(run, rank) if e.labelled(label_prefix)]
    rows = {"forward": [e for e in events if phase_of(e) == "forward"],
            "backward": [e for e in events if phase_of(e) == "backward"]}
    slots = max(1, *(len(v) for v in rows.values()))
    fig = figure(width, 2.8)  # room for four lines of text in a box
    ax = fig.add_subplot()
    for y, (phase, evs) in enumerate(rows.items()):
        if not evs:
            ax.text(0.1, y, "no message", va="center", fontsize=TEXT_PT, color="#777777",
                    gid=f"msg:{phase}:none")
        for i, e in enumerate(evs):
            color = OP_COLORS.get(e.op, "#444444")
            ax.add_patch(FancyBboxPatch((i + 0.05, y - 0.32), 0.9, 0.64, boxstyle="round,pad=0.02",
                                        facecolor=_lighten(color, 0.35), edgecolor=color,
                                        gid=f"msg:{phase}:{i}:{e.op}"))
            op = e.op.replace("_", "-")
            ax.text(i + 0.5, y, f"{op}\n{_box_text(e, label_prefix)}\n{format_bytes(e.bytes)}",
                    ha="center", va="center", fontsize=TEXT_PT)
    ax.set_xlim(0, max(slots, 4))  # narrow boxes even for one message
    ax.set_ylim(1.5, -0.5)
    ax.set_yticks([0, 1], ["forward", "backward"])
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"rank {rank}: messages in the order sent", fontsize=9)
    return fig


__all__ = ["Placement", "locate", "whole", "matmul_blocks", "weight_shards", "message_flow",
           "phase_of"]
