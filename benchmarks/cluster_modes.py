"""Single process vs parameter server vs all-reduce, same model and total batch, on a
shaped loopback (a fresh network namespace with tc tbf). Needs root and iproute2.

Prints, side by side: iterations/s (wall throughput: the steady iterations over their wall
time), the TicTac metrics of a worker's iteration (Mc, Pc, U, E, a), bytes per
iteration (transport count and the kernel's lo counter) against the model's parameter
bytes x workers x 2, and the achieved bandwidth of one large transfer against the limit.

    sudo python benchmarks/cluster_modes.py --bandwidth 1gbit --width 1024 --batch 512
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import _cli
import torch
from omegaconf import OmegaConf

from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.cluster import run_cluster
from accelopt.drivers.cluster.probe import measure_bandwidth
from accelopt.drivers.cluster.settings import parse_rate
from accelopt.job import Job
from accelopt.workloads.models import MODEL_NAMES

WARMUP = 2


def config(args: argparse.Namespace, mode: str) -> object:
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name="bench", model=args.model, width=args.width, batch_size=args.batch,
        iterations=args.iterations, seed=0))]
    cfg.cluster.mode = mode
    cfg.cluster.workers = args.workers
    cfg.cluster.servers = args.servers
    cfg.cluster.bucket_mb = args.bucket_mb
    cfg.cluster.timeout_s = 120
    cfg.cluster.network.bandwidth = args.bandwidth
    return cfg


def single(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(1)  # each cluster rank runs with one thread too
    cfg = config(args, "none")
    spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig),
                                               cfg.workload.jobs[0]))
    job = Job(spec, job_id="single", device=torch.device("cpu"))
    times = []
    for _ in range(args.iterations):
        t = time.perf_counter()
        job.step()
        times.append(time.perf_counter() - t)
    it = statistics.median(times[WARMUP:])
    return {"wall_iterations_per_s": 1 / it, "pc_s": it}  # one process: no overlap


def median_of(runs: list[dict[str, float]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "-".rjust(int(spec.split(".")[0] or 1))
    return format(value, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--bandwidth", type=_cli.rate, default="1gbit")
    ap.add_argument("--model", default="mlp", choices=MODEL_NAMES)
    ap.add_argument("--width", type=_cli.positive_int, default=1024)
    ap.add_argument("--batch", type=_cli.positive_int, default=512)
    ap.add_argument("--iterations", type=_cli.positive_int, default=8)
    ap.add_argument("--repeats", type=_cli.positive_int, default=1)
    ap.add_argument("--workers", type=_cli.positive_int, default=2)
    ap.add_argument("--servers", type=_cli.positive_int, default=1)
    ap.add_argument("--bucket-mb", type=_cli.positive_float, default=1.0)
    args = ap.parse_args()
    if args.iterations <= WARMUP:
        ap.error(f"--iterations must be > {WARMUP} (the first {WARMUP} are excluded)")
    limit = parse_rate(args.bandwidth)

    rows: dict[str, list[dict[str, float]]] = {"single": [], "ps": [], "allreduce": []}
    for _ in range(args.repeats):
        rows["single"].append(single(args))
        for mode in ("ps", "allreduce"):
            rows[mode].append(run_cluster(config(args, mode), run_dir=".").metrics)
    probe = measure_bandwidth(limit, nbytes=32 * 2**20, repeats=3)

    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"kernel {platform.release()}, torch {torch.__version__}, gloo over a tc-shaped lo")
    print(f"settings: {args.model} width {args.width}, total batch {args.batch}, "
          f"{args.iterations} iterations (first {WARMUP} excluded), {args.workers} workers, "
          f"{args.servers} server(s) in ps mode, bucket {args.bucket_mb} MB, "
          f"bandwidth {args.bandwidth}, medians of {args.repeats} repeat(s)")
    print()
    header = (f"{'mode':<10} {'it/s':>7} {'Mc ms':>8} {'Pc ms':>8} {'U ms':>8} {'E':>6} "
              f"{'a':>6} {'MB/iter':>8} {'lo MB/iter':>10} {'expected MB':>11} {'link Mbit/s':>11}")
    print(header)
    print("-" * len(header))
    for mode, runs in rows.items():
        ms = {k: median_of(runs, k) for k in (
            "wall_iterations_per_s", "mc_s", "pc_s", "iteration_makespan_s", "efficiency_e",
            "ratio_a", "bytes_per_iteration", "loopback_bytes_per_iteration",
            "expected_bytes_per_iteration", "achieved_bandwidth_bps")}

        def scaled(key: str, factor: float, ms: dict = ms) -> float | None:
            return None if ms[key] is None else ms[key] * factor

        print(f"{mode:<10} {fmt(ms['wall_iterations_per_s'], '7.2f')} "
              f"{fmt(scaled('mc_s', 1e3), '8.1f')} {fmt(scaled('pc_s', 1e3), '8.1f')} "
              f"{fmt(scaled('iteration_makespan_s', 1e3), '8.1f')} "
              f"{fmt(ms['efficiency_e'], '6.2f')} {fmt(ms['ratio_a'], '6.2f')} "
              f"{fmt(scaled('bytes_per_iteration', 1e-6), '8.3f')} "
              f"{fmt(scaled('loopback_bytes_per_iteration', 1e-6), '10.3f')} "
              f"{fmt(scaled('expected_bytes_per_iteration', 1e-6), '11.3f')} "
              f"{fmt(scaled('achieved_bandwidth_bps', 1e-6), '11.1f')}")
    ps = rows["ps"][0]
    print()
    print(f"bytes on the wire (ps): transport {ps['bytes_per_iteration']:.0f} B/iter, "
          f"lo {ps.get('loopback_bytes_per_iteration', float('nan')):.0f} B/iter vs "
          f"params x workers x 2 = {ps['expected_bytes_per_iteration']:.0f} B: "
          f"{100 * (ps['bytes_per_iteration'] / ps['expected_bytes_per_iteration'] - 1):+.3f}% "
          f"(transport), "
          f"{100 * (ps.get('loopback_bytes_per_iteration', 0) / ps['expected_bytes_per_iteration'] - 1):+.2f}% (lo)")
    achieved = statistics.median(probe)
    print(f"achieved bandwidth, one 32 MiB gloo transfer: {achieved / 1e6:.1f} Mbit/s vs "
          f"configured {limit / 1e6:.0f} Mbit/s ({100 * (achieved / limit - 1):+.1f}%); "
          f"runs: {', '.join(f'{p / 1e6:.1f}' for p in probe)}")
    floor_s = ps["expected_bytes_per_iteration"] * 8 / limit
    print(f"bound (ps): one iteration's {ps['expected_bytes_per_iteration'] / 1e6:.3f} MB at the "
          f"configured {limit / 1e6:.0f} Mbit/s take {floor_s * 1e3:.1f} ms: at most "
          f"{1 / floor_s:.2f} iterations/s with compute fully overlapped (one shaped loopback "
          "carries every link)")
    print("Mc, Pc, U, E, a: medians over a worker's steady iterations; Mc and Pc are the "
          "communication and compute inside a worker's iteration span, whichever iteration a "
          "transfer belongs to (a one-job ps worker runs free: its pushes end in the next "
          "iteration), U is that span's length; E < 0: the worker idled (none of its own "
          "transfers in flight, no compute) longer than its transfers and compute overlapped")


if __name__ == "__main__":
    _cli.run(main)
