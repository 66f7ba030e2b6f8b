"""Ablation arithmetic: each plugin set's gain over the empty set, and interaction effects.

Gain is oriented so that > 1 always means "better": ``baseline / value`` for a metric where
lower is better (JCT, duration), ``value / baseline`` where higher is better (throughput).
A combination's **interaction** is its gain divided by the product of its members' gains
alone: 1 means the effects compose multiplicatively (independent speedups multiply), above
means synergy, below means the plugins get in each other's way.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

HIGHER_IS_BETTER_HINTS = ("per_s", "throughput", "efficiency", "utilization", "precision")
INTERACTION_TOLERANCE = 0.05


def higher_is_better(metric: str) -> bool:
    return any(hint in metric for hint in HIGHER_IS_BETTER_HINTS)


@dataclass(frozen=True)
class SetResult:
    """One plugin set's repeated measurements of the metric."""

    plugins: tuple[str, ...]
    values: tuple[float, ...]

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

    single = {r.plugins[0]: gain(r.median) for r in results if len(r.plugins) == 1}
    out = []
    for r in results:
        gains = sorted(gain(v) for v in r.values)
        g = gain(r.median)
        expected = interaction = None
        verdict = "baseline" if not r.plugins else "alone"
        if len(r.plugins) > 1 and all(p in single for p in r.plugins):
            expected = math.prod(single[p] for p in r.plugins)
            interaction = g / expected if expected else math.nan
            verdict = classify(interaction)
        out.append(SetSummary(r.label, r.plugins, r.median, min(r.values), max(r.values),
                              len(r.values), g, gains[0], gains[-1], expected, interaction,
                              verdict))
    return out


def classify(interaction: float) -> str:
    if math.isnan(interaction):
        return "undefined"
    if interaction > 1 + INTERACTION_TOLERANCE:
        return "synergistic"
    if interaction < 1 - INTERACTION_TOLERANCE:
        return "interfering"
    return "independent (gains multiply)"
