"""``accelopt bench --eval``: top-1 precision of each run's trained weights on the held-out set.

A speed-up that costs accuracy is not a gain, so an ablation can also score what each run
learned. Every run saves its jobs' final weights (``run.save_weights``, on by default); this
module rebuilds each job exactly as the run did (same config, same plugins, so a plugin that
replaces or prunes layers at build time produces the same shapes), loads the weights and
scores the dataset's held-out set in eval mode.

``top1`` = the share of held-out points whose highest-scoring class is one of their labels:
accuracy for single-label data, precision@1 (P@1) for multi-label data (labels ``[B, M]``
padded with -1, the extreme-classification convention). It is run in the bench process after
the sweep, never inside the timed runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from omegaconf import OmegaConf

from accelopt.activation import activate
from accelopt.job import build_jobs, job_id_for, job_specs
from accelopt.job.checkpoint import WEIGHTS_DIR
from accelopt.plugin import Registry
from accelopt.runtime.run import CONFIG_FILE

EVAL_METRIC = "top1"
EVAL_BATCH = 1024


def hits_at_1(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per point: 1.0 if the arg-max class is among its labels (``[B]`` class ids, or ``[B, M]``
    label sets padded with -1), else 0.0."""
    pred = logits.argmax(dim=1)
    labels = labels.reshape(len(labels), -1)
    return (labels == pred[:, None]).any(dim=1).to(torch.float64)


def eval_batches(dataset: object, batch_size: int = EVAL_BATCH) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The dataset's held-out set in batches (its own ``eval_batches`` when it has one)."""
    own = getattr(dataset, "eval_batches", None)
    if callable(own):
        yield from own(batch_size)
        return
    x, y = dataset.eval_set()  # type: ignore[attr-defined]
    for lo in range(0, len(y), batch_size):
        yield x[lo:lo + batch_size], y[lo:lo + batch_size]


def score(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Top-1 precision of ``model`` over ``batches`` (eval mode, no gradients)."""
    model.eval()
    hits, n = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            hits += float(hits_at_1(model(x), y).sum())
            n += len(y)
    return hits / n if n else float("nan")


def evaluate_run(run_dir: Path, registry: Registry) -> float | None:
    """Mean top-1 over the run's training jobs whose weights were saved; ``None`` if none
    (inference-only workloads, ``run.save_weights=false``, cluster runs)."""
    cfg_path = run_dir / CONFIG_FILE
    if not cfg_path.is_file() or not (run_dir / WEIGHTS_DIR).is_dir():
        return None
    from accelopt.config import AccelConfig

    cfg = OmegaConf.merge(OmegaConf.structured(AccelConfig), OmegaConf.load(cfg_path))
    if cfg.cluster.mode != "none":
        return None
    torch.manual_seed(int(cfg.run.seed))
    specs = job_specs(cfg)
    plugins = activate(cfg, registry, [job_id_for(i, s) for i, s in enumerate(specs)])  # type: ignore[arg-type]
    jobs = build_jobs(specs, torch.device("cpu"), plugins)
    scores = []
    for job in jobs:
        path = run_dir / WEIGHTS_DIR / f"{job.info.job_id}.pt"
        if job.optimizer is None or not path.is_file():
            continue
        job.model.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
        scores.append(score(job.model, eval_batches(job.dataset)))
    return statistics.fmean(scores) if scores else None
