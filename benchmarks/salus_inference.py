"""Inference packing under SALUS: K small inference jobs (batch 1-10) served concurrently
through lanes on one device vs "one device per job" (each model served alone, exclusively,
one after another on the same machine, with every core): how many fit, throughput and p95
latency. Both sides use the same cores: the exclusive baseline runs each model with as many
intra-op threads as the machine has cores, PACK runs at most one lane per core with one
thread each; the exclusive run at one thread is printed too, and the bound is that run's
throughput times the number of cores (independent requests on every core, perfect scaling).

Paper: 42 inference models on 1 GPU instead of 42 (42x), 7x better than NVIDIA MPS. Here the
device is a CPU with an accounted capacity (lanes are accounted, not enforced): "how many fit"
is the number of lanes the lane manager admits at once within ``--capacity``; throughput is
samples per second over the whole run; latency is per request (one iteration = one batch).

    python benchmarks/salus_inference.py \
        [--models 12] [--requests 200] [--repeats 3] [--capacity 64MiB]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics

import _cli
from salus_common import machine, profile_all, run_policy

from accelopt.config import JobConfig
from accelopt.report.metrics import percentile
from accelopt.units import format_bytes

ZOO = ["mlp", "cnn", "lstm", "transformer", "resnet", "inception"]


def main() -> None:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--models", type=_cli.positive_int, default=12)
    ap.add_argument("--requests", type=_cli.positive_int, default=200, help="batches per model")
    ap.add_argument("--repeats", type=_cli.positive_int, default=3)
    ap.add_argument("--capacity", type=_cli.size, default="64MiB")
    ap.add_argument("--seed", type=_cli.nonnegative_int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    specs = [JobConfig(name=f"inf-{i:02d}", model=ZOO[i % len(ZOO)], kind="infer",
                       batch_size=rng.randint(1, 10), iterations=args.requests, seed=i)
             for i in range(args.models)]
    profiles = profile_all(specs, 1)
    need = sorted(1.05 * (1.1 * p.persistent_bytes + p.ephemeral_bytes) for p in profiles.values())
    print(f"machine: {machine()}")
    print(f"{args.models} inference models ({', '.join(ZOO)}), batch 1-10, {args.requests} "
          f"requests each; capacity {args.capacity} (accounted, not enforced on CPU); lane "
          f"need per model {format_bytes(need[0])}..{format_bytes(need[-1])}; "
          f"{args.repeats} repeats, medians")
    cores = os.cpu_count() or 1
    baseline = f"one device per job (exclusive, one at a time), {cores} threads"
    single = "one device per job (exclusive, one at a time), 1 thread"
    sides = {baseline: dict(policy="fifo", threads=cores),
             f"SALUS lanes (PACK), lanes <= cores ({cores}), 1 thread each":
                 dict(policy="pack", threads=1, max_lanes=cores),
             "SALUS lanes (PACK), as many lanes as fit, 1 thread each":
                 dict(policy="pack", threads=1),
             single: dict(policy="fifo", threads=1)}
    stats: dict[str, dict[str, list[float]]] = {k: {"tput": [], "p95": [], "fit": []}
                                                for k in sides}
    for rep in range(args.repeats):  # interleaved: the order rotates between repeats
        order = list(sides)[rep % len(sides):] + list(sides)[:rep % len(sides)]
        for name in order:
            results, summary, record = run_policy(specs, profiles, capacity=args.capacity,
                                                  **sides[name])  # type: ignore[arg-type]
            ends = [r.end_s for r in results if r.end_s is not None]
            samples = sum(r.samples for r in results)
            latencies = [s.end_s - s.start_s for s in record.spans if s.category == "iteration"]
            stats[name]["tput"].append(samples / max(ends))
            stats[name]["p95"].append(percentile(latencies, 95) or 0.0)
            stats[name]["fit"].append(summary["peak_resident_jobs"]
                                      if name.startswith("SALUS") else 1)
        print(f"  repeat {rep + 1} of {args.repeats} done", flush=True)
    print(f"\n{'side':48s} {'models at once':>14s} {'samples/s':>10s} {'p95 latency ms':>15s}")
    base = statistics.median(stats[baseline]["tput"])
    for name, s in stats.items():
        tput = statistics.median(s["tput"])
        print(f"{name:48s} {statistics.median(s['fit']):14.0f} {tput:10.0f} "
              f"{statistics.median(s['p95']) * 1e3:15.2f}   ({tput / base:.2f}x throughput)")
    bound = cores * statistics.median(stats[single]["tput"])
    print(f"bound: {bound:.0f} samples/s = {cores} cores x the 1-thread exclusive throughput "
          f"(every core serving requests, perfect scaling): {bound / base:.2f}x the baseline")
    print("\nlanes are accounted, not enforced on this CPU; paper (GPU): 42 models on 1 GPU")


if __name__ == "__main__":
    _cli.run(main)
