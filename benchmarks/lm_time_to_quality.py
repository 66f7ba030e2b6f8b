"""Time to quality on ``workload=lm``: training time until the held-out perplexity first
reaches each target, no plugins vs each plugin that applies to the model, medians of
``--repeats`` interleaved repeats (the order rotates each repeat).

Every run is a real ``accelopt run workload=lm`` (``accelopt.run``, one process) with one
extra plugin of this script beside the technique: the probe. At every ``--eval-every``-th
iteration end it scores the held-out perplexity with the dataset's own evaluation (dense
logits, eval mode, the held-out tenth of the corpus) and records it against the job's
training time so far, the sum of its iterations' durations, so the probe's evaluations are
outside the clock. Same data, batch, iterations, schedule and seed on every side.

Variants: ``none``; ``slide`` (its LSH-sampled softmax on GPT-2's 25k-word output layer,
trained by its own Adam at the job's peak lr; the layer's weight stays tied to the input
embedding: one tensor, trained from both sides); ``sampled`` (the same SLIDE layer with
``sampling=random``: a sampled softmax with uniformly drawn negatives, as many neurons
per sample, so the difference to ``slide`` is what the LSH retrieval buys); ``offload``
(feature-map offload: on a CPU it only accounts, so its figure is the cost of its hooks). The bound printed beside them is the
FLOP share of the output layer in a training step: a sampled output layer can make an
iteration at most ``1 / (1 - share)`` times faster.

    python benchmarks/lm_time_to_quality.py [--iterations 300] [--repeats 3] \
        [--targets 3000 1500 1000] [--variants none slide sampled offload]
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _cli
import torch

import accelopt
from accelopt import PluginSpec, Registry, hookimpl

VARIANTS: dict[str, list[str]] = {
    "none": [],
    "slide": ["+plugins=[slide,ttq_probe]", "plugins.slide.lr=0.003"],
    "sampled": ["+plugins=[slide,ttq_probe]", "plugins.slide.lr=0.003",
                "plugins.slide.sampling=random"],
    "offload": ["+plugins=[offload,ttq_probe]"],
}


class Probe:
    """Scores the job's model every ``every`` iterations; keeps (train s, iteration, ppl)."""

    def __init__(self, dataset: Any, every: int) -> None:
        self.dataset, self.every = dataset, every
        self.model: torch.nn.Module | None = None
        self.train_s = 0.0
        self.curve: list[tuple[float, int, float]] = []
        self.eval_s = 0.0

    @hookimpl
    def accelopt_job_built(self, run: Any, job: Any) -> None:
        self.model = job.model

    @hookimpl
    def accelopt_iteration_end(self, context: Any, result: Any) -> None:
        self.train_s += result.end_s - result.start_s
        done = result.iteration + 1
        if done % self.every == 0 or done == context.job.iterations:
            t0 = time.perf_counter()
            ppl = self.dataset.evaluate_model(self.model).value
            self.eval_s += time.perf_counter() - t0
            self.curve.append((self.train_s, done, ppl))


def run_variant(name: str, args: argparse.Namespace, dataset: Any, out: Path) -> Probe:
    probe = Probe(dataset, args.eval_every)
    registry = Registry.discover()
    registry.add(PluginSpec(name="ttq_probe", factory=lambda _cfg: probe, scope="run"))
    selection = VARIANTS[name] or ["+plugins=[ttq_probe]"]
    record = accelopt.run(["workload=lm", *selection, "cluster.mode=none", "run.compare=none",
                           "run.progress=false", "run.profile=false",
                           f"workload.jobs.0.iterations={args.iterations}"],
                          run_dir=out, registry=registry)
    (job,) = record.jobs
    if job.status != "done":
        raise SystemExit(f"{name}: the job {job.status}: {job.error}")
    probe.rows = [r for r in record.plugin_rows if r.plugin != "ttq_probe"]  # type: ignore[attr-defined]
    return probe


