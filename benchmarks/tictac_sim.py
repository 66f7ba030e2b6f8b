"""TicTac in the simulator: the paper's five models on the meta device, every heuristic in one
invocation.

Sections (all by default):

* ``table``: makespan and E per heuristic at a = Mc/Pc = 1, forward-only and training, for
  TensorFlow-style dataflow execution (the paper's setting) and PyTorch eager execution;
  random is the mean (and p95) over 1000 fresh random orders.
* ``sweep``: the gain of TAC over random and over named for a in {0.25, 0.5, 1, 2, 4}.
* ``straggler``: 8 workers, each op's time jittered per worker and iteration (lognormal,
  sigma = --jitter), every worker with its own fresh random order vs all with TAC: spread
  (max - min) of the workers' finish times per iteration.
* ``schedule``: time to compute TIC and TAC on the ResNet-152 DAG (median of 5).

    python benchmarks/tictac_sim.py

Compute times are a roofline (FLOPs / 15 TFLOP/s vs bytes / 900 GB/s per op, a V100-class
GPU): the meta device has no clock. Only relative op costs matter, because the link
bandwidth is then chosen to give the stated a.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import _cli
import numpy as np
from accelopt_plugins.tictac.order import tac, tic
from accelopt_plugins.tictac.plan import plan_meta, with_ratio
from accelopt_plugins.tictac.simulate import Simulator

MODELS = ("alexnet", "vgg16", "resnet50", "inception_v3", "resnet152")
HEURISTICS = ("tac", "tic", "named", "reverse", "random")


def table(batch: int, samples: int) -> None:
    print("\n## Simulator: makespan (ms) and E per heuristic at a = 1 "
          f"(batch {batch}; random: mean / p95 over {samples} orders)\n")
    print("| model | mode | execution | TAC | TIC | named | reverse | random mean / p95 "
          "| TAC gain vs random | E: TAC | TIC | named | random | E bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in MODELS:
        for kind in ("infer", "train"):
            for execution in ("dataflow", "eager"):
                plan = plan_meta(model, batch=batch, kind=kind, a=1.0,
                                 execution=execution)  # type: ignore[arg-type]
                pred = plan.predict(HEURISTICS, samples=samples)
                ms = {h: pred[h]["makespan_s"] * 1e3 for h in HEURISTICS}
                gain = 100 * (ms["random"] / ms["tac"] - 1)
                bound = e_bound(plan)
                print(f"| {model} | {kind} | {execution} | {ms['tac']:.2f} | {ms['tic']:.2f} "
                      f"| {ms['named']:.2f} | {ms['reverse']:.2f} | {ms['random']:.2f} / "
                      f"{pred['random']['p95_s'] * 1e3:.2f} | {gain:+.1f}% "
                      f"| {pred['tac']['E']:.3f} | {pred['tic']['E']:.3f} "
                      f"| {pred['named']['E']:.3f} | {pred['random']['E']:.3f} | {bound:.3f} |")


def e_bound(plan) -> float:  # noqa: ANN001
    """Best E any order can reach: backward needs every parameter, so U >= Mc + backward."""
    sim = plan.sim
    bwd = float(sum(plan.times[op] for op in plan.dag.backward_of))
    lower = max(sim.mc, sim.pc, sim.mc + bwd)
    upper = sim.mc + sim.pc
    return (upper - lower) / (upper - max(sim.mc, sim.pc))


def sweep(batch: int, samples: int) -> None:
    print("\n## a-sweep (dataflow, forward-only and training): throughput gain of TAC\n")
    print("| model | mode | a | TAC vs random (mean) | TAC vs named | TAC E | random E |")
    print("|---|---|---|---|---|---|---|")
    for model in MODELS:
        for kind in ("infer", "train"):
            base = plan_meta(model, batch=batch, kind=kind, a=1.0, execution="dataflow")
            for a in (0.25, 0.5, 1.0, 2.0, 4.0):
                plan = with_ratio(base, a)
                pred = plan.predict(("tac", "named", "random"), samples=samples)
                t, n, r = (pred[h]["makespan_s"] for h in ("tac", "named", "random"))
                print(f"| {model} | {kind} | {a:g} | {100 * (r / t - 1):+.1f}% "
                      f"| {100 * (n / t - 1):+.1f}% | {pred['tac']['E']:.3f} "
                      f"| {pred['random']['E']:.3f} |")


def straggler(batch: int, workers: int, iterations: int, jitter: float, seed: int) -> None:
    print(f"\n## Stragglers: {workers} workers, {iterations} iterations, op-time jitter "
          f"lognormal sigma {jitter} (dataflow, training, a = 1)\n")
    print("| model | spread random (ms) | spread TAC (ms) | reduction | iteration random (ms) "
          "| iteration TAC (ms) |")
    print("|---|---|---|---|---|---|")
    for model in MODELS:
        plan = plan_meta(model, batch=batch, kind="train", a=1.0, execution="dataflow")
        order_tac = tac(plan.dag, plan.times, "dataflow")
        rng = np.random.default_rng(seed)
        nr = len(plan.dag.recvs)
        spread = {"random": [], "tac": []}
        iteration = {"random": [], "tac": []}
        for _ in range(iterations):
            for h in ("random", "tac"):
                finish = []
                for _w in range(workers):
                    times = plan.times * rng.lognormal(0.0, jitter, size=plan.times.shape)
                    order = rng.permutation(nr) if h == "random" else order_tac
                    finish.append(Simulator(plan.dag, times, "dataflow").run(order).makespan)
                spread[h].append(max(finish) - min(finish))
                iteration[h].append(max(finish))
        sr, st = (1e3 * statistics.mean(spread[h]) for h in ("random", "tac"))
        ir, it = (1e3 * statistics.mean(iteration[h]) for h in ("random", "tac"))
        print(f"| {model} | {sr:.3f} | {st:.3f} | {reduction(sr, st)} | {ir:.2f} | {it:.2f} |")


def reduction(random_ms: float, tac_ms: float) -> str:
    """Random's spread over TAC's, or "none (TAC 0)" where TAC's workers all finish together
    (``--jitter 0``: every worker runs the same times in the same order), which printed
    ``infx`` with a division warning."""
    return f"{random_ms / tac_ms:.1f}x" if tac_ms > 0 else "none (TAC 0)"


def schedule() -> None:
    print("\n## Schedule computation on the ResNet-152 DAG (median of 5)\n")
    print("| execution | recvs | TIC (s) | TAC (s) |")
    print("|---|---|---|---|")
    for execution in ("dataflow", "eager"):
        plan = plan_meta("resnet152", batch=32, kind="infer", execution=execution)
        ti, ta = [], []
        for _ in range(5):
            t = time.perf_counter()
            tic(plan.dag, execution)  # type: ignore[arg-type]
            ti.append(time.perf_counter() - t)
            t = time.perf_counter()
            tac(plan.dag, plan.times, execution)  # type: ignore[arg-type]
            ta.append(time.perf_counter() - t)
        print(f"| {execution} | {len(plan.dag.recvs)} | {statistics.median(ti):.4f} "
              f"| {statistics.median(ta):.3f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--section", type=_cli.names(("table", "sweep", "straggler", "schedule")), default="table,sweep,straggler,schedule")
    ap.add_argument("--batch", type=_cli.positive_int, default=32)
    ap.add_argument("--samples", type=_cli.positive_int, default=1000)
    ap.add_argument("--workers", type=_cli.positive_int, default=8)
    ap.add_argument("--iterations", type=_cli.positive_int, default=100)
    ap.add_argument("--jitter", type=_cli.nonnegative_float, default=0.05)
    ap.add_argument("--seed", type=_cli.nonnegative_int, default=0)
    args = ap.parse_args()
    if "straggler" in args.section.split(",") and args.workers < 2:
        # one worker has no spread: the section printed 0.000 / 0.000 = "nanx"
        ap.error(f"--workers: the straggler section needs at least 2 workers (the spread is "
                 f"between workers' finish times); got {args.workers}")
    print(f"# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.2f}; python {sys.version.split()[0]}; args {vars(args)}")
    sections = args.section.split(",")
    t0 = time.time()
    if "schedule" in sections:
        schedule()
    if "table" in sections:
        table(args.batch, args.samples)
    if "sweep" in sections:
        sweep(args.batch, min(args.samples, 300))
    if "straggler" in sections:
        straggler(args.batch, args.workers, args.iterations, args.jitter, args.seed)
    print(f"\n# wall {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    _cli.run(main)
