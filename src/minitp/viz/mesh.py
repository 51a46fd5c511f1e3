"""Figures for 3D parallelism (chapter 06): the ranks on their mesh, which slice of a block each
rank held, and every message of a step sorted by the dimension it served.

* ``mesh_cube``: the ranks drawn as the corners of a (dp, pp, tp) box, once per dimension, each
  group of that dimension in its own colour. Drawn from the coordinates and group members the ranks
  reported, never from the formula.
* ``block_shards``: weights of the model drawn as the (in, out) matrix of y = x·W, each slice
  coloured by its tp coordinate and labelled with every global rank that held it (dp replicas hold
  the same). Where a slice sits is found from its values (``minitp.viz.tp.locate``).
* ``messages_by_dim``: one lane per rank, with a row per dimension (tp, pp, dp) and each message a
  bar in its dimension's colour, the bytes each rank sent in each dimension written at the end of
  the lane.
* ``bytes_by_dim``: per rank, the bytes sent in each dimension stacked, beside what a formula (the
  planner's, ``minitp.cost``) says.

A message's dimension is the one its process group was named with (``Event.dim``, set by
``minitp.comm`` from the group: the mesh names its groups); messages through a group nobody named
(dim "") are left out.

Every drawn piece carries a ``gid`` ("group:<dim>:<i>", "rank:<dim>:<r>", "slice:<name>:<rank>",
"msg:<rank>:<dim>:<i>", "<which>:<i>:<dim>") so that tests can find it.
"""

from __future__ import annotations

from minitp import layout
from minitp.trace import Event
from minitp.viz.format import byte_scale, format_bytes
from minitp.viz.style import (
    LEGEND_PT,
    RANK_COLORS,
    TEXT_PT,
    figure,
    label_totals,
    rank_color,
    text_on,
)
from minitp.viz.timeline import collect_events
from minitp.viz.tp import locate, whole

# ("tp", "pp", "dp"): fastest first, the order they are drawn in
AXES = tuple(reversed(layout.AXES))
# a colour per dimension; "fsdp" is what a group handed to FSDP alone (no mesh) is named
DIM_COLORS = {"tp": "#0072B2", "pp": "#E69F00", "dp": "#009E73", "fsdp": "#CC79A7",
              "dp_shard": "#56B4E9", "dp_replicate": "#D55E00"}  # HSDP: data parallel in two


def dims_present(dims) -> list[str]:
    """The named dimensions among ``dims``, in drawing order: the mesh's fastest first, then any
    other ("fsdp", ...) by name; "" (a group nobody named) is left out."""
    named = {d for d in dims if d}
    return [d for d in AXES if d in named] + sorted(named - set(AXES))


def _dim_color(dim: str) -> str:
    return DIM_COLORS.get(dim, "#999999")


# -- the mesh as a box -----------------------------------------------------------------------------
def _position(coords, sizes) -> tuple[float, float]:
    """Oblique projection: tp to the right, pp upwards, dp into the page (up and to the right)."""
    d, p, t = coords
    return t * 1.0 + d * 0.6, p * 1.0 + d * 0.45


def mesh_cube(per_rank: list[dict], *, title: str = "", width: float = 9.0):
    """The ranks as the corners of the mesh, one panel per dimension, coloured by group.

    per_rank: one dict per rank with "rank", "coords" ([dp, pp, tp] of ``Mesh.coords``) and
        "groups" ({"tp": [...], "pp": [...], "dp": [...]}: ``Mesh.group_ranks``).
    Raises ``ValueError`` when the ranks disagree about a group (a member that does not list it).
    """
    per_rank = sorted(per_rank, key=lambda r: r["rank"])
    coords = {r["rank"]: tuple(r["coords"]) for r in per_rank}
    sizes = tuple(max(c[i] for c in coords.values()) + 1 for i in range(3))
    fig = figure(width, 3.2)
    axes = fig.subplots(1, 3)
    names = {"tp": "tensor parallel", "pp": "pipeline", "dp": "data parallel"}
    for ax, dim in zip(axes, AXES):
        groups: list[list[int]] = []
        for r in per_rank:
            members = list(r["groups"][dim])
            if members not in groups:
                groups.append(members)
        for members in groups:
            for m in members:
                if m in coords and list(next(q for q in per_rank
                                             if q["rank"] == m)["groups"][dim]) != members:
                    raise ValueError(
                        f"rank {m} is listed in {dim} group {members} but reports another one")
        # the box's edges: ranks one step apart along one coordinate
        for a, ca in coords.items():
            for b, cb in coords.items():
                if a < b and sum(abs(x - y) for x, y in zip(ca, cb)) == 1:
                    (xa, ya), (xb, yb) = _position(ca, sizes), _position(cb, sizes)
                    ax.plot([xa, xb], [ya, yb], color="#CCCCCC", linewidth=0.8, zorder=1)
        for i, members in enumerate(groups):
            color = RANK_COLORS[i % len(RANK_COLORS)]
            xs, ys = zip(*(_position(coords[m], sizes) for m in members))
            ax.plot(xs, ys, color=color, linewidth=4, alpha=0.8, solid_capstyle="round", zorder=2,
                    gid=f"group:{dim}:{i}")
            for m in members:
                x, y = _position(coords[m], sizes)
                ax.scatter([x], [y], s=260, color=color, edgecolor="black", linewidth=0.6, zorder=3,
                           gid=f"rank:{dim}:{m}")
                ax.text(x, y, str(m), ha="center", va="center", fontsize=TEXT_PT,
                        color=text_on(color), weight="bold", zorder=4)
        listed = "  ".join("{" + ",".join(map(str, g)) + "}" for g in groups)
        ax.set_title(f"{dim} groups ({names[dim]})\n{listed}", fontsize=8.5)
        ax.set_aspect("equal")
        ax.margins(0.18)
        ax.set_xticks([])
        ax.set_yticks([])
        for side in ax.spines.values():
            side.set_visible(False)
    fig.supxlabel("tp → right     pp ↑ up     dp ↗ into the page", fontsize=TEXT_PT,
                  color="#555555")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


