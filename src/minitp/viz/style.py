"""One look for every figure: a colour per rank, the same in every chapter."""

from __future__ import annotations

# Colour-blind-safe palette (Okabe-Ito order), one colour per rank, cycling past 8.
RANK_COLORS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442",
               "#000000"]
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

# Text sizes, in points. At DPI = 80 a font of s points is s·80/72 px at the figure's natural size,
# and the website shows a figure at natural size up to its content column (COLUMN_PX), scaled down
# past it. No text a figure stores may come out under MIN_TEXT_PX there
# (tests/test_viz_text_sizes.py reads every one).
MIN_TEXT_PX = 9
COLUMN_PX = 900
TEXT_PT = 8.5  # the smallest: labels inside bars and boxes, tick labels, notes (9.4 px)
LEGEND_PT = 9.0  # legends


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def luminance(color) -> float:
    """Relative luminance (WCAG) of a matplotlib colour: 0 for black, 1 for white."""
    from matplotlib.colors import to_rgb

    def channel(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(c) for c in to_rgb(color))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def text_on(face) -> str:
    """Black or white, whichever reads better on a box filled with ``face``."""
    return "black" if luminance(face) > 0.3 else "white"


def readable(color, contrast: float = 4.5) -> tuple[float, float, float]:
    """``color`` darkened (mixed with black) until text in it reads on white: a contrast ratio of at
    least ``contrast``. Pale colours (the yellow rank, the orange of a send) need it; dark ones come
    back as they are."""
    from matplotlib.colors import to_rgb

    rgb = to_rgb(color)
    for k in range(21):
        mixed = tuple(c * (1 - 0.05 * k) for c in rgb)
        if 1.05 / (luminance(mixed) + 0.05) >= contrast:
            return mixed
    return (0.0, 0.0, 0.0)


def rank_text_color(rank: int) -> tuple[float, float, float]:
    """The rank's colour for text on white (its own colour, darkened where it is too pale to
    read)."""
    return readable(rank_color(rank))


def text_fits(width_pt: float, text: str, fontsize: float = TEXT_PT) -> bool:
    """Whether one line of ``text`` at ``fontsize`` fits in ``width_pt`` points (a rough average
    glyph width of 0.6 em, plus a little margin)."""
    longest = max((len(line) for line in text.splitlines()), default=0)
    return width_pt >= 0.6 * fontsize * longest + 4


def text_sizes_px(fig, column_px: float = COLUMN_PX) -> list[tuple[str, float]]:
    """(text, px) for every visible, non-empty text of ``fig`` as the website shows it: titles, axis
    and tick labels, legends, annotations and texts inside axes. A font of s points is s·dpi/72 px,
    scaled down by column_px / the figure's width where the figure is wider than the column."""
    fig.canvas.draw()  # tick labels and legends take their final text once drawn
    scale = min(1.0, column_px / (fig.get_figwidth() * fig.dpi))
    out = []
    for text in _shown_texts(fig):
        if text.get_visible() and text.get_text().strip():
            out.append((text.get_text(), text.get_fontsize() * fig.dpi / 72 * scale))
    return out


def _shown_texts(fig) -> list:
    """The Text artists a drawn figure shows: the figure's own (suptitle, supxlabel, texts, legends)
    and, per visible axes, its titles, texts, annotations and legend, and where its axis is on, the
    axis labels, the offset text and the labels of the ticks inside the view."""
    texts = [t for t in (getattr(fig, "_suptitle", None), getattr(fig, "_supxlabel", None),
                         getattr(fig, "_supylabel", None)) if t is not None]
    texts += list(fig.texts)
    legends = list(fig.legends)
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        texts += [ax.title, ax._left_title, ax._right_title, *ax.texts]
        if ax.get_legend() is not None:
            legends.append(ax.get_legend())
        if not ax.axison:
            continue
        for axis in (ax.xaxis, ax.yaxis):
            if not axis.get_visible():
                continue
            texts += [axis.label, axis.offsetText]
            for tick in axis._update_ticks():
                texts += [label for label in (tick.label1, tick.label2) if label.get_visible()]
    for legend in legends:
        if legend.get_visible():
            texts += [*legend.get_texts(), legend.get_title()]
    return texts


def figure(width: float = 8.0, height: float = 3.0, **kwargs):
    """A new figure, not attached to pyplot: it shows once, where the notebook displays it, and
    needs no GUI backend. A Jupyter kernel displays a returned Figure once its inline backend is
    on: every chapter's first cell runs ``%matplotlib inline`` (importing minitp changes
    nothing)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained", **kwargs)


def label_totals(ax, measured: list[float], formula: list[float] | None) -> None:
    """The total over each bar of a (measured, formula) pair at x = 0, 1, ...; one over the pair
    where the two agree to three digits, else one over each (measured left, formula right)."""
    for i, top in enumerate(measured):
        other = formula[i] if formula else None
        if other is None or f"{other:.3g}" == f"{top:.3g}":
            ax.text(i, top, f"{top:.3g}", ha="center", va="bottom", fontsize=TEXT_PT)
        else:
            for shift, value in ((-0.2, top), (0.2, other)):
                ax.text(i + shift, value, f"{value:.3g}", ha="center", va="bottom",
                        fontsize=TEXT_PT)


__all__ = ["RANK_COLORS", "OP_COLORS", "DPI", "MIN_TEXT_PX", "COLUMN_PX", "TEXT_PT", "LEGEND_PT",
           "rank_color", "rank_text_color", "readable", "text_on", "luminance", "text_fits",
           "text_sizes_px", "label_totals", "figure"]