def time_to(curve: list[tuple[float, int, float]], target: float) -> tuple[float, int] | None:
    """(training seconds, iterations) at the first evaluation at or below ``target``."""
    return next(((s, i) for s, i, ppl in curve if ppl <= target), None)


def output_flop_share(dataset: Any, n_embd: int = 64, n_layer: int = 2, seq: int = 64) -> float:
    """The output layer's share of a training step's matmul FLOPs (forward + backward are
    proportional for every matmul, so the forward ratio is the step's): per token, the LM
    head ``d V``, each block ``12 d^2`` (attention projections and MLP) plus ``2 T d``
    (scores and weighted values)."""
    head = n_embd * dataset.vocab_size
    blocks = n_layer * (12 * n_embd * n_embd + 2 * seq * n_embd)
    return head / (head + blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=_cli.positive_int, default=300)
    parser.add_argument("--repeats", type=_cli.positive_int, default=3)
    parser.add_argument("--eval-every", type=_cli.positive_int, default=20)
    parser.add_argument("--targets", type=_cli.positive_float, nargs="+", default=[3000.0, 1500.0, 1000.0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()

    from accelopt.workloads.lm import stdlib_text

    dataset = stdlib_text(seed=0)  # the job's own dataset (workload=lm's defaults)
    share = output_flop_share(dataset)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch "
          f"{torch.__version__}, python {platform.python_version()}")
    print(f"workload=lm: {dataset}; {args.iterations} iterations, held-out perplexity every "
          f"{args.eval_every}; {args.repeats} interleaved repeats")
    print(f"bound: the output layer is {share:.1%} of a step's matmul FLOPs, so a sampled "
          f"output layer can make an iteration at most {1 / (1 - share):.1f}x faster")
    results: dict[str, list[Probe]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory(prefix="accelopt-ttq-") as tmp:
        for r in range(args.repeats):
            order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
            for name in order:
                probe = run_variant(name, args, dataset, Path(tmp) / f"{name}-{r}")
                results[name].append(probe)
                last = probe.curve[-1]
                print(f"  repeat {r + 1} {name:8s} {last[0]:7.1f} s train, final ppl "
                      f"{last[2]:8.1f} (evaluations {probe.eval_s:.1f} s, off the clock)",
                      flush=True)
    print()
    head = (f"{'variant':8s} {'s/iter':>7s} {'final ppl':>10s} " + " ".join(
        f"{'to ' + format(t, 'g'):>22s}" for t in args.targets))
    print(head)
    for name, probes in results.items():
        per_iter = statistics.median(p.curve[-1][0] / p.curve[-1][1] for p in probes)
        final = statistics.median(p.curve[-1][2] for p in probes)
        cells = []
        for target in args.targets:
            hits = [time_to(p.curve, target) for p in probes]
            reached = [h for h in hits if h is not None]
            if len(reached) < len(hits):
                cells.append(f"{len(reached)}/{len(hits)} reached".rjust(22))
                continue
            secs = [h[0] for h in reached]
            cells.append(f"{statistics.median(secs):6.1f} s [{min(secs):.0f}-{max(secs):.0f}]"
                         f" {statistics.median(h[1] for h in reached):4.0f} it".rjust(22))
        print(f"{name:8s} {per_iter:7.3f} {final:10.1f} " + " ".join(cells))
    for name, probes in results.items():
        for row in getattr(probes[0], "rows", []):
            print(f"[{name}] {row.plugin}: {row.summary}")
    print("cells: median training seconds to reach the held-out perplexity [min-max over "
          "repeats], median iterations; evaluated every --eval-every iterations, so a time "
          f"is at most {args.eval_every} iterations late")
    if any(math.isnan(p.curve[-1][2]) for ps in results.values() for p in ps):
        print("warning: a run ended with a NaN perplexity")


if __name__ == "__main__":
    _cli.run(main)
