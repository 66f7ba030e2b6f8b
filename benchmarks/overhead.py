"""Per-iteration overhead of the accelopt runtime and its hook machinery, on a real step.

Runs the default workload's MLP job (``mlp-a`` of ``configs/workload/default.yaml``: MLP of
width 256, batch 64) three ways, on the same model, data and number of iterations:

  (a) a plain hand-written PyTorch training loop doing the same work (the job's batch,
      forward, loss, zero_grad, backward, optimizer step, reading the loss);
  (b) accelopt's local driver running the job's one step (``Job.step``), no plugins;
  (c) the same with the ``noop`` plugin implementing every hook (every per-iteration event
      fires: allocation, iteration start, after forward, before the optimizer step with its
      gradients view, after the step, iteration end), with the hook timeline on, as
      ``accelopt run`` records it by default.

CPU time, end to end: the clock is the process's CPU time with one torch thread. Inside the
driver's lane thread, one iteration of the hand-written loop runs beside every step of the
job, alternately before and after it, so both sides see the same moment of a busy machine
and the same thread; the accelopt side of a pair is the step plus the driver's time until the
next step. The overhead is the median over the pairs of accelopt / plain - 1, printed with
its spread (min, quartiles, max) and the number of pairs. The runtime's bookkeeping alone
(an empty step) is printed after, as a diagnostic.

On a shared VM the time of one iteration moves by tens of percent from one moment to the
next, so ``--instructions SHORT LONG`` also counts the instructions each side executes per
iteration under valgrind's callgrind (a count another process cannot change): each side in
its own process for SHORT and LONG iterations, the difference over LONG - SHORT. A run of one
job runs it on the thread that started the run, as (a) runs: (b) and (c) against (a) are
what the runtime and the hooks add. The plain loop is also counted on a thread of its own
(t): what a lane's thread costs a job's tensors in a run of several jobs (glibc's malloc on a
second thread: an arena of the thread's own, and locks).

    python benchmarks/overhead.py [--iterations 3000] [--threads 1] [--instructions 10 210]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable

import _cli
import torch
from torch import nn

from accelopt.activation import PluginSet
from accelopt.config import JobConfig
from accelopt.drivers.local import Executor
from accelopt.host import HookTrace
from accelopt.job import Job, StepEvents, build_jobs
from accelopt.plugin import Registry
from accelopt.types import IterationResult

SPEC = JobConfig(name="mlp-a", model="mlp", batch_size=64, iterations=400, seed=1)
"""The default workload's first job (configs/workload/default.yaml)."""


