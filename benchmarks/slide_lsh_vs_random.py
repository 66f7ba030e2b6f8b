"""LSH-selected vs uniformly random active sets of equal size: P@1 per iteration, and recall
of the exact top-10 logits in the LSH-retrieved set.

Both runs train the same SLIDE network from the same weights on the same batches; the only
difference is ``sampling``: the LSH default (top 1000 of the retrieved buckets by hits, plus
labels, topped up at random) or ``random`` (labels + uniform neurons up to the LSH run's
measured average active count).

    python benchmarks/slide_lsh_vs_random.py --width 200k
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _cli  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from accelopt_plugins.slide.xcdata import SIZES, synthetic  # noqa: E402
from slide_common import (  # noqa: E402
    SlideTrainer,
    init_net,
    machine,
    p_at_k,
    set_threads,
    slide_config,
    use_huge_pages,
)

BATCH = 128
LR = 1e-3


def recall_top10(trainer: SlideTrainer, ds, n_points: int = 256) -> tuple[float, float]:
    """Mean |exact top-10 ∩ retrieved| / 10 over held-out points, and retrieved set size."""
    model = trainer.model
    layer = model.out
    x, _ = next(ds.eval_batches(n_points))
    with torch.no_grad():
        h = model.act(model.embed(x))
        exact = torch.nn.functional.linear(h, layer.weight, layer.bias).topk(10, 1).indices
    hn = np.ascontiguousarray(h.numpy())
    s = layer.select(hn, np.zeros((len(hn), 0), np.int64), 0)
    rec = []
    for b in range(len(hn)):
        got = set(s["ids"][b, : s["n_active"][b]].tolist())
        rec.append(len(got & set(exact[b].tolist())) / 10)
    return float(np.mean(rec)), float(np.mean(s["n_active"][: len(hn)]))


def main() -> None:
    use_huge_pages()  # before any model is built: the same memory setting for every method
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--width", default="200k", choices=list(SIZES))
    ap.add_argument("--steps", type=_cli.positive_int, default=400)
    ap.add_argument("--eval-every", type=_cli.positive_int, default=100)
    ap.add_argument("--eval-n", type=_cli.positive_int, default=2000)
    ap.add_argument("--threads", type=_cli.positive_int, default=2)
    args = ap.parse_args()
    set_threads(args.threads)
    ds = synthetic(args.width)
    n, d = ds.num_classes, ds.vocab_size
    print(f"# machine: {machine()}")
    print(f"# {n:,} labels, batch {BATCH}, Adam lr {LR}, {args.steps} steps, same batches and "
          "initial weights for both")
    results = {}
    active = None
    for mode in ("lsh", "random"):
        cfg = slide_config(n) if mode == "lsh" else slide_config(
            n, sampling="random", min_active=active, max_active=active + 64)
        tr = SlideTrainer(d, n, LR, init_net(d, n), cfg)
        rows = []
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            tr.step(*ds.batch(step - 1, BATCH))
            if step % args.eval_every == 0:
                p1, p5 = p_at_k(tr.eval_model(), ds, args.eval_n)
                rec = recall_top10(tr, ds) if mode == "lsh" else (None, None)
                rows.append((step, p1, p5, *rec))
                print(f"  {mode:6s} step {step:4d}: P@1 {p1:.4f} P@5 {p5:.4f}"
                      + (f" recall@10 of retrieved {rec[0]:.3f} ({rec[1]:.0f} retrieved)"
                         if rec[0] is not None else ""), flush=True)
        s = tr.model.out.summary()
        if mode == "lsh":
            active = int(round(s["active_per_sample"]))
        results[mode] = (rows, s, time.perf_counter() - start)
        del tr
    print(f"\nactive neurons per sample: LSH {results['lsh'][1]['active_per_sample']:.0f}, "
          f"random {results['random'][1]['active_per_sample']:.0f} (of {n:,})")
    print("| step | P@1 LSH | P@1 random | P@5 LSH | P@5 random | recall of exact top-10 in "
          "LSH-retrieved set | retrieved / sample | recall of a random set that size |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (st, p1l, p5l, rec, size), (_, p1r, p5r, *_) in zip(results["lsh"][0],
                                                             results["random"][0], strict=True):
        print(f"| {st} | {p1l:.4f} | {p1r:.4f} | {p5l:.4f} | {p5r:.4f} | {rec:.3f} | {size:.0f} "
              f"| {size / n:.4f} |")
    print("bound: recall 1.000 (a retrieval that always finds the exact top-10 logits); the "
          "floor is the last column, what a random set of the same size recalls")


if __name__ == "__main__":
    _cli.run(main)
