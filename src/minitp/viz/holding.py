"""What a step holds, and in how many bits: three figures for chapter 12, each drawn from data a run
returned (they never run anything).

* ``value_ranges``: where a tensor's values sit on a log2 scale (a histogram of their exponents)
  against the ranges of the FP8 formats: the normal range, where rounding keeps 3 (e4m3) or 2 (e5m2)
  bits of mantissa, and the subnormals below it, where it keeps fewer, down to zero.
* ``host_moves``: the bytes held in the host's memory over a step of activation offload: each saved
  storage going out during forward and coming back during backward, coloured by its block.
* ``kept_per_block``: per way of keeping activations, the bytes one block holds for backward,
  measured beside the formula, and the matmuls backward ran.
"""

from __future__ import annotations

import math

import torch

from minitp.viz import style
from minitp.viz.format import byte_scale
from minitp.viz.style import LEGEND_PT, TEXT_PT

FORMAT_COLORS = {"float8_e4m3fn": "#0072B2", "float8_e5m2": "#E69F00"}


def _format_range(dtype: torch.dtype) -> tuple[float, float, float]:
    """(log2 of the smallest subnormal, of the smallest normal, of the largest value)."""
    info = torch.finfo(dtype)
    return math.log2(info.smallest_normal) + math.log2(info.eps), math.log2(info.smallest_normal), \
        math.log2(info.max)


