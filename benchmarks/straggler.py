"""A straggler: one worker's link at a fraction of the others', parameter server and
all-reduce, against all links equal, in one invocation. Needs root and iproute2.

Every rank runs in a network namespace of its own (``cluster.network.topology=hosts``),
joined to a switch by a veth link shaped in both directions; the straggler run gives the
last worker's link ``1/--slowdown`` of the rate. Each repeat runs both networks back to back,
alternating which goes first. The figure is the steady-state iteration period (one over
the run's ``wall_iterations_per_s``: the iterations after the warm-up over their wall time,
first start to last end), median over repeats, beside its wire bound: the busiest link's
time at its rate (:func:`wire_bound_s`; PS: a worker's push and then its pull, which waits
for the server's step, a server ``workers/servers`` times its shard one way; a ring
all-reduce moves ``2 (W-1)/W`` of the gradient each way through every link, so the slowest
link paces all of them).

    sudo python benchmarks/straggler.py [--bandwidth 100mbit] [--slowdown 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from dataclasses import dataclass

import _cli
import torch
from omegaconf import OmegaConf

from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.cluster import run_cluster
from accelopt.drivers.cluster.metrics import WARMUP_ITERATIONS
from accelopt.drivers.cluster.settings import ClusterSettings, parse_rate, settings_from
from accelopt.errors import UserError
from accelopt.workloads.models import MODEL_NAMES


@dataclass
class Case:
    mode: str
    straggler: bool


def config(args: argparse.Namespace, case: Case) -> object:
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name="bench", model=args.model, width=args.width, batch_size=args.batch,
        iterations=args.iterations, seed=0))]
    cfg.cluster.mode = case.mode
    cfg.cluster.workers = args.workers
    cfg.cluster.servers = args.servers
    cfg.cluster.timeout_s = 120
    cfg.cluster.network.topology = "hosts"
    cfg.cluster.network.bandwidth = args.bandwidth
    if case.straggler:
        slow = int(parse_rate(args.bandwidth) / args.slowdown)
        cfg.cluster.network.links = {f"worker{args.workers - 1}": f"{slow}bit"}
    return cfg


def wire_bound_s(settings: ClusterSettings, param_bytes: int) -> float:
    """The busiest link's time per iteration at its rate. Links are full duplex, so a link's
    two directions count once, except where one waits for the other: a PS worker's next
    parameters come back only after the server's whole step, which needs this worker's
    gradients, so a worker's link carries its push and then its pull, in sequence. (A server
    can overlap them across workers: one worker's next push while it still sends another's
    parameters.)"""
    worst = 0.0
    for rank in range(settings.world_size):
        rate = settings.link(rank).bandwidth_bps
        if not rate:
            continue
        if settings.mode == "ps":
            moved = (param_bytes * settings.workers / settings.servers
                     if settings.role(rank) == "server" else 2 * param_bytes)
        else:
            moved = 2 * (settings.workers - 1) / settings.workers * param_bytes
        worst = max(worst, moved * 8 / rate)
    return worst


BELOW_BOUND = "below the wire bound: not a steady-state measurement"
"""Said of a period shorter than its wire bound: the links cannot move an iteration's bytes
that fast, so the run timed something other than its steady iterations."""


def check_iterations(iterations: int) -> None:
    """Refuse a run too short for a steady window: the period is the iterations after the
    :data:`~accelopt.drivers.cluster.metrics.WARMUP_ITERATIONS` warm-up over their wall
    time, and a run of no more iterations than that times its warm-up instead (a PS period
    below its own wire bound)."""
    if iterations <= WARMUP_ITERATIONS:
        raise UserError(f"--iterations {iterations} leaves no steady iterations after the "
                        f"{WARMUP_ITERATIONS} warm-up ones, so no steady-state period; give "
                        f"at least {WARMUP_ITERATIONS + 1}")


def repeat_line(mode: str, straggler: bool, rep: int, period_s: float, bound_s: float) -> str:
    """One repeat's progress line; a period below its wire bound is marked as not a
    measurement."""
    mark = f" ({BELOW_BOUND})" if period_s < bound_s else ""
    return (f"  {mode} {'straggler' if straggler else 'equal'} repeat {rep + 1}: "
            f"{period_s * 1e3:.1f} ms/iteration{mark}")


def table_row(mode: str, straggler: bool, times: list[float], bound_s: float,
              equal_times: list[float], equal_bound_s: float) -> str:
    """One row of the table. A median period below its wire bound is not printed as a result
    (the links cannot carry an iteration that fast), nor is a slowdown computed from one."""
    med, equal = statistics.median(times), statistics.median(equal_times)
    below = med < bound_s
    slowdown = "-" if below or equal < equal_bound_s else f"{med / equal:.2f}"
    iteration = "-" if below else f"{med * 1e3:.1f}"
    return (f"{mode:<10}{'straggler' if straggler else 'equal':<11}{iteration:>13}"
            f"{min(times) * 1e3:>8.1f}{max(times) * 1e3:>8.1f}{len(times):>3}"
            f"{bound_s * 1e3:>15.1f}{slowdown:>10}{bound_s / equal_bound_s:>16.2f}"
            + (f"  {BELOW_BOUND}" if below else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--bandwidth", type=_cli.rate, default="100mbit")
    ap.add_argument("--slowdown", type=_cli.positive_float, default=4.0,
                    help="the straggler's link runs at bandwidth / slowdown")
    ap.add_argument("--model", default="mlp", choices=MODEL_NAMES)
    ap.add_argument("--width", type=_cli.positive_int, default=256)
    ap.add_argument("--batch", type=_cli.positive_int, default=32)
    ap.add_argument("--iterations", type=_cli.positive_int, default=20)
    ap.add_argument("--workers", type=_cli.positive_int, default=2)
    ap.add_argument("--servers", type=_cli.positive_int, default=1)
    ap.add_argument("--repeats", type=_cli.positive_int, default=3)
    args = ap.parse_args()
    check_iterations(args.iterations)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"python {platform.python_version()}, gloo, 1 thread per rank; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"job: {args.model} width {args.width} on digits, global batch {args.batch}, "
          f"{args.iterations} iterations; {args.workers} workers (+{args.servers} server in "
          f"ps); links {args.bandwidth}, straggler worker{args.workers - 1} at 1/"
          f"{args.slowdown:g}; {args.repeats} paired repeats, order alternating")
    header = (f"{'mode':<10}{'links':<11}{'iteration ms':>13}{'min':>8}{'max':>8}{'n':>3}"
              f"{'wire bound ms':>15}{'slowdown':>10}{'bound slowdown':>16}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="accelopt-straggler-") as run_dir:
        for mode in ("ps", "allreduce"):
            times: dict[bool, list[float]] = {False: [], True: []}
            bounds: dict[bool, float] = {}
            for rep in range(args.repeats):
                order = [False, True] if rep % 2 == 0 else [True, False]
                for straggler in order:
                    cfg = config(args, Case(mode, straggler))
                    out = run_cluster(cfg, run_dir=run_dir)
                    # the period, not a worker's median iteration: a one-job PS worker runs
                    # free, so its iteration also holds the wait for the server's turnaround
                    times[straggler].append(1.0 / float(out.metrics["wall_iterations_per_s"]))
                    bounds[straggler] = wire_bound_s(settings_from(cfg.cluster),
                                                     int(out.metrics["param_bytes"]))
                    print(repeat_line(mode, straggler, rep, times[straggler][-1],
                                      bounds[straggler]), flush=True)
            rows += [table_row(mode, straggler, times[straggler], bounds[straggler],
                               times[False], bounds[False]) for straggler in (False, True)]
    print(header)
    print("-" * len(header))
    print("\n".join(rows))
    print("iteration: median over repeats of the run's steady iteration period (wall time of "
          "the iterations after the warm-up over their number). wire bound: the "
          "busiest link's time at its rate (a PS worker's push then pull, in sequence; "
          "otherwise one direction; headers excluded). slowdown: "
          f"over the equal links of the same mode. '-': a median period {BELOW_BOUND}.")


if __name__ == "__main__":
    _cli.run(main)
