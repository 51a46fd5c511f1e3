"""One look for every figure: a colour per rank, the same in every chapter."""

from __future__ import annotations

# Colour-blind-safe palette (Okabe-Ito order), one colour per rank, cycling past 8.
RANK_COLORS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]
OP_COLORS = {
    "all_reduce": "#0072B2",
    "all_gather": "#009E73",
    "reduce_scatter": "#D55E00",
    "broadcast": "#CC79A7",
    "all_to_all": "#882255",
    "send": "#E69F00",
    "recv": "#56B4E9",
    "compute": "#BBBBBB",
}
DPI = 80  # small PNGs keep the notebooks and the website light


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def figure(width: float = 8.0, height: float = 3.0, **kwargs):
    """A new figure, not attached to pyplot: it shows once, where the notebook displays it, and
    needs no GUI backend. A Jupyter kernel displays a returned Figure once its inline backend is
    on: every chapter's first cell runs ``%matplotlib inline`` (importing minitp changes nothing)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained", **kwargs)


__all__ = ["RANK_COLORS", "OP_COLORS", "DPI", "rank_color", "figure"]
