"""Pipeline parallel, drawn from what the stages recorded while they ran.

* ``stage_map``: which pieces of the model each rank held (embedding, blocks, final norm and output
  layer), one box per piece, as wide as its parameter count, coloured by the rank that held it.
* ``gantt``: one lane per rank, one bar per forward (F) and backward (B) of each micro-batch, at the
  times the rank recorded; what is left white is the bubble.
* ``bubble_curve``: the idle share of the step against the number of micro-batches m, measured
  next to the formula (p-1)/(m+p-1).
* ``in_flight``: how many micro-batches' activations each rank held over the step, per schedule.

The timelines they take come from ``minitp.pp`` (``StepRecord.timeline``: (Action, start, end) per
action, ``pp.simulate`` gives the same shape) or from a ``minitp.runs.run_pp`` report
(``last_step_timeline``: [kind, microbatch, start, end]). Every drawn piece has a ``gid``
("action:<rank>:F3", "piece:<rank>:layers.2", ...) so tests can find it.
"""

from __future__ import annotations

from minitp.viz import style
from minitp.viz.style import LEGEND_PT, TEXT_PT

# forward light blue, backward orange, weight green
KIND_COLORS = {"F": "#56B4E9", "B": "#E69F00", "W": "#009E73"}
KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}
CHUNK_HATCHES = ("", "////", "....", "xxxx")  # interleaved: chunk 0 plain, chunk 1 hatched, ...


def actions_of(timeline) -> list[tuple[str, int, float, float]]:
    """One rank's timeline as (kind, microbatch, start, end): from (Action, start, end) tuples or
    from a report's [kind, microbatch, start, end] lists."""
    out = []
    for item in timeline:
        if len(item) == 3:
            action, start, end = item
            out.append((action.kind, action.microbatch, float(start), float(end)))
        else:  # [kind, microbatch, start, end] or [kind, microbatch, start, end, chunk]
            kind, mb, start, end = item[:4]
            out.append((kind, int(mb), float(start), float(end)))
    return out


def chunks_of(timeline) -> list[int]:
    """The chunk of each action of one rank's timeline (0 where none is recorded)."""
    return [(item[0].chunk if len(item) == 3 else (int(item[4]) if len(item) > 4 else 0))
            for item in timeline]


def _raw(run) -> list:
    return run["last_step_timeline"] if hasattr(run, "keys") else run


def _timelines(run) -> list[list[tuple[str, int, float, float]]]:
    if hasattr(run, "keys"):  # a run_pp Report, or its JSON as a dict
        run = run["last_step_timeline"]
    return [actions_of(t) for t in run]