# -- which rank holds which slice ------------------------------------------------------------------
def block_shards(per_rank: list[dict], names: list[str], *, labels: list[str] | None = None,
                 title: str = "", width: float = 9.0):
    """Weights drawn as the (in, out) matrix W = weight.T, each rank's slice where its values sit.

    per_rank: one dict per rank with "rank", "coords" ([dp, pp, tp]) and "shards"
        ({name: (tensor, tp split dim or None)}: ``Parallel3D.local_shards``).
    names: the parameters to draw (2-D weights). Each panel says which stage held it; each slice is
    coloured by the tp coordinate of its holders and lists them; a slice whose values are found
    nowhere in the whole weight is outlined in red.
    """
    labels = labels or names
    fig = figure(width, 2.9)
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name, label in zip(axes, names, labels):
        holders = sorted((r for r in per_rank if name in r["shards"]),
                         key=lambda r: (r["coords"][2], r["rank"]))
        if not holders:
            raise ValueError(f"no rank holds {name!r}")
        dim = holders[0]["shards"][name][1]
        first = min(r["coords"][0] for r in holders)
        # one replica, tp order
        pieces = [r["shards"][name][0] for r in holders if r["coords"][0] == first]
        W = whole(pieces, dim).detach().T  # (in, out), as in y = x·W
        rows, cols = W.shape
        placements = locate(W, [r["shards"][name][0].detach().T for r in holders])
        slots: dict[tuple, list[int]] = {}
        for r, place in zip(holders, placements):
            key = (place.kind, place.dim, place.start, place.stop, r["coords"][2])
            slots.setdefault(key, []).append(r["rank"])
        from matplotlib.patches import Rectangle

        for (kind, d, start, stop, tp_rank), ranks in slots.items():
            if kind == "slice":
                x, y, w, h = ((start, 0, stop - start, rows) if d == 1
                              else (0, start, cols, stop - start))
            else:
                x, y, w, h = 0, 0, cols, rows
            bad = kind not in ("slice", "replicated")
            for rank in ranks:
                ax.add_patch(Rectangle((x, y), w, h, facecolor="none" if bad
                                       else rank_color(tp_rank),
                                       alpha=1.0 if bad else 0.75, edgecolor="#D55E00" if bad
                                       else "white",
                                       linestyle="--" if bad else "-", linewidth=1.5 if bad
                                       else 1.0,
                                       gid=f"slice:{label}:{rank}" + (":unknown" if bad else "")))
            text = ("?" if bad else "") + "ranks\n" + ", ".join(map(str, ranks))
            if kind == "replicated":
                text = "every tp rank:\n" + ", ".join(map(str, ranks))
            ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=TEXT_PT,
                    color="black" if bad else text_on(rank_color(tp_rank)), weight="bold")
        stage = holders[0]["coords"][1]
        how = {None: "replicated over tp", 0: "columns split over tp", 1: "rows split over tp"}[dim]
        ax.set_title(f"{label}  ({rows}×{cols})\nstage {stage}, {how}", fontsize=TEXT_PT)
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_xticks([0, cols])
        ax.set_yticks([0, rows])
        ax.tick_params(labelsize=TEXT_PT)
        ax.set_aspect("auto")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


