"""Present an ablation: terminal table, bar chart PNG, markdown report."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from accelopt.atomic import atomic_open
from accelopt.bench.analysis import INTERACTION_TOLERANCE, MIN_REPEATS, SetSummary

VERDICT_RULE = (
    f"fewer than {MIN_REPEATS} repeats give none (inconclusive, n = the repeats measured); a "
    f"combination is independent when its interaction is within 1 +- {INTERACTION_TOLERANCE}, "
    "synergistic above, interfering below, and inconclusive when its range includes 1 (unless "
    f"the whole range lies within 1 +- {INTERACTION_TOLERANCE}); a set alone is within noise "
    "when its gain against each repeat's own baseline run (without repeats: every value "
    "against every baseline value) ranges over 1. A set is inert when each of its plugins "
    "said in every one of its runs' report rows that it changed nothing there: its gain is "
    "run-to-run noise, not an effect (a set of which only some plugins were inert names them).")
"""The verdict column's rule, as ``accelopt.bench.analysis.classify`` and ``alone_verdict``
apply it: written under the report's table so that a reader sees why a verdict is missing."""

COLUMNS = ("set", "median", "min-max", "gain", "gain range", "expected", "interaction", "verdict")


def columns(context: dict[str, Any]) -> tuple[str, ...]:
    quality = context.get("quality")
    return COLUMNS + ((f"{quality} (median)",) if quality else ())


def _row(s: SetSummary, context: dict[str, Any]) -> list[str]:
    row = [s.label, f"{s.median:.4g}", _span(s.low, s.high, ".3g"), _num(s.gain, ".3f", "x"),
           _span(s.gain_low, s.gain_high, ".3f"), _num(s.expected_gain, ".3f"),
           _interaction(s), s.verdict]
    if context.get("quality"):
        row.append(_num(s.quality, ".4f"))
    return row


def _num(x: float | None, spec: str, unit: str = "") -> str:
    """``x`` formatted; '–' when there is none, 'n/a' when it is undefined (NaN: a gain
    against a baseline of 0)."""
    if x is None:
        return "–"
    return "n/a" if math.isnan(x) else f"{x:{spec}}{unit}"


def _span(low: float | None, high: float | None, spec: str) -> str:
    if low is None and high is None:  # none (the baseline's gain range): one '–'
        return "–"
    low_text, high_text = _num(low, spec), _num(high, spec)
    return low_text if low_text == high_text == "n/a" else f"{low_text}-{high_text}"


def _interaction(s: SetSummary) -> str:
    if s.interaction is None:
        return "–"
    if s.interaction_low is None or s.interaction_high is None or math.isnan(s.interaction):
        return _num(s.interaction, ".3f")
    return f"{_num(s.interaction, '.3f')} ({_span(s.interaction_low, s.interaction_high, '.2f')})"


def fewer_repeats(summary: Sequence[SetSummary], context: dict[str, Any]) -> str | None:
    """How many repeats the figures are medians of when that is not the planned count
    (``context["repeats"]``), e.g. "1 repeat (2 planned; the runs left out are named)";
    ``None`` when every set measured every repeat. A bench reported with runs missing
    (stopped, then --reanalyze --force) or left out (failed) measured fewer: stating the
    plan's count would claim figures it does not have."""
    planned = context["repeats"]
    counts = sorted({s.n for s in summary}) or [planned]
    if counts == [planned]:
        return None
    low, high = counts[0], counts[-1]
    span = f"{low}" if low == high else f"{low}-{high}"
    return (f"{span} repeat{'' if high == 1 else 's'} ({planned} planned; the runs left out "
            "are named)")


def repeats_text(summary: Sequence[SetSummary], context: dict[str, Any],
                 kind: str = "interleaved ") -> str:
    """What the figures are medians of, worded alike in the table's title and bench.md
    ("medians of 1 interleaved repeat", not "1 repeats")."""
    planned = context["repeats"]
    return (fewer_repeats(summary, context)
            or f"{planned} {kind}repeat{'' if planned == 1 else 's'}")


def direction(context: dict[str, Any]) -> str:
    """"higher is better" or "lower is better": the metric's direction, as the gain reads it
    (stated in every report, not only in the table's title)."""
    return f"{'higher' if context['higher_is_better'] else 'lower'} is better"


