"""Gradient communication on a shaped network, one invocation: accelopt's plain all-reduce vs
each gradcomm option vs PyTorch DDP (plain, fp16_compress_hook, powerSGD_hook), same model,
data, total batch, optimizer and bucket size, 2 workers on gloo.

Prints per variant: bytes on the wire per iteration (the kernel's loopback counter inside the
shaped namespace: every byte of every process), the iteration time (one definition on both
sides: rank 0's wall time from the start of the first iteration after warm-up to the end of
the last, over the iterations between, on ``time.perf_counter``; DDP's rank stamps the same
points of its loop as accelopt's step does: before the batch is read, after the optimizer
step), the link's floor for the variant's payload (its bytes at the shaped rate),
the loss curve (global batch) at a few points, and final accuracy on the digits test split.
Needs root (network namespace + tc tbf; no latency shaping: netem is missing on this kernel).

    python benchmarks/gradcomm_compare.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import _cli
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.cluster import netns, run_cluster
from accelopt.drivers.cluster.launch import free_port
from accelopt.drivers.cluster.settings import parse_rate
from accelopt.drivers.processes import release_before_exit
from accelopt.job import Job
from accelopt.job.optim import make_optimizer
from accelopt.job.params import shard_rows
from accelopt.workloads.models import MODEL_NAMES

WARMUP = 2


@dataclass
class Result:
    name: str
    wire_bytes: float | None
    iteration_s: float | None
    losses: list[float]
    accuracy: float
    note: str = ""
    ratio_a: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def job_config(args: argparse.Namespace) -> JobConfig:
    return JobConfig(name="bench", model=args.model, dataset="digits", width=args.width,
                     batch_size=args.batch, iterations=args.iterations, seed=0,
                     optimizer="sgd", lr=args.lr, momentum=0.9)


def accuracy(spec: JobConfig, params: dict[str, torch.Tensor]) -> float:
    job = Job(spec, job_id="eval", device=torch.device("cpu"))
    job.model.load_state_dict(params, strict=False)
    x, y = job.dataset.eval_set()
    with torch.no_grad():
        return float((job.model(x).argmax(1) == y).float().mean())


def accelopt_variant(args: argparse.Namespace, name: str, gradcomm: dict[str, Any] | None,
                     bucket_mb: float) -> Result:
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(job_config(args))]
    cfg.cluster.mode = "allreduce"
    cfg.cluster.workers = 2
    cfg.cluster.bucket_mb = bucket_mb
    cfg.cluster.timeout_s = 120
    cfg.cluster.network.bandwidth = None if args.bandwidth == "none" else args.bandwidth
    cfg.run.threads = 1
    if gradcomm is not None:
        cfg.plugins = {"gradcomm": gradcomm}
    out = run_cluster(cfg, run_dir=tempfile.gettempdir())
    m = out.metrics
    rows = [r for r in out.plugin_rows if r.plugin == "gradcomm"]
    note = ""
    if rows and "sent_fraction" in rows[0].metrics:
        note = f"sent {float(rows[0].metrics['sent_fraction']):.2%} of elements"
    payload = sum(r.stats.payload_bytes for r in out.ranks) / 2 / args.iterations
    first = next(r for r in out.ranks if r.rank == 0)
    its = next(iter(first.parts.values())).iterations
    steady = (its[-1]["end_s"] - its[WARMUP]["start_s"]) / (len(its) - WARMUP)
    return Result(name, m.get("loopback_bytes_per_iteration"), steady,
                  list(out.results[0].losses), accuracy(job_config(args), out.state), note,
                  m.get("ratio_a"), {"payload": payload, "median_iteration_s": m.get("iteration_s")})


def ddp_child(rank: int, world: int, port: int, namespace: str, spec: JobConfig, hook: str,
              bucket_mb: float, rank_power: int, out_dir: str) -> None:
    """One DDP rank inside the shaped namespace: same job, same rows of each global batch."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    if namespace:
        netns.enter(namespace)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    job = Job(spec, job_id="ddp", device=torch.device("cpu"))
    model = DDP(job.model, bucket_cap_mb=bucket_mb)
    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook in ("powersgd", "powersgd-sync"):
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=rank_power,
                                            start_powerSGD_iter=2)
        if hook == "powersgd":
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            def in_order(st, bucket):  # no annotations: DDP checks them (strings here)
                """powerSGD_hook issues its P and Q all-reduces from future callbacks (gloo's
                threads), racing the next bucket's first all-reduce from the autograd
                thread: the ranks issue them in different orders. Waiting for each bucket's
                whole chain keeps one order on every rank, at the cost of overlap."""
                fut = powerSGD_hook.powerSGD_hook(st, bucket)
                fut.wait()
                return fut

            model.register_comm_hook(state, in_order)
    opt = make_optimizer(spec, model.parameters())
    row0, row1 = shard_rows(spec.batch_size, world)[rank]
    times, losses, lo, starts = [], [], [], []
    for i in range(spec.iterations):
        lo.append(netns.tx_bytes())
        t0 = time.perf_counter()
        starts.append(t0)
        x, y = job.dataset.batch(i, spec.batch_size)
        x, y = x[row0:row1], y[row0:row1]
        opt.zero_grad(set_to_none=True)
        loss = job.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()) * (row1 - row0) / spec.batch_size)
    end = time.perf_counter()
    lo.append(netns.tx_bytes())
    params = {n: p.detach().clone() for n, p in job.model.named_parameters()}
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as fh:
        pickle.dump({"times": times, "losses": losses, "lo": lo, "params": params,
                     "starts": starts, "end": end}, fh)
    dist.barrier()
    dist.destroy_process_group()
    # End here, as accelopt's ranks do: left to the interpreter's exit, the DDP wrapper's
    # gloo threads may free a finished work's tensors while Python shuts down, which aborts
    # the process ('terminate called without an active exception', ~1 exit in 20 on this
    # machine, plain DDP alike) and lost a whole invocation's repeats with it.
    release_before_exit()
    os._exit(0)


