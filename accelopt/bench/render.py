"""Present an ablation: terminal table, bar chart PNG, markdown report."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from accelopt.atomic import atomic_open
from accelopt.bench.analysis import SetSummary

COLUMNS = ("set", "median", "min-max", "gain", "gain range", "expected", "interaction", "verdict")


def _row(s: SetSummary) -> list[str]:
    def opt(x: float | None) -> str:
        return "–" if x is None else f"{x:.3f}"

    return [s.label, f"{s.median:.4g}", f"{s.low:.4g}-{s.high:.4g}", f"{s.gain:.3f}x",
            f"{s.gain_low:.3f}-{s.gain_high:.3f}", opt(s.expected_gain), opt(s.interaction),
            s.verdict]


def render_table(summary: Sequence[SetSummary], context: dict[str, Any]) -> Table:
    direction = "higher" if context["higher_is_better"] else "lower"
    table = Table(title=f"{context['metric']} ({direction} is better), medians of "
                  f"{context['repeats']} interleaved repeats; gain > 1 = better than baseline",
                  title_justify="left")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("set", "verdict") else "right")
    for s in summary:
        table.add_row(*_row(s))
    return table


def render_markdown(summary: Sequence[SetSummary], context: dict[str, Any]) -> str:
    lines = [
        f"# Ablation: {context['metric']}",
        "",
        f"Command: `{context['command']}`",
        "",
        f"Machine: {context['machine']}, Python {context['python']}. "
        f"{context['repeats']} repeats, sets interleaved within each repeat.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(_row(s)) + " |" for s in summary]
    lines += [
        "",
        "Gain: baseline / value when lower is better, value / baseline when higher is better. "
        "Expected: the product of the members' gains alone. Interaction: gain / expected "
        "(1 = independent; > 1.05 synergistic; < 0.95 interfering).",
        "",
    ]
    return "\n".join(lines)


def render_png(summary: Sequence[SetSummary], context: dict[str, Any], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(4.0, 1.2 * len(summary)), 3.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    labels = [s.label for s in summary]
    gains = [s.gain for s in summary]
    errors = [[s.gain - s.gain_low for s in summary], [s.gain_high - s.gain for s in summary]]
    ax.bar(labels, gains, yerr=errors, capsize=4, color="#4c72b0")
    ax.axhline(1.0, color="black", linewidth=0.8)
    for i, s in enumerate(summary):
        if s.expected_gain is not None:
            ax.plot([i - 0.4, i + 0.4], [s.expected_gain] * 2, color="#dd8452", linewidth=2)
    ax.set_ylabel(f"gain over baseline ({context['metric']})")
    ax.set_title("bars: measured gain (min-max); orange: product of members' gains")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    with atomic_open(path, "wb") as handle:
        fig.savefig(handle, format="png", dpi=110)
    return path