def value_ranges(tensors: dict[str, torch.Tensor],
                 formats: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2), *,
                 title: str = "", width: float = 8.0):
    """One row per tensor: the histogram of log2 |x| over its nonzero values, under bands showing
    each format's subnormal (light) and normal (dark) range. A value left of a format's range
    becomes 0 in it; right of it, it saturates."""
    names = list(tensors)
    fig = style.figure(width, 0.9 + 0.75 * len(names) + 0.35 * len(formats))
    ax = fig.add_subplot()
    exponents = {n: torch.log2(t.detach().abs().float().flatten()[t.detach().flatten() != 0])
                 for n, t in tensors.items()}
    lo = min([float(e.min()) for e in exponents.values() if e.numel()]
             + [_format_range(f)[0] for f in formats]) - 1
    hi = max([float(e.max()) for e in exponents.values() if e.numel()]
             + [_format_range(f)[2] for f in formats]) + 1
    bins = torch.arange(math.floor(lo), math.ceil(hi) + 1, 0.5)
    for row, name in enumerate(names):
        counts, _ = torch.histogram(exponents[name].clamp(float(bins[0]), float(bins[-1])), bins)
        top = float(counts.max()) or 1.0
        y0 = len(names) - 1 - row + len(formats) * 0.5
        ax.bar(bins[:-1].tolist(), (0.8 * counts / top).tolist(), width=0.5, bottom=y0,
               align="edge", color="#777777", gid=f"values:{name}")
        ax.text(float(bins[0]), y0 + 0.45, name, fontsize=TEXT_PT, va="center", ha="left")
    for i, dtype in enumerate(formats):
        sub, normal, top = _format_range(dtype)
        name = str(dtype).replace("torch.", "")
        color = FORMAT_COLORS.get(name, style.RANK_COLORS[i])
        y = (len(formats) - 1 - i) * 0.5
        ax.broken_barh([(sub, normal - sub)], (y + 0.05, 0.4), facecolors=color, alpha=0.35,
                       gid=f"subnormal:{name}")
        ax.broken_barh([(normal, top - normal)], (y + 0.05, 0.4), facecolors=color,
                       gid=f"normal:{name}")
        ax.text(top + 0.3, y + 0.25, f"{name}: 2^{normal:g} … {torch.finfo(dtype).max:g}",
                fontsize=TEXT_PT, va="center", ha="left")
    ax.set_xlim(float(bins[0]), float(bins[-1]) + 9)
    ax.set_ylim(0, len(names) + len(formats) * 0.5)
    ax.set_yticks([])
    ax.set_xlabel("log2 |value|  (a format's band: subnormal light, normal dark)")
    ax.spines[["top", "right", "left"]].set_visible(False)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def host_moves(moves, *, title: str = "", width: float = 8.0):
    """The bytes the host holds after each move of a step (``minitp.offload.HostStore.moves``):
    rising during forward as each block's saved storages go out, falling during backward as they
    come back, block by block in reverse. Each move is one step of the line, coloured by its
    block."""
    moves = list(moves)
    if not moves:
        raise ValueError("no moves to draw: was anything offloaded?")
    labels = list(dict.fromkeys(m.label for m in moves))
    held, levels = 0, []
    for m in moves:
        held += m.nbytes if m.direction == "out" else -m.nbytes
        levels.append(held)
    unit, scale = byte_scale(max(levels))
    fig = style.figure(width, 2.8)
    ax = fig.add_subplot()
    before = 0
    for i, (m, level) in enumerate(zip(moves, levels)):
        color = style.rank_color(labels.index(m.label))
        ax.bar(i, (level - before) / scale, bottom=before / scale, width=0.9, color=color,
               gid=f"move:{m.direction}:{m.label}:{i}")
        before = level
    turn = next((i for i, m in enumerate(moves) if m.direction == "in"), len(moves))
    ax.axvline(turn - 0.5, color="#666666", linewidth=0.8, linestyle="--")
    top = max(levels) / scale  # each half named over its middle, where the line is low
    ax.text((turn - 1) / 2, top, "forward: out", fontsize=TEXT_PT, ha="center", va="top")
    ax.text((turn + len(moves) - 1) / 2, top, "backward: back in", fontsize=TEXT_PT,
            ha="center", va="top")
    from matplotlib.patches import Patch

    handles = [Patch(color=style.rank_color(i), label=label) for i, label in enumerate(labels)]
    ax.legend(handles=handles, fontsize=LEGEND_PT, frameon=False, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    ax.set_xlabel("moves across the host link, in order (one bar per storage)")
    ax.set_ylabel(f"held on the host ({unit})")
    ax.spines[["top", "right"]].set_visible(False)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def kept_per_block(rows: dict[str, dict], *, title: str = "", width: float = 7.0):
    """One pair of bars per way of keeping activations: the bytes one block held for backward,
    measured (solid) and by the formula (hatched), with the matmuls backward ran above them.

    rows: {mode: {"measured": bytes, "formula": bytes, "matmuls": count}}."""
    modes = list(rows)
    unit, scale = byte_scale(max(max(r["measured"], r["formula"]) for r in rows.values()))
    fig = style.figure(width, 2.9)
    ax = fig.add_subplot()
    for i, mode in enumerate(modes):
        r = rows[mode]
        ax.bar(i - 0.2, r["measured"] / scale, width=0.38, color=style.rank_color(0),
               gid=f"measured:{mode}")
        ax.bar(i + 0.2, r["formula"] / scale, width=0.38, color="white", hatch="//",
               edgecolor=style.rank_color(0), gid=f"formula:{mode}")
        ax.text(i, max(r["measured"], r["formula"]) / scale, f"{r['matmuls']} matmuls\nin backward",
                fontsize=TEXT_PT, ha="center", va="bottom")
    ax.set_xticks(range(len(modes)), modes, fontsize=TEXT_PT)
    ax.set_ylabel(f"kept per block ({unit})")
    top = max(max(r["measured"], r["formula"]) for r in rows.values()) / scale
    ax.set_ylim(0, top * 1.35)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=style.rank_color(0), label="measured"),
                       Patch(facecolor="white", hatch="//", edgecolor=style.rank_color(0),
                             label="formula")],
              fontsize=LEGEND_PT, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.spines[["top", "right"]].set_visible(False)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


__all__ = ["value_ranges", "host_moves", "kept_per_block"]
