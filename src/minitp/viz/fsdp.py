"""Figures for chapter 02, fully sharded data parallel: which rank holds which slice of each unit,
the gather -> compute -> free cycle of every unit through a step, and the bytes each stage sends.

Every function takes what a run returned (each rank's layout of its units, traced events) and gives
back a Figure; none runs anything. Drawn pieces carry a ``gid`` ("shard:<unit>:<rank>",
"held:<unit>:<phase>", "sent:<config>:<op>", ...) so that tests can find them.
"""

from __future__ import annotations

from collections.abc import Iterable

from minitp.trace import Event, totals
from minitp.viz.format import format_bytes
from minitp.viz.style import LEGEND_PT, OP_COLORS, TEXT_PT, figure, rank_color, text_fits, text_on
from minitp.viz.timeline import collect_events

HELD_COLOR = "#CFE3F3"  # the full parameters of a unit exist on this rank
PARAM_SHADES = ("#E6E6E6", "#C8C8C8")
PAD_COLOR = "#D55E00"


def _short(name: str) -> str:
    """'layers.0.attention.wq.weight' -> 'wq'; 'tok_embeddings.weight' -> 'tok_embeddings'."""
    parts = name.split(".")
    return parts[-2] if len(parts) > 1 else parts[0]


# -- who holds what --------------------------------------------------------------------------------
def shard_map(layouts: list[list[dict]], *, title: str = "", width: float = 8.0):
    """One row per unit: its flat buffer (elements along x), the parameters laid in it (grey strip
    on top), the slice each rank holds (coloured by rank) and the padding (hatched, in orange).

    layouts: per rank, in rank order, a list of units, each
        {"unit": name, "padded": P, "shard": [start, end), "params": [(name, offset, numel), ...]},
        as the ranks reported them about themselves.
    The padding is at most n - 1 elements: it is drawn at least 0.6 % of the axis wide, and its
    size is written next to it.
    """
    if not layouts or not layouts[0]:
        raise ValueError("no layouts to draw: pass each rank's list of units")
    n = len(layouts)
    units = layouts[0]
    longest = max(u["padded"] for u in units)
    fig = figure(width, 0.55 * len(units) + 1.0)
    ax = fig.add_subplot()
    for row, unit in enumerate(units):
        y = len(units) - 1 - row  # the first unit on top
        name = unit["unit"]
        numel = sum(numel for _, _, numel in unit["params"])
        for i, (param, offset, size) in enumerate(unit["params"]):
            ax.barh(y + 0.35, size, 0.3, left=offset, color=PARAM_SHADES[i % 2], edgecolor="white",
                    linewidth=0.3, gid=f"param:{name}:{param}")  # tall enough for a line of text
            label = _short(param)
            if text_fits(size / longest * (width - 2.0) * 72, label):
                ax.text(offset + size / 2, y + 0.35, label, ha="center", va="center",
                        fontsize=TEXT_PT)
        for rank in range(n):
            start, end = next(u["shard"] for u in layouts[rank] if u["unit"] == name)
            ax.barh(y - 0.08, end - start, 0.5, left=start, color=rank_color(rank), alpha=0.85,
                    edgecolor="white", linewidth=0.8, gid=f"shard:{name}:{rank}")
            if text_fits((end - start) / longest * (width - 2.0) * 72, f"rank {rank}"):
                ax.text((start + end) / 2, y - 0.08, f"rank {rank}", ha="center", va="center",
                        fontsize=TEXT_PT, color=text_on(rank_color(rank)))
        pad = unit["padded"] - numel
        if pad:
            shown = max(pad, 0.006 * longest)
            ax.barh(y - 0.08, shown, 0.5, left=numel, color="none", edgecolor=PAD_COLOR,
                    hatch="////", linewidth=0.8, gid=f"pad:{name}")
            ax.text(numel + shown, y - 0.08, f" +{pad} padding", ha="left", va="center",
                    fontsize=TEXT_PT, color=PAD_COLOR)
    ax.set_yticks(range(len(units)), [f"{u['unit']}\n{u['padded']:,}" for u in reversed(units)],
                  fontsize=TEXT_PT)
    ax.set_xlim(0, longest * 1.12)
    ax.set_ylim(-0.55, len(units) - 0.4)
    ax.set_xlabel("position in the unit's flat buffer (elements)")
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title(title or f"each unit's flat buffer, cut into {n} equal shards", fontsize=10)
    return fig


