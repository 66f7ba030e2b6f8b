"""Learning per step: P@1 against training steps (not time) for dense, sampled softmax and SLIDE
variants, same data order, same initial weights, same lr. Used to find why SLIDE learned less
per step than dense (the per-row Adam bias correction; docs/benchmarks.md, "slide: LSH vs
random active sets").

A variant is ``name:key=value,key=value`` (keys of SlideConfig; ``dense`` and ``sampled*`` are
the baselines, ``sampled`` scoring ``--sampled-active`` candidates per sample; ``sampled:logq=1``
with the log-Q correction).

    python benchmarks/slide_diag.py --width 20k --steps 1500 \\
        dense slide "all:min_active=20000" "random:sampling=random"
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _cli  # noqa: E402
from accelopt_plugins.slide.xcdata import SIZES, synthetic  # noqa: E402
from slide_common import (  # noqa: E402
    SlideTrainer,
    init_net,
    machine,
    make_trainer,
    p_at_k,
    parse_variant,
    set_threads,
    use_huge_pages,
)


def eval_steps(steps: int, asked: list[int] | None) -> list[int]:
    """The steps to evaluate at, in order: ``asked``, or five evenly spaced ones. Step 0 (the
    default's first with fewer than 5 steps) is left out: evaluation follows a step, so a
    column for it would stay empty and shift the row."""
    chosen = asked or [steps * i // 5 for i in range(1, 6)]
    return sorted({s for s in chosen if s >= 1})


def table_head(evals: list[int]) -> list[str]:
    """The lines above the rows: the bound, then the markdown header and separator. The bound
    goes first: a line between the separator and the rows ends a markdown table there."""
    return ["# bound: the dense variant's P@1 at each step (full softmax, the same data, weights "
            "and lr) is what a sampled output layer can at best match; run `dense` beside",
            "| variant | " + " | ".join(f"P@1 @{s}" for s in evals) + " | ms/step | active/sample |",
            "|---|" + "---:|" * (len(evals) + 2)]


def main() -> None:
    use_huge_pages()  # before any model is built: the same memory setting for every method
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--width", default="20k", choices=list(SIZES))
    ap.add_argument("--steps", type=_cli.positive_int, default=1500)
    ap.add_argument("--eval-at", type=_cli.positive_int, nargs="+", default=None,
                    help="steps at which to evaluate (default: 5 evenly spaced)")
    ap.add_argument("--eval-n", type=_cli.positive_int, default=2000)
    ap.add_argument("--threads", type=_cli.positive_int, default=2)
    ap.add_argument("--lr", type=_cli.positive_float, default=1e-3)
    ap.add_argument("--batch", type=_cli.positive_int, default=128)
    ap.add_argument("--sampled-active", type=_cli.positive_int, default=1000)
    ap.add_argument("variants", nargs="+")
    args = ap.parse_args()
    # a step past --steps is never reached: its column would be missing and the row's later
    # figures would shift under the wrong headers
    late = sorted(s for s in args.eval_at or [] if s > args.steps)
    if late:
        ap.error(f"--eval-at {' '.join(map(str, late))}: after the last step ({args.steps}); "
                 "give steps from 1 to --steps")
    evals = eval_steps(args.steps, args.eval_at)
    set_threads(args.threads)
    ds = synthetic(args.width)
    n, d = ds.num_classes, ds.vocab_size
    print(f"# machine: {machine()}")
    print(f"# {n:,} labels, batch {args.batch}, lr {args.lr}, {args.steps} steps, "
          f"P@1 on {args.eval_n} held-out points at steps {evals}")
    print("\n".join(table_head(evals)))
    for spec in args.variants:
        name, kw = parse_variant(spec)
        init = init_net(d, n)
        tr = make_trainer(name, kw, d, n, args.lr, init, args.sampled_active)
        p1s, clock = [], 0.0
        for step in range(1, args.steps + 1):
            x, y = ds.batch(step - 1, args.batch)
            t = time.perf_counter()
            tr.step(x, y)
            clock += time.perf_counter() - t
            if step in evals:
                p1s.append(p_at_k(tr.eval_model(), ds, args.eval_n)[0])
        act = ""
        if isinstance(tr, SlideTrainer):
            s = tr.model.out.summary()
            act = f"{s['active_per_sample']:.0f} (retrieved {s['retrieved_per_sample']:.0f})"
        print(f"| {spec} | " + " | ".join(f"{p:.4f}" for p in p1s)
              + f" | {1e3 * clock / args.steps:.1f} | {act} |", flush=True)
        del tr, init
        gc.collect()


if __name__ == "__main__":
    _cli.run(main)
