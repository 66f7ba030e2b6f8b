"""Hyper-parameter tuning under SALUS: N identical small training jobs (different learning
rates) packed into lanes (PACK) vs run one after another (FIFO, one lane), same jobs.

Paper: 2.38x GPU utilization for 300 packed identical jobs. On a CPU the lanes are accounted,
not enforced, and the "device" is the cores: packing can win at most what the cores allow
(here 2 cores; a single-threaded lane leaves the other core idle, and two threads per job
scale imperfectly), so the makespan ratio is reported against both serial variants.

    python benchmarks/salus_hparam.py \
        [--jobs 8] [--iterations 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics

import _cli
from salus_common import machine, profile_all, result_stats, run_policy

from accelopt.config import JobConfig
from accelopt.workloads.models import MODEL_NAMES


def main() -> None:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--jobs", type=_cli.positive_int, default=8)
    ap.add_argument("--iterations", type=_cli.positive_int, default=60)
    ap.add_argument("--model", default="cnn", choices=MODEL_NAMES)
    ap.add_argument("--batch", type=_cli.positive_int, default=32)
    ap.add_argument("--repeats", type=_cli.positive_int, default=3)
    ap.add_argument("--capacity", type=_cli.size, default="1GiB")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    specs = [JobConfig(name=f"hp-{i}", model=args.model, batch_size=args.batch,
                       iterations=args.iterations, lr=0.01 * (i + 1), seed=7)
             for i in range(args.jobs)]
    profiles = profile_all(specs, 1)
    sides = {
        f"serial, 1 lane x {cores} threads (FIFO)": dict(policy="fifo", threads=cores),
        "serial, 1 lane x 1 thread (FIFO)": dict(policy="fifo", threads=1),
        f"PACK, lanes = cores ({cores}) x 1 thread": dict(policy="pack", threads=1,
                                                         max_lanes=cores),
        f"PACK, all {args.jobs} jobs in lanes x 1 thread": dict(policy="pack", threads=1),
    }
    print(f"machine: {machine()}")
    print(f"{args.jobs} x {args.model} batch {args.batch}, {args.iterations} iterations, "
          f"lr 0.01..{0.01 * args.jobs:.2f}; capacity {args.capacity} (accounted, not enforced "
          f"on CPU); {args.repeats} repeats, rotating order, medians (min-max)")
    makespans: dict[str, list[float]] = {k: [] for k in sides}
    lanes: dict[str, int] = {}
    for rep in range(args.repeats):
        names = list(sides)
        names = names[rep % len(names):] + names[:rep % len(names)]
        for name in names:
            results, summary, _ = run_policy(specs, profiles, capacity=args.capacity,
                                             **sides[name])  # type: ignore[arg-type]
            makespans[name].append(result_stats(results)["makespan"])
            lanes[name] = summary["peak_lanes"]
    serial, serial1 = makespans[next(iter(sides))], makespans["serial, 1 lane x 1 thread (FIFO)"]
    print(f"\n{'side':44s} {'makespan s (min-max)':>21s} {'lanes':>5s} "
          f"{f'vs serial {cores}t, paired (min-max)':>32s} {'vs serial 1t, paired':>21s}")
    for name in sides:
        mine = makespans[name]
        ratios = [b / m for b, m in zip(serial, mine, strict=True)]
        ratios1 = [b / m for b, m in zip(serial1, mine, strict=True)]
        print(f"{name:44s} {statistics.median(mine):9.2f} ({min(mine):.2f}-{max(mine):.2f}) "
              f"{lanes[name]:5d} {statistics.median(ratios):19.2f}x ({min(ratios):.2f}-"
              f"{max(ratios):.2f}) {statistics.median(ratios1):20.2f}x")
    base, base1 = statistics.median(serial), statistics.median(serial1)
    bound = base1 / cores
    print(f"bound: makespan {bound:.2f} s = the 1-thread serial makespan over {cores} cores "
          f"(every core busy with independent jobs, perfect scaling): {base / bound:.2f}x vs "
          f"serial {cores}t, {cores:.2f}x vs serial 1t")
    print("paired: each side's makespan against the serial side's in the same repeat, "
          f"median over the {args.repeats} repeats")
    for name in sides:
        print(f"# {name}: " + ", ".join(f"{m:.2f}" for m in makespans[name]))
    print("\nlanes are accounted, not enforced on this CPU (paper's GPU figure: 2.38x)")


if __name__ == "__main__":
    _cli.run(main)
