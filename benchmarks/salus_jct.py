"""SALUS on a seeded trace: average / p95 JCT and makespan under FIFO, SRTF, FAIR, PACK, the
oracle SRPT schedule, and "what a user does without accelopt" (every job its own OS process,
started the moment it arrives). Also switch latency and peak accounted memory.

Paper (Yu & Chowdhury, MLSys 2020): SRTF improves average JCT 3.19x over FIFO. Goal here:
that on our trace, and, trace-independent, SRTF within 10% of the oracle SRPT average JCT
(computed from the jobs' true lengths, measured as their service time in the same SRTF run,
with the same arrivals: the optimum for average JCT on one server with free preemption).

    python benchmarks/salus_jct.py \
        [--jobs 40] [--load 1.0 | --interarrival S] [--repeats 3] [--seed 0] [--threads 1]

The offered load is a design parameter, printed and documented: how much any schedule can
beat FIFO on a trace depends on it (at low load jobs rarely queue, so there is little to
reorder; the busier the device, the more a long job at the head of FIFO's queue costs).
``--load L`` (default 1.0: a fully busy shared device, the situation SALUS is for) keeps the
seeded trace's jobs and Poisson draws and scales its arrivals so that the profiled work
divided by the arrival span is L, i.e. it derives the mean inter-arrival time from the
profiles (printed, so ``--interarrival`` reproduces the same arrivals). The script also
prints the one-server bound (oracle SRPT / FIFO average JCT, computed from the profiles) at
several loads, so a reader sees what the trace allows at each one.

Every side runs the same jobs (same models, data, iterations, arrivals). In-process policies
use ``--threads`` intra-op threads per lane; the OS-process baseline uses torch's default
threads per process (what a user gets), and ``--threads`` per process as a second row.
On a CPU the lanes are accounted, not enforced: the capacity is a budget, not a partition.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import _cli
from accelopt_plugins.salus.metrics import OracleJob, oracle_srpt
from omegaconf import OmegaConf
from salus_common import (
    jct_stats,
    machine,
    profile_all,
    result_stats,
    run_all_at_once,
    run_policy,
)

from accelopt.config import AccelConfig, JobConfig
from accelopt.job import job_specs
from accelopt.types import JobProfile
from accelopt.units import format_bytes, parse_bytes

POLICIES = ("fifo", "srtf", "fair", "pack")
MODELS = ["mlp", "cnn", "resnet", "inception", "lstm", "transformer"]
MIN_ITERATIONS = 20  # the trace's Pareto lengths: [MIN_ITERATIONS, --max-iterations]


def trace_specs(n_jobs: int, seed: int, interarrival: float, max_iterations: int):
    cfg = OmegaConf.structured(AccelConfig)
    gen = cfg.workload.generate
    gen.n_jobs, gen.seed, gen.mean_interarrival_s = n_jobs, seed, interarrival
    gen.models, gen.batch_sizes = MODELS, [16, 32]
    gen.min_iterations, gen.max_iterations, gen.pareto_alpha = MIN_ITERATIONS, max_iterations, 1.1
    return job_specs(cfg)  # the core's own trace -> job mapping (adam for lstm/transformer)


def same_jobs(a: list[JobConfig], b: list[JobConfig]) -> bool:
    """Two traces with the same jobs (arrivals aside)."""
    return [dataclasses.replace(x, arrival_s=0.0) for x in a] == [
        dataclasses.replace(x, arrival_s=0.0) for x in b]


def fifo_finish(jobs: list[OracleJob]) -> dict[str, float]:
    """Completion times of non-preemptive FIFO on one server (arrival order)."""
    now, done = 0.0, {}
    for job in sorted(jobs, key=lambda j: (j.arrival_s, j.job_id)):
        now = max(now, job.arrival_s) + job.length_s
        done[job.job_id] = now
    return done


def bound_at_load(specs: list[JobConfig], profiles: dict[str, JobProfile], load: float,
                  current: float) -> float:
    """Oracle SRPT's average-JCT gain over FIFO on one server, from the profiled job
    lengths, with the trace's arrivals scaled to offered load ``load`` (a model, not a run)."""
    scale = current / load
    jobs = [OracleJob(s.name, s.arrival_s * scale,
                      profiles[s.name].iteration_seconds * s.iterations) for s in specs]

    def avg(finish: dict[str, float]) -> float:
        return statistics.fmean(finish[j.job_id] - j.arrival_s for j in jobs)

    return avg(fifo_finish(jobs)) / avg(oracle_srpt(jobs))


