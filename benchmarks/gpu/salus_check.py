"""GPU check for salus (about a minute on one CUDA GPU; skips cleanly without CUDA).

Runs two training jobs in two lanes (PACK, max 2 lanes) through the real core executor with
the salus plugin on CUDA, where each lane is a real ``torch.cuda.MemPool`` with its own
stream, and verifies:

1. both lanes existed at once and both jobs finished;
2. each job's iteration allocations landed in its own lane's pool (the pool holds segments,
   and the memory outside the pools did not grow by more than a small slack while the jobs
   ran: their activations did not go to the default pool);
3. each lane's peak *allocated* bytes (replayed from the caching allocator's trace, per lane
   stream) stay under the lane's accounted size, which follows the SALUS recipe (allocator
   statistics of allocated bytes). The pool's *reserved* bytes are printed beside it: the
   caching allocator rounds blocks into segments, so a lane's real device footprint is larger
   than its allocated peak, and the check says by how much;
4. the capacity used is the real device memory (torch.cuda.mem_get_info).

    python benchmarks/gpu/salus_check.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _cli
import _cli  # noqa: E402

SLACK = 20 * 2**20


def peak_allocated_on(trace: list[dict], stream: int) -> int:
    """Replay the allocator trace: the peak of bytes allocated on ``stream`` and not yet freed
    (blocks allocated before recording began are ignored, their frees too)."""
    live: dict[int, int] = {}
    current = peak = 0
    for event in trace:
        if event.get("stream") != stream:
            continue
        action, addr = event.get("action"), event.get("addr")
        if action == "alloc":
            live[addr] = event["size"]
            current += event["size"]
            peak = max(peak, current)
        elif action == "free_completed" and addr in live:
            current -= live.pop(addr)
    return peak


def main() -> int:
    # before the CUDA check: --help shows what the check does, and a mistyped option is
    # refused here instead of starting the whole check on a GPU
    argparse.ArgumentParser(description=_cli.summary(__doc__)).parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device (salus GPU check needs one)")
        return 0
    from accelopt_plugins.salus import PLUGIN, SalusConfig
    from omegaconf import OmegaConf

    from accelopt.config import AccelConfig, JobConfig
    from accelopt.drivers.local import Executor
    from accelopt.host import PluginHost
    from accelopt.job import Job
    from accelopt.job.profile import measure_profile
    from accelopt.types import RunInfo

    device = torch.device("cuda")
    specs = [
        JobConfig(name="gpu-cnn", model="cnn", batch_size=512, iterations=60, width=64, seed=1),
        JobConfig(name="gpu-resnet", model="resnet", batch_size=256, iterations=40, width=32,
                  seed=2),
    ]
    jobs = [Job(s, job_id=f"{i:02d}-{s.name}", device=device) for i, s in enumerate(specs)]
    for job in jobs:
        job.with_profile(measure_profile(job))
    free, total = torch.cuda.mem_get_info()
    config = SalusConfig(policy="pack", max_lanes=2)
    plugin = PLUGIN.instantiate(config)
    host = PluginHost([(PLUGIN, plugin)])
    run_cfg = OmegaConf.structured(AccelConfig)
    run_cfg.run.device = "cuda"
    host.call("accelopt_configure", config=config, run_config=run_cfg)
    info = RunInfo("", "cuda:0", host.names, tuple(j.info for j in jobs), 0)
    host.call("accelopt_run_start", run=info)
    torch.cuda.synchronize()
    outside_before = torch.cuda.memory_reserved()
    torch.cuda.memory._record_memory_history(context=None, stacks="python",
                                             max_entries=2_000_000)
    print(f"running 2 jobs in 2 lanes on {torch.cuda.get_device_name()}", flush=True)
    executor = Executor(host, jobs, capacity_bytes=int(total), device="cuda:0")
    results = executor.run()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    summary = plugin.summary()
    lanes_cuda = plugin._cuda
    allocated_peak = {lane: peak_allocated_on(trace, sid)
                      for lane, sid in lanes_cuda.stream_ids.items()}
    pools = summary["cuda_pool_peak_bytes"]
    sizes = summary["lane_size_peak_bytes"]
    pool_total = sum(pools.values())
    outside_growth = torch.cuda.memory_reserved() - outside_before - pool_total

    checks: list[tuple[str, bool, str]] = []
    checks.append(("both jobs done", all(r.status == "done" for r in results),
                   ", ".join(f"{r.job.name}={r.status} {r.error}" for r in results)))
    checks.append(("two lanes at once", summary["peak_lanes"] == 2 and len(pools) == 2,
                   f"peak lanes {summary['peak_lanes']}, pools {sorted(pools)}"))
    for lane, reserved in sorted(pools.items()):
        checks.append((f"lane {lane}: allocations in its pool", reserved > 0,
                       f"pool reserved {reserved / 2**20:.1f} MiB"))
        peak = allocated_peak.get(lane, 0)
        checks.append((f"lane {lane}: allocated peak <= lane size", 0 < peak <= sizes.get(lane, 0),
                       f"allocated peak {peak / 2**20:.1f} MiB vs lane "
                       f"{sizes.get(lane, 0) / 2**20:.1f} MiB (pool reserved "
                       f"{reserved / 2**20:.1f} MiB: the caching allocator's segment rounding)"))
    checks.append(("activations did not go to the default pool", outside_growth <= 2 * SLACK,
                   f"reserved outside pools grew {outside_growth / 2**20:.1f} MiB"))
    checks.append(("capacity is the real device memory", plugin.capacity == int(total),
                   f"{plugin.capacity} vs mem_get_info total {total}"))
    print(f"device: {torch.cuda.get_device_name()}, {total / 2**30:.1f} GiB "
          f"({free / 2**30:.1f} GiB free at start)")
    print(f"salus: {plugin.summary_line()}")
    print(f"pool routing: {summary['cuda_routing']} (stream: backward's autograd thread lands in "
          "the lane too; thread: forward and optimizer only)")
    failed = 0
    for name, ok, detail in checks:
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    print(f"SUMMARY: {'PASS' if not failed else 'FAIL'} ({len(checks) - failed}/{len(checks)})")
    return 1 if failed else 0


if __name__ == "__main__":
    _cli.run(main)
