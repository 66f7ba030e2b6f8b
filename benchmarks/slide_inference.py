"""LSH-sparse inference vs dense scoring of SLIDE's output layer: per-row latency and how
well the LSH top-k agrees with the dense one.

Two heads, each trained a little first so that its tables hold meaningful weights:

* ``xc``: ``workload=xc``'s network (sparse input -> 128 ReLU -> 20K labels by default),
  SLIDE-trained from the benchmark's shared settings (:func:`slide_common.slide_config`);
* ``lm``: ``workload=lm``'s GPT-2 (the standard library's source, ~25K words), its tied
  ``lm_head`` replaced by SLIDE and trained with it for a short run.

On the same held-out rows, in interleaved repeats (dense, LSH, LSH, dense, ...), it times
four paths, named in the output: ``dense logits`` (``F.linear`` alone, all N scores: the
strict baseline, without the layer's input checks, which the LSH paths include), ``lsh
logits`` (:meth:`SlideLinear.sparse_logits`: the retrieved neurons' scores, -inf elsewhere,
a [rows, N] tensor like dense), ``dense top-5`` (``F.linear`` + ``topk``) and ``lsh top-5``
(:meth:`SlideLinear.sparse_topk`: no [rows, N] tensor). Medians per row with the spread
(min-max over repeats), and each LSH path's speed-up over its dense counterpart as the median
of the per-repeat ratios. Agreement: top-1 equal and top-5 overlap of LSH vs dense, and
precision against the labels (xc: P@1/P@5; lm: next-token accuracy@1/@5).

The bound printed is the FLOP ratio: dense computes N rows of logits per input row, LSH the
retrieved rows plus the hashing (in row-equivalents of d multiply-adds); bucket lookups and
merging are memory work it does not count, so the measured speed-up should stay below it.

    python benchmarks/slide_inference.py                  # defaults: < ~3 min on 2 cores
    python benchmarks/slide_inference.py --quick          # smoke run: < 30 s
    python benchmarks/slide_inference.py --heads xc --xc-width 200k --rows-per-call 1 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _cli  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812
from accelopt_plugins.slide.layer import SlideLinear  # noqa: E402
from accelopt_plugins.slide.xcdata import SIZES  # noqa: E402
from slide_common import (  # noqa: E402
    SlideTrainer,
    init_net,
    machine,
    set_threads,
    slide_config,
    use_huge_pages,
)

TOP = 5


@dataclass
class Head:
    """A trained SLIDE output layer, held-out hidden rows for it and their labels."""

    name: str
    layer: SlideLinear
    rows: torch.Tensor
    """[R, d] float32 hidden states (the layer's inputs)."""
    labels: torch.Tensor
    """[R, M] label ids padded with -1 (lm: M = 1, the next token)."""
    trained: str


def xc_head(width: str, steps: int, n_rows: int) -> Head:
    """``workload=xc``'s network SLIDE-trained for ``steps`` batches of 128."""
    from accelopt_plugins.slide.xcdata import synthetic

    ds = synthetic(width)
    n, d = ds.num_classes, ds.vocab_size
    trainer = SlideTrainer(d, n, 1e-3, init_net(d, n), slide_config(n))
    for i in range(steps):
        trainer.step(*ds.batch(i, 128))
    model = trainer.model
    x, y = next(ds.eval_batches(n_rows))
    with torch.no_grad():
        h = model.act(model.embed(x)).contiguous()
    return Head(f"xc ({n:,} labels, hidden {h.shape[1]})", model.out, h, y,
                f"SLIDE-trained {steps} steps of 128")


def lm_head(steps: int, n_rows: int, quick: bool) -> Head:
    """``workload=lm``'s GPT-2 with its tied lm_head replaced by SLIDE (kept tied), trained
    ``steps`` batches of 16 with the workload's AdamW for the rest of the model."""
    from accelopt.workloads.lm import gpt2, stdlib_text

    kwargs = {"max_files": 40, "vocab": 800, "seq_len": 16, "eval_chunks": 64} if quick else {}
    data = stdlib_text(seed=0, **kwargs)
    torch.manual_seed(0)
    model = gpt2(vocab_size=data.vocab_size, input_shape=data.input_shape)
    cfg = replace(slide_config(data.vocab_size), lr=3e-3)
    model.lm_head = SlideLinear.from_linear(model.lm_head, cfg, lr=3e-3,
                                            tied_to="transformer.wte.weight")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for i in range(steps):
        x, y = data.batch(i, 16)
        opt.zero_grad()
        model(x, labels=y).loss.backward()
        opt.step()
    held = data._held_out  # the workload's held-out chunks (the perplexity's)
    with torch.no_grad():
        states = model.transformer(held).last_hidden_state[:, :-1]
    h = states.reshape(-1, states.shape[-1])[:n_rows].contiguous()
    nxt = held[:, 1:].reshape(-1)[:n_rows, None]
    return Head(f"lm (GPT-2, {data.vocab_size:,} words, hidden {h.shape[1]})", model.lm_head,
                h, nxt, f"trained with SLIDE {steps} steps of 16 x {data.input_shape[0]} tokens")


def paths(layer: SlideLinear) -> dict[str, Callable[[torch.Tensor], object]]:
    """The four timed paths (see the module doc), by the name printed."""
    w, b = layer.weight, layer.bias
    return {
        "dense logits (F.linear)": lambda h: F.linear(h, w, b),
        "lsh logits (sparse_logits, -inf elsewhere)": layer.sparse_logits,
        f"dense top-{TOP} (F.linear + topk)": lambda h: F.linear(h, w, b).topk(TOP, dim=1),
        f"lsh top-{TOP} (sparse_topk)": lambda h: layer.sparse_topk(h, TOP),
    }


def time_interleaved(fns: dict[str, Callable], h: torch.Tensor, repeats: int
                     ) -> dict[str, list[float]]:
    """Seconds per row of each path over ``repeats`` rounds on the same rows; the order
    alternates each round (A B C D, D C B A) so that drift hits every path alike."""
    names = list(fns)
    for name in names:  # warm-up: numba compilation, scratch buffers, table build
        fns[name](h)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[name](h)
            out[name].append((time.perf_counter() - t0) / len(h))
    return out


def hits_at(top: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[float, float]:
    """(P@k, the XC convention: |top-k ∩ labels| / k; accuracy@k: a label in the top k)."""
    match = (top[:, :k, None] == labels[:, None, :]).any(2) & (top[:, :k] >= 0)
    return float(match.sum(1).float().mean()) / k, float(match.any(1).float().mean())


def agreement(layer: SlideLinear, h: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Top-1 equality and top-5 overlap of the LSH top-k with the dense one, and each one's
    precision against the labels."""
    with torch.no_grad():
        dense = F.linear(h, layer.weight, layer.bias).topk(TOP, dim=1).indices
    _, lsh = layer.sparse_topk(h, TOP)
    overlap = (lsh[:, :, None] == dense[:, None, :]).any(2).sum(1).float().mean()
    out = {"top1_same": float((lsh[:, 0] == dense[:, 0]).float().mean()),
           f"top{TOP}_overlap": float(overlap) / TOP}
    for name, top in (("dense", dense), ("lsh", lsh)):
        for k in (1, TOP):
            out[f"P@{k} {name}"], out[f"acc@{k} {name}"] = hits_at(top, labels, k)
    return out


def hashing_rows(layer: SlideLinear) -> float:
    """The hashing of one input in row-equivalents (d multiply-adds each): SimHash K*L
    projections over density*d coordinates; WTA/DWTA K*L bins of bin_size comparisons."""
    c = layer.cfg
    if c.hash == "simhash":
        return c.k * c.l * c.simhash_density
    return c.k * c.l * c.bin_size / layer.in_features


def active_per_row(layer: SlideLinear, h: torch.Tensor) -> float:
    _, s = layer.retrieve(h)
    return float(s["n_active"][: len(h)].mean())


def spread(values: list[float], scale: float = 1e6) -> str:
    return f"{scale * min(values):.1f}-{scale * max(values):.1f}"


def report(head: Head, rows_per_call: list[int], repeats: int) -> None:
    layer, n = head.layer, head.layer.out_features
    c = layer.cfg
    print(f"\n## {head.name}: {head.trained}; {c.hash} K={c.k} L={c.l}, "
          f"buckets of {c.bucket_size}, sampling={c.sampling} (topk {c.topk})")
    active = active_per_row(layer, head.rows)
    hashing = hashing_rows(layer)
    print(f"retrieved per row (mean over {len(head.rows)} held-out rows): {active:.0f} of {n:,} "
          f"({100 * active / n:.2f}%); hashing ~{hashing:.1f} row-equivalents")
    print(f"FLOP bound on the LSH speed-up: N / active = {n / max(active, 1):.1f}x; "
          f"N / (active + hashing) = {n / (active + hashing):.1f}x (bucket lookups and "
          "merging not counted)")
    agree = agreement(layer, head.rows, head.labels)
    single = head.labels.shape[1] == 1
    metric = "acc" if single else "P"
    print(f"agreement with dense over {len(head.rows)} rows: top-1 same "
          f"{agree['top1_same']:.3f}, top-{TOP} overlap {agree[f'top{TOP}_overlap']:.3f}; "
          + ", ".join(f"{metric}@{k} dense {agree[f'{metric}@{k} dense']:.4f} lsh "
                      f"{agree[f'{metric}@{k} lsh']:.4f}" for k in (1, TOP))
          + (" (next token)" if single else " (labels)"))
    print("| rows per call | path timed | median µs/row | min-max µs/row | LSH speed-up "
          "(median of paired ratios, min-max) |")
    print("|---:|---|---:|---:|---:|")
    fns = paths(layer)
    names = list(fns)
    for rows in rows_per_call:
        h = head.rows[:rows]
        t = time_interleaved(fns, h, repeats)
        for i, name in enumerate(names):
            ratio = ""
            if name.startswith("lsh"):
                r = [d / s for d, s in zip(t[names[i - 1]], t[name], strict=True)]
                ratio = f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"
            print(f"| {len(h)} | {name} | {1e6 * statistics.median(t[name]):.1f} | "
                  f"{spread(t[name])} | {ratio} |", flush=True)


def main() -> None:
    use_huge_pages()  # the shared SLIDE benchmarks' memory setting, before any model
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", nargs="+", choices=("xc", "lm"), default=["xc", "lm"])
    ap.add_argument("--xc-width", default="20k", choices=list(SIZES), help="synthetic XC size (workload=xc: 20k)")
    ap.add_argument("--xc-steps", type=_cli.positive_int, default=300)
    ap.add_argument("--lm-steps", type=_cli.positive_int, default=100)
    ap.add_argument("--rows", type=_cli.positive_int, default=1024, help="held-out rows for agreement")
    ap.add_argument("--rows-per-call", type=_cli.positive_int, nargs="+", default=[1, 64])
    ap.add_argument("--repeats", type=_cli.positive_int, default=31)
    ap.add_argument("--threads", type=_cli.positive_int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: xc 2k, a small lm corpus, few steps and repeats")
    args = ap.parse_args()
    if args.quick:
        args.xc_width, args.xc_steps, args.lm_steps = "2k", 40, 20
        args.rows, args.repeats = min(args.rows, 256), min(args.repeats, 5)
    set_threads(args.threads)
    print(f"# machine: {machine()}")
    print(f"# threads: torch {torch.get_num_threads()}, numba "
          f"{__import__('numba').get_num_threads()}; repeats {args.repeats}, interleaved")
    start = time.perf_counter()
    for name in args.heads:
        head = (xc_head(args.xc_width, args.xc_steps, args.rows) if name == "xc"
                else lm_head(args.lm_steps, args.rows, args.quick))
        report(head, args.rows_per_call, args.repeats)
    print(f"\n# {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    _cli.run(main)