# -- the gather -> compute -> free cycle -----------------------------------------------------------
def unit_cycle(run, *, rank: int = 0, label_prefix: str = "", title: str = "", width: float = 8.0,
               reshard_after_forward: bool = True):
    """For one rank, one row per unit: when its full parameters were gathered (green), used (grey:
    the compute spans the run recorded), its gradient reduce-scattered (orange), and, in pale blue
    behind them, how long the full parameters existed on the rank, from the start of each gather
    until they were freed.

    run: launch Results, Traces or Events of a ZeRO-3 step (``minitp.fsdp``'s messages, which carry
    their unit and phase, ``Event.unit`` and ``Event.phase``; only those whose label starts with
    ``label_prefix`` when it is given). Compute spans are events of kind "compute" with their unit
    and phase set (``trace.tagged(unit=..., phase=...)`` around them, or the fields of the Event).
    When a unit is freed comes from the library's rule: after its forward when the run resharded
    after forward (``reshard_after_forward``, as the run was built; the root stays), and in backward
    as soon as its reduce-scatter has been started.
    """
    events = [e for e in collect_events(run) if e.rank == rank and e.labelled(label_prefix)
              and e.unit and e.kind in ("comm", "compute")]
    # the step itself: forward and backward
    events = [e for e in events if e.phase not in ("step", "state_dict")]
    if not events:
        raise ValueError(
            f"no fsdp events of rank {rank} under {label_prefix!r}; was the run traced?")
    t0 = min(e.start for e in events)
    units: list[str] = []
    for e in sorted(events, key=lambda e: e.start):
        if e.unit not in units:
            units.append(e.unit)
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    fig = figure(width, 0.45 * len(units) + 1.1)
    ax = fig.add_subplot()
    for row, unit in enumerate(units):
        y = len(units) - 1 - row
        mine = sorted((e for e in events if e.unit == unit), key=lambda e: e.start)
        gathers = [e for e in mine if e.op == "all_gather"]
        computes = [e for e in mine if e.kind == "compute"]
        reduces = [e for e in mine if e.op == "reduce_scatter"]
        for g in gathers:
            phase = g.phase
            ends = [c.end for c in computes if c.op == "forward" and c.start >= g.start]
            if phase == "forward" and unit != "root" and ends and reshard_after_forward:
                freed = min(ends)
            else:
                later = [r.start for r in reduces if r.start >= g.start]
                freed = min(later) if later else max(e.end for e in mine)
            ax.barh(y, ms(freed) - ms(g.start), 0.8, left=ms(g.start), color=HELD_COLOR,
                    gid=f"held:{unit}:{phase}")
            ax.plot([ms(freed)], [y + 0.3], marker="v", color="#444444", markersize=4,
                    gid=f"free:{unit}:{phase}")
        for e in mine:
            if e.kind == "compute":
                color, h, gid = OP_COLORS["compute"], 0.35, f"compute:{unit}:{e.op}"
            else:
                color, h, gid = OP_COLORS.get(e.op, "#444444"), 0.5, f"{e.op}:{unit}:{e.phase}"
            ax.barh(y, max(ms(e.end) - ms(e.start), 0.05), h, left=ms(e.start), color=color,
                    edgecolor="black", linewidth=0.3, gid=gid)
    ax.set_yticks(range(len(units)), list(reversed(units)))
    ax.set_xlabel("time (ms)")
    ax.set_ylim(-0.6, len(units) - 0.3)
    ax.spines[["top", "right"]].set_visible(False)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=OP_COLORS["all_gather"], label="all-gather"),
               Patch(color=OP_COLORS["compute"], label="compute"),
               Patch(color=OP_COLORS["reduce_scatter"], label="reduce-scatter"),
               Patch(color=HELD_COLOR, label="full parameters held"),
               Line2D([], [], marker="v", color="#444444", linestyle="none", markersize=4,
                      label="freed")]
    ax.legend(handles=handles, fontsize=LEGEND_PT, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              frameon=False)
    ax.set_title(title or f"rank {rank}: gather, compute, free, unit by unit", fontsize=10)
    return fig


