"""Per-step time of SLIDE vs a dense PyTorch baseline vs sampled softmax, by output width.

Same synthetic XC data (preloaded padded batches), same network (sparse input -> 128 ReLU ->
L outputs), batch 128, Adam lr 1e-4... 1e-3, same thread count on each side; only training
steps are timed. Each method: warm-up steps (JIT compile, first table build), then ``--reps``
rounds, each one block of steps of every method, the order rotating between rounds (so a busy
moment of the VM slows every method alike); the figure is the median over blocks of the mean
step time in a block (SLIDE's blocks each span a table rebuild, so the rebuild is amortised
in them). The bound beside SLIDE's speed-up is the output layer's FLOP ratio, labels over
active labels per sample (what sampling can save at most, with nothing else in the step).

    python benchmarks/slide_step.py --widths 2k 20k 200k 670k
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _cli  # noqa: E402
import numpy as np  # noqa: E402
from accelopt_plugins.slide.xcdata import SIZES, synthetic  # noqa: E402
from machine_scaling import describe, machine_scaling  # noqa: E402
from slide_common import (  # noqa: E402
    DenseTrainer,
    SampledTrainer,
    SlideTrainer,
    init_net,
    machine,
    median,
    parse_overrides,
    preload,
    set_threads,
    slide_config,
    use_huge_pages,
)

BATCH = 128
LR = 1e-3


class Timed:
    """One method's trainer, stepped in blocks through the same batches."""

    def __init__(self, trainer, batches, per_rep: int) -> None:
        self.trainer, self.batches, self.per_rep = trainer, batches, per_rep
        self.i = 0
        self.blocks: list[float] = []

    def steps(self, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            self.trainer.step(*self.batches[self.i % len(self.batches)])
            self.i += 1
        return (time.perf_counter() - start) / max(n, 1)

    def warm_up(self, n: int) -> None:
        self.steps(n)
        self.trainer.reset()

    def block(self) -> None:
        self.blocks.append(self.steps(self.per_rep))

    def result(self) -> tuple[float, dict]:
        steps = len(self.blocks) * self.per_rep
        t = self.trainer
        phases = t.phases() if hasattr(t, "phases") else dict(t.times)
        return median(self.blocks), {k: 1e3 * v / steps for k, v in phases.items()}


def run(trainer, batches, warmup: int, reps: int, per_rep: int) -> tuple[float, dict]:
    """One method alone: warm-up, then ``reps`` blocks (for a tool comparing settings of one
    method, which interleaves its own runs)."""
    timed = Timed(trainer, batches, per_rep)
    timed.warm_up(warmup)
    for _ in range(reps):
        timed.block()
    return timed.result()


def interleaved(methods: list[Timed], reps: int) -> None:
    """``reps`` rounds of one block per method, the order rotating between rounds."""
    for r in range(reps):
        k = r % len(methods)
        for m in methods[k:] + methods[:k]:
            m.block()


def main() -> None:
    use_huge_pages()  # before any model is built: the same memory setting for every method
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--widths", nargs="+", default=["2k", "20k", "200k", "670k"], choices=list(SIZES))
    ap.add_argument("--threads", type=_cli.positive_int, default=2)
    ap.add_argument("--reps", type=_cli.positive_int, default=3)
    ap.add_argument("--slide-steps", type=_cli.positive_int, default=50, help="steps per SLIDE block")
    ap.add_argument("--dense-budget-s", type=_cli.positive_float, default=40.0,
                    help="rough seconds of timed dense steps per width")
    ap.add_argument("--scaling-width", nargs="*", default=["200k", "670k"], choices=list(SIZES),
                    help="widths of the 1 vs 2 thread test (none: skip it)")
    ap.add_argument("--scaling-pairs", type=_cli.positive_int, default=12,
                    help="interleaved 1- and 2-thread block pairs of the scaling test")
    ap.add_argument("--slide", nargs="*", default=[], metavar="KEY=VALUE",
                    help="SLIDE settings instead of the defaults, e.g. topup=batch topk=50 l=16")
    args = ap.parse_args()
    overrides = parse_overrides(args.slide)
    set_threads(args.threads)
    print(f"# machine: {machine()}")
    print(f"# batch {BATCH}, hidden 128, Adam lr {LR}, {args.reps} timed blocks per method"
          + (f", SLIDE settings {overrides}" if overrides else ""))
    rows = []
    for size in args.widths:
        ds = synthetic(size)
        n, d = ds.num_classes, ds.vocab_size
        cfg = slide_config(n, **overrides)
        batches = preload(ds, 0, 60, BATCH)
        init = init_net(d, n)
        slide = Timed(SlideTrainer(d, n, LR, init, cfg), batches, args.slide_steps)
        dense = Timed(DenseTrainer(d, n, LR, init), batches, 0)
        slide.warm_up(5)  # the sampled softmax is sized from SLIDE's active set, known now
        active = int(round(slide.trainer.model.out.summary()["active_per_sample"]))
        sampled = Timed(SampledTrainer(d, n, LR, init, per_sample=active), batches, 20)
        sampled.warm_up(3)
        per = dense.steps(2)
        dense.trainer.reset()
        dense.per_rep = int(np.clip(args.dense_budget_s / max(per, 1e-3) / args.reps, 2, 50))
        interleaved([slide, dense, sampled], args.reps)
        t_slide, ph_slide = slide.result()
        t_dense, ph_dense = dense.result()
        t_samp, ph_samp = sampled.result()
        summ = slide.trainer.model.out.summary()
        active = int(round(summ["active_per_sample"]))
        del slide, dense, sampled, init
        gc.collect()
        rows.append((n, t_dense, t_samp, t_slide, active, summ, ph_dense, ph_samp, ph_slide))
        print(f"\n## {n} labels ({d} features): dense {1e3 * t_dense:.1f} ms, sampled "
              f"{1e3 * t_samp:.1f} ms, slide {1e3 * t_slide:.1f} ms per step")
        print(f"  bound: output-layer FLOP ratio {n / max(active, 1):.1f}x (labels / active "
              f"per sample); SLIDE vs dense measured {t_dense / t_slide:.2f}x")
        print(f"  slide: {active} active/sample ({100 * summ['active_fraction']:.2f}%), "
              f"{summ['retrieved_per_sample']:.0f} retrieved/sample, "
              f"{summ['union_rows_per_batch']:.0f} rows updated/batch, "
              f"rebuild share {100 * summ['rebuild_time_share']:.1f}% of layer time")
        for name, ph in (("dense", ph_dense), ("sampled", ph_samp), ("slide", ph_slide)):
            print(f"  {name:8s} ms/step: " + ", ".join(f"{k} {v:.1f}" for k, v in ph.items()))
        sys.stdout.flush()

    print("\n| labels | dense ms/step | sampled softmax ms/step | SLIDE ms/step | SLIDE vs dense "
          "| bound (FLOP ratio) | SLIDE vs sampled | active/sample | rows updated/batch "
          "| rebuild share |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, td, ts, tl, act, summ, *_ in rows:
        print(f"| {n:,} | {1e3 * td:.1f} | {1e3 * ts:.1f} | {1e3 * tl:.1f} | {td / tl:.1f}x "
              f"| {n / max(act, 1):.0f}x "
              f"| {ts / tl:.2f}x | {act} ({100 * summ['active_fraction']:.2f}%) "
              f"| {summ['union_rows_per_batch']:.0f} | {100 * summ['rebuild_time_share']:.1f}% |")
    print("\nper-step breakdown (ms): hash = hashing + table lookups + active-set building")
    print("| labels | method | hash | forward | backward | optimizer | rebuild (amortised) | other |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n, _, _, _, _, _, pd, ps, pl in rows:
        for name, ph in (("dense", pd), ("sampled", ps), ("slide", pl)):
            cells = [ph.get(k, 0.0) for k in ("hash", "forward", "backward", "optimizer",
                                               "rebuild", "other")]
            print(f"| {n:,} | {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    ratios = [(n, td / tl) for n, td, _, tl, *_ in rows]
    print("\nbreak-even width (SLIDE = dense per step): " + break_even(ratios))

    if args.scaling_width:  # the yardstick, before and after: the VM's load drifts
        print(f"\n{describe(machine_scaling())} (before the scaling tests)", flush=True)
    for width in args.scaling_width:
        ds = synthetic(width)
        n, d = ds.num_classes, ds.vocab_size
        batches = preload(ds, 0, 60, BATCH)
        t1, t2, ratios, phases = thread_scaling(d, n, batches, slide_config(n, **overrides),
                                                args.scaling_pairs, args.slide_steps)
        print(f"\nthread scaling, SLIDE at {n:,} labels: 1 thread {1e3 * t1:.1f} ms/step, "
              f"2 threads {1e3 * t2:.1f} ms/step, speed-up {median(ratios):.2f}x (median of "
              f"{len(ratios)} interleaved block pairs: "
              + ", ".join(f"{r:.2f}" for r in ratios) + ")")
        print("  ms/step by phase, all pairs (1 thread / 2 threads = speed-up): " + ", ".join(
            f"{k} {phases[1][k]:.1f} / {phases[2][k]:.1f} = {phases[1][k] / phases[2][k]:.2f}x"
            for k in phases[1] if phases[2].get(k, 0.0) > 0.05), flush=True)
    if args.scaling_width:
        print(f"\n{describe(machine_scaling())} (after the scaling tests)", flush=True)


def thread_scaling(d: int, n: int, batches, cfg, pairs: int, per_rep: int
                   ) -> tuple[float, float, list[float], dict[int, dict[str, float]]]:
    """1 vs 2 threads, measured as interleaved blocks: two trainers (same initial weights and
    batches) take turns, one block each, and the speed-up is the median over block pairs of
    (1-thread time / 2-thread time). Why interleaved: on this VM the same code's speed drifts
    by up to 1.6x within minutes (docs/benchmarks.md, "slide: thread scaling"); timing one thread
    count after the other measured that drift as much as the scaling. Returns (median
    1-thread s/step, median 2-thread s/step, the ``pairs`` per-pair ratios (within a pair
    the order alternates, so neither thread count always runs first), each thread
    count's ms/step by phase over all its timed blocks)."""
    init = init_net(d, n)
    trainers = {t: SlideTrainer(d, n, LR, init, cfg) for t in (1, 2)}
    pos = {1: 0, 2: 0}

    def block(threads: int, steps: int) -> float:
        set_threads(threads)
        start = time.perf_counter()
        for _ in range(steps):
            trainers[threads].step(*batches[pos[threads] % len(batches)])
            pos[threads] += 1
        return (time.perf_counter() - start) / steps

    for t in (1, 2):
        block(t, 5)  # warm-up: JIT, first table build
        trainers[t].reset()
    times: dict[int, list[float]] = {1: [], 2: []}
    for k in range(max(pairs, 1)):  # the order alternates: 1 then 2, 2 then 1, ...
        for t in ((1, 2) if k % 2 == 0 else (2, 1)):
            times[t].append(block(t, per_rep))
    set_threads(2)
    ratios = [a / b for a, b in zip(times[1], times[2], strict=True)]
    steps = max(pairs, 1) * per_rep
    phases = {t: {k: 1e3 * v / steps for k, v in trainers[t].phases().items()} for t in (1, 2)}
    return median(times[1]), median(times[2]), ratios, phases


def break_even(ratios: list[tuple[int, float]]) -> str:
    """Interpolate log(speed-up) linearly in log(width) between measured widths."""
    ratios = sorted(ratios)
    if all(r > 1 for _, r in ratios):
        return f"below {ratios[0][0]:,} labels (SLIDE is already faster at every measured width)"
    if all(r < 1 for _, r in ratios):
        return f"above {ratios[-1][0]:,} labels (dense is faster at every measured width)"
    for (n0, r0), (n1, r1) in zip(ratios, ratios[1:], strict=False):
        if (r0 - 1) * (r1 - 1) <= 0 and r0 != r1:
            f = np.log(r0) / (np.log(r0) - np.log(r1))
            return f"about {int(np.exp(np.log(n0) + f * (np.log(n1) - np.log(n0)))):,} labels"
    return "not bracketed by the measured widths"


if __name__ == "__main__":
    _cli.run(main)
