"""The backward by rows in isolation: indexing a real batch's active lists by row
(``RowGradients.assign``) and summing the gradient rows (``RowGradients.accumulate``), on 1
and 2 threads, interleaved.

The batch is a real one: a SLIDE trainer with the plugin defaults runs ``--steps`` steps on
the synthetic set, then its last batch's active lists, softmax gradients and hidden
activations are captured; each repetition then indexes and accumulates that batch afresh
(the packed block is cleared between repetitions, outside the timed region). Run it at two
commits to compare two versions of the kernels on the same batch.

    python benchmarks/slide_row_index.py --width 670k
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _cli  # noqa: E402
import numba  # noqa: E402
import numpy as np  # noqa: E402
from accelopt_plugins.slide.rowgrads import RowGradients  # noqa: E402
from accelopt_plugins.slide.xcdata import SIZES, synthetic  # noqa: E402
from slide_common import (  # noqa: E402
    SlideTrainer,
    init_net,
    machine,
    preload,
    set_threads,
    slide_config,
    use_huge_pages,
)
from slide_step import BATCH, LR  # noqa: E402


def capture_batch(width: str, steps: int) -> tuple[np.ndarray, ...]:
    """(ids, n_active, dz, h, weight) of the last of ``steps`` training steps."""
    ds = synthetic(width)
    n, d = ds.num_classes, ds.vocab_size
    batches = preload(ds, 0, steps, BATCH)
    set_threads(2)
    trainer = SlideTrainer(d, n, LR, init_net(d, n), slide_config(n))
    layer = trainer.model.out
    for i in range(steps):
        trainer.step(*batches[i])
    s = layer.scratch(BATCH)
    x, _ = batches[-1]
    hidden = trainer.model.act(trainer.model.embed(x)).detach().numpy()  # the layer's input
    return (s["ids"].copy(), s["n_active"].copy(), s["dz"].copy(), hidden.copy(),
            layer.weight.numpy())


def main() -> None:
    use_huge_pages()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--width", default="670k", choices=list(SIZES))
    ap.add_argument("--steps", type=_cli.positive_int, default=30, help="training steps before the capture")
    ap.add_argument("--reps", type=_cli.positive_int, default=21, help="timed repetitions per thread count")
    args = ap.parse_args()
    ids, n_active, dz, h, w = capture_batch(args.width, args.steps)
    n, dim = w.shape
    print(f"# machine: {machine()}")
    grads = {t: RowGradients(n, dim, with_bias=True) for t in (1, 2)}
    times: dict[int, dict[str, list[float]]] = {t: {"index": [], "accumulate": []} for t in (1, 2)}
    rows = 0
    for rep in range(args.reps + 2):  # two warm-up rounds (JIT, first-touch of the buffers)
        for t in (1, 2):
            numba.set_num_threads(t)
            g = grads[t]
            t0 = time.perf_counter()
            rows = g.assign(ids, n_active)
            t1 = time.perf_counter()
            g.accumulate(dz, 1.0 / BATCH, h, w)
            t2 = time.perf_counter()
            g.w[:g.count] = 0.0
            g.b[:g.count] = 0.0
            g.release()
            if rep >= 2:
                times[t]["index"].append(t1 - t0)
                times[t]["accumulate"].append(t2 - t1)
    numba.set_num_threads(2)
    entries = int(n_active.sum())
    print(f"## {n:,} labels: one batch of {BATCH}, {entries:,} active entries, {rows:,} distinct "
          f"rows; median of {args.reps} interleaved repetitions (ms)")
    for part in ("index", "accumulate"):
        one, two = (1e3 * float(np.median(times[t][part])) for t in (1, 2))
        print(f"  {part:10s} 1 thread {one:6.2f}  2 threads {two:6.2f}  speed-up {one / two:.2f}x")
    print("  bound: 2.00x for two threads on two cores")


if __name__ == "__main__":
    _cli.run(main)
