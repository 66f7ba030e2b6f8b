"""A job and its one training step: model, data, loss, optimizer, random state, and the
exchange that moves its gradients and parameters (local, or a cluster's).

Layering: ``job`` sits below the drivers and above the records; it never imports a driver or
the runtime (import-linter checks it)."""

from __future__ import annotations

from accelopt.job.build import build_jobs
from accelopt.job.events import Event, StepEvents
from accelopt.job.exchange import Exchange
from accelopt.job.gradients import Gradients
from accelopt.job.job import Job, job_loss
from accelopt.job.rng import JobRandom, isolated_rng
from accelopt.job.specs import job_id_for, job_specs

__all__ = [
    "Event",
    "build_jobs",
    "Exchange",
    "Gradients",
    "Job",
    "JobRandom",
    "StepEvents",
    "isolated_rng",
    "job_id_for",
    "job_loss",
    "job_specs",
]
