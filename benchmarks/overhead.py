"""Per-iteration overhead of the accelopt runtime and its hook machinery.

Runs the default MLP job (``workload=single``: MLP, batch 64) three ways, on the same model,
data and number of iterations:

  (a) a plain hand-written PyTorch training loop,
  (b) accelopt's executor with no plugins,
  (c) accelopt's executor with the ``noop`` plugin implementing every hook.

Two clocks per side: wall time, and the process's CPU time. With ``--threads 1`` all of
torch's compute runs on the calling thread, so CPU time counts exactly the work done and is
far less disturbed by other processes on a busy machine than wall time. Model build and
accelopt's one-off profiling of the job are excluded (profiling is reported separately).
The three sides are interleaved in rotating order, repeated; medians are printed side by side.

    python benchmarks/overhead.py [--iterations 300] [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from torch import nn

from accelopt.config import JobConfig
from accelopt.host import PluginHost
from accelopt.plugin import Registry
from accelopt.runtime.executor import Executor
from accelopt.runtime.profile import measure_profile
from accelopt.runtime.run import build_jobs

SPEC = JobConfig(name="mlp", model="mlp", batch_size=64, iterations=300, seed=0)


def plain_loop(spec: JobConfig) -> tuple[float, float, float]:
    """(a) What a user writes by hand: (wall s/iter, cpu s/iter, 0)."""
    (job,) = build_jobs([spec], torch.device("cpu"), PluginHost())
    model, data = job.model, job.dataset
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)
    loss_fn = nn.CrossEntropyLoss()
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(spec.iterations):
        x, y = data.batch(i, spec.batch_size)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
        float(loss.detach())  # the runtime reads the loss every iteration too
    n = spec.iterations
    return (time.perf_counter() - start) / n, (time.process_time() - cpu) / n, 0.0


def accelopt_executor(spec: JobConfig, plugins: list[str]) -> tuple[float, float, float]:
    """(b)/(c): (wall s/iter, cpu s/iter, one-off profiling seconds)."""
    registry = Registry.discover()
    active = [(registry.get(n), registry.get(n).instantiate()) for n in plugins]
    host = PluginHost(active)
    (job,) = build_jobs([spec], torch.device("cpu"), host)
    started = time.perf_counter()
    job.with_profile(measure_profile(job))
    profile_s = time.perf_counter() - started
    executor = Executor(host, [job], capacity_bytes=None, device="cpu")
    start, cpu = time.perf_counter(), time.process_time()
    executor.run()
    n = spec.iterations
    return (time.perf_counter() - start) / n, (time.process_time() - cpu) / n, profile_s


def runtime_cost_per_iteration(spec: JobConfig, plugins: list[str]) -> float:
    """CPU seconds the runtime itself spends per iteration: the executor driving a job whose
    step does no work (it only advances the iteration counter). Stable even on a busy
    machine, because it is pure bookkeeping measured with the CPU clock."""
    registry = Registry.discover()
    host = PluginHost([(registry.get(n), registry.get(n).instantiate()) for n in plugins])
    (job,) = build_jobs([spec], torch.device("cpu"), host)
    job.with_profile(measure_profile(job))

    def empty_step() -> tuple[float, int]:
        job.iteration += 1
        return 0.0, spec.batch_size

    job.step = empty_step  # type: ignore[method-assign]
    executor = Executor(host, [job], capacity_bytes=None, device="cpu")
    cpu = time.process_time()
    executor.run()
    return (time.process_time() - cpu) / spec.iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    parser.add_argument("--width", type=int, default=256, help="MLP hidden width")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = JobConfig(**{**SPEC.__dict__, "iterations": args.iterations, "width": args.width})
    sides = {
        "a plain loop": lambda: plain_loop(spec),
        "b accelopt, no plugins": lambda: accelopt_executor(spec, []),
        "c accelopt + noop (all hooks)": lambda: accelopt_executor(spec, ["noop"]),
    }
    names = list(sides)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    profile: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up, not recorded
        sides[name]()
    for rep in range(args.repeats):
        order = names[rep % 3:] + names[: rep % 3]
        for name in order:
            w, c, prof = sides[name]()
            wall[name].append(w)
            cpu[name].append(c)
            profile[name].append(prof)

    base_wall = statistics.median(wall[names[0]])
    base_cpu = statistics.median(cpu[names[0]])
    print(f"machine: {platform.machine()} {platform.processor() or ''} "
          f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, "
          f"python {platform.python_version()}")
    print(f"job: MLP (width {args.width}), batch {spec.batch_size}, {spec.iterations} "
          f"iterations, {args.repeats} repeats (interleaved), medians; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'side':<32}{'wall us/it':>11}{'overhead':>10}{'cpu us/it':>11}{'overhead':>10}"
          f"{'cpu min-max':>17}{'profile s':>11}")
    for name in names:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        spread = f"{min(cpu[name]) * 1e6:.0f}-{max(cpu[name]) * 1e6:.0f}"
        print(f"{name:<32}{w * 1e6:>11.1f}{(w / base_wall - 1) * 100:>9.2f}%"
              f"{c * 1e6:>11.1f}{(c / base_cpu - 1) * 100:>9.2f}%{spread:>17}"
              f"{statistics.median(profile[name]):>11.3f}")
    empty = JobConfig(**{**spec.__dict__, "iterations": 20000})
    print("\nruntime bookkeeping per iteration (empty job step, CPU clock, median of "
          f"{args.repeats}), as a share of the plain loop's {base_cpu * 1e6:.0f} us iteration:")
    for name, plugins in (("b accelopt, no plugins", []), ("c accelopt + noop", ["noop"])):
        costs = [runtime_cost_per_iteration(empty, plugins) for _ in range(args.repeats)]
        cost = statistics.median(costs)
        print(f"  {name:<30}{cost * 1e6:>8.1f} us  = {cost / base_cpu * 100:.2f}% of an iteration")


if __name__ == "__main__":
    main()
