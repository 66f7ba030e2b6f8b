"""Building a workload's jobs in this process, each offered to its plugins' layer build."""

from __future__ import annotations

import torch

from accelopt.activation import PluginSet, as_plugin_set
from accelopt.config import JobConfig
from accelopt.host import PluginHost
from accelopt.job.job import DEFAULT_BUCKET_BYTES, Job
from accelopt.job.specs import job_id_for


def build_jobs(specs: list[JobConfig], device: torch.device,
               plugins: PluginSet | PluginHost | None = None,
               *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Job]:
    """One :class:`Job` per spec (ids ``NN-name``), with the local exchange, each built
    through the host of the plugins that see it."""
    plugins = as_plugin_set(plugins)
    return [
        Job(spec, job_id=job_id, device=device, host=plugins.for_job(job_id),
            bucket_bytes=bucket_bytes)
        for job_id, spec in ((job_id_for(i, s), s) for i, s in enumerate(specs))
    ]