class PlainLoop:
    """(a) What a user writes by hand, continued block after block on one model."""

    def __init__(self, spec: JobConfig) -> None:
        (job,) = build_jobs([spec], torch.device("cpu"))
        self.spec, self.model, self.data = spec, job.model, job.dataset
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=spec.lr,
                                         momentum=spec.momentum)
        self.loss_fn = nn.CrossEntropyLoss()
        self.i = 0

    def block(self, n: int) -> float:
        """CPU seconds per iteration of the next ``n`` iterations."""
        gc.collect()  # see Driver.block
        cpu = time.process_time()
        for _ in range(n):
            self.one()
        return (time.process_time() - cpu) / n

    def one(self) -> None:
        x, y = self.data.batch(self.i, self.spec.batch_size)
        loss = self.loss_fn(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self.optimizer.step()
        float(loss.detach())  # the runtime reads the loss every iteration too
        self.i += 1


def plugins_of(names: list[str]) -> PluginSet:
    registry = Registry.discover()
    return PluginSet.of((registry.get(n), registry.get(n).instantiate()) for n in names)


class Driver:
    """(b)/(c): the local driver running the job for a block of iterations (a job of that
    many iterations, built before the clock starts, with fresh plugin instances)."""

    def __init__(self, spec: JobConfig, names: list[str], trace_hooks: bool = True,
                 step: Callable[..., object] | None = None) -> None:
        self.spec, self.names, self.trace_hooks, self.step = spec, names, trace_hooks, step

    def block(self, n: int) -> float:
        spec = JobConfig(**{**self.spec.__dict__, "iterations": n})
        plugins = plugins_of(self.names)
        (job,) = build_jobs([spec], torch.device("cpu"), plugins)
        calls: HookTrace = []
        if self.trace_hooks:  # as accelopt run records the hooks' timeline by default
            plugins.set_trace(calls)
        if self.step is not None:
            job.step = self.step.__get__(job)  # type: ignore[method-assign]
        executor = Executor(plugins, [job], capacity_bytes=None, device="cpu")
        # Every side starts from a collected heap: the imports and the build leave a full
        # collection pending (a third of a million objects to walk), which would otherwise
        # land in whichever side's count first allocates enough to trigger it.
        gc.collect()
        cpu = time.process_time()
        executor.run()
        return (time.process_time() - cpu) / n


def empty_step(self: Job, events: object = None) -> object:
    """A step that does no work: what is left is the driver's own bookkeeping."""
    self.iteration += 1
    return IterationResult(self.info.job_id, self.iteration - 1, 0.0, 0.0, 0.0, 64)


def interleaved(names: list[str], iterations: int, twin: bool = False) -> list[float]:
    """End to end, iteration by iteration: the local driver runs the job (its plugins
    ``names``, hook timeline on) and, inside the driver's own lane thread, one iteration of
    the hand-written loop beside each of its steps, alternately before and after it. The
    accelopt side of iteration k is its step plus the driver's time from the end of step k to
    the start of step k+1 (admission, choice, bookkeeping); the plain side is its one
    iteration. Both run within microseconds of each other on the same thread, so a busy
    machine slows both alike. Returns the per-iteration ratios (accelopt / plain) - 1.

    ``twin``: the same measurement with a second hand-written loop's iteration in place of
    the job's step (the driver still runs around it): what the method itself reads when both
    sides do the same work (its clock reads are system calls, and the second of two
    back-to-back iterations runs slower than the first), to be read beside the others."""
    clock = time.process_time_ns
    plain = PlainLoop(SPEC)
    other = PlainLoop(SPEC) if twin else None
    spec = JobConfig(**{**SPEC.__dict__, "iterations": iterations + 1})
    plugins = plugins_of(names)
    (job,) = build_jobs([spec], torch.device("cpu"), plugins)
    calls: HookTrace = []
    plugins.set_trace(calls)
    marks: list[tuple[int, int, int, int]] = []  # (entry, plain, step start, step end)
    state = {"exit": 0}

    def work(job: Job, events: StepEvents) -> object:
        if other is None:
            return job.step(events)
        other.one()
        return empty_step(job)

    def stepper(job: Job, events: StepEvents) -> object:
        entry = clock()
        if len(marks) % 2:
            t0 = clock()
            plain.one()
            t1 = clock()
            result = work(job, events)
            t2 = clock()
            marks.append((state["exit"], entry, t1 - t0, t2 - t1))
        else:
            t0 = clock()
            result = work(job, events)
            t1 = clock()
            plain.one()
            t2 = clock()
            marks.append((state["exit"], entry, t2 - t1, t1 - t0))
        state["exit"] = clock()
        return result

    Executor(plugins, [job], capacity_bytes=None, device="cpu", stepper=stepper).run()
    ratios = []
    for k in range(1, len(marks)):  # the driver's time before step k belongs to step k-1
        prev_exit, entry, plain_ns, step_ns = marks[k]
        driver_ns = entry - prev_exit
        _, _, prev_plain, prev_step = marks[k - 1]
        ratios.append((prev_step + driver_ns) / prev_plain - 1)
    return ratios


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return (f"min {min(values):+.2%}  q1 {q[0]:+.2%}  median {statistics.median(values):+.2%}"
            f"  q3 {q[2]:+.2%}  max {max(values):+.2%}")


SIDES = {"a": [], "t": [], "b": [], "c": ["noop"], "d": ["noop"]}
"""a: the plain loop on the process's main thread; t: the same on a thread of its own, as a
lane of a run of several jobs runs it; b, c, d: the driver with these plugins (one job: on
the main thread); d is c with the hook timeline off (``run.trace_hooks=false``)."""


def measure(side: str, iterations: int) -> None:
    """One side for ``iterations`` iterations, nothing else (what --instructions counts).

    The heap the imports left is collected and frozen first, as a cluster run's ranks have
    it (``accelopt/drivers/rank_preload.py``): otherwise whether a full collection over
    those ~300,000 objects lands inside the counted iterations decides several thousand
    instructions per iteration (two counts of the same build differed by 0.1%), as much as
    the hooks' margin. Collections of what the iterations themselves allocate still count."""
    gc.collect()
    gc.freeze()
    if side == "a":
        PlainLoop(SPEC).block(iterations)
    elif side == "t":
        plain = PlainLoop(SPEC)
        lane = threading.Thread(target=plain.block, args=(iterations,))
        lane.start()
        lane.join()
    else:
        Driver(SPEC, SIDES[side], trace_hooks=side != "d").block(iterations)


def instructions(short: int, long: int) -> dict[str, float]:
    """Instructions per iteration of each side, counted by valgrind's callgrind (a count, not
    a time: the same for the same binary and inputs whatever else the machine does): each
    side runs in its own process for ``short`` and for ``long`` iterations, and the
    difference of the two totals over ``long - short`` is the per-iteration count (imports,
    build and start-up cancel out)."""
    import sys

    from callgrind import per_step

    return per_step(list(SIDES), lambda side, n: [sys.executable, __file__, "--measure", side,
                                                  "--iterations", str(n)],
                    short, long, env={"OMP_NUM_THREADS": "1"})


def main() -> None:
    parser = argparse.ArgumentParser(description=_cli.summary(__doc__))
    parser.add_argument("--iterations", type=_cli.positive_int, default=3000,
                        help="interleaved iteration pairs per comparison")
    parser.add_argument("--threads", type=_cli.nonnegative_int, default=1,
                        help="torch threads (0: default)")
    parser.add_argument("--instructions", nargs=2, type=_cli.positive_int, metavar=("SHORT", "LONG"),
                        help="also count instructions per iteration under callgrind, from runs "
                             "of SHORT and LONG iterations (e.g. 20 120; minutes per side)")
    parser.add_argument("--measure", choices=sorted(SIDES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instructions and not args.instructions[0] < args.instructions[1]:
        parser.error("--instructions SHORT LONG: SHORT must be below LONG; got "
                     f"{args.instructions[0]} {args.instructions[1]}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure:
        measure(args.measure, args.iterations)
        return
    labels = {"b": "b accelopt, no plugins",
              "c": "c accelopt + noop (every hook), hook trace on"}
    plain = PlainLoop(SPEC)
    plain.block(50)  # warm-up
    base = statistics.median(plain.block(200) for _ in range(5))
    interleaved([], 50)  # warm-up
    ratios = {"b": interleaved([], args.iterations), "c": interleaved(["noop"], args.iterations),
              "aa": interleaved([], args.iterations, twin=True)}
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} torch thread(s), torch {torch.__version__}, python "
          f"{platform.python_version()}; load average {os.getloadavg()[0]:.2f}")
    print(f"job: {SPEC.name} (MLP width 256, batch {SPEC.batch_size}); plain loop "
          f"{base * 1e6:.0f} us/iteration (median of 5 blocks of 200); CPU clock")
    print("bound: 0% (the same model, data and work as the hand-written loop); goal <= 1%")
    print(f"\nend to end, {args.iterations} interleaved iteration pairs per comparison "
          "(accelopt / plain - 1, per pair):")
    for key in ("b", "c"):
        print(f"  {labels[key]:<46} {spread(ratios[key])}")
    twin_label = "A/A: a second plain loop in the step's place"
    print(f"  {twin_label:<46} {spread(ratios['aa'])}")
    print("  (the A/A line is the method's own reading when both sides do the same work)")
    print("\nthe driver's bookkeeping alone (a step that does no work, median of 5 blocks of "
          "20000 iterations):")
    for key, names in (("b", []), ("c", ["noop"])):
        idle = Driver(SPEC, names, True, empty_step)
        cost = statistics.median(idle.block(20000) for _ in range(5))
        print(f"  {labels[key]:<46}{cost * 1e6:>8.2f} us = {cost / base:.2%} of an iteration")
    if args.instructions:
        short, long = args.instructions
        counts = instructions(short, long)
        from callgrind import LAYOUT

        print(f"\ninstructions per iteration (callgrind, runs of {short} and {long} iterations "
              f"per side, {LAYOUT}; a count, not a time):")
        print(f"  {'a plain hand-written loop, main thread':<46}{counts['a']:>14,.0f}")
        for key in ("b", "c"):
            print(f"  {labels[key]:<46}{counts[key]:>14,.0f}  = "
                  f"{counts[key] / counts['a'] - 1:+.2%} vs a (goal <= +1%)")
        print(f"  {'d the same as c, hook trace off':<46}{counts['d']:>14,.0f}  = "
              f"{counts['d'] / counts['a'] - 1:+.2%} vs a (what the hook timeline costs)")
        print(f"  {'t plain hand-written loop, own thread':<46}{counts['t']:>14,.0f}  = "
              f"{counts['t'] / counts['a'] - 1:+.2%} vs a: what a lane thread (several jobs) "
              "costs the job, glibc malloc on a second thread")


if __name__ == "__main__":
    _cli.run(main)
