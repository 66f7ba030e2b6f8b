"""Where SLIDE's step time goes at one width: per-phase ms/step, the rebuild's parts, and
1 vs 2 thread scaling per phase (SLIDE only; no baselines: use slide_step.py for those).

Same trainer, data, settings and timing method as ``slide_step.py`` (preloaded batches,
warm-up steps incl. JIT and first table build, then ``--reps`` blocks of ``--steps`` steps,
median block). The rebuild is timed inside the blocks (amortised) and once more in isolation
with its parts: rehashing (keys of the neurons to rehash) and refilling the tables.

    python benchmarks/slide_profile.py --width 670k --threads 1 2
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _cli  # noqa: E402
import numba  # noqa: E402
import numpy as np  # noqa: E402
from accelopt_plugins.slide.config import HASHES  # noqa: E402
from accelopt_plugins.slide.tables import INSERTIONS, build_tables  # noqa: E402
from accelopt_plugins.slide.xcdata import SIZES, synthetic  # noqa: E402
from slide_common import (  # noqa: E402
    SlideTrainer,
    init_net,
    machine,
    parse_overrides,
    preload,
    set_threads,
    slide_config,
    use_huge_pages,
)
from slide_step import BATCH, LR, run  # noqa: E402


def rebuild_parts(layer) -> dict[str, float]:
    """Time one rebuild's parts in isolation (ms)."""
    dirty = int(layer.dirty.numpy().sum())
    keys = np.empty_like(layer.keys.numpy(), order="F")
    t0 = time.perf_counter()
    layer._neuron_keys(out=keys)
    t1 = time.perf_counter()
    rows = np.flatnonzero(layer.dirty.numpy())
    t2 = time.perf_counter()
    layer._neuron_keys(rows, out=keys, scatter=True)
    t3 = time.perf_counter()
    build_tables(keys, layer.tables.numpy(), layer.counts.numpy(),
                 INSERTIONS[layer.cfg.insertion], 0)
    t4 = time.perf_counter()
    return {"rehash all": 1e3 * (t1 - t0), "rehash dirty": 1e3 * (t3 - t2),
            "fill tables": 1e3 * (t4 - t3), "dirty rows": dirty}


def main() -> None:
    use_huge_pages()  # before any model is built: the same memory setting for every method
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--width", default="670k", choices=list(SIZES))
    ap.add_argument("--threads", type=_cli.positive_int, nargs="+", default=[2])
    ap.add_argument("--reps", type=_cli.positive_int, default=3)
    ap.add_argument("--steps", type=_cli.positive_int, default=50)
    ap.add_argument("--hash", default="simhash", choices=HASHES)
    ap.add_argument("--k", type=_cli.positive_int, default=9)
    ap.add_argument("--slide", nargs="*", default=[], metavar="KEY=VALUE",
                    help="further SLIDE settings, e.g. topup=batch topk=50 l=16")
    args = ap.parse_args()
    overrides = {"hash": args.hash, "k": args.k, **parse_overrides(args.slide)}
    ds = synthetic(args.width)
    n, d = ds.num_classes, ds.vocab_size
    batches = preload(ds, 0, 60, BATCH)
    res = {}
    for threads in args.threads:
        set_threads(threads)
        init = init_net(d, n)
        tr = SlideTrainer(d, n, LR, init, slide_config(n, **overrides))
        t, ph = run(tr, batches, 5, args.reps, args.steps)
        summ = tr.model.out.summary()
        print(f"# machine: {machine()}, numba threading layer {numba.threading_layer()}")
        print(f"## {n:,} labels, {threads} thread(s), {overrides}: "
              f"{1e3 * t:.1f} ms/step (median of {args.reps} blocks of {args.steps})")
        print("  ms/step: " + ", ".join(f"{k} {v:.1f}" for k, v in ph.items()))
        print(f"  active/sample {summ['active_per_sample']:.0f}, retrieved/sample "
              f"{summ['retrieved_per_sample']:.0f}, rows updated/batch "
              f"{summ['union_rows_per_batch']:.0f}, rebuilds {summ['rebuilds']}, rehashed rows "
              f"per rebuild {summ['rehashed_per_rebuild']:.0f}")
        parts = rebuild_parts(tr.model.out)
        print("  one rebuild: " + ", ".join(
            f"{k} {v:.0f}" + ("" if k == "dirty rows" else " ms") for k, v in parts.items()))
        sys.stdout.flush()
        res[threads] = (t, ph)
        del tr, init
        gc.collect()
    if 1 in res and 2 in res:
        t1, p1 = res[1]
        t2, p2 = res[2]
        print(f"\nthread scaling 1 -> 2: {t1 / t2:.2f}x  (" + ", ".join(
            f"{k} {p1[k] / p2[k]:.2f}x" for k in p1 if p2.get(k, 0) > 0.05) + ")"
              + "; bound 2.00x (two threads on two cores)")


if __name__ == "__main__":
    _cli.run(main)
