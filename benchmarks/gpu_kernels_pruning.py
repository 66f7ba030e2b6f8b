"""Node pruning after N iterations, then fine-tuning, vs the dense model trained as long.

For a residual CNN (zoo ``resnet`` on digits: coupled residual groups), a transformer (zoo
``transformer`` on synthetic_sequences: feed-forward blocks) and, if transformers is
installed, ``workload=lm``'s GPT-2 on stdlib text (feed-forward blocks and attention heads):

  * dense: train T iterations (Adam);
  * pruned: the same initial weights and the same batches; train N = T/2 iterations, prune
    50% of every prunable group by L1 on the trained weights (coupled channels, heads),
    slice the optimizer state with the parameters (what the plugin does with
    ``prune_at_iteration=N``), fine-tune the remaining T - N iterations.

Both sides get the same total number of iterations. Printed side by side: inference latency
and training step time (medians of interleaved repeats on the same batch), held-out quality
(accuracy, or perplexity for lm), parameters, FLOPs and the fraction of the FLOP bound
reached (a speed-up cannot exceed dense FLOPs / pruned FLOPs). The last line summarises.

    python benchmarks/gpu_kernels_pruning.py [--quick] [--reps 9]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _cli
import torch
from accelopt_plugins.gpu_kernels.autotune import time_callables
from accelopt_plugins.gpu_kernels.pruning import (
    count_flops,
    count_params,
    node_prune,
    record_lineage,
    slice_like,
)
from torch import nn

from accelopt.workloads import build_dataset, build_model


@dataclass
class Case:
    """One model: how to build it, its batches, its loss and its held-out quality."""

    label: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    quality: Callable[[nn.Module], float]
    metric: str
    higher_is_better: bool


def _ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _accuracy(data: Any) -> Callable[[nn.Module], float]:
    @torch.no_grad()
    def score(model: nn.Module) -> float:
        model.eval()
        x, y = data.eval_set()
        return float((model(x).argmax(1) == y).float().mean()) * 100
    return score


def cases(quick: bool, batch: int) -> list[Case]:
    digits = build_dataset("digits", seed=0)
    seqs = build_dataset("synthetic_sequences", seed=0)
    out = [
        Case("resnet (zoo, width 16, digits)",
             lambda: build_model("resnet", input_shape=digits.input_shape, num_classes=10,
                                 width=16),
             lambda i: digits.batch(i, batch), _ce, _accuracy(digits), "accuracy %", True),
        Case("transformer (zoo, width 64, synthetic_sequences)",
             lambda: build_model("transformer", input_shape=seqs.input_shape,
                                 num_classes=seqs.num_classes, vocab_size=seqs.vocab_size,
                                 width=64),
             lambda i: seqs.batch(i, batch), _ce, _accuracy(seqs), "accuracy %", True),
    ]
    lm = _lm_case(quick, batch)
    return out + ([lm] if lm is not None else [])


def _lm_case(quick: bool, batch: int) -> Case | None:
    """``workload=lm``'s model and data at a small size (None without transformers)."""
    try:
        from accelopt.workloads.lm import gpt2, stdlib_text
        text = stdlib_text(seed=0, max_files=15 if quick else 120, vocab=2000, seq_len=32,
                           eval_chunks=16 if quick else 64)
        gpt2(vocab_size=8, input_shape=(8,))
    except (ImportError, ValueError):
        return None

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return model(x, labels=y).loss

    return Case("lm (gpt2 n_embd 64, 2 layers, 4 heads, stdlib text)",
                lambda: gpt2(vocab_size=text.vocab_size, input_shape=text.input_shape,
                             n_embd=64, n_layer=2, n_head=4),
                lambda i: text.batch(i, batch // 4), loss,
                lambda m: text.evaluate_model(m).value, "perplexity", False)


def train(model: nn.Module, opt: torch.optim.Optimizer, case: Case, start: int, stop: int) -> None:
    model.train()
    for i in range(start, stop):
        x, y = case.batch(i)
        opt.zero_grad()
        case.loss(model, x, y).backward()
        opt.step()


def prune_and_rebuild(model: nn.Module, opt: torch.optim.Optimizer, lr: float
                      ) -> tuple[torch.optim.Optimizer, Any]:
    """Prune 50% by L1, then an optimizer over the new parameters with the old state sliced
    (the plugin's ``accelopt_optimizer_build`` does the same)."""
    with record_lineage() as lineage:
        report = node_prune(model, 0.5, criterion="l1")
    new = torch.optim.Adam(model.parameters(), lr=lr)
    for p in model.parameters():
        orig, steps = lineage.get(p, (p, []))
        state = opt.state.get(orig)
        if state:
            new.state[p] = {k: slice_like(v, steps).clone() if isinstance(v, torch.Tensor)
                            and v.shape == orig.shape else v for k, v in state.items()}
    return new, report


def measure(models: dict[str, nn.Module], case: Case, x: torch.Tensor, y: torch.Tensor,
            reps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median inference and training-step seconds, interleaved, same batch for both."""
    def infer(m: nn.Module) -> Callable[[], Any]:
        m = copy.deepcopy(m).eval()

        def run() -> Any:
            with torch.no_grad():
                return case.loss(m, x, y) if "lm" in case.label else m(x)
        return run

    def step(m: nn.Module) -> Callable[[], None]:
        m = copy.deepcopy(m).train()
        opt = torch.optim.Adam(m.parameters(), lr=1e-9)

        def run() -> None:
            opt.zero_grad()
            case.loss(m, x, y).backward()
            opt.step()
        return run

    dev = torch.device("cpu")
    inf = time_callables({k: infer(m) for k, m in models.items()}, dev, reps)
    trn = time_callables({k: step(m) for k, m in models.items()}, dev, reps)
    return ({k: statistics.median(v) for k, v in inf.items()},
            {k: statistics.median(v) for k, v in trn.items()})


def above_bound(speed_inf: float, speed_trn: float, bound: float) -> str:
    """What to say when a measured speed-up exceeds the FLOP bound ('' when none does): not
    an achievement, the timings were disturbed."""
    over = [name for name, s in (("inference", speed_inf), ("training step", speed_trn))
            if s > bound]
    return f"{' and '.join(over)} above the bound: timing noise, rerun on a quiet machine" if over else ""


def run_case(case: Case, total: int, lr: float, reps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    init = case.build()
    dense, pruned = copy.deepcopy(init), copy.deepcopy(init)
    opt = torch.optim.Adam(dense.parameters(), lr=lr)
    train(dense, opt, case, 0, total)
    at = total // 2
    opt = torch.optim.Adam(pruned.parameters(), lr=lr)
    train(pruned, opt, case, 0, at)
    opt, report = prune_and_rebuild(pruned, opt, lr)
    train(pruned, opt, case, at, total)
    x, y = case.batch(10_000)
    flops = {k: count_flops(copy.deepcopy(m).eval(), x) for k, m in
             (("dense", dense), ("pruned", pruned))}
    inf, trn = measure({"dense": dense, "pruned": pruned}, case, x, y, reps)
    quality = {"dense": case.quality(dense), "pruned": case.quality(pruned)}
    bound = flops["dense"] / max(flops["pruned"], 1)
    speed_inf, speed_trn = inf["dense"] / inf["pruned"], trn["dense"] / trn["pruned"]
    print(f"## {case.label}: {total} iterations each; pruned at iteration {at} "
          f"({len(report.pruned)} layers/blocks pruned in {len(report.groups)} groups, "
          f"{len(report.refused)} refused), fine-tuned {total - at}")
    print(f"{'':<8} {'infer ms':>9} {'step ms':>9} {'params':>9} {'MFLOPs':>9} "
          f"{case.metric:>11}")
    for k, m in (("dense", dense), ("pruned", pruned)):
        print(f"{k:<8} {inf[k] * 1e3:>9.3f} {trn[k] * 1e3:>9.3f} {count_params(m):>9} "
              f"{flops[k] / 1e6:>9.2f} {quality[k]:>11.2f}")
    above = above_bound(speed_inf, speed_trn, bound)
    print(f"speed-up: inference {speed_inf:.2f}x, training step {speed_trn:.2f}x; FLOP bound "
          f"{bound:.2f}x (inference reaches {speed_inf / bound:.0%} of it"
          + (f"; {above}" if above else "") + f"); {case.metric} "
          f"{quality['dense']:.2f} -> {quality['pruned']:.2f}\n")
    return {"inf": speed_inf, "trn": speed_trn, "bound": bound, "metric": case.metric,
            "q_dense": quality["dense"], "q_pruned": quality["pruned"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: few iterations and reps (an explicit --iterations, "
                         "--batch or --reps wins)")
    ap.add_argument("--iterations", type=_cli.positive_int, default=None,
                    help="total training iterations (default 200; --quick: 8)")
    ap.add_argument("--batch", type=_cli.positive_int, default=None,
                    help="default 64; --quick: 32")
    ap.add_argument("--reps", type=_cli.positive_int, default=None,
                    help="timed repetitions (default 9; --quick: 3)")
    args = ap.parse_args()
    total = args.iterations if args.iterations is not None else 8 if args.quick else 200
    reps = args.reps if args.reps is not None else 3 if args.quick else 9
    if args.batch is None:
        args.batch = 32 if args.quick else 64
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}; load average "
          f"{os.getloadavg()[0]:.1f}; Adam 2e-3, batch {args.batch} (lm {args.batch // 4}); "
          f"timing: median of {reps} interleaved reps\n")
    results = {c.label.split(" ")[0]: run_case(c, total, 2e-3, reps)
               for c in cases(args.quick, args.batch)}
    print("summary (50% after T/2, fine-tuned; same total iterations): " + "; ".join(
        f"{k} infer {r['inf']:.2f}x / step {r['trn']:.2f}x of bound {r['bound']:.2f}x"
        + (f" ({above})" if (above := above_bound(r["inf"], r["trn"], r["bound"])) else "")
        + ", "
        f"{r['metric']} {r['q_dense']:.2f} -> {r['q_pruned']:.2f}" for k, r in results.items()))


if __name__ == "__main__":
    _cli.run(main)
