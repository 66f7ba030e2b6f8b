"""Which job's iteration runs next: the one choice function of every driver.

The single-process executor asks it at each lane's iteration boundary; a cluster run's leader
asks it the same way and broadcasts the answer, so a scheduling plugin behaves identically in
both. Without an answer (no plugin implements ``accelopt_select_next``, or all say ``None``)
the earliest arrival runs (ties: job id), which runs each job to completion: FIFO.
"""

from __future__ import annotations

from collections.abc import Sequence

from accelopt.errors import AccelOptError
from accelopt.host import PluginHost
from accelopt.types import JobState

HOOK = "accelopt_select_next"


def arrival_order(state: JobState) -> tuple[float, str]:
    return (state.job.arrival_s, state.job.job_id)


def choose_next(host: PluginHost, lane: str, ready: Sequence[JobState], now_s: float) -> str:
    """The ``job_id`` of the ready job that runs next in ``lane`` (``ready`` is not empty).

    With a single ready job the choice is forced and the hook is not asked. An answer that
    names no ready job of the lane is an error naming the hook and the ready jobs."""
    if len(ready) > 1 and host.implements(HOOK):
        job_id = host.call(HOOK, lane=lane, ready=list(ready), now_s=now_s)
        if job_id is not None:
            if not any(s.job.job_id == job_id for s in ready):
                raise AccelOptError(
                    f"{HOOK} returned {job_id!r}, which is not a ready job of lane '{lane}' "
                    f"(ready: {', '.join(s.job.job_id for s in ready)})"
                )
            return str(job_id)
    return min(ready, key=arrival_order).job.job_id
