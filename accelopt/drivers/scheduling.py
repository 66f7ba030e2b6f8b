"""Which job's iteration runs next: the one choice function of every driver.

The single-process executor asks it at each lane's iteration boundary; a cluster run's leader
asks it the same way and broadcasts the answer, so a scheduling plugin behaves identically in
both. Without an answer (no plugin implements ``accelopt_select_next``, or all say ``None``)
the earliest arrival runs (ties: submission order), which runs each job to completion: FIFO.
"""

from __future__ import annotations

from collections.abc import Sequence

from accelopt.host import PluginHost
from accelopt.types import JobInfo, JobState

HOOK = "accelopt_select_next"


def submission_index(job_id: str) -> int:
    """The submission number a job id starts with (``07-cnn`` -> 7, ``112-mlp`` -> 112);
    an id without one sorts after every numbered id."""
    head = job_id.partition("-")[0]
    return int(head) if head.isdigit() else 1 << 62


def arrival_key(job: JobInfo) -> tuple[float, int, str]:
    """Earliest arrival first; ties by submission order, the number a job id starts with
    compared as a number (job 100 after job 11, which the ids as strings would invert),
    then by id."""
    return (job.arrival_s, submission_index(job.job_id), job.job_id)


def arrival_order(state: JobState) -> tuple[float, int, str]:
    """:func:`arrival_key` of a ready job's snapshot."""
    return arrival_key(state.job)


def choose_next(host: PluginHost, lane: str, ready: Sequence[JobState], now_s: float) -> str:
    """The ``job_id`` of the ready job that runs next in ``lane`` (``ready`` is not empty).

    With a single ready job the choice is forced and the hook is not asked. An answer that
    names no ready job of the lane is refused by the host, naming the plugin and the ready
    jobs (``hookspecs.ANSWER_CHECKS``)."""
    if len(ready) > 1 and host.implements(HOOK):
        job_id = host.call(HOOK, lane=lane, ready=list(ready), now_s=now_s)
        if job_id is not None:
            return str(job_id)
    return min(ready, key=arrival_order).job.job_id
