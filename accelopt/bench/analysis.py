"""Ablation arithmetic: each plugin set's gain over the empty set, and interaction effects.

Gain is oriented so that > 1 always means "better": ``baseline / value`` for a metric where
lower is better (JCT, duration), ``value / baseline`` where higher is better (throughput).
A combination's **interaction** is its gain divided by the product of its members' gains
alone: 1 means the effects compose multiplicatively (independent speedups multiply), above
means synergy, below means the plugins get in each other's way. A verdict needs
``MIN_REPEATS`` repeats (the min-max of one or two values is no interval), and a range over
the repeats that includes 1 reads "inconclusive" unless it lies within the tolerance (then
the gains multiply); a set alone whose gain range includes 1 is "within noise": machine
noise must not read as an effect.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

HIGHER_IS_BETTER_HINTS = ("per_s", "throughput", "efficiency", "utilization", "precision",
                          "quality", "accuracy", "bandwidth", "speedup", "n_done")
"""Substrings of a metric's name that mean higher is better (``--higher-is-better auto``);
any other metric (times, bytes, memory, perplexity, loss, failed or rejected jobs) is
lower-better."""
INTERACTION_TOLERANCE = 0.05
MIN_REPEATS = 3
"""Fewer repeats than this give no verdict: their min-max is one or two samples of the
machine's noise, not a range (two lucky runs made a plugin that does nothing 'synergistic')."""


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
    inert: tuple[str, ...] = ()
    """The set's plugins that changed nothing in every one of its runs (each run's report
    rows say so: ``accelopt.types.INERT``): their part of the gain is run-to-run noise."""

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
    gain_low: float | None
    gain_high: float | None
    """The gain range: min-max over the repeats of the set's gain within each repeat (that
    repeat's baseline run against the set's run: paired, the repeats being interleaved);
    without repeat labels, the baseline's median against each of the set's values. ``None``
    for the baseline (a range against itself says nothing)."""
    expected_gain: float | None
    interaction: float | None
    verdict: str
    """The conclusion and, when there is none, why: 'baseline'; for a set of one plugin
    'alone', or 'alone; within noise (...)' / 'alone; inconclusive (...)'; for a combination
    the interaction's verdict (``classify``)."""
    quality: float | None = None
    """Median held-out score (``--eval``), or None."""
    interaction_low: float | None = None
    interaction_high: float | None = None
    """The interaction's range: min-max of the interactions computed within each repeat
    (paired: every set ran once per repeat, so slow drift between repeats cancels); without
    repeat labels, the conservative unpaired bound (the combination's lowest gain over the
    product of its members' highest gains, and vice versa)."""
    inert: tuple[str, ...] = ()
    """The set's plugins that changed nothing in its runs (:attr:`SetResult.inert`)."""


INERT_VERDICT = "inert: changed nothing in its runs (its gain is noise)"
"""The verdict of a set none of whose plugins did anything: no gain, alone or together."""


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
        if value == 0 or base == 0:  # undefined: NaN here, null in bench.json, n/a shown
            return math.nan
        return value / base if higher else base / value

    spread = {r.plugins: sorted(gain(v) for v in r.values) for r in results}
    single = {r.plugins[0]: gain(r.median) for r in results if len(r.plugins) == 1}
    out = []
    for r in results:
        gains = spread[r.plugins]
        g = gain(r.median) if r.plugins else 1.0  # the baseline is itself, whatever its value
        expected = interaction = low = high = None
        if not r.plugins:
            verdict = "baseline"
        elif len(r.plugins) == 1:
            verdict = alone_verdict(gain_range(r, by_set[()], higher))
        else:
            verdict = "undefined (a member was not measured alone)"
        if len(r.plugins) > 1 and all(p in single for p in r.plugins):
            members = [by_set[(p,)] for p in r.plugins]
            expected = math.prod(single[p] for p in r.plugins)
            interaction = g / expected if expected else math.nan
            paired = paired_interactions(r, members, by_set[()], higher)
            if paired:  # the paired estimate is the better one: drift cancels within a repeat
                interaction = statistics.median(paired)
                low, high = min(paired), max(paired)
                n = len(paired)
            else:
                lows = math.prod(spread[(p,)][0] for p in r.plugins)
                highs = math.prod(spread[(p,)][-1] for p in r.plugins)
                low = gains[0] / highs if highs else math.nan
                high = gains[-1] / lows if lows else math.nan
                n = min(len(x.values) for x in (r, *members, by_set[()]))
            verdict = classify(interaction, low, high, n)
        quality = statistics.median(r.quality) if r.quality else None
        gain_low, gain_high = gain_span(r, by_set[()], gains, higher)
        out.append(SetSummary(r.label, r.plugins, r.median, min(r.values), max(r.values),
                              len(r.values), g, gain_low, gain_high, expected, interaction,
                              inert_verdict(r, verdict), quality, low, high, r.inert))
    return out