# -- what each rank holds -------------------------------------------------------------------------
def _piece(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "layers":
        return f"layers.{parts[1]}"
    return {"tok_embeddings": "embedding", "norm": "norm + output",
            "output": "norm + output"}.get(parts[0], parts[0])


def stage_map(held: list[dict[str, int]], *, title: str = "", width: float = 8.0):
    """Draw the model as a row of pieces in the order data flows through it, each as wide as its
    parameter count and coloured by the rank that held it.

    held: per rank, {parameter name: number of elements} as the rank's stage reported it (the
        plain model's names: ``layers.2.attention.wq.weight``).
    """
    pieces: dict[str, tuple[int, int]] = {}  # piece -> (rank, parameters), in the order first seen
    for rank, names in enumerate(held):
        for name, numel in names.items():
            piece = _piece(name)
            owner, count = pieces.get(piece, (rank, 0))
            if owner != rank:
                raise ValueError(
                    f"{piece} is held by rank {owner} and rank {rank}: a stage's pieces "
                    f"should not overlap")
            pieces[piece] = (rank, count + numel)

    def order(piece: str) -> float:
        if piece == "embedding":
            return -1
        if piece.startswith("layers."):
            return int(piece.split(".")[1])
        return 1e9

    ordered = sorted(pieces, key=order)
    total = sum(c for _, c in pieces.values())
    fig = style.figure(width, 2.0)
    ax = fig.add_subplot()
    points = (width - 0.3) * 72  # the axes' width in points, roughly
    x = 0.0
    for piece in ordered:
        rank, count = pieces[piece]
        w = count / total
        ax.broken_barh([(x, w)], (0, 1), facecolors=style.rank_color(rank), edgecolor="white",
                       linewidth=1.5, gid=f"piece:{rank}:{piece}")
        label = piece.replace("layers.", "block ")
        ink = style.text_on(style.rank_color(rank))
        if style.text_fits(w * points, label, 9.0):  # room inside: name and parameter count
            ax.text(x + w / 2, 0.62, label, ha="center", va="center", fontsize=9.0, color=ink)
            ax.text(x + w / 2, 0.32, f"{count:,}", ha="center", va="center", fontsize=TEXT_PT,
                    color=ink)
        # a thin piece (the embedding, the output layer of a small vocabulary): named above it
        else:
            ax.annotate(f"{label} ({count:,})", (x + w / 2, 1.0), xytext=(x + w / 2, 1.22),
                        fontsize=TEXT_PT, ha="left" if x < 0.5 else "right", va="center",
                        arrowprops={"arrowstyle": "-", "color": "#666666", "linewidth": 0.6})
        x += w
    runs: list[tuple[int, float, float]] = []  # (rank, start, width): consecutive pieces of a rank
    x = 0.0
    for piece in ordered:
        rank, count = pieces[piece]
        if runs and runs[-1][0] == rank:
            runs[-1] = (rank, runs[-1][1], runs[-1][2] + count / total)
        else:
            runs.append((rank, x, count / total))
        x += count / total
    named: set[int] = set()
    for rank, start, span in runs:  # a line under each run (a V's first rank has two), named once
        ax.plot([start + 0.004, start + span - 0.004], [-0.12, -0.12], color=style.rank_color(rank),
                linewidth=3, solid_capstyle="butt", gid=f"rank:{rank}")
        if rank not in named:
            named.add(rank)
            params = sum(c for r, c in pieces.values() if r == rank)
            ax.text(start + span / 2, -0.33, f"rank {rank} · {params:,} params", ha="center",
                    va="center", fontsize=TEXT_PT)
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.5, 1.35)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10)
    return fig


