"""The loss curve of a ``minitp train`` run, drawn from its ``log.jsonl``."""

from __future__ import annotations

from minitp.layout import DIMS
from minitp.viz.style import RANK_COLORS, figure


def loss_figure(records: list[dict], title: str | None = None, width: float = 8.0,
                height: float = 3.4):
    """Training loss per step (faint) and its running mean (up to 20 steps), validation loss (dots),
    in nats per byte; a dashed line where a run resumed from its checkpoint (a restart, or another
    layout)."""
    steps = [r for r in records if "loss" in r]
    fig = figure(width, height)
    ax = fig.add_subplot()
    if steps:
        x, y = [r["step"] for r in steps], [r["loss"] for r in steps]
        ax.plot(x, y, color=RANK_COLORS[0], alpha=0.25, linewidth=1)
        # a running mean over a tenth of the run, at most 20 steps
        w = max(1, min(20, len(y) // 10))
        mean = [sum(y[max(0, i - w + 1):i + 1]) / len(y[max(0, i - w + 1):i + 1])
                for i in range(len(y))]
        ax.plot(x, mean, color=RANK_COLORS[0], linewidth=2, label=f"training (mean of {w} steps)")
    val = [r for r in records if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", color=RANK_COLORS[5],
                markersize=5, label="validation (files never trained on)")
    starts = [r for r in records if r.get("event") == "start"]
    for r in starts[1:] if starts and starts[0]["step"] == 0 else starts:
        ax.axvline(r["step"], color="#555555", linestyle="--", linewidth=1)
        layout = r["settings"]
        where = "·".join(f"{d}{layout[d]}" for d in DIMS if layout[d] > 1) or "1 process"
        ax.annotate(f"resumed at {r['step']}, {where}", (r["step"], 0.03),
                    xycoords=("data", "axes fraction"), xytext=(-4, 0), textcoords="offset points",
                    fontsize=10, color="#333333", rotation=90,
                    ha="right", va="bottom")
    ax.set_xlabel("step", fontsize=11)
    ax.set_ylabel("loss (nats per byte)", fontsize=11)
    ax.tick_params(labelsize=10)
    ax.grid(alpha=0.3)
    if steps or val:
        ax.legend(fontsize=10, loc="upper right")
    if title:
        ax.set_title(title, fontsize=11)
    return fig


def save_loss_figure(records: list[dict], path: str) -> None:
    """``loss_figure`` of a run's records (``minitp.runs.train_log.read_log``) saved as a PNG: the
    ``out/loss.png`` of ``minitp train``, drawn with no display (matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    fig = loss_figure(records)
    fig.savefig(path, dpi=120, bbox_inches="tight")
