"""Node pruning vs weight (CSR) pruning on the real digits data set (REFERENCE.md section 4).

For an MLP and a CNN from the zoo: train the dense model, then for each amount (50/75/90%)
  * node pruning: remove that fraction of neurons/channels by L1 norm (physically sliced,
    consumers and BatchNorm included), fine-tune;
  * weight pruning: zero that fraction of weights by magnitude, fine-tune with the mask
    fixed, then execute as torch.sparse CSR matmuls;
and report inference latency (median of interleaved repetitions, same input batch for
every side) as a speed ratio vs dense, parameters, and held-out digits accuracy, beside each
variant's bound: dense FLOPs over its FLOPs (every product counted by torch's
``FlopCounterMode``) for node pruning, dense weights over its nonzero weights for CSR (the
multiply-adds a sparse kernel could skip at best).
Seed claim (Scalpel): node pruning speeds up, weight pruning slows down (CPU 2.61x vs
1.06x; GPU 1.25x vs 0.41x).

    python benchmarks/gpu_kernels_node_vs_csr.py [--quick] [--reps 15]

(``benchmarks/gpu_kernels_pruning.py`` measures pruning during training, after N
iterations.)
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics

import _cli
import torch
from accelopt_plugins.gpu_kernels.autotune import time_callables
from accelopt_plugins.gpu_kernels.pruning import count_flops, node_prune
from accelopt_plugins.gpu_kernels.weight_pruning import (
    CSRConv2d,
    CSRLinear,
    to_sparse,
    weight_prune,
)
from torch import nn

from accelopt.job.quality import evaluate
from accelopt.workloads import build_dataset, build_model


def train(model: nn.Module, data, epochs: int, lr: float, seed: int) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    steps = epochs * data.n_train // 64
    for i in range(steps):
        x, y = data.batch(i, 64)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    model.eval()


def accuracy(model: nn.Module, data) -> float:  # type: ignore[no-untyped-def]
    """Held-out top-1 in percent, scored as every run scores its jobs."""
    quality = evaluate(model, data)
    assert quality is not None, "digits has a held-out set"
    return quality.value * 100


def stored(model: nn.Module) -> int:
    """Numbers the model stores: parameters, or CSR values + biases for sparse layers."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, (CSRLinear, CSRConv2d)):
            total += mod.weight.values().numel() + (0 if mod.bias is None else mod.bias.numel())
        else:
            total += sum(p.numel() for p in mod.parameters(recurse=False))
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer epochs/reps (smoke test)")
    ap.add_argument("--batch", type=_cli.positive_int, default=256,
                    help="inference batch for latency")
    ap.add_argument("--reps", type=_cli.positive_int, default=None,
                    help="timed repetitions (default 15; --quick: 5; an explicit value wins)")
    args = ap.parse_args()
    epochs, ft_epochs = (2, 1) if args.quick else (12, 4)
    reps = args.reps if args.reps is not None else 5 if args.quick else 15
    data = build_dataset("digits", seed=0)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"digits: {data.n_train} train / {len(data.eval_set()[1])} held-out; train {epochs} "
          f"epochs (Adam 1e-3), fine-tune {ft_epochs} epochs (Adam 3e-4); latency: batch "
          f"{args.batch}, median of {reps} interleaved reps\n")
    models = {"mlp (width 1024)": ("mlp", 1024), "cnn (width 64)": ("cnn", 64)}
    for label, (name, width) in models.items():
        torch.manual_seed(0)
        dense = build_model(name, input_shape=data.input_shape, num_classes=10, width=width)
        train(dense, data, epochs, 1e-3, seed=1)
        variants: dict[str, nn.Module] = {"dense": dense}
        for amount in (0.5, 0.75, 0.9):
            node = copy.deepcopy(dense)
            node_prune(node, amount, criterion="l1")
            train(node, data, ft_epochs, 3e-4, seed=2)
            variants[f"node {amount:.0%}"] = node
            weight = copy.deepcopy(dense)
            weight_prune(weight, amount)
            train(weight, data, ft_epochs, 3e-4, seed=2)
            variants[f"csr {amount:.0%}"] = to_sparse(weight)
        x = torch.randn(args.batch, *data.input_shape)

        def infer(m: nn.Module, x: torch.Tensor = x):  # type: ignore[no-untyped-def]
            def run():  # type: ignore[no-untyped-def]
                with torch.no_grad():
                    return m(x)
            return run

        samples = time_callables({k: infer(m) for k, m in variants.items()}, x.device, reps)
        med = {k: statistics.median(v) for k, v in samples.items()}
        print(f"## {label}")
        print(f"{'variant':<10} {'latency ms':>10} {'speed vs dense':>15} {'bound':>7} "
              f"{'stored':>9} {'accuracy %':>10}")
        dense_flops, dense_stored = count_flops(dense, x), stored(dense)
        for k, m in variants.items():
            bound = (dense_stored / stored(m) if k.startswith("csr")  # nonzero weights
                     else dense_flops / count_flops(m, x))
            print(f"{k:<10} {med[k] * 1e3:>10.3f} {med['dense'] / med[k]:>14.2f}x "
                  f"{bound:>6.2f}x {stored(m):>9} {accuracy(m, data):>10.2f}")
        print()
    print("bound: node rows, dense FLOPs / pruned FLOPs of one forward; csr rows, dense weights "
          "/ nonzero weights (what a sparse kernel could skip at best)")



if __name__ == "__main__":
    _cli.run(main)
