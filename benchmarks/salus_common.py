"""Shared machinery of the salus benchmarks: build a trace's jobs, run them in-process under a
salus policy (the real core executor + the salus plugin), run them "without accelopt" (one OS
process per job, all started at arrival), and describe the machine.

Jobs are profiled once, up front, and every side reuses the same profiles: the SALUS authors
profiled offline too, and it keeps the executor's on-arrival profiling (which runs in the
main thread) out of every policy's JCT alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _cli
import torch
from accelopt_plugins.salus import PLUGIN, SalusConfig
from omegaconf import OmegaConf

from accelopt import PluginSpec
from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.local import Executor
from accelopt.host import PluginHost
from accelopt.job import Job
from accelopt.job.profile import measure_profile
from accelopt.records import JobResult, RunRecord
from accelopt.report import write_run_outputs
from accelopt.types import JobProfile, RunInfo
from accelopt.units import parse_bytes

LOCK_HINT = "python benchmarks/<x>.py"


def machine() -> str:
    load = os.getloadavg()
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__} ({'OpenMP' if 'OpenMP' in torch.__config__.parallel_info() else '?'}), "
        f"python {platform.python_version()}, load average {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}"
    )


def build(specs: list[JobConfig], profiles: dict[str, JobProfile] | None = None) -> list[Job]:
    jobs = [Job(s, job_id=f"{i:02d}-{s.name}", device=torch.device("cpu"))
            for i, s in enumerate(specs)]
    if profiles is not None:
        for job in jobs:
            job.with_profile(profiles[job.info.name])
    return jobs


def profile_all(specs: list[JobConfig], threads: int) -> dict[str, JobProfile]:
    torch.set_num_threads(threads)
    return {job.info.name: measure_profile(job) for job in build(specs)}


def run_policy(
    specs: list[JobConfig],
    profiles: dict[str, JobProfile],
    *,
    policy: str,
    capacity: str,
    threads: int,
    max_lanes: int = -1,
    run_dir: Path | None = None,
    extra_plugins: list[Any] = (),  # type: ignore[assignment]
    history: str = "",
) -> tuple[list[JobResult], dict[str, Any], RunRecord]:
    """Run every job under one salus policy; return results, salus's summary, the record.
    ``extra_plugins``: hook implementations beside salus (a benchmark's noise source);
    ``history``: ``plugins.salus.history`` (past jobs' lengths, for ``gittins``)."""
    config = SalusConfig(policy=policy, capacity=capacity, threads=threads, max_lanes=max_lanes,
                         history=history if policy == "gittins" else "")
    plugin = PLUGIN.instantiate(config)
    host = PluginHost([(PLUGIN, plugin), *((PluginSpec(f"extra{i}", lambda _c, p=p: p), p)
                                           for i, p in enumerate(extra_plugins))])
    run_cfg = OmegaConf.structured(AccelConfig)
    run_cfg.run.device = "cpu"
    run_cfg.run.deterministic = True
    host.call("accelopt_configure", config=config, run_config=run_cfg)
    jobs = build(specs, profiles)
    info = RunInfo(str(run_dir or ""), "cpu", host.names, tuple(j.info for j in jobs), 0)
    host.call("accelopt_run_start", run=dataclasses.replace(info, run_dir=str(run_dir or "")))
    executor = Executor(host, jobs, capacity_bytes=parse_bytes(capacity), device="cpu")
    started = time.perf_counter()
    results = executor.run()
    record = RunRecord(info=info, duration_s=time.perf_counter() - started, jobs=results,
                       spans=executor.spans)
    host.call("accelopt_run_end", run=info, metrics={})
    record.plugin_rows = [r for rows in host.call("accelopt_report_rows", run=info) for r in rows]
    if run_dir is not None:
        write_run_outputs(record, run_dir)
    return results, plugin.summary(), record


CHILD = r"""
import json, sys, time
spec = json.loads(sys.argv[1])
threads = int(sys.argv[2])
import torch
if threads:
    torch.set_num_threads(threads)
from accelopt.config import JobConfig
from accelopt.job import Job
job = Job(JobConfig(**spec), job_id=spec["name"], device=torch.device("cpu"))
print("ready", flush=True)
sys.stdin.readline()
start = time.time()
while not job.done:
    job.step()
print(json.dumps({"start": start, "end": time.time()}), flush=True)
"""


def run_all_at_once(
    specs: list[JobConfig], *, threads: int = 0, timeout_s: float = 900.0
) -> tuple[list[dict[str, float]], float]:
    """"What a user does without accelopt": one OS process per job, each started the moment
    its job arrives, all competing for the machine. The processes are spawned (python and
    torch imported, model built) before the clock starts and released at their arrival
    times, so the figure is pure contention; the one-off start-up cost is returned apart.

    ``threads=0`` leaves torch's default (every process uses all cores), as a user would.
    Returns per-job {arrival, end, jct} and the median process start-up seconds.
    """
    procs: list[subprocess.Popen] = []
    # no job process outlives this call when it ends on an error, Ctrl-C or SIGTERM
    with _cli.stopping(procs):
        return _all_at_once(specs, procs, threads, timeout_s)


def _all_at_once(specs: list[JobConfig], procs: list[subprocess.Popen], threads: int,
                 timeout_s: float) -> tuple[list[dict[str, float]], float]:
    spawn = []
    for spec in specs:
        t = time.perf_counter()
        proc = _cli.popen(
            [sys.executable, "-c", CHILD, json.dumps(dataclasses.asdict(spec)), str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        procs.append(proc)
        spawn.append(t)
    startup = []
    for proc, t in zip(procs, spawn, strict=True):
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if line.strip() != "ready":
            raise RuntimeError(f"child failed to start: {line!r}")
        startup.append(time.perf_counter() - t)
    t0 = time.time()
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_s)
    for i in order:
        delay = t0 + specs[i].arrival_s - time.time()
        if delay > 0:
            time.sleep(delay)
        procs[i].stdin.write("go\n")  # type: ignore[union-attr]
        procs[i].stdin.flush()  # type: ignore[union-attr]
    out = []
    deadline = time.time() + timeout_s
    for spec, proc in zip(specs, procs, strict=True):
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
                other.wait()
            raise TimeoutError(f"the processes had not finished after {timeout_s:.0f}s") from None
        times = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        arrival = t0 + spec.arrival_s
        out.append({"arrival": spec.arrival_s, "end": times["end"] - t0,
                    "jct": times["end"] - arrival})
    return out, statistics.median(startup)


def jct_stats(jcts: list[float], ends: list[float], arrivals: list[float]) -> dict[str, float]:
    ordered = sorted(jcts)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {
        "avg_jct": statistics.fmean(jcts),
        "p95_jct": _pct(jcts, 95) if jcts else p95,
        "makespan": max(ends) - min(arrivals),
    }


def _pct(values: list[float], q: float) -> float:
    from accelopt.report.metrics import percentile

    result = percentile(values, q)
    assert result is not None
    return result


def result_stats(results: list[JobResult]) -> dict[str, float]:
    done = [r for r in results if r.status == "done"]
    if len(done) != len(results):
        bad = [f"{r.job.name}: {r.status} {r.error}" for r in results if r.status != "done"]
        raise RuntimeError("jobs did not finish: " + "; ".join(bad))
    return jct_stats([r.jct_s for r in done], [r.end_s for r in done],  # type: ignore[misc]
                     [r.job.arrival_s for r in done])