# -- bytes per stage -------------------------------------------------------------------------------
def sent_by_op(run, label_prefix: str, rank: int = 0) -> dict[str, float]:
    """Bytes ``rank`` sent (ring model) per collective, over the events whose label starts with
    ``label_prefix`` (e.g. a ``trace.scope`` name)."""
    events = [e for e in collect_events(run) if e.rank == rank and e.labelled(label_prefix)]
    return {op: row["sent_bytes"] for (op,), row in sorted(totals(events).items())}


def bytes_by_stage(sent: dict[str, dict[str, float]], expected: dict[str, float] | None = None, *,
                   baseline: str | None = None, title: str = "", width: float = 7.0):
    """One horizontal bar per configuration: the bytes a rank sent, stacked by collective (traced),
    a black tick at the formula's total, and the ratio to ``baseline`` (the first by default).

    sent: {configuration: {op: bytes}} (``sent_by_op`` of each); expected: {configuration: bytes}.
    """
    if not sent:
        raise ValueError("nothing to draw: sent is empty")
    names = list(sent)
    baseline = baseline or names[0]
    base = sum(sent[baseline].values())
    largest = max([sum(v.values()) for v in sent.values()] + list((expected or {}).values()))
    unit, scale = next(((u, s) for u, s in (("MB", 1e6), ("KB", 1e3)) if largest >= s),
                       ("bytes", 1.0))
    fig = figure(width, 0.42 * len(names) + 1.0)
    ax = fig.add_subplot()
    seen: dict[str, str] = {}
    for row, name in enumerate(names):
        y = len(names) - 1 - row
        left = 0.0
        for op, value in sent[name].items():
            color = OP_COLORS.get(op, "#444444")
            seen.setdefault(op, color)
            ax.barh(y, value / scale, 0.6, left=left, color=color, edgecolor="white", linewidth=0.5,
                    gid=f"sent:{name}:{op}")
            left += value / scale
        if expected and name in expected:
            ax.plot([expected[name] / scale] * 2, [y - 0.38, y + 0.38], color="black",
                    linewidth=1.5, gid=f"formula:{name}")
        ratio = left * scale / base if base else float("nan")
        ax.text(left, y, f"  {format_bytes(left * scale)}  ({ratio:.2f}x {baseline})", va="center",
                fontsize=TEXT_PT)
    ax.set_yticks(range(len(names)), list(reversed(names)))
    ax.set_xlim(0, largest / scale * 1.5)
    ax.set_xlabel(f"bytes one rank sent ({unit})")
    ax.spines[["top", "right"]].set_visible(False)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=op.replace("_", "-")) for op, c in seen.items()]
    if expected:
        handles.append(Line2D([], [], color="black", linewidth=1.5, label="formula"))
    ax.legend(handles=handles, fontsize=LEGEND_PT, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def phases(events: Iterable[Event]) -> list[str]:
    """The distinct fsdp message kinds in some events, collective and phase (``Event.phase``), e.g.
    ['all_gather.backward', 'all_gather.forward', 'reduce_scatter.backward']."""
    return sorted({f"{e.op}.{e.phase}" for e in events if e.kind == "comm" and e.unit})


__all__ = ["shard_map", "unit_cycle", "sent_by_op", "bytes_by_stage", "phases"]
