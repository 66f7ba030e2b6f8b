"""TicTac on the real parameter-server transport over a shaped loopback (root, tbf).

Every heuristic runs the same job (same seed, model, batch, iterations, bandwidth) in one
invocation; rounds alternate the heuristics (none, random, named, tic, tac, ...) so slow
drift of the machine hits all of them alike; the table gives medians over the rounds of
the per-run steady-state medians (first two warm-up iterations excluded) and the same with
warm-up included.

    python benchmarks/tictac_real.py \
        --model inception --width 32 --batch 64 --bandwidth 50mbit --rounds 3

``none`` is the transport without the plugin (its default: layer order, = named);
``tac`` is the self-limited plugin (it stays out of the way when its predicted gain does
not pay for its overhead), ``tac!`` is TAC with force=true.

Rounds rotate the order of the heuristics (round r starts at heuristic r), so no heuristic
always runs right after the same neighbour; "vs random" is the median over rounds of the
paired ratio (same round), next to the ratio of medians. A second table says where the
time goes (first worker, steady iterations, medians): the parameter phase (first parameter
sent -> last one in), how much longer it took than its bytes need at the shaped rate
("link excess": per-transfer costs, idle link), when forward ended, backward, the gradient
tail after backward and the iteration. The header prints the shaper's token-bucket burst
next to the bytes one iteration sends each way: a burst as large as the parameter set lets
every transfer leave at loopback speed, so the link is not the bottleneck it claims to be.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import _cli
from accelopt_plugins.tictac.config import HEURISTIC_CHOICES
from omegaconf import OmegaConf

from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.cluster import run_cluster
from accelopt.drivers.cluster.settings import parse_rate
from accelopt.workloads.models import MODEL_NAMES

HEURISTICS = ("none", "random", "named", "tic", "tac", "tac!")


def make_cfg(args: argparse.Namespace, heuristic: str) -> Any:
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name=args.model, model=args.model, width=args.width, batch_size=args.batch,
        iterations=args.iterations, seed=0, kind=args.kind))]
    cfg.cluster.mode = "ps"
    cfg.cluster.workers = args.workers
    cfg.cluster.servers = 1
    cfg.cluster.timeout_s = 60
    if args.bandwidth != "none":
        cfg.cluster.network.bandwidth = args.bandwidth
    if heuristic != "none":
        name = heuristic.rstrip("!")
        cfg.plugins = {"tictac": {"heuristic": name, "force": heuristic.endswith("!"),
                                  "seed": 0}}
    return cfg


def one_run(args: argparse.Namespace, heuristic: str, run_dir: str) -> dict[str, Any]:
    if args.kind == "infer":
        from tictac_infer_ps import run_inference

        out = run_inference(make_cfg(args, heuristic), run_dir=run_dir)
    else:
        out = run_cluster(make_cfg(args, heuristic), run_dir=run_dir)
    m = out.metrics
    row = {k: m.get(k) for k in (
        "iterations_per_s", "iterations_per_s_with_warmup", "efficiency_e",
        "efficiency_e_with_warmup", "ratio_a", "mc_s", "pc_s", "out_of_order_fraction",
        "transfers_ordered", "param_bytes", "achieved_bandwidth_bps")}
    row["E_per_iteration"] = [round(r["efficiency_e"], 3) if r["efficiency_e"] is not None
                              else None for r in out.per_iteration]
    rows = [r for r in out.plugin_rows if r.plugin == "tictac" and r.metrics]
    row["plugin"] = rows[0].summary if rows else ""
    row["plugin_metrics"] = dict(rows[0].metrics) if rows else {}
    rate = parse_rate(args.bandwidth) / 8 if args.bandwidth != "none" else None
    row["phases"] = phases(out.spans, rate, args.iterations)
    return row


def phases(spans: list[Any], rate_bytes_per_s: float | None, iterations: int,
           warmup: int = 2) -> dict[str, float | None]:
    """Where one steady iteration of the first worker goes (medians, seconds): see the
    module docstring. Times are relative to the worker's iteration start."""
    worker = min((s.process for s in spans if "(worker)" in s.process), default="")
    rows: list[dict[str, float]] = []
    for i in range(warmup if iterations > warmup else 0, iterations):
        mine = [s for s in spans if s.args.get("iteration") == i]
        it = [s for s in mine if s.category == "iteration" and s.process == worker]
        par = [s for s in mine if s.category == "comm" and s.args.get("kind") == "param"
               and int(s.args.get("destination", -2)) == int(worker.split()[1])]
        grd = [s for s in mine if s.category == "comm" and s.args.get("kind") == "grad"
               and int(s.args.get("source", -2)) == int(worker.split()[1])]
        fwd = [s for s in mine if s.process == worker and s.name == "forward"]
        bwd = [s for s in mine if s.process == worker and s.name == "backward"]
        if not (it and par and fwd):
            continue
        t0 = it[0].start_s
        first, last = min(s.start_s for s in par), max(s.end_s for s in par)
        wire = sum(int(s.args.get("bytes", 0)) for s in par) / rate_bytes_per_s \
            if rate_bytes_per_s else None
        fwd_end = max(s.end_s for s in fwd)
        back = (min(s.start_s for s in bwd), max(s.end_s for s in bwd)) if bwd \
            else (fwd_end, fwd_end)
        rows.append({
            "param_phase_s": last - first,
            "link_excess_s": (last - first - wire) if wire is not None else float("nan"),
            "forward_end_s": fwd_end - t0,
            "forward_compute_s": sum(s.end_s - s.start_s for s in fwd),
            "backward_s": back[1] - back[0],
            "grad_tail_s": (max(s.end_s for s in grd) - back[1]) if grd else 0.0,
            "iteration_s": it[0].end_s - t0,
        })
    keys = ("param_phase_s", "link_excess_s", "forward_end_s", "forward_compute_s",
            "backward_s", "grad_tail_s", "iteration_s")
    return {k: med([r[k] for r in rows if r[k] == r[k]]) for k in keys}


