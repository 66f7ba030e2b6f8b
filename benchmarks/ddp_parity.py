"""accelopt's all-reduce mode vs a plain hand-written PyTorch DDP script on the same job, in
one invocation: fp32 (accelopt, no plugin vs DDP's own all-reduce) and fp16 (gradcomm
``dtype=fp16 error_feedback=false check_finite=false`` vs DDP's built-in
``fp16_compress_hook``), 2 gloo workers x 1 thread, on a shaped loopback link and unshaped.

Both sides train the same model from the same weights on the same rows of the same global
batches with the same optimizer and bucket size, and are timed the same way: rank 0's wall
time from the start of iteration ``WARMUP`` to the end of the last iteration, over the
iterations in between (everything a step costs, the driver's time between steps included).
Each repeat runs the accelopt side and the DDP side back to back, alternating which goes
first, so drift hits both; the figure is the median over repeats of DDP time / accelopt time
(1.0: as fast as DDP; > 1: faster), with its spread. Needs root for the shaped link.

    python benchmarks/ddp_parity.py [--bandwidths 100mbit,none] [--repeats 5] [--pairs fp32,fp16]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _cli  # noqa: E402
import torch  # noqa: E402
from gradcomm_compare import WARMUP, accelopt_variant, ddp_variant, job_config  # noqa: E402

from accelopt.workloads.models import MODEL_NAMES  # noqa: E402

PAIRS = {
    "fp32": (None, "none"),
    "fp16": ({"dtype": "fp16", "error_feedback": False, "check_finite": False}, "fp16"),
}
"""name -> (gradcomm settings of the accelopt side, DDP hook of the plain side). The fp16
pair does the same work on both sides: DDP's ``fp16_compress_hook`` casts and sums, keeps no
rounding error and never looks for NaN/Inf, so gradcomm's error feedback (on by default;
three more passes over every bucket, and other numerics) and its finiteness check (one
``aminmax`` pass per bucket) are off here. Its cast-overflow check stays (a pass DDP does
not make)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--bandwidths", type=_cli.comma_separated(_cli.rate_or_none), default="100mbit,none",
                    help="comma-separated links; 'none': unshaped loopback")
    ap.add_argument("--model", default="mlp", choices=MODEL_NAMES)
    ap.add_argument("--width", type=_cli.positive_int, default=512)
    ap.add_argument("--batch", type=_cli.positive_int, default=1024)
    ap.add_argument("--iterations", type=_cli.positive_int, default=60)
    ap.add_argument("--lr", type=_cli.positive_float, default=0.1)
    ap.add_argument("--bucket-mb", type=_cli.positive_float, default=0.25)
    ap.add_argument("--repeats", type=_cli.positive_int, default=5)
    ap.add_argument("--pairs", default=",".join(PAIRS),
                    help=f"comma-separated pairs to run, of {', '.join(PAIRS)}")
    args = ap.parse_args()
    if args.iterations <= WARMUP:
        ap.error(f"--iterations must be > {WARMUP} (the first {WARMUP} are excluded)")
    args.powersgd_rank = 1
    pairs = [p for p in args.pairs.split(",") if p]
    unknown = sorted(set(pairs) - set(PAIRS))
    if unknown:
        ap.error(f"unknown pair(s) {', '.join(unknown)}; choose from {', '.join(PAIRS)}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"python {platform.python_version()}, gloo, 2 workers x 1 thread; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"job: {args.model} width {args.width} on digits, global batch {args.batch}, "
          f"{args.iterations} iterations (wall per iteration after {WARMUP}), SGD lr {args.lr} "
          f"momentum 0.9, bucket {args.bucket_mb:g} MiB on both sides; {args.repeats} paired "
          f"repeats, order alternating")
    header = (f"{'link':<9}{'pair':<6}{'accelopt ms':>12}{'DDP ms':>9}{'DDP/accelopt':>14}"
              f"{'min':>7}{'max':>7}{'n':>3}  {'loss (accelopt, DDP)':<22}{'wire bound ms':>14}")
    rows = []
    for bandwidth in [b for b in args.bandwidths.split(",") if b]:
        args.bandwidth = bandwidth
        for name in pairs:
            gradcomm, hook = PAIRS[name]
            ratios, ours, theirs, losses = [], [], [], None
            for rep in range(args.repeats):
                sides = [lambda g=gradcomm: accelopt_variant(args, "accelopt", g, args.bucket_mb),
                         lambda h=hook: ddp_variant(args, "DDP", h, args.bucket_mb)]
                if rep % 2:
                    sides.reverse()
                a, b = (f() for f in sides)
                if rep % 2:
                    a, b = b, a
                t_a, t_b = a.iteration_s, b.iteration_s
                ratios.append(t_b / t_a)
                ours.append(t_a)
                theirs.append(t_b)
                losses = (a.losses[-1], b.losses[-1])
                print(f"  {bandwidth} {name} repeat {rep + 1}: accelopt {t_a * 1e3:.1f} ms, "
                      f"DDP {t_b * 1e3:.1f} ms", flush=True)
            bound = "-"
            if bandwidth != "none":
                # a ring all-reduce of 2 ranks sends each rank's gradient bytes once (half in
                # reduce-scatter, half in all-gather); both ranks' traffic crosses the one
                # shaped loopback, so the floor is 2 x one rank's gradient bytes at its rate
                from accelopt.drivers.cluster.settings import parse_rate
                from accelopt.job import Job

                job = Job(job_config(args), job_id="bound", device=torch.device("cpu"))
                elements = sum(p.numel() for p in job.model.parameters())
                wire = elements * (2 if name == "fp16" else 4)
                bound = f"{2 * wire * 8 / parse_rate(bandwidth) * 1e3:.1f}"
            rows.append(f"{bandwidth:<9}{name:<6}{statistics.median(ours) * 1e3:>12.1f}"
                        f"{statistics.median(theirs) * 1e3:>9.1f}"
                        f"{statistics.median(ratios):>14.3f}{min(ratios):>7.3f}"
                        f"{max(ratios):>7.3f}{len(ratios):>3}  "
                        f"{losses[0]:.4f}, {losses[1]:.4f}{'':<8}{bound:>14}")
    print(header)
    print("-" * len(header))
    print("\n".join(rows))
    print("DDP/accelopt: median over the paired repeats of DDP's wall per iteration over "
          "accelopt's (>= 1: accelopt as fast or faster). wire bound: both ranks' gradient "
          "bytes at the link rate (one shaped loopback carries every link), headers excluded.")


if __name__ == "__main__":
    _cli.run(main)
