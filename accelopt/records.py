"""What a run measured, as plain data: the runtime fills these, ``accelopt.report`` writes them.

Keeping the record separate from both sides means a report can be re-rendered from a saved
``metrics.json`` and the runtime never formats output itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from accelopt.types import JobInfo, ReportRow, RunInfo

JobStatus = Literal["done", "failed", "rejected", "pending"]


@dataclass
class Span:
    """A timed interval on one track of the timeline (seconds since the run started).

    ``track`` groups spans into one row of the Chrome trace / PNG timeline, e.g.
    ``"lane default"``, ``"job mlp-a"``, ``"hooks"`` or ``"rank 1 link 0->1"``.
    """

    name: str
    track: str
    start_s: float
    end_s: float
    category: str = "iteration"
    args: dict[str, float | int | str] = field(default_factory=dict)
    process: str = "executor"


@dataclass
class TelemetrySample:
    """One sample of the machine: GPU utilisation/memory where pynvml sees a GPU, else the
    process's CPU percentage and resident memory."""

    t_s: float
    source: Literal["nvml", "process"]
    utilization_pct: float | None
    """``None``: not measured (the process's first sample: a CPU share needs a previous
    reading)."""
    memory_bytes: int


@dataclass(frozen=True)
class Quality:
    """What a job learned: its final model's score on the held-out set
    (``accelopt/job/quality.py``)."""

    metric: str
    """``accuracy`` (single-label data) or ``p_at_1`` (multi-label: precision@1)."""
    value: float
    samples: int
    """Held-out points scored."""
    p_at_5: float | None = None
    """Multi-label data: precision@5 (the mean share of the five best-scored classes that
    are among a point's labels), the extreme-classification convention beside P@1."""
    note: str = ""
    """What to know about the score (``""``: nothing): a model whose output width is not
    the dataset's class count, which trains without an error."""


CANNOT_SCORE = "cannot score"
"""How :attr:`JobResult.quality_note` starts for a trained job whose held-out scoring
failed (as opposed to one with nothing to score: no held-out set, an inference job)."""