def oracle_stats(results) -> dict[str, float]:
    jobs = [OracleJob(r.job.job_id, r.job.arrival_s, r.service_s) for r in results]
    finish = oracle_srpt(jobs)
    return jct_stats([finish[j.job_id] - j.arrival_s for j in jobs], list(finish.values()),
                     [j.arrival_s for j in jobs])


def main() -> None:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--jobs", type=_cli.positive_int, default=40)
    ap.add_argument("--repeats", type=_cli.positive_int, default=3)
    ap.add_argument("--seed", type=_cli.nonnegative_int, default=0)
    load_or_gap = ap.add_mutually_exclusive_group()
    load_or_gap.add_argument("--load", type=_cli.positive_float, default=1.0,
                             help="target offered load (profiled work / arrival span); the mean "
                                  "inter-arrival time is derived from the profiles")
    load_or_gap.add_argument("--interarrival", type=_cli.nonnegative_float, default=None,
                             help="fix the Poisson mean inter-arrival time instead (seconds)")
    ap.add_argument("--max-iterations", type=_cli.positive_int, default=600)
    ap.add_argument("--threads", type=_cli.positive_int, default=1)
    ap.add_argument("--capacity", type=_cli.size, default="16MiB")
    ap.add_argument("--no-processes", action="store_true", help="skip the OS-process baseline")
    ap.add_argument("--default-threads-timeout", type=_cli.positive_float, default=60.0,
                    help="the torch-default-threads process baseline runs once (repeat 0), "
                         "killed after this many seconds")
    ap.add_argument("--out", default=None,
                    help="directory of results.json and repeat 0's run directories "
                         "(default: runs/bench/salus_jct/<date-time>, a new one each time)")
    _cli.add_force(ap)
    args = ap.parse_args()
    if args.max_iterations < MIN_ITERATIONS:
        ap.error(f"--max-iterations must be >= {MIN_ITERATIONS} (the trace's shortest job); "
                 f"got {args.max_iterations}")
    out = Path(args.out or f"runs/bench/salus_jct/{time.strftime('%Y%m%d-%H%M%S')}")
    _cli.refuse_not_a_directory(out, "--out")
    _cli.refuse_existing(out / "results.json", args.force, "--out")
    for path in (out / f"{policy}-rep0" for policy in POLICIES):  # what this run writes
        _cli.refuse_existing(path, args.force, "--out", directory=True)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"machine: {machine()}", flush=True)

    # The seeded trace's jobs and Poisson draws do not depend on the mean inter-arrival time
    # (it only scales the arrivals), so profile once and place the arrivals for the load.
    if args.interarrival is not None:
        specs = trace_specs(args.jobs, args.seed, args.interarrival, args.max_iterations)
        profiles = profile_all(specs, args.threads)
        interarrival = args.interarrival
    else:
        unit = trace_specs(args.jobs, args.seed, 1.0, args.max_iterations)
        profiles = profile_all(unit, args.threads)
        unit_work = sum(profiles[s.name].iteration_seconds * s.iterations for s in unit)
        unit_span = max(s.arrival_s for s in unit) or 1.0
        interarrival = round(unit_work / (args.load * unit_span), 4)
        specs = trace_specs(args.jobs, args.seed, interarrival, args.max_iterations)
        if not same_jobs(specs, unit):
            raise RuntimeError("the trace's jobs changed with the inter-arrival time")
    work = sum(profiles[s.name].iteration_seconds * s.iterations for s in specs)
    batch = max(s.arrival_s for s in specs) == 0.0  # all jobs at t=0: no arrival span
    span = 1.0 if batch else max(s.arrival_s for s in specs)  # loads then read per second
    load = work / span
    how = ("given" if args.interarrival is not None
           else f"derived from the profiles for --load {args.load}")
    print(f"trace: {len(specs)} jobs, seed {args.seed}, models {', '.join(MODELS)}, batch 16/32, "
          f"Pareto(1.1) iterations in [{MIN_ITERATIONS}, {args.max_iterations}], Poisson arrivals mean "
          f"{interarrival}s ({how}) over {span:.1f}s")
    print(f"offered load (design): profiled work {work:.1f}s at {args.threads} thread(s) / "
          f"arrival span {span:.1f}s = {load:.2f} (profiles on a loaded machine overestimate "
          "the work; the measured load is printed per repeat)" + (
              "; all jobs arrive at t=0, so 'load' here is work per second" if batch else ""))
    sweep = () if batch else (0.5, 0.75, 0.9, 1.0, 1.1, 1.25)
    print("one-server bound from the profiles, oracle SRPT / FIFO average JCT, by offered load "
          "(a model, not a run): " + ", ".join(
              f"{x:.2f}: {bound_at_load(specs, profiles, x, load):.2f}x" for x in sweep)
          + f"; at this trace's {load:.2f}: {bound_at_load(specs, profiles, load, load):.2f}x")
    print(f"settings: {args.threads} intra-op thread(s) per lane, capacity {args.capacity} "
          f"(accounted, not enforced on CPU), {args.repeats} repeats (policy order rotates), "
          "medians shown")
    lengths = sorted(s.iterations for s in specs)
    print(f"iterations per job: min {lengths[0]}, median {lengths[len(lengths) // 2]}, "
          f"max {lengths[-1]}")

    rows: dict[str, list[dict[str, Any]]] = {}
    extras: dict[str, list[dict[str, Any]]] = {}
    for rep in range(args.repeats):
        order = POLICIES[rep % len(POLICIES):] + POLICIES[:rep % len(POLICIES)]
        for policy in order:
            run_dir = out / f"{policy}-rep{rep}" if rep == 0 else None
            results, summary, _ = run_policy(specs, profiles, policy=policy,
                                             capacity=args.capacity, threads=args.threads,
                                             run_dir=run_dir)
            rows.setdefault(policy, []).append(result_stats(results))
            extras.setdefault(policy, []).append(summary)
            if policy == "srtf":
                rows.setdefault("oracle SRPT", []).append(oracle_stats(results))
                measured = sum(r.service_s for r in results)
                rows.setdefault("measured load", []).append({"load": measured / span})
                print(f"  rep {rep} measured work (SRTF service time) {measured:.1f}s -> "
                      f"offered load {measured / span:.2f}", flush=True)
            print(f"  rep {rep} {policy:5s}: avg JCT {rows[policy][-1]['avg_jct']:.2f}s",
                  flush=True)
        fifo_r, srtf_r, oracle_r = (rows[k][-1]["avg_jct"] for k in ("fifo", "srtf",
                                                                      "oracle SRPT"))
        print(f"  rep {rep} ratios: SRTF/FIFO {fifo_r / srtf_r:.2f}x, oracle/FIFO "
              f"{fifo_r / oracle_r:.2f}x, SRTF/oracle {srtf_r / oracle_r:.3f}", flush=True)
        if not args.no_processes:
            variants = [(f"all-at-once ({args.threads} thread/process)", args.threads, 900.0)]
            if rep == 0:
                variants.append(("all-at-once (torch default threads)", 0,
                                 args.default_threads_timeout))
            for label, threads, timeout in variants:
                t = time.perf_counter()
                try:
                    per_job, startup = run_all_at_once(specs, threads=threads, timeout_s=timeout)
                except TimeoutError as exc:
                    print(f"  rep {rep} {label}: {exc}; reported as > {timeout:.0f}s", flush=True)
                    rows.setdefault(label, []).append(
                        {"avg_jct": float("inf"), "p95_jct": float("inf"),
                         "makespan": float("inf")})
                    continue
                rows.setdefault(label, []).append(
                    {**jct_stats([j["jct"] for j in per_job], [j["end"] for j in per_job],
                                 [j["arrival"] for j in per_job]), "startup": startup})
                print(f"  rep {rep} {label}: avg JCT {rows[label][-1]['avg_jct']:.2f}s "
                      f"({time.perf_counter() - t:.0f}s wall, process start-up "
                      f"{startup:.1f}s median, not counted)", flush=True)

    def med(label: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[label])

    def xmed(policy: str, key: str) -> Any:
        values = [e[key] for e in extras.get(policy, []) if e.get(key) is not None]
        return statistics.median(values) if values else None

    fifo = med("fifo", "avg_jct")
    print()
    print(f"{'schedule':38s} {'avg JCT s':>9s} {'p95 JCT s':>9s} {'makespan s':>10s} "
          f"{'FIFO/this':>9s} {'busy':>5s} {'Jain':>5s} {'switch med/p99 ms':>18s} "
          f"{'peak mem':>9s} {'resident':>8s}")
    for label in (k for k in rows if k != "measured load"):
        avg = med(label, "avg_jct")
        line = (f"{label:38s} {avg:9.2f} {med(label, 'p95_jct'):9.2f} "
                f"{med(label, 'makespan'):10.2f} {fifo / avg:8.2f}x")
        if label in extras:
            busy, jain_ = xmed(label, "busy_fraction"), xmed(label, "jain_fairness")
            sw50, sw99 = xmed(label, "switch_latency_median_s"), xmed(label, "switch_latency_p99_s")
            switch = f"{sw50 * 1e3:.3f}/{sw99 * 1e3:.3f}" if sw50 is not None else "-"
            line += (f" {busy:5.2f} {jain_ if jain_ is None else round(jain_, 2)!s:>5s} "
                     f"{switch:>18s} {format_bytes(xmed(label, 'peak_accounted_bytes')):>9s} "
                     f"{xmed(label, 'peak_resident_jobs'):8.0f}")
        print(line)
    srtf, oracle = med("srtf", "avg_jct"), med("oracle SRPT", "avg_jct")
    cap = parse_bytes(args.capacity)
    peak = max(e["peak_accounted_bytes"] for es in extras.values() for e in es)

    def per_rep(num: str, den: str, fmt: str) -> str:
        return ", ".join(format(a["avg_jct"] / b["avg_jct"], fmt)
                         for a, b in zip(rows[num], rows[den], strict=True))

    print()
    loads = [r["load"] for r in rows["measured load"]]
    print(f"offered load: {load:.2f} by design (profiles); measured per repeat "
          f"{', '.join(f'{x:.2f}' for x in loads)}")
    print(f"SRTF vs FIFO average JCT: {fifo / srtf:.2f}x (medians; per repeat "
          f"{per_rep('fifo', 'srtf', '.2f')}) (paper: 3.19x)")
    print(f"oracle SRPT vs FIFO average JCT: {fifo / oracle:.2f}x (medians; per repeat "
          f"{per_rep('fifo', 'oracle SRPT', '.2f')}): the most a one-lane schedule could gain")
    print(f"SRTF vs oracle SRPT average JCT: {srtf / oracle:.3f} (medians; per repeat "
          f"{per_rep('srtf', 'oracle SRPT', '.3f')}) (goal: <= 1.10)")
    print(f"peak accounted memory over all runs: {format_bytes(peak)} of {format_bytes(cap)} "
          f"capacity ({'never exceeded' if peak <= cap else 'EXCEEDED'}); jobs resident at "
          f"once: up to {max(e['peak_resident_jobs'] for es in extras.values() for e in es)} "
          "(exclusive allocation: 1)")
    print("lanes are accounted, not enforced on this CPU")
    print(f"wall {time.perf_counter() - started:.0f}s; at the end: {machine()}")
    (out / "results.json").write_text(json.dumps({"rows": rows, "salus": extras}, indent=1))
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    _cli.run(main)
