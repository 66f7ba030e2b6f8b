"""Convolution algorithm choice (REFERENCE.md section 4): per-layer autotuning on the zoo's
CNNs vs always-direct, and the FFT/direct crossover kernel size on this machine.

Part 1: for cnn, resnet and inception (synthetic 3x16x16 images, batch 32, training step =
forward + backward), every Conv2d is autotuned on its real input shape (direct / im2col /
FFT / Winograd, noise rule in ``autotune.py``); the per-layer choices are printed, then the
whole training step is timed with the tuned model and the always-direct model, interleaved
(median of reps). The tuned model must never be slower beyond noise.

Part 2: one conv (16 -> 16 channels, 64x64 input, batch 8, 'same' zero padding), kernel
size k swept; direct vs FFT forward time. Reference (measured before on this machine):
crossover between k=15 and k=31.

    python benchmarks/gpu_kernels_conv.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import _cli
import torch
from accelopt_plugins.gpu_kernels.autotune import (
    AutotunedConv2d,
    ConvAutotuner,
    DecisionCache,
    autotune_model,
    time_callables,
    verify_model,
)
from accelopt_plugins.gpu_kernels.conv_algos import run_algorithm
from torch import nn

from accelopt.workloads import build_model

NOISE = "timing noise, rerun on a quiet machine"


def step_fn(model: nn.Module, x: torch.Tensor):  # type: ignore[no-untyped-def]
    def run() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
    return run


def part1(reps: int, tune_reps: int) -> None:
    print("## Part 1: per-layer autotuning, training step (forward+backward), batch 32, 3x16x16")
    for name in ("cnn", "resnet", "inception"):
        torch.manual_seed(0)
        direct = build_model(name, input_shape=(3, 16, 16), num_classes=10)
        torch.manual_seed(0)
        tuned = build_model(name, input_shape=(3, 16, 16), num_classes=10)
        x = torch.randn(32, 3, 16, 16)
        tuner = ConvAutotuner(DecisionCache(None), reps=tune_reps)
        autotune_model(tuned, tuner)
        step_fn(tuned, x)()  # first forward: tuning happens here
        print(f"\n### {name}")
        print(f"{'layer':<28} {'input':<14} {'kernel':<6} {'choice':<9} median ms per algorithm")
        for path, mod in tuned.named_modules():
            if isinstance(mod, AutotunedConv2d):
                for (shape, _dtype, _train), d in mod.decisions.items():
                    times = ", ".join(f"{a} {t:.3f}" for a, t in d.median_ms.items())
                    print(f"{path:<28} {'x'.join(map(str, shape)):<14} {mod.kernel_size[0]}x"
                          f"{mod.kernel_size[1]:<4} {d.algorithm:<9} {times or '(only direct valid)'}")
        kept = verify_model(tuned, x, training=True, reps=tune_reps)
        convs = [m for m in tuned.modules() if isinstance(m, AutotunedConv2d)]

        def with_override(value: str | None, model: nn.Module = tuned,  # type: ignore[no-untyped-def]
                          inp: torch.Tensor = x, layers: list = convs):  # noqa: B006
            inner = step_fn(model, inp)

            def run() -> None:
                for m in layers:
                    m.override = value
                inner()
            return run

        guarded = "direct" if not kept else None
        samples = time_callables({"always-direct": step_fn(direct, x),
                                  "per-layer": with_override(None),
                                  "guarded": with_override(guarded)}, x.device, reps)
        med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
        d = med["always-direct"]
        measured = [dec.median_ms for m in convs for dec in m.decisions.values()
                    if "direct" in dec.median_ms]
        # the step's speed-up cannot exceed the convolutions' own (the rest is unchanged)
        bound = (sum(t["direct"] for t in measured) / sum(min(t.values()) for t in measured)
                 if measured else None)
        over = [k for k in ("per-layer", "guarded")
                if bound is not None and d / med[k] > max(bound, 1.0)]
        print(f"whole-model guard: {'kept the tuned choices' if kept else 'reverted to direct'}")
        print(f"whole training step: always-direct {d:.3f} ms | per-layer choices "
              f"{med['per-layer']:.3f} ms ({d / med['per-layer']:.2f}x) | with guard "
              f"{med['guarded']:.3f} ms ({d / med['guarded']:.2f}x)"
              + (f" | {' and '.join(over)} above the bound ({max(bound or 1.0, 1.0):.2f}x): "
                 f"{NOISE}" if over else ""))
        if measured:
            direct_ms = sum(t["direct"] for t in measured)
            best_ms = sum(min(t.values()) for t in measured)
            print(f"bound: the convolutions at each layer's fastest measured algorithm take "
                  f"{best_ms:.3f} ms against {direct_ms:.3f} ms direct ({direct_ms / best_ms:.2f}x "
                  f"on the convolutions; the step's other work unchanged); never slower is the "
                  f"floor")


def part2(reps: int) -> None:
    print("\n## Part 2: FFT vs direct crossover (16->16 channels, 64x64, batch 8, forward)")
    print(f"{'k':>3} {'direct ms':>10} {'fft ms':>10} {'fft speed-up':>12}")
    crossover = None
    for k in (3, 5, 7, 9, 11, 15, 21, 31):
        torch.manual_seed(0)
        conv = nn.Conv2d(16, 16, k, padding=k // 2)
        x = torch.randn(8, 16, 64, 64)

        def algo(a: str, conv: nn.Module = conv, x: torch.Tensor = x):  # type: ignore[no-untyped-def]
            def run() -> None:
                with torch.no_grad():
                    run_algorithm(a, conv, x)
            return run

        samples = time_callables({"direct": algo("direct"), "fft": algo("fft")}, x.device, reps)
        d, f = (statistics.median(samples[a]) * 1e3 for a in ("direct", "fft"))
        if crossover is None and f < d:
            crossover = k
        print(f"{k:>3} {d:>10.3f} {f:>10.3f} {d / f:>11.2f}x")
    print(f"first kernel size where FFT beats direct: {crossover}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: fewer reps (an explicit --reps wins)")
    ap.add_argument("--reps", type=_cli.positive_int, default=None,
                    help="timed repetitions (default 15; --quick: 5)")
    args = ap.parse_args()
    reps = args.reps if args.reps is not None else 5 if args.quick else 15
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}; "
          f"load average {os.getloadavg()[0]:.1f}; reps {reps}\n")
    part1(reps, tune_reps=7 if not args.quick else 3)
    part2(reps)


if __name__ == "__main__":
    _cli.run(main)