def render_table(summary: Sequence[SetSummary], context: dict[str, Any]) -> Table:
    # user text (a metric's name, plugin names in verdicts) is shown as is, not as markup
    table = Table(title=f"{escape(context['metric'])} ({direction(context)}), medians of "
                  f"{repeats_text(summary, context)}; gain > 1 = better than baseline",
                  title_justify="left")
    for column in columns(context):
        # a figure is never cut ("0.01183-0.011…" on a narrow terminal): it wraps instead
        table.add_column(column, justify="left" if column in ("set", "verdict") else "right",
                         overflow="fold")
    for s in summary:
        table.add_row(*(escape(cell) for cell in _row(s, context)))
    planned = context["repeats"]
    most = max((s.n for s in summary), default=planned)
    if most < MIN_REPEATS:
        what = (f"{most} repeat(s)" if most == planned
                else f"{most} repeat(s) measured ({planned} planned)")
        fix = (f"--repeats {MIN_REPEATS} or more" if planned < MIN_REPEATS
               else "rerun the bench to measure its planned repeats")
        table.caption = (f"{what}: too few for a verdict (the min-max of fewer than "
                         f"{MIN_REPEATS} runs is noise, not a range); {fix}")
        table.caption_justify = "left"
    return table


def code_span(text: str) -> str:
    """``text`` as one Markdown code span, shown as is: fenced by one backtick more than the
    longest run of them in it (a shell-quoted ``'a`b'`` argument ended a one-backtick span
    early), padded with a space where it starts or ends with one."""
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def render_markdown(summary: Sequence[SetSummary], context: dict[str, Any]) -> str:
    repeats = repeats_text(summary, context, kind="")  # "interleaved" follows
    lines = [
        f"# Ablation: {context['metric']} ({direction(context)})",
        "",
        f"Command: {code_span(context['command'])}",
        "",
        f"Machine: {context['machine']}, Python {context['python']}. "
        f"Medians of {repeats}, sets interleaved within each repeat; {context['metric']}: "
        f"{direction(context)}, gain > 1 = better than the baseline.",
        "",
        f"Settings: {context.get('settings', '')}. "
        + ("Sweep: did not finish." if context.get("sweep_s") is None
           else f"Sweep: {context['sweep_s']} s."),
        "",
        *([f"**Runs missing from this report** (`--reanalyze --force`; their sets have fewer "
           f"repeats): {'; '.join(context['missing_runs'])}.", ""]
          if context.get("missing_runs") else []),
        *([f"**Runs left out of this report** (they did not measure the set: a run failed, "
           f"a job of it failed, was refused or diverged, or the metric has no value; a set "
           f"all of whose runs are left out has no row): "
           f"{'; '.join(context['left_out'])}.", ""]
          if context.get("left_out") else []),
        "| " + " | ".join(columns(context)) + " |",
        "|" + "---|" * len(columns(context)),
    ]
    lines += ["| " + " | ".join(_row(s, context)) + " |" for s in summary]
    lines += [
        "",
        "Gain: baseline / value when lower is better, value / baseline when higher is better. "
        "Gain range: min-max over the repeats of the set's gain within each repeat (that "
        "repeat's baseline run against the set's run, paired; without repeat labels, the "
        "baseline's median against each of the set's values); none for the baseline. "
        "Expected: the product of the members' gains alone. Interaction: computed within "
        "each repeat against that repeat's own baseline run (paired), median and in brackets "
        "min-max over the repeats (gain / expected when runs carry no repeat). "
        f"Verdict: {VERDICT_RULE} "
        "Runs are interleaved and the order of the sets rotates from repeat to repeat.",
        "",
    ]
    if context.get("quality"):
        what = ("held-out perplexity of each run's language models (lower is better)"
                if context["quality"] == "perplexity" else "held-out top-1 of each run's "
                "saved weights (accuracy; P@1 for multi-label data)")
        lines[-1:-1] = [f"{context['quality']}: {what}, median over the repeats; not part of "
                        "the gain.", ""]
    return "\n".join(lines)


def render_png(summary: Sequence[SetSummary], context: dict[str, Any], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(4.0, 1.2 * len(summary)), 3.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    labels = [s.label for s in summary]
    gains = [s.gain for s in summary]
    # a paired range need not contain the gain of the medians: no negative bar there
    errors = [[_below(s.gain, s.gain_low) for s in summary],
              [_below(s.gain_high, s.gain) for s in summary]]
    ax.bar(labels, gains, yerr=errors, capsize=4, color="#4c72b0")
    ax.axhline(1.0, color="black", linewidth=0.8)
    for i, s in enumerate(summary):
        if s.expected_gain is not None:
            ax.plot([i - 0.4, i + 0.4], [s.expected_gain] * 2, color="#dd8452", linewidth=2)
    ax.set_ylabel(f"gain over baseline ({context['metric']}, {direction(context)})")
    # two short lines: one long title was clipped on charts of a few sets
    ax.set_title(f"{context['metric']}: {direction(context)}; bars: measured gain (min-max)\n"
                 "orange: product of the members' gains", fontsize=9)
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    with atomic_open(path, "wb") as handle:
        fig.savefig(handle, format="png", dpi=110)
    return path


def _below(high: float | None, low: float | None) -> float:
    """An error bar's length, ``high - low``, 0 where either end is missing, undefined or
    on the wrong side (matplotlib refuses negative error bars)."""
    if high is None or low is None or math.isnan(high) or math.isnan(low):
        return 0.0
    return max(0.0, high - low)