def param_bytes(args: argparse.Namespace) -> int:
    """Bytes of the job's parameters (what a server sends each worker per iteration)."""
    import torch

    from accelopt.job import Job

    spec = JobConfig(name=args.model, model=args.model, width=args.width,
                     batch_size=args.batch, seed=0)
    job = Job(spec, job_id=args.model, device=torch.device("cpu"))
    return sum(p.numel() * p.element_size() for p in job.model.parameters())


def med(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return statistics.median(vals) if vals else None


def main() -> int:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--model", default="inception", choices=MODEL_NAMES)
    ap.add_argument("--width", type=_cli.positive_int, default=32)
    ap.add_argument("--batch", type=_cli.positive_int, default=64)
    ap.add_argument("--workers", type=_cli.positive_int, default=1)
    ap.add_argument("--kind", choices=("train", "infer"), default="train",
                    help="train: the cluster runtime's PS training; infer: forward-only PS "
                    "steps (benchmarks/tictac_infer_ps.py), the paper's inference setting")
    ap.add_argument("--bandwidth", type=_cli.rate_or_none, default="50mbit")
    ap.add_argument("--iterations", type=_cli.positive_int, default=20)
    ap.add_argument("--rounds", type=_cli.positive_int, default=3)
    ap.add_argument("--heuristics", type=_cli.names(["none", *HEURISTIC_CHOICES, *(h + "!" for h in HEURISTIC_CHOICES)]), default=",".join(HEURISTICS))
    ap.add_argument("--json", default="", help="also write every run's figures to this file")
    _cli.add_force(ap)
    args = ap.parse_args()
    if args.json:
        _cli.refuse_existing(args.json, args.force, "--json")
    heuristics = [h.strip() for h in args.heuristics.split(",") if h.strip()]
    print(f"# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}; python {sys.version.split()[0]}")
    print(f"# job: {args.kind} {args.model} width {args.width} batch {args.batch}, "
          f"{args.iterations} "
          f"iterations, ps 1 server + {args.workers} worker(s), loopback "
          f"{args.bandwidth}; {args.rounds} rounds x {heuristics}")
    if args.bandwidth != "none":
        from accelopt.drivers.cluster.netns import Shape

        tbf = Shape(parse_rate(args.bandwidth), None).tbf_args()
        burst = int(tbf[tbf.index("burst") + 1])
        print(f"# shaper: tc {' '.join(tbf)}; burst {burst / 1e3:.0f} KB vs parameter bytes "
              f"{param_bytes(args) / 1e3:.0f} KB each way per worker and iteration")
    runs: dict[str, list[dict[str, Any]]] = {h: [] for h in heuristics}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="tictac-bench-") as root:
        for rnd in range(args.rounds):
            for h in heuristics[rnd % len(heuristics):] + heuristics[:rnd % len(heuristics)]:
                run_dir = os.path.join(root, f"{h.replace('!', 'F')}-{rnd}")
                os.makedirs(run_dir)
                runs[h].append(one_run(args, h, run_dir))
    print(f"# wall {time.time() - t0:.0f} s; load after {os.getloadavg()[0]:.2f}")
    base = med([r["iterations_per_s"] for r in runs.get("random", [])])
    paired = {h: med([a["iterations_per_s"] / b["iterations_per_s"]
                      for a, b in zip(runs[h], runs.get("random", []), strict=False)
                      if a["iterations_per_s"] and b["iterations_per_s"]])
              for h in heuristics}
    named = med([r["iterations_per_s"] for r in runs.get("named", runs.get("none", []))])
    print("| order | it/s | it/s (with warm-up) | vs random | vs random (paired) | vs named | E "
          "| E (with warm-up) | a = Mc/Pc | out-of-order | plugin |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for h in heuristics:
        rs = runs[h]
        ips = med([r["iterations_per_s"] for r in rs])
        vs_r = f"{100 * (ips / base - 1):+.1f}%" if base and ips else "-"
        vs_n = f"{100 * (ips / named - 1):+.1f}%" if named and ips else "-"
        pm = rs[0]["plugin_metrics"]
        note = ("-" if not pm else ("enforced" if pm.get("enforced") else "stayed out")
                + f", predicted gain {pm.get('predicted_gain_ms', 0):.2f} ms vs overhead "
                f"{pm.get('overhead_ms', 0):.2f} ms")
        vs_p = f"{100 * (paired[h] - 1):+.1f}%" if paired.get(h) else "-"
        print(f"| {h} | {ips:.3f} | {med([r['iterations_per_s_with_warmup'] for r in rs]):.3f} "
              f"| {vs_r} | {vs_p} | {vs_n} | {med([r['efficiency_e'] for r in rs]):.3f} "
              f"| {med([r['efficiency_e_with_warmup'] for r in rs]):.3f} "
              f"| {med([r['ratio_a'] for r in rs]):.2f} "
              f"| {med([r['out_of_order_fraction'] for r in rs]):.4f} | {note} |")
    print()
    print("Where the time goes (ms; first worker, steady iterations, median over rounds):")
    print()
    print("| order | parameter phase | link excess | forward ends at | forward compute "
          "| backward | gradient tail | iteration |")
    print("|---|---|---|---|---|---|---|---|")
    for h in heuristics:
        ph = [r["phases"] for r in runs[h]]
        cells = []
        for k in ("param_phase_s", "link_excess_s", "forward_end_s", "forward_compute_s",
                  "backward_s", "grad_tail_s", "iteration_s"):
            v = med([p.get(k) for p in ph])
            cells.append("-" if v is None else f"{1e3 * v:.1f}")
        print(f"| {h} | " + " | ".join(cells) + " |")
    floors = [p["param_phase_s"] - p["link_excess_s"] for h in heuristics for r in runs[h]
              for p in [r["phases"]] if p.get("param_phase_s") is not None
              and p.get("link_excess_s") is not None]
    if floors:
        print(f"\nbound: the parameter phase's bytes need {1e3 * med(floors):.1f} ms at the "
              "shaped rate (the link's floor, whatever the order); an order can at best hide "
              "all of forward behind it (E = 1)")
    print()
    print("# it/s per round: " + "; ".join(
        f"{h} {[round(r['iterations_per_s'], 2) for r in runs[h]]}" for h in heuristics))
    print("# E per iteration (first round):")
    for h in heuristics:
        print(f"#   {h}: {runs[h][0]['E_per_iteration']}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        # "x": a file another run wrote there meanwhile is refused, not overwritten
        with open(args.json, "w" if args.force else "x") as fh:
            json.dump({"args": vars(args), "runs": runs}, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    _cli.run(main)