# -- the Gantt chart -------------------------------------------------------------------------------
def gantt(run, *, title: str = "", width: float = 8.0, lane_height: float = 0.55, unit: str = "ms",
          text: bool = True, messages: bool = False, ax=None, legend: bool = True):
    """One lane per rank (rank 0 on top), one bar per action at its recorded start and end.

    run: a ``run_pp`` report, or a list (one per rank) of timelines: (Action, start, end) tuples
        as ``Pipeline.forward_backward`` and ``pp.simulate`` return them, or [kind, mb, start, end].
    unit: "ms" for recorded seconds, "slots" for ``pp.simulate`` times (drawn as they are).
    messages: draw each message as an arrow from the action that produced it (the end of F3 on
        rank s, or of B3 on rank s) to the action that consumed it (F3 on rank s+1, B3 on rank s-1).
    ax: draw into these axes (``gantt_grid``) instead of a new figure; ``legend`` beside it or not.
    Times start at 0 at the first action on any rank.
    """
    lanes = _timelines(run)
    if not any(lanes):
        raise ValueError("no actions to draw: every timeline is empty")
    chunks = [chunks_of(t) for t in _raw(run)]
    interleaved = any(any(c) for c in chunks)
    t0 = min(a[2] for lane in lanes for a in lane)
    scale = 1e3 if unit == "ms" else 1.0
    t1 = max(a[3] for lane in lanes for a in lane)
    span = (t1 - t0) * scale
    p = len(lanes)
    if ax is None:
        fig = style.figure(width, 0.55 + lane_height * p)
        ax = fig.add_subplot()
    else:
        fig = ax.figure
        width = ax.get_position().width * fig.get_figwidth() + 1.3
    points_per_unit = (width - 1.3) * 72 / max(span, 1e-9)
    names: dict[str, list] = {}  # kind -> where its names go: every action of a kind named, or none
    for rank, lane in enumerate(lanes):
        y = p - 1 - rank
        for (kind, mb, s, e), chunk in zip(lane, chunks[rank]):
            x, w = (s - t0) * scale, (e - s) * scale
            name = f"{kind}{mb}" + (f"c{chunk}" if chunk else "")
            ax.broken_barh([(x, w)], (y - 0.38, 0.76), facecolors=KIND_COLORS[kind],
                           edgecolor="black", linewidth=0.4, hatch=CHUNK_HATCHES[chunk % len(
                               CHUNK_HATCHES)], gid=f"action:{rank}:{name}")
            names.setdefault(kind, []).append((x + w / 2, y, w * points_per_unit, name))
    for kind, spots in names.items():
        if text and all(style.text_fits(width_pt, name) for _, _, width_pt, name in spots):
            for x, y, _, name in spots:
                ax.text(x, y, name, ha="center", va="center", fontsize=TEXT_PT,
                        color=style.text_on(KIND_COLORS[kind]), clip_on=True)
    if messages and not interleaved:
        at = {(rank, kind, mb): (s, e) for rank, lane in enumerate(lanes)
              for kind, mb, s, e in lane}
        for (rank, kind, mb), (_, end) in at.items():
            to = rank + 1 if kind == "F" else rank - 1
            if (to, kind, mb) not in at:
                # the last stage's forward feeds its own backward; the first sends no gradient
                continue
            start = at[to, kind, mb][0]
            y0, y1 = p - 1 - rank, p - 1 - to
            ax.annotate("", xy=((start - t0) * scale, y1 + 0.38 * (1 if kind == "F" else -1)),
                        xytext=((end - t0) * scale, y0 - 0.38 * (1 if kind == "F" else -1)),
                        arrowprops={"arrowstyle": "->", "color": "#0072B2" if kind == "F"
                                    else "#D55E00",
                                    "linewidth": 0.7, "shrinkA": 0, "shrinkB": 0},
                        gid=f"message:{rank}->{to}:{kind}{mb}")
    ax.set_yticks(range(p), [f"rank {r}" for r in reversed(range(p))])
    ax.set_ylim(-0.6, p - 0.4)
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("time (ms)" if unit == "ms" else "time (slots of one forward)")
    ax.spines[["top", "right"]].set_visible(False)
    if legend:
        ax.legend(handles=_legend(lanes, chunks, messages), fontsize=LEGEND_PT, loc="upper left",
                  bbox_to_anchor=(1.0, 1.0),
                  frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def _legend(lanes, chunks, messages: bool) -> list:
    from matplotlib.patches import Patch

    interleaved = any(any(c) for c in chunks)
    kinds = {a[0] for lane in lanes for a in lane}
    handles = [Patch(facecolor=c, edgecolor="black", linewidth=0.4, label=KIND_NAMES[k])
               for k, c in KIND_COLORS.items() if k in kinds]
    if interleaved:
        handles += [Patch(facecolor="white", edgecolor="black", hatch=CHUNK_HATCHES[c],
                          linewidth=0.4, label=f"chunk {c}")
                          for c in range(1 + max(max(c, default=0) for c in chunks))]
    handles.append(Patch(facecolor="white", edgecolor="#999999", linewidth=0.4,
                         label="idle (bubble)"))
    if messages and not interleaved:  # gantt draws no arrows for interleaved runs
        from matplotlib.lines import Line2D

        handles += [Line2D([], [], color="#0072B2", linewidth=0.8, label="activation →"),
                    Line2D([], [], color="#D55E00", linewidth=0.8, label="← gradient")]
    return handles


def gantt_grid(runs: dict, formulas: dict[str, float] | None = None, *, title: str = "",
               unit: str = "ms", width: float = 10.0, columns: int = 2):
    """Several schedules' Gantt charts side by side on one time axis, one panel per schedule, each
    titled with its measured idle share (mean over ranks) and, if given, its formula's.

    runs: {schedule name: per-rank timelines (or a ``run_pp`` report)}; formulas: {name: bubble}.
    """
    from minitp.pp_schedules import bubble_fraction

    names = list(runs)
    rows = -(-len(names) // columns)
    lanes = max(len(_timelines(r)) for r in runs.values())
    fig = style.figure(width, rows * (0.9 + 0.32 * lanes) + 0.6)
    axes = fig.subplots(rows, columns, squeeze=False)
    everything, chunks, right = [], [], 0.0
    for k, (ax, name) in enumerate(zip(axes.flat, names)):
        run = runs[name]
        share = sum(bubble_fraction(_as_triples(run))) / len(_timelines(run))
        head = f"{name}: idle {share:.3f}"
        if formulas and name in formulas:
            head += f", formula {formulas[name]:.3f}"
        gantt(run, unit=unit, text=False, ax=ax, legend=False)
        ax.set_title(head, fontsize=8.5)
        right = max(right, ax.get_xlim()[1])
        if k < len(names) - columns:
            ax.set_xlabel("")
        everything += _timelines(run)
        chunks += [chunks_of(t) for t in _raw(run)]
    for ax in axes.flat:
        ax.set_xlim(0, right)  # one time axis for all: the longest step
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.legend(handles=_legend(everything, chunks, False), fontsize=LEGEND_PT,
               loc="outside lower center", ncol=6, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _as_triples(run) -> list[list[tuple]]:
    """(kind, start, end) triples per rank, the shape ``bubble_fraction`` sums over."""
    return [[(kind, s, e) for kind, _, s, e in lane] for lane in _timelines(run)]


# -- the bubble as m grows -------------------------------------------------------------------------
def bubble_curve(microbatches: list[int], measured: list[float], num_stages: int, *,
                 title: str = "", width: float = 6.0):
    """The measured idle share of the step for each m, next to (p-1)/(m+p-1)."""
    if len(microbatches) != len(measured):
        raise ValueError(f"{len(microbatches)} values of m but {len(measured)} measurements")
    p = num_stages
    fig = style.figure(width, 2.8)
    ax = fig.add_subplot()
    dense = [microbatches[0] + k * (microbatches[-1] - microbatches[0]) / 200 for k in range(201)]
    ax.plot(dense, [(p - 1) / (m + p - 1) for m in dense], color="black", linestyle="--",
            linewidth=1.2, label=f"formula (p-1)/(m+p-1), p={p}", gid="formula")
    ax.plot(microbatches, measured, marker="o", color=style.rank_color(0),
            label="measured (mean over ranks)", gid="measured")
    ax.set_xscale("log", base=2)
    ax.set_xticks(microbatches, [str(m) for m in microbatches])
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("idle share of the step")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=LEGEND_PT, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


# -- activations held ------------------------------------------------------------------------------
def in_flight_steps(timeline) -> list[tuple[float, int]]:
    """(time, micro-batches held) after each action of one rank: +1 when a forward starts (its
    activations are being kept), -1 when a backward ends (they are freed), or its W when the
    schedule splits the weight gradient off (zero-bubble keeps inputs and gradients until then)."""
    actions = actions_of(timeline)
    frees = "W" if any(a[0] == "W" for a in actions) else "B"
    points = []
    for kind, _, s, e in actions:
        if kind == "F":
            points.append((s, 1))
        elif kind == frees:
            points.append((e, -1))
    held, out = 0, []
    for t, delta in sorted(points, key=lambda x: (x[0], x[1])):
        held += delta
        out.append((t, held))
    return out


def in_flight(runs: dict[str, list], *, title: str = "", width: float = 8.0):
    """Micro-batches held over the step, one panel per schedule, one line per rank.

    runs: {schedule name: per-rank timelines} (or ``run_pp`` reports).
    """
    fig = style.figure(width, 2.6)
    axes = fig.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    top = 1
    for ax, (name, run) in zip(axes, runs.items()):
        lanes = _timelines(run)
        t0 = min(a[2] for lane in lanes for a in lane)
        t1 = max(a[3] for lane in lanes for a in lane)
        for rank, lane in enumerate(lanes):
            steps = in_flight_steps([(k, mb, s, e) for k, mb, s, e in lane])
            xs = [0.0] + [(t - t0) * 1e3 for t, _ in steps] + [(t1 - t0) * 1e3]
            ys = [0] + [h for _, h in steps] + [0]
            top = max(top, max(ys))
            ax.step(xs, ys, where="post", color=style.rank_color(rank), linewidth=1.4,
                    label=f"rank {rank} (peak {max(ys)})", gid=f"held:{name}:{rank}")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("time (ms)")
        ax.legend(fontsize=LEGEND_PT, frameon=False, loc="upper right")
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].set_ylabel("micro-batches held")
    axes[0].set_ylim(0, top + 0.8)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


__all__ = ["stage_map", "gantt", "gantt_grid", "bubble_curve", "in_flight", "in_flight_steps",
           "actions_of", "chunks_of", "KIND_COLORS"]