def gain_span(result: SetResult, base: SetResult, unpaired: Sequence[float],
              higher: bool) -> tuple[float | None, float | None]:
    """The gain range column (:attr:`SetSummary.gain_low`): paired within the repeats that
    measured both the set and the baseline, else ``unpaired`` (the set's sorted gains against
    the baseline's median); none for the baseline itself."""
    if not result.plugins:
        return None, None
    mine, theirs = _by_repeat(result), _by_repeat(base)
    if mine is not None and theirs is not None and set(mine) & set(theirs):
        low, high, _, _ = gain_range(result, base, higher)
        return low, high
    return unpaired[0], unpaired[-1]


def inert_verdict(result: SetResult, verdict: str) -> str:
    """``verdict``, unless plugins of the set changed nothing in its runs: then a gain or an
    interaction is machine noise, and the verdict says so (every plugin inert: the set has
    no effect at all; some: which of them did nothing)."""
    if not result.inert or not result.plugins:
        return verdict
    if set(result.inert) >= set(result.plugins):
        return INERT_VERDICT
    return f"{verdict}; {', '.join(result.inert)} changed nothing in its runs"


def gain_range(result: SetResult, base: SetResult,
               higher: bool) -> tuple[float, float, int, bool]:
    """(lowest, highest, n, paired) of a set's gain with the baseline's own noise in it (the gain
    column's range is against the baseline's median and hides the baseline's spread): within
    each repeat against that repeat's baseline run when runs carry repeats (n: the repeats
    that measured both), else the unpaired bound, every value against every baseline value
    (n: the fewer of the two sets' runs)."""
    def ratio(v: float, b: float) -> float:
        return (v / b if higher else b / v) if v and b else math.nan

    mine, theirs = _by_repeat(result), _by_repeat(base)
    if mine is not None and theirs is not None:
        common = sorted(set(mine) & set(theirs))
        gains, n = [ratio(mine[k], theirs[k]) for k in common], len(common)
        paired = True
    else:
        gains = [ratio(v, b) for v in result.values for b in base.values]
        n, paired = min(len(result.values), len(base.values)), False
    gains = [g for g in gains if not math.isnan(g)]
    return (min(gains), max(gains), n, paired) if gains else (math.nan, math.nan, n, paired)


def _by_repeat(result: SetResult) -> dict[int, float] | None:
    """{repeat: value}, or None when the runs carry no repeat labels."""
    if not result.repeats or len(result.repeats) != len(result.values):
        return None
    return dict(zip(result.repeats, result.values, strict=True))


def alone_verdict(bounds: tuple[float, float, int, bool]) -> str:
    """A set of one plugin: 'alone' when its gain is measured (enough repeats, and a range
    that excludes 1), else why the gain column is not a finding. The range it quotes is
    named for what it is (paired within repeats, or every value against every baseline
    value), as the table's "gain range" column is (without repeat labels it is against the
    baseline's median, other numbers)."""
    low, high, n, paired = bounds
    if n < MIN_REPEATS:
        return f"alone; {too_few(n)}"
    if math.isnan(low):
        return "alone; gain undefined (a value of 0)"
    if low <= 1 <= high:
        kind = "paired gain" if paired else "unpaired gain"
        return f"alone; within noise ({kind} {low:.2f}-{high:.2f} includes 1)"
    return "alone"


def too_few(n: int) -> str:
    return f"inconclusive (n={n} repeat{'s' if n != 1 else ''}; {MIN_REPEATS} needed)"


def paired_interactions(combo: SetResult, members: Sequence[SetResult], base: SetResult,
                        higher: bool) -> list[float]:
    """The interaction within each repeat that measured the combination, every member and
    the baseline (gains against that repeat's own baseline run); [] without repeat labels."""
    found = [_by_repeat(r) for r in (combo, *members, base)]
    value = [v for v in found if v is not None]
    if len(value) != len(found):
        return []
    common = set.intersection(*(set(v) for v in value))
    out = []
    for rep in sorted(common):
        b = value[-1][rep]
        gains = [(v[rep] / b if higher else b / v[rep]) if v[rep] and b else math.nan
                 for v in value[:-1]]
        expected = math.prod(gains[1:])
        out.append(gains[0] / expected if expected else math.nan)
    return [x for x in out if not math.isnan(x)]


def classify(interaction: float, low: float | None = None, high: float | None = None,
             n: int | None = None) -> str:
    """Verdict on an interaction (gain / product of the members' gains). ``low``/``high``:
    its range over the repeats; ``n``: how many repeats measured it. Fewer than
    ``MIN_REPEATS`` repeats give no verdict, and a range that includes 1 is noise, not an
    effect, unless the whole range lies within the tolerance (a plugin that does nothing
    must never look synergistic)."""
    if math.isnan(interaction):
        return "undefined"
    if n is not None and n < MIN_REPEATS:
        return too_few(n)
    lo, hi = 1 - INTERACTION_TOLERANCE, 1 + INTERACTION_TOLERANCE
    if low is not None and high is not None and low <= 1 <= high and not lo <= low <= high <= hi:
        return f"inconclusive (range {low:.2f}-{high:.2f} includes 1)"
    if lo <= interaction <= hi:
        return "independent (gains multiply)"
    return "synergistic" if interaction > 1 else "interfering"
