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

The clock is the process's CPU time with one torch thread, so all compute runs on the calling
thread and a busy machine disturbs the figure far less than wall time. Model build and the
one-off profiling are excluded. Each *pair* runs (a) and (b) (and (a) and (c)) back to back,
in alternating order; the overhead is the median over the pairs of (b)/(a) - 1, printed with
its spread (min, quartiles, max) and the number of pairs. The runtime's bookkeeping alone
(an empty step) is printed after, as a diagnostic.

    python benchmarks/overhead.py [--pairs 24] [--iterations 400] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from accelopt.activation import PluginSet
from accelopt.config import JobConfig
from accelopt.drivers.local import Executor
from accelopt.job import Job, build_jobs
from accelopt.plugin import Registry

SPEC = JobConfig(name="mlp-a", model="mlp", batch_size=64, iterations=400, seed=1)
"""The default workload's first job (configs/workload/default.yaml)."""


def plain_loop(spec: JobConfig) -> float:
    """(a) What a user writes by hand: CPU seconds per iteration."""
    (job,) = build_jobs([spec], torch.device("cpu"))
    model, data = job.model, job.dataset
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)
    loss_fn = nn.CrossEntropyLoss()
    cpu = time.process_time()
    for i in range(spec.iterations):
        x, y = data.batch(i, spec.batch_size)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
        float(loss.detach())  # the runtime reads the loss every iteration too
    return (time.process_time() - cpu) / spec.iterations


def plugins_of(names: list[str]) -> PluginSet:
    registry = Registry.discover()
    return PluginSet.of((registry.get(n), registry.get(n).instantiate()) for n in names)


def accelopt_driver(spec: JobConfig, names: list[str], trace_hooks: bool,
                    step: Callable[[Job], None] | None = None) -> float:
    """(b)/(c): CPU seconds per iteration of the local driver running the job."""
    plugins = plugins_of(names)
    (job,) = build_jobs([spec], torch.device("cpu"), plugins)
    calls: list[tuple[str, float, float]] = []
    if trace_hooks:
        plugins.set_timer(lambda hook, start, end: calls.append((hook, start, end)))
    if step is not None:
        job.step = step.__get__(job)  # type: ignore[method-assign]
    executor = Executor(plugins, [job], capacity_bytes=None, device="cpu")
    cpu = time.process_time()
    executor.run()
    return (time.process_time() - cpu) / spec.iterations


def empty_step(self: Job, events: object = None) -> object:
    """A step that does no work: what is left is the driver's own bookkeeping."""
    from accelopt.types import IterationResult

    self.iteration += 1
    return IterationResult(self.info.job_id, self.iteration - 1, 0.0, 0.0, 0.0, 64)


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return (f"min {min(values):+.2%}  q1 {q[0]:+.2%}  median {statistics.median(values):+.2%}"
            f"  q3 {q[2]:+.2%}  max {max(values):+.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=24)
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = JobConfig(**{**SPEC.__dict__, "iterations": args.iterations})
    sides: dict[str, Callable[[], float]] = {
        "a": lambda: plain_loop(spec),
        "b": lambda: accelopt_driver(spec, [], trace_hooks=True),
        "c": lambda: accelopt_driver(spec, ["noop"], trace_hooks=True),
    }
    for side in sides.values():  # warm-up, not recorded
        side()
    seconds: dict[str, list[float]] = {k: [] for k in sides}
    ratios: dict[str, list[float]] = {"b": [], "c": []}
    for pair in range(args.pairs):
        for other in ("b", "c"):
            order = ("a", other) if pair % 2 == 0 else (other, "a")
            got = {k: sides[k]() for k in order}
            seconds["a"].append(got["a"])
            seconds[other].append(got[other])
            ratios[other].append(got[other] / got["a"] - 1)

    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} torch thread(s), torch {torch.__version__}, python "
          f"{platform.python_version()}; load average {os.getloadavg()[0]:.2f}")
    print(f"job: {spec.name} (MLP width 256, batch {spec.batch_size}), {spec.iterations} "
          f"iterations per side, {args.pairs} interleaved pairs per comparison, CPU clock")
    print(f"{'side':<44}{'median us/it':>14}")
    labels = {"a": "a plain hand-written loop",
              "b": "b accelopt, no plugins",
              "c": "c accelopt + noop (every hook), hook trace on"}
    for key, label in labels.items():
        print(f"{label:<44}{statistics.median(seconds[key]) * 1e6:>14.1f}")
    print("\noverhead vs the plain loop, per pair ((x / a) - 1), over "
          f"{args.pairs} pairs each:")
    for key in ("b", "c"):
        print(f"  {labels[key]:<44} {spread(ratios[key])}")
    base = statistics.median(seconds["a"])
    empty = JobConfig(**{**spec.__dict__, "iterations": 20000})
    print("\ndiagnostic: the driver's bookkeeping per iteration (a step that does no work, CPU "
          f"clock, median of 5), as a share of the plain loop's {base * 1e6:.0f} us:")
    for key, names in (("b", []), ("c", ["noop"])):
        cost = statistics.median(accelopt_driver(empty, names, True, empty_step)
                                 for _ in range(5))
        print(f"  {labels[key]:<44}{cost * 1e6:>8.2f} us = {cost / base:.2%}")


if __name__ == "__main__":
    main()
