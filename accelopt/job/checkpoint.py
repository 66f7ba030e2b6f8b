"""Checkpoints at iteration boundaries, written atomically, and resume.

Each job has its own file (``checkpoints/<job_id>.pt``): jobs in different lanes reach their
boundaries at different times, and a job's state (model, optimizer, random state, iteration
number) is independent of every other job's. A file is written to a temporary name in the same
directory and renamed over the old one, so a kill at any instant leaves either the previous
checkpoint or the new one, never half of one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from accelopt.atomic import atomic_open
from accelopt.errors import UserError
from accelopt.job.job import Job, misfit
from accelopt.records import JobResult

CHECKPOINT_DIR = "checkpoints"
WEIGHTS_DIR = "weights"
_RESULT_FIELDS = ("status", "lane", "error", "iterations_done", "service_s", "samples",
                  "final_loss", "losses")


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` through :func:`accelopt.atomic.atomic_open` (temp file + rename)."""
    with atomic_open(path, "wb") as handle:
        torch.save(obj, handle)


class Checkpointer:
    """Saves a job's state every ``every`` iterations and when it finishes."""

    def __init__(self, run_dir: Path, every: int, save_weights: bool) -> None:
        if every < 0:
            raise UserError(f"run.checkpoint_every must be >= 0 (0 = off), got {every}")
        self.dir = run_dir / CHECKPOINT_DIR
        self.weights_dir = run_dir / WEIGHTS_DIR
        self.every = every
        self.save_weights = save_weights
        self.written = 0
        self.clock: Callable[[], float] | None = None
        """The driver's clock (seconds since the run started): how long each job has run,
        kept in its checkpoint so a resumed job's JCT counts the part before the resume."""

    def after_iteration(self, job: Job, result: JobResult) -> None:
        if self.every and job.iteration % self.every == 0 and not job.done:
            self.save(job, result)

    def save(self, job: Job, result: JobResult) -> None:
        if result.status == "done" and result.jct_s is not None:
            elapsed = result.jct_s
        else:
            now = self.clock() if self.clock is not None else job.info.arrival_s
            elapsed = max(0.0, now - job.info.arrival_s) + result.carried_s
        state = {
            "job": job.state_dict(),
            "result": {k: getattr(result, k) for k in _RESULT_FIELDS},
            "timing": {"elapsed_s": elapsed, "queueing_s": result.queueing_s},
            "spec": asdict(job.spec),
        }
        atomic_torch_save(state, self.dir / f"{job.info.job_id}.pt")
        self.written += 1

    def after_finish(self, job: Job, result: JobResult) -> None:
        if self.every:
            self.save(job, result)
        if self.save_weights and result.status == "done":
            atomic_torch_save(job.model.state_dict(), self.weights_dir / f"{job.info.job_id}.pt")


def load_into(path: Path, job: Job) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``job`` (model, optimizer, random state,
    iteration) and return the whole saved state. Each way it can be wrong is one line: an
    unreadable file, another job's spec, or a state that does not fit the model."""
    try:
        state = torch.load(path, map_location=job.device, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user problem
        raise UserError(f"cannot read checkpoint {path}: {exc}; delete it to restart "
                        "that job from scratch") from None
    if state.get("spec") != asdict(job.spec):
        raise UserError(f"checkpoint {path} was written for a different job spec; "
                        "resume with the run's own config (run.resume=<that run dir>)")
    try:
        job.load_state_dict(state["job"], source=str(path))
    except (RuntimeError, KeyError, ValueError) as exc:
        raise misfit(str(path), job.info.name, exc) from None
    return state


def restore(run_dir: Path, jobs: list[Job]) -> dict[str, JobResult]:
    """Load each job's latest checkpoint from ``run_dir``; return the restored results.

    A job without a checkpoint starts from scratch. A checkpoint whose job spec differs from
    the job being resumed is refused (it would silently train something else).
    """
    results: dict[str, JobResult] = {}
    for job in jobs:
        path = run_dir / CHECKPOINT_DIR / f"{job.info.job_id}.pt"
        if not path.exists():
            continue
        state = load_into(path, job)
        result = JobResult(job.info)
        for key, value in state["result"].items():
            setattr(result, key, value)
        timing = state.get("timing", {})
        result.carried_s = float(timing.get("elapsed_s", 0.0))
        result.carried_queueing_s = timing.get("queueing_s")
        if result.status == "done":
            result.end_s = job.info.arrival_s  # nothing more to run: its JCT is what it was
        elif result.status not in ("failed", "rejected"):
            result.status = "pending"
        results[job.info.job_id] = result
    return results