@dataclass
class JobResult:
    """Outcome and timing of one job.

    JCT (job completion time) is measured from arrival to the end of its last iteration;
    queueing delay from arrival to the start of its first iteration. In a resumed run the
    arrival is on that run's clock (negative for a job that had arrived before it:
    ``job/checkpoint.py`` ``arrive_on_resumed_clock``), so JCT and queueing delay count
    the time before the resume; ``carried_s`` serves checkpoints that recorded no clock.
    """

    job: JobInfo
    status: JobStatus = "pending"
    lane: str = ""
    error: str = ""
    admitted_s: float | None = None
    first_start_s: float | None = None
    end_s: float | None = None
    iterations_done: int = 0
    service_s: float = 0.0
    samples: int = 0
    final_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    carried_s: float = 0.0
    """Time from arrival to the checkpoint this job was resumed from, where that run
    recorded no clock (0 otherwise: its arrival on the resumed clock counts that time)."""
    carried_queueing_s: float | None = None
    """The queueing delay it had before that checkpoint (``None``: it had not started)."""
    quality: Quality | None = None
    """The trained model on the held-out set (``None``: not scored, see ``quality_note``)."""
    quality_note: str = ""
    """Why there is no quality: no held-out set, an inference job, the job did not finish,
    ``evaluate: false``, or the one-line reason scoring failed; with a quality, its
    :attr:`Quality.note` (a model whose output width is not the class count); after either,
    where some losses were not finite but the job did not diverge, :attr:`nonfinite_note`."""
    weights_finite: bool | None = None
    """Whether its trained weights are all finite, checked where it is scored
    (``job/quality.py`` ``score_result``); ``None``: not known in this process. The truest
    sign of divergence: a loss of nan from a skipped step or from a batch with nothing to
    predict leaves the weights finite, a diverged job's weights are not."""

    @property
    def jct_s(self) -> float | None:
        """Arrival to the last iteration's end; none for a job rejected before it ran (its
        ``end_s`` is when it was turned away, no completion: the CSV's column averaged it)."""
        if self.end_s is None or self.status == "rejected":
            return None
        return self.end_s - self.job.arrival_s + self.carried_s

    @property
    def queueing_s(self) -> float | None:
        if self.carried_queueing_s is not None:
            return self.carried_queueing_s
        return None if self.first_start_s is None else self.first_start_s - self.job.arrival_s

    @property
    def throughput(self) -> float | None:
        """Samples per second of the job's own service time."""
        return self.samples / self.service_s if self.service_s > 0 else None

    @property
    def diverged_at(self) -> int | None:
        """Where the job diverged, or ``None`` when it did not: a job can train to its last
        iteration on a diverged loss, and must not be read as done well.

        Its weights decide where they are known (:attr:`weights_finite`): finite, it did not
        diverge, whatever its losses (a step a plugin skipped, a batch with no labelled
        point: a loss of nan, then finite ones); not finite, the index of the first loss of
        its trailing run of losses that are not finite (a NaN or inf, ``None`` once it went
        through JSON from a rank), or ``len(losses)`` when every loss is finite (the last
        step's gradient: :attr:`diverged_where`). Where they are not known, that trailing
        run alone: the losses are not finite to the end."""
        if self.weights_finite is True:
            return None
        trailing = self._trailing_nonfinite()
        if self.weights_finite is False:
            return len(self.losses) if trailing is None else trailing
        return trailing

    def _trailing_nonfinite(self) -> int | None:
        """The index of the first loss of the trailing run of losses that are not finite
        (``None``: the last loss is finite, or there is none)."""
        start = None
        for i in range(len(self.losses) - 1, -1, -1):
            if _finite(self.losses[i]):
                break
            start = i
        return start

    @property
    def diverged_where(self) -> str:
        """Where it diverged in words (``""``: it did not): "its loss is not finite from
        loss 3 of 6", or, where every loss is finite but its weights are not, "its weights
        are not finite after its last step"."""
        at = self.diverged_at
        if at is None:
            return ""
        if at >= len(self.losses):
            return "its weights are not finite after its last step, every loss finite"
        return f"its loss is not finite from loss {at + 1} of {len(self.losses)}"

    @property
    def nonfinite_note(self) -> str:
        """``""``, or, for a job that did not diverge though some of its losses were not
        finite, how many and the first: a skipped step, or a batch with no labelled point
        (its loss a mean over nothing), is no divergence, but is worth knowing."""
        bad = [i for i, loss in enumerate(self.losses) if not _finite(loss)]
        if not bad or self.diverged_at is not None:
            return ""
        after = ("its weights stayed finite" if self.weights_finite
                 else "the losses after them are finite")
        return (f"{len(bad)} of {len(self.losses)} losses not finite (first: loss "
                f"{bad[0] + 1}); {after} (a skipped step, or a batch with no labelled point)")


def _finite(loss: float | None) -> bool:
    return loss is not None and math.isfinite(loss)


@dataclass
class RunRecord:
    """Everything one run measured."""

    info: RunInfo
    duration_s: float = 0.0
    jobs: list[JobResult] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    plugin_rows: list[ReportRow] = field(default_factory=list)
    telemetry: list[TelemetrySample] = field(default_factory=list)
    telemetry_note: str = ""
    metrics: dict[str, float | int | str] = field(default_factory=dict)
    """Run-level figures the runtime or a plugin measured (e.g. a cluster's E)."""
    summary: dict[str, Any] = field(default_factory=dict)
    """Once the run's outputs are written: ``metrics.json``'s ``summary`` (JCT statistics,
    makespan, duration, and :attr:`metrics`)."""
    warnings: list[str] = field(default_factory=list)
    """Settings this run was given that it could not use, or that distort what it measures
    (``runtime.run.setting_warnings``): kept in ``metrics.json``'s ``run`` section, so its
    figures are never read as measured under them (a one-process run given a shaped link)."""
