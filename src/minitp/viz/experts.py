"""Figures of expert parallel: the load on each expert, and who sends how many tokens to whom.

They take the routing counts a run returned (``report["load_per_expert"]``,
``report["routing_counts"]``, or a layer's ``history``) and draw them; none runs anything or imports
a strategy.
"""

from __future__ import annotations

from minitp.cost.experts import tokens_between_ranks
from minitp.viz.format import format_bytes
from minitp.viz.style import LEGEND_PT, TEXT_PT, figure, rank_color


def expert_load(routed: list[int], kept: list[int] | None = None, *, ep: int = 1,
                capacity: int | None = None, title: str = "", width: float = 6.0):
    """Bars: the assignments each expert was chosen for, coloured by the rank that holds it (E/ep
    experts each); hatched on top, the part capacity dropped; a dashed line at ``capacity`` (the
    most an expert may take) and a dotted one at the even share."""
    n_experts = len(routed)
    per = max(1, n_experts // ep)
    fig = figure(width, 2.8)
    ax = fig.subplots()
    kept = list(routed) if kept is None else list(kept)
    colors = [rank_color(e // per) for e in range(n_experts)]
    ax.bar(range(n_experts), kept, color=colors, label="computed")
    dropped = [r - k for r, k in zip(routed, kept)]
    if any(dropped):
        ax.bar(range(n_experts), dropped, bottom=kept, color="white", edgecolor=colors, hatch="///",
               linewidth=0.8, label="dropped (over capacity)")
    even = sum(routed) / n_experts
    ax.axhline(even, color="black", linestyle=":", linewidth=1, label=f"even share {even:.0f}")
    if capacity is not None:
        ax.axhline(capacity, color="black", linestyle="--", linewidth=1,
                   label=f"capacity {capacity}")
    ax.set_xticks(range(n_experts), [str(e) for e in range(n_experts)])
    ax.set_xlabel("expert (colour: the rank holding it)" if ep > 1 else "expert")
    ax.set_ylabel("token assignments")
    top = max(max(routed, default=0), capacity or 0)
    ax.set_ylim(0, 1.4 * top if top else 1)
    ax.legend(fontsize=LEGEND_PT, loc="upper center", ncol=3, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def dispatch_matrix(counts: list[list[int]], *, dim: int | None = None, dtype_bytes: int = 4,
                    title: str = "", width: float = 4.2):
    """A grid: row i, column j holds the tokens rank i sends rank j in one dispatch (the combine
    sends the same back, column to row). The diagonal stays on its rank and costs nothing; with
    ``dim`` each cell also says the bytes (tokens x dim x dtype_bytes)."""
    t = tokens_between_ranks(counts, len(counts))
    n = len(t)
    fig = figure(width, width * 0.85)
    ax = fig.subplots()
    most = max(max(row) for row in t) or 1
    for i in range(n):
        for j in range(n):
            shade = 0.15 + 0.85 * t[i][j] / most
            face = "#EEEEEE" if i == j else rank_color(i)
            ax.add_patch(_cell(j, i, face, 1.0 if i == j else shade, hatch="..." if i == j
                               else None))
            words = f"{t[i][j]}"
            if dim is not None and i != j:
                words += "\n" + format_bytes(t[i][j] * dim * dtype_bytes)
            ax.text(j + 0.5, i + 0.5, words, ha="center", va="center", fontsize=TEXT_PT)
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_xticks([j + 0.5 for j in range(n)], [f"to {j}" for j in range(n)])
    ax.set_yticks([i + 0.5 for i in range(n)], [f"rank {i}" for i in range(n)])
    ax.tick_params(length=0)
    ax.set_aspect("equal")
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(title or "tokens dispatched (diagonal: stays on its rank)", fontsize=10)
    return fig


def _cell(x: float, y: float, color: str, alpha: float, hatch: str | None = None):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), 1, 1, facecolor=color, alpha=alpha, edgecolor="white", linewidth=2,
                     hatch=hatch)


__all__ = ["expert_load", "dispatch_matrix"]