def ddp_variant(args: argparse.Namespace, name: str, hook: str, bucket_mb: float) -> Result:
    """Plain DDP in two spawned processes (``args.bandwidth`` ``none``: on this machine's
    own loopback, unshaped and uncounted)."""
    spec = job_config(args)
    shaped = args.bandwidth != "none"
    namespace = (netns.Namespace(netns.Shape(parse_rate(args.bandwidth), None)) if shaped
                 else contextlib.nullcontext(None))
    with tempfile.TemporaryDirectory() as out_dir, namespace as ns:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=ddp_child, args=(r, 2, port, ns.name if ns else "", spec,
                                                     hook, bucket_mb, args.powersgd_rank,
                                                     out_dir))
                 for r in range(2)]
        with _cli.stopping(procs):  # no rank outlives an error, Ctrl-C or SIGTERM
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout=600)
                if p.exitcode != 0:
                    raise RuntimeError(f"DDP rank failed ({name}): exit code {p.exitcode}")
        ranks = [pickle.load(open(Path(out_dir) / f"rank{r}.pkl", "rb")) for r in range(2)]
    r0 = ranks[0]
    losses = [a + b for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    lo = r0["lo"]
    diffs = [b - a for a, b in zip(lo, lo[1:], strict=False) if a is not None and b is not None]
    steady = (r0["end"] - r0["starts"][WARMUP]) / (len(r0["starts"]) - WARMUP)
    payload = sum(p.numel() * p.element_size() for p in r0["params"].values())
    if hook == "fp16":
        payload //= 2
    return Result(name, statistics.median(diffs[WARMUP:]) if diffs[WARMUP:] else None,
                  steady, losses, accuracy(spec, r0["params"]),
                  extra={"median_iteration_s": statistics.median(r0["times"][WARMUP:]),
                         "payload": None if hook.startswith("powersgd") else payload})


def main() -> None:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--bandwidth", type=_cli.rate_or_none, default="200mbit")
    ap.add_argument("--model", default="mlp", choices=MODEL_NAMES)
    ap.add_argument("--width", type=_cli.positive_int, default=512)
    ap.add_argument("--batch", type=_cli.positive_int, default=64)
    ap.add_argument("--iterations", type=_cli.positive_int, default=150)
    ap.add_argument("--lr", type=_cli.positive_float, default=0.05)
    ap.add_argument("--bucket-mb", type=_cli.positive_float, default=0.25)
    ap.add_argument("--density", type=_cli.fraction, default=0.01)
    ap.add_argument("--threshold", type=_cli.positive_float, default=0.002)
    ap.add_argument("--powersgd-rank", type=_cli.positive_int, default=2)
    ap.add_argument("--repeats", type=_cli.positive_int, default=3)
    ap.add_argument("--only", type=_cli.comma_separated(_cli.nonnegative_int, allow_empty=True),
                    default="", help="comma-separated variant numbers to run")
    args = ap.parse_args()
    if args.iterations <= WARMUP:
        ap.error(f"--iterations must be > {WARMUP} (the first {WARMUP} are excluded)")
    d = args.density
    topk = {"sparsify": "topk", "density": d, "topk_scope": "bucket"}
    thr = {"sparsify": "threshold", "threshold": args.threshold}
    no_mc, mc = {"momentum_correction": False}, {"momentum_correction": True}
    shared = {"topk_scope": "model"}
    variants: list[tuple[str, Any]] = [
        ("all-reduce fp32", lambda: accelopt_variant(args, "all-reduce fp32", None, args.bucket_mb)),
        ("  no overlap", lambda: accelopt_variant(args, "  no overlap", {"overlap": False},
                                                   args.bucket_mb)),
        ("  no fusion", lambda: accelopt_variant(args, "  no fusion", None, 1e-6)),
        ("gradcomm fp16", lambda: accelopt_variant(args, "gradcomm fp16", {"dtype": "fp16"},
                                                   args.bucket_mb)),
        ("gradcomm bf16", lambda: accelopt_variant(args, "gradcomm bf16", {"dtype": "bf16"},
                                                   args.bucket_mb)),
        # the rows of the recorded table: error feedback only (no momentum correction)
        (f"top-k {d:g}", lambda: accelopt_variant(
            args, f"top-k {d:g}", {**topk, **no_mc}, args.bucket_mb)),
        (f"top-k {d:g} fp16", lambda: accelopt_variant(
            args, f"top-k {d:g} fp16", {**topk, **no_mc, "dtype": "fp16"}, args.bucket_mb)),
        (f"top-k {d:g} 1 bucket", lambda: accelopt_variant(
            args, f"top-k {d:g} 1 bucket", {**topk, **no_mc}, 25.0)),
        (f"top-k {d:g} no EF", lambda: accelopt_variant(
            args, f"top-k {d:g} no EF", {**topk, **no_mc, "error_feedback": False},
            args.bucket_mb)),
        (f"threshold {args.threshold:g}", lambda: accelopt_variant(
            args, f"threshold {args.threshold:g}", {**thr, **no_mc}, args.bucket_mb)),
        # DGC momentum correction (+ factor masking unless said), the plugin's default for
        # sparse modes under SGD with momentum
        (f"top-k {d:g} +MC", lambda: accelopt_variant(
            args, f"top-k {d:g} +MC", {**topk, **mc}, args.bucket_mb)),
        (f"top-k {d:g} fp16 +MC", lambda: accelopt_variant(
            args, f"top-k {d:g} fp16 +MC", {**topk, **mc, "dtype": "fp16"}, args.bucket_mb)),
        (f"top-k {d:g} 1 bucket +MC", lambda: accelopt_variant(
            args, f"top-k {d:g} 1 bucket +MC", {**topk, **mc}, 25.0)),
        (f"top-k {d:g} +MC no mask", lambda: accelopt_variant(
            args, f"top-k {d:g} +MC no mask", {**topk, **mc, "factor_masking": False},
            args.bucket_mb)),
        (f"threshold {args.threshold:g} +MC", lambda: accelopt_variant(
            args, f"threshold {args.threshold:g} +MC", {**thr, **mc}, args.bucket_mb)),
        # k shared over the whole model (one step stale), buckets still overlap backward
        (f"top-k {d:g} model", lambda: accelopt_variant(
            args, f"top-k {d:g} model", {**topk, **no_mc, **shared}, args.bucket_mb)),
        (f"top-k {d:g} model +MC", lambda: accelopt_variant(
            args, f"top-k {d:g} model +MC", {**topk, **mc, **shared}, args.bucket_mb)),
        (f"top-k {d:g} model fp16 +MC", lambda: accelopt_variant(
            args, f"top-k {d:g} model fp16 +MC", {**topk, **mc, **shared, "dtype": "fp16"},
            args.bucket_mb)),
        ("DDP fp32", lambda: ddp_variant(args, "DDP fp32", "none", args.bucket_mb)),
        ("DDP fp16_compress", lambda: ddp_variant(args, "DDP fp16_compress", "fp16",
                                                  args.bucket_mb)),
        # one bucket: powerSGD_hook issues its all-reduces from future callbacks, and with
        # several buckets on gloo their order differs between ranks ("Received data size
        # doesn't match expected size ... collective mismatch"); one bucket is a chain
        (f"DDP powerSGD r={args.powersgd_rank}", lambda: ddp_variant(
            args, f"DDP powerSGD r={args.powersgd_rank}*", "powersgd", 100.0)),
        (f"DDP powerSGD r={args.powersgd_rank} sync", lambda: ddp_variant(
            args, f"DDP powerSGD r={args.powersgd_rank} sync+", "powersgd-sync",
            args.bucket_mb)),
    ]
    chosen = {int(s) for s in args.only.split(",") if s} or set(range(len(variants)))
    if not chosen <= set(range(len(variants))):
        ap.error(f"--only: variant numbers are 0-{len(variants) - 1}; got "
                 f"{','.join(map(str, sorted(chosen - set(range(len(variants))))))}")
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}, gloo, "
          f"2 workers x 1 thread, shaped loopback {args.bandwidth} (tbf, shared by all links)")
    print(f"job: {args.model} width {args.width} on digits, global batch {args.batch}, "
          f"{args.iterations} iterations, SGD lr {args.lr} momentum 0.9, bucket "
          f"{args.bucket_mb:g} MiB (no fusion: one bucket per tensor); iter ms = median over "
          f"{args.repeats} round-robin runs of each run's wall time per iteration on rank 0 "
          f"(start of iteration {WARMUP} to end of the last, the same clock and the same "
          "points of the loop on both sides)")
    runs: dict[int, list[Result]] = {}
    for rep in range(args.repeats):  # round-robin, so slow drift hits every variant alike
        for k, (name, fn) in enumerate(variants):
            if k not in chosen:
                continue
            t0 = time.time()
            try:
                runs.setdefault(k, []).append(fn())
            except Exception as exc:  # noqa: BLE001 - one failed variant must not hide the rest
                print(f"  FAILED {name.strip()}: {type(exc).__name__}: {exc}", flush=True)
                continue
            print(f"  repeat {rep + 1}: ran {name.strip()} in {time.time() - t0:.0f} s",
                  flush=True)
    results: list[Result] = []
    for k in sorted(runs):
        rs = runs[k]
        if not rs:  # failed in every repeat (printed above)
            continue
        first = rs[0]
        differ = [i + 1 for i, r in enumerate(rs[1:], 1)
                  if r.losses != first.losses or r.accuracy != first.accuracy]
        if differ:  # the table prints one curve and one accuracy per variant: say so
            print(f"  NOT DETERMINISTIC: {first.name.strip()}: repeat(s) "
                  f"{', '.join(map(str, differ))} ended at another loss or accuracy than repeat "
                  f"1 (accuracies {', '.join(f'{r.accuracy:.2%}' for r in rs)}); the table "
                  "shows repeat 1's", flush=True)
        times = [r.iteration_s for r in rs if r.iteration_s is not None]
        wires = [r.wire_bytes for r in rs if r.wire_bytes is not None]
        first.iteration_s = statistics.median(times) if times else None
        first.wire_bytes = statistics.median(wires) if wires else None
        first.extra["iteration_s_runs"] = times
        results.append(first)  # same seed, same data: checked above
    base = results[0]
    n = len(base.losses)
    points = sorted({0, n // 4, n // 2, 3 * n // 4, n - 1})
    rate = None if args.bandwidth == "none" else parse_rate(args.bandwidth) / 8  # bytes/s
    header = (f"{'variant':<22}{'payload KiB':>12}{'wire KiB/it':>12}{'vs fp32':>9}"
              f"{'link ms':>9}{'iter ms':>9}{'vs fp32':>9}"
              f"{'test acc':>10}{'d acc':>7}  loss at it {','.join(str(p) for p in points)}")
    print(header)
    print("-" * len(header))
    for r in results:
        wire = "-" if r.wire_bytes is None else f"{r.wire_bytes / 1024:.1f}"
        fewer = (f"{base.wire_bytes / r.wire_bytes:.1f}x" if r.wire_bytes and base.wire_bytes
                 else "-")
        it = "-" if r.iteration_s is None else f"{r.iteration_s * 1e3:.1f}"
        speed = (f"{r.iteration_s / base.iteration_s:.2f}" if r.iteration_s and base.iteration_s
                 else "-")
        curve = " ".join(f"{r.losses[p]:.3f}" for p in points if p < len(r.losses))
        pay = r.extra.get("payload")
        pay_s = "-" if pay is None else f"{pay / 1024:.1f}"
        floor = "-" if pay is None or rate is None else f"{2 * pay / rate * 1e3:.1f}"
        print(f"{r.name:<22}{pay_s:>12}{wire:>12}{'1/' + fewer:>9}{floor:>9}{it:>9}{speed:>9}"
              f"{r.accuracy:>10.2%}"
              f"{(r.accuracy - base.accuracy) * 100:>+7.1f}  {curve}  {r.note}")
    print("* powerSGD runs with one DDP bucket (with several, its callback-issued gloo "
          "collectives mismatch between ranks); + the same hook with the default buckets, "
          "each bucket's all-reduce chain awaited inside the hook (one order on every rank, "
          "no overlap)")
    print("+MC: DGC momentum correction with momentum factor masking (no mask: without); "
          "rows without +MC set momentum_correction=false (error feedback only); top-k rows "
          "without 'model' take k per bucket (topk_scope=bucket), 'model' shares k over the "
          "model (topk_scope=model, the plugin's default)")
    print("payload: what one rank hands to gloo per iteration (transport count: all-reduce "
          "input or all-gather contribution); wire: every byte on the shaped loopback per "
          "iteration (kernel counter, both ranks, TCP/IP and gloo framing included)")
    print("link ms (the bound): both ranks' payloads at the shaped rate (in a 2-rank ring "
          "all-reduce each rank sends its whole payload once, half in reduce-scatter, half in "
          "all-gather, and one shaped loopback carries both ranks' traffic); the iteration is "
          "at least max(compute, link ms) even with perfect overlap")
    print(f"a = Mc/Pc of plain all-reduce (median over iterations): "
          f"{base.ratio_a:.2f}" if base.ratio_a is not None else "a: not measured")


if __name__ == "__main__":
    _cli.run(main)
