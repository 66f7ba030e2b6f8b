"""Ablation arithmetic: each plugin set's gain over the empty set, and interaction effects.

Gain is oriented so that > 1 always means "better": ``baseline / value`` for a metric where
lower is better (JCT, duration), ``value / baseline`` where higher is better (throughput).
A combination's **interaction** is its gain divided by the product of its members' gains
alone: 1 means the effects compose multiplicatively (independent speedups multiply), above
means synergy, below means the plugins get in each other's way. A departure from 1 counts
only if the interaction's range over the repeats' min-max spread excludes 1; otherwise the
verdict is "inconclusive": machine noise must not read as an effect.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

HIGHER_IS_BETTER_HINTS = ("per_s", "throughput", "efficiency", "utilization", "precision",
                          "quality", "accuracy", "bandwidth", "speedup")
"""Substrings of a metric's name that mean higher is better (``--higher-is-better auto``);
any other metric (times, bytes, memory, perplexity, loss) is lower-better."""
INTERACTION_TOLERANCE = 0.05


def higher_is_better(metric: str) -> bool:
    return any(hint in metric for hint in HIGHER_IS_BETTER_HINTS)


@dataclass(frozen=True)
class SetResult:
    """One plugin set's repeated measurements of the metric."""

    plugins: tuple[str, ...]
    values: tuple[float, ...]
    quality: tuple[float, ...] = ()
    """Optional held-out score of each run's weights (``--eval``), not part of the gain."""
    repeats: tuple[int, ...] = ()
    """The repeat each value was measured in (aligned with ``values``), when known: then a
    combination's interaction is also computed within each repeat (paired)."""

    @property
    def label(self) -> str:
        return "+".join(self.plugins) or "baseline"

    @property
    def median(self) -> float:
        return statistics.median(self.values)


@dataclass(frozen=True)
class SetSummary:
    label: str
    plugins: tuple[str, ...]
    median: float
    low: float
    high: float
    n: int
    gain: float
    gain_low: float
    gain_high: float
    expected_gain: float | None
    interaction: float | None
    verdict: str
    quality: float | None = None
    """Median held-out score (``--eval``), or None."""
    interaction_low: float | None = None
    interaction_high: float | None = None
    """The interaction's range: min-max of the interactions computed within each repeat
    (paired: every set ran once per repeat, so slow drift between repeats cancels); without
    repeat labels, the conservative unpaired bound (the combination's lowest gain over the
    product of its members' highest gains, and vice versa)."""


def summarize(
    results: Sequence[SetResult], metric: str, higher: bool | None = None
) -> list[SetSummary]:
    """Gains vs the empty set (which must be among ``results``), with min-max spread."""
    higher = higher_is_better(metric) if higher is None else higher
    by_set: Mapping[tuple[str, ...], SetResult] = {r.plugins: r for r in results}
    if () not in by_set:
        raise ValueError("the empty plugin set (baseline) must be measured to compute gains")
    base = by_set[()].median

    def gain(value: float) -> float:
        if value == 0 or base == 0:
            return math.nan
        return value / base if higher else base / value

    spread = {r.plugins: sorted(gain(v) for v in r.values) for r in results}
    single = {r.plugins[0]: gain(r.median) for r in results if len(r.plugins) == 1}
    out = []
    for r in results:
        gains = spread[r.plugins]
        g = gain(r.median)
        expected = interaction = low = high = None
        verdict = "baseline" if not r.plugins else "alone"
        if len(r.plugins) > 1 and all(p in single for p in r.plugins):
            expected = math.prod(single[p] for p in r.plugins)
            interaction = g / expected if expected else math.nan
            paired = paired_interactions(r, [by_set[(p,)] for p in r.plugins], by_set[()],
                                         higher)
            if paired:  # the paired estimate is the better one: drift cancels within a repeat
                interaction = statistics.median(paired)
                low, high = min(paired), max(paired)
            else:
                lows = math.prod(spread[(p,)][0] for p in r.plugins)
                highs = math.prod(spread[(p,)][-1] for p in r.plugins)
                low = gains[0] / highs if highs else math.nan
                high = gains[-1] / lows if lows else math.nan
            verdict = classify(interaction, low, high)
        quality = statistics.median(r.quality) if r.quality else None
        out.append(SetSummary(r.label, r.plugins, r.median, min(r.values), max(r.values),
                              len(r.values), g, gains[0], gains[-1], expected, interaction,
                              verdict, quality, low, high))
    return out


def paired_interactions(combo: SetResult, members: Sequence[SetResult], base: SetResult,
                        higher: bool) -> list[float]:
    """The interaction within each repeat that measured the combination, every member and
    the baseline (gains against that repeat's own baseline run); [] without repeat labels."""
    runs = [combo, *members, base]
    if any(len(r.repeats) != len(r.values) or not r.repeats for r in runs):
        return []
    value = [dict(zip(r.repeats, r.values, strict=True)) for r in runs]
    common = set.intersection(*(set(v) for v in value))
    out = []
    for rep in sorted(common):
        b = value[-1][rep]
        gains = [(v[rep] / b if higher else b / v[rep]) if v[rep] and b else math.nan
                 for v in value[:-1]]
        expected = math.prod(gains[1:])
        out.append(gains[0] / expected if expected else math.nan)
    return [x for x in out if not math.isnan(x)]


def classify(interaction: float, low: float | None = None, high: float | None = None) -> str:
    """Verdict on an interaction (gain / product of the members' gains). ``low``/``high``:
    its range over the repeats' spread; a departure from 1 that this range does not exclude
    is noise, not an effect (a plugin that does nothing must never look synergistic)."""
    if math.isnan(interaction):
        return "undefined"
    if 1 - INTERACTION_TOLERANCE <= interaction <= 1 + INTERACTION_TOLERANCE:
        return "independent (gains multiply)"
    if low is not None and high is not None and low <= 1 <= high:
        return "inconclusive (spread includes 1)"
    return "synergistic" if interaction > 1 else "interfering"
