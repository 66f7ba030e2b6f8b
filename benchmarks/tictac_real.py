"""TicTac on the real parameter-server transport over a shaped loopback (root, tbf).

Every heuristic runs the same job (same seed, model, batch, iterations, bandwidth) in one
invocation; rounds alternate the heuristics (none, random, named, tic, tac, ...) so slow
drift of the machine hits all of them alike; the table gives medians over the rounds of
the per-run steady-state medians (first two warm-up iterations excluded) and the same with
warm-up included.

    flock /tmp/accelopt-bench.lock /work/venv/bin/python benchmarks/tictac_real.py \
        --model inception --width 32 --batch 64 --bandwidth 50mbit --rounds 3

``none`` is the transport without the plugin (its default: layer order, = named);
``tac`` is the self-limited plugin (it stays out of the way when its predicted gain does
not pay for its overhead), ``tac!`` is TAC with force=true.
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

from omegaconf import OmegaConf

from accelopt.cluster import run_cluster
from accelopt.config import AccelConfig, JobConfig

HEURISTICS = ("none", "random", "named", "tic", "tac", "tac!")


def make_cfg(args: argparse.Namespace, heuristic: str) -> Any:
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name=args.model, model=args.model, width=args.width, batch_size=args.batch,
        iterations=args.iterations, seed=0))]
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
    return row


def med(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return statistics.median(vals) if vals else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="inception")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--bandwidth", default="50mbit")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heuristics", default=",".join(HEURISTICS))
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    heuristics = args.heuristics.split(",")
    print(f"# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}; python {sys.version.split()[0]}")
    print(f"# job: {args.model} width {args.width} batch {args.batch}, {args.iterations} "
          f"iterations, ps 1 server + {args.workers} worker(s), loopback "
          f"{args.bandwidth}; {args.rounds} rounds x {heuristics}")
    runs: dict[str, list[dict[str, Any]]] = {h: [] for h in heuristics}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="tictac-bench-") as root:
        for rnd in range(args.rounds):
            for h in heuristics:
                run_dir = os.path.join(root, f"{h.replace('!', 'F')}-{rnd}")
                os.makedirs(run_dir)
                runs[h].append(one_run(args, h, run_dir))
    print(f"# wall {time.time() - t0:.0f} s; load after {os.getloadavg()[0]:.2f}")
    base = med([r["iterations_per_s"] for r in runs.get("random", [])])
    named = med([r["iterations_per_s"] for r in runs.get("named", runs.get("none", []))])
    print("| order | it/s | it/s (with warm-up) | vs random | vs named | E | E (with warm-up) "
          "| a = Mc/Pc | out-of-order | plugin |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for h in heuristics:
        rs = runs[h]
        ips = med([r["iterations_per_s"] for r in rs])
        vs_r = f"{100 * (ips / base - 1):+.1f}%" if base and ips else "-"
        vs_n = f"{100 * (ips / named - 1):+.1f}%" if named and ips else "-"
        pm = rs[0]["plugin_metrics"]
        note = ("-" if not pm else ("enforced" if pm.get("enforced") else "stayed out")
                + f", predicted gain {pm.get('predicted_gain_ms', 0):.2f} ms vs overhead "
                f"{pm.get('overhead_ms', 0):.2f} ms")
        print(f"| {h} | {ips:.3f} | {med([r['iterations_per_s_with_warmup'] for r in rs]):.3f} "
              f"| {vs_r} | {vs_n} | {med([r['efficiency_e'] for r in rs]):.3f} "
              f"| {med([r['efficiency_e_with_warmup'] for r in rs]):.3f} "
              f"| {med([r['ratio_a'] for r in rs]):.2f} "
              f"| {med([r['out_of_order_fraction'] for r in rs]):.4f} | {note} |")
    print("# E per iteration (first round):")
    for h in heuristics:
        print(f"#   {h}: {runs[h][0]['E_per_iteration']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "runs": runs}, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