# -- the messages of a step, by dimension ----------------------------------------------------------
def messages_by_dim(run, *, ranks=None, title: str = "", width: float = 9.0,
                    lane_height: float = 0.55):
    """One lane per rank, a row per dimension, each message a bar coloured by its dimension; at the
    end of each lane the bytes (ring model) the rank sent in each dimension.

    run: what ``minitp.launch`` returned (its traces), a list of Traces or of Events. A row for each
        dimension any drawn rank sent through (``Event.dim``).
    """
    events = [e for e in collect_events(run) if e.kind == "comm" and e.dim]
    if ranks is not None:
        events = [e for e in events if e.rank in set(ranks)]
    if not events:
        raise ValueError("no message through a named group (a mesh's or a strategy's) to draw; was "
                         "the run traced?")
    dims = dims_present(e.dim for e in events)
    pitch = 0.81 / max(len(dims), 3)  # rows inside a lane: 0.27 apart for tp, pp, dp
    lanes = sorted({e.rank for e in events})
    t0, t1 = min(e.start for e in events), max(e.end for e in events)
    span_ms = max((t1 - t0) * 1e3, 1e-6)
    fig = figure(width, 0.7 + lane_height * len(lanes))
    ax = fig.add_subplot()
    counts: dict[tuple[int, str], int] = {}
    for i, rank in enumerate(lanes):
        base = len(lanes) - 1 - i  # rank 0 on top
        mine: list[Event] = [e for e in events if e.rank == rank]
        for row, dim in enumerate(dims):
            y = base + 0.28 - row * pitch
            for e in (e for e in mine if e.dim == dim):
                k = counts.get((rank, dim), 0)
                counts[(rank, dim)] = k + 1
                ax.broken_barh([((e.start - t0) * 1e3, max(e.duration * 1e3, span_ms * 3e-3))],
                               (y - 0.4 * pitch, 0.8 * pitch), facecolors=_dim_color(dim),
                               edgecolor="black", linewidth=0.2, gid=f"msg:{rank}:{dim}:{k}")
        for row, dim in enumerate(dims):  # the bytes sent in each dimension, at the end of its row
            sent = sum(e.sent_bytes for e in mine if e.dim == dim)
            ax.text(span_ms * 1.02, base + 0.28 - row * pitch, f"{dim} {format_bytes(sent)}",
                    ha="left", va="center", fontsize=TEXT_PT, gid=f"sent:{rank}:{dim}")
    ax.set_yticks(range(len(lanes)), [f"rank {r}" for r in reversed(lanes)])
    ax.set_ylim(-0.55, len(lanes) - 0.45)
    ax.set_xlim(0, span_ms * 1.22)
    ax.set_xlabel("time (ms)")
    ax.spines[["top", "right"]].set_visible(False)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=_dim_color(d), label=d) for d in dims], fontsize=LEGEND_PT,
              ncol=len(dims), loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False)
    if title:
        ax.set_title(title, fontsize=10, loc="right")
    return fig


def bytes_by_dim(traced: list[dict], expected: list[dict] | None = None, *,
                 names: list[str] | None = None, title: str = "", width: float = 7.0):
    """Per rank, the bytes sent in each dimension stacked; ``expected`` (same form, e.g. from
    ``minitp.cost.threed_step_bytes``) hatched beside each bar.

    traced: one {dimension: bytes} per rank, as ``minitp.trace.sent_bytes_by_dim`` gives them.
    """
    traced = list(traced)
    if expected is not None and len(expected) != len(traced):
        raise ValueError(f"{len(traced)} traced entries but {len(expected)} expected ones")
    names = names or [f"rank {i}" for i in range(len(traced))]
    dims = dims_present(d for b in traced + list(expected or []) for d in b)
    totals = [sum(b.get(d, 0) for d in dims) for b in traced + list(expected or [])]
    unit, scale = byte_scale(max(totals))
    fig = figure(width, 3.0)
    ax = fig.add_subplot()
    pairs = [("traced", traced, 0.0)] if expected is None else [("traced", traced, -0.2),
                                                                ("expected", expected, 0.2)]
    bar_w = 0.7 if expected is None else 0.38
    tops: dict[str, list[float]] = {"traced": [], "expected": []}
    for which, entries, shift in pairs:
        for i, b in enumerate(entries):
            bottom = 0.0
            for d in dims:
                value = b.get(d, 0) / scale
                ax.bar(i + shift, value, bar_w, bottom=bottom, color=_dim_color(d),
                       gid=f"{which}:{i}:{d}", alpha=1.0 if which == "traced" else 0.45, hatch=None
                       if which == "traced" else "//",
                       edgecolor="white" if which == "traced" else _dim_color(d), linewidth=0.5)
                bottom += value
            tops[which].append(bottom)
    label_totals(ax, tops["traced"], tops["expected"])
    ax.set_xticks(range(len(traced)), names, fontsize=TEXT_PT)
    ax.set_ylabel(f"sent ({unit})")
    ax.set_ylim(0, max(totals) / scale * 1.15)
    ax.spines[["top", "right"]].set_visible(False)
    from matplotlib.patches import Patch

    handles = [Patch(color=_dim_color(d), label=d) for d in dims]
    if expected is not None:
        first = _dim_color(dims[0])  # swatches in a colour the bars have, solid and hatched
        handles += [Patch(facecolor=first, edgecolor="white", label="traced (solid)"),
                    Patch(facecolor=first, alpha=0.45, edgecolor=first, hatch="//",
                          label="formula (hatched)")]
    ax.legend(handles=handles, fontsize=LEGEND_PT, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


__all__ = ["AXES", "DIM_COLORS", "dims_present", "mesh_cube", "block_shards", "messages_by_dim",
           "bytes_by_dim"]
