"""Time to accuracy: P@1 on the held-out set against training wall-clock, SLIDE vs the dense
PyTorch baseline (and sampled softmax), same data, network, batch, lr and threads.

Each method trains for ``--budget-s`` seconds of *training* time; every ``--eval-every``
seconds the clock stops and P@1/P@5 are measured on ``--eval-n`` held-out points with full
(dense) scoring. Reported: each method's best P@1, the time each needs to reach 95% of the
dense baseline's best, and a PNG of the curves.

    flock /tmp/accelopt-bench.lock python benchmarks/slide_tta.py --width 20k --budget-s 150
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from accelopt_plugins.slide.xcdata import synthetic  # noqa: E402
from slide_common import (  # noqa: E402
    DenseTrainer,
    SampledTrainer,
    SlideTrainer,
    init_net,
    machine,
    p_at_k,
    set_threads,
    slide_config,
)

BATCH = 128
LR = 1e-3


def curve(trainer, ds, budget_s: float, eval_every: float, eval_n: int) -> list[tuple]:
    """[(train seconds, steps, P@1, P@5)], data prepared outside the clock."""
    points = [(0.0, 0, *p_at_k(trainer.eval_model(), ds, eval_n))]
    clock, step, next_eval = 0.0, 0, eval_every
    while clock < budget_s:
        x, y = ds.batch(step, BATCH)  # batch assembly is outside the timed region
        start = time.perf_counter()
        trainer.step(x, y)
        clock += time.perf_counter() - start
        step += 1
        if clock >= next_eval or clock >= budget_s:
            points.append((clock, step, *p_at_k(trainer.eval_model(), ds, eval_n)))
            next_eval += eval_every
            print(f"  {trainer.name:8s} t={clock:7.1f}s step={step:5d} P@1={points[-1][2]:.4f} "
                  f"P@5={points[-1][3]:.4f}", flush=True)
    return points


def time_to(points: list[tuple], target: float) -> float | None:
    for t, _, p1, _ in points:
        if p1 >= target:
            return t
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--width", default="20k")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--eval-every", type=float, default=10.0)
    ap.add_argument("--eval-n", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=["dense", "slide", "sampled"])
    ap.add_argument("--png", default="docs/benchmarks_slide_tta.png")
    args = ap.parse_args()
    set_threads(args.threads)
    ds = synthetic(args.width)
    n, d = ds.num_classes, ds.vocab_size
    print(f"# machine: {machine()}")
    print(f"# {n:,} labels, {d:,} features, {ds.n_train:,} train points, batch {BATCH}, "
          f"Adam lr {LR}, budget {args.budget_s:.0f}s training time per method")
    curves: dict[str, list[tuple]] = {}
    active = 1000
    for method in args.methods:
        init = init_net(d, n)
        if method == "dense":
            tr = DenseTrainer(d, n, LR, init)
        elif method == "slide":
            tr = SlideTrainer(d, n, LR, init, slide_config(n))
        else:
            tr = SampledTrainer(d, n, LR, init, per_sample=active)
        curves[method] = curve(tr, ds, args.budget_s, args.eval_every, args.eval_n)
        if method == "slide":
            s = tr.model.out.summary()
            active = int(round(s["active_per_sample"]))
            print(f"  slide: {active} active/sample ({100 * s['active_fraction']:.2f}%), "
                  f"rebuild share {100 * s['rebuild_time_share']:.1f}%")
        del tr, init
        gc.collect()
    best = {m: max(p[2] for p in c) for m, c in curves.items()}
    steps = {m: c[-1][1] for m, c in curves.items()}
    target = 0.95 * best.get("dense", max(best.values()))
    print(f"\ntarget: P@1 >= {target:.4f} (95% of dense's best {best.get('dense', 0):.4f})")
    print("| method | steps in budget | final P@1 | best P@1 | best P@5 | time to target (s) | "
          "P@1 rise over last 3 evals (points) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    tt = {}
    for m, c in curves.items():
        tt[m] = time_to(c, target)
        shown = f"{tt[m]:.1f}" if tt[m] is not None else f"not reached in {args.budget_s:.0f}"
        rise = 100 * (c[-1][2] - c[max(0, len(c) - 4)][2])
        print(f"| {m} | {steps[m]} | {c[-1][2]:.4f} | {best[m]:.4f} | {max(p[3] for p in c):.4f} "
              f"| {shown} | {rise:+.2f} over {c[-1][0] - c[max(0, len(c) - 4)][0]:.0f}s |")
    if tt.get("dense") and tt.get("slide"):
        print(f"\nSLIDE reaches the target {tt['dense'] / tt['slide']:.1f}x sooner than dense")
    if "dense" in curves:
        for m in curves:
            if m != "dense":
                print(f"{m}: final P@1 {100 * (curves[m][-1][2] - curves['dense'][-1][2]):+.2f} "
                      f"points vs dense's final, best {100 * (best[m] - best['dense']):+.2f} "
                      "points vs dense's best")
    plot(curves, args, n, target)


def plot(curves: dict[str, list[tuple]], args, n: int, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, c in curves.items():
        ax.plot([p[0] for p in c], [p[2] for p in c], marker="o", ms=3, label=m)
    ax.axhline(target, ls="--", c="grey", lw=0.8, label="95% of dense best")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("P@1 (held-out)")
    ax.set_title(f"time to accuracy, {n:,} labels, {args.threads} threads")
    ax.legend()
    fig.tight_layout()
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=120)
    print(f"curves: {args.png}")


if __name__ == "__main__":
    main()
