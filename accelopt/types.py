"""Small frozen records that the core passes to plugin hooks.

Hooks never receive the runtime's mutable objects (no "god object"): each hook gets the
few facts it needs as immutable dataclasses, so a plugin cannot corrupt core state by
accident and a recorded hook call can be compared later (see ``accelopt.testing``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

JobKind = Literal["train", "infer"]
AllocationPhase = Literal["admission", "iteration"]
TransferKind = Literal["param", "grad"]


@dataclass(frozen=True, slots=True)
class JobProfile:
    """Measured memory and time of one job (never guessed; see ``runtime/profile.py``).

    ``persistent_bytes`` lives for the whole job (parameters, gradients, optimizer state) and
    is the exact sum of those tensors' sizes. ``ephemeral_bytes`` is allocated and freed within
    one iteration (``peak_bytes - persistent_bytes``). ``method`` says how the peak was
    measured, because a CPU has no allocator statistics and the figure there is a bound.
    """

    persistent_bytes: int
    peak_bytes: int
    ephemeral_bytes: int
    iteration_seconds: float
    device: str
    method: str


@dataclass(frozen=True, slots=True)
class JobInfo:
    """Identity and plan of a job, as a plugin sees it."""

    job_id: str
    name: str
    model: str
    kind: JobKind
    arrival_s: float
    iterations: int
    batch_size: int
    profile: JobProfile | None = None


@dataclass(frozen=True, slots=True)
class AllocationRequest:
    """A job asks for memory: its persistent bytes at admission, or one iteration's ephemeral
    bytes before that iteration starts."""

    job: JobInfo
    phase: AllocationPhase
    persistent_bytes: int
    ephemeral_bytes: int
    device: str
    capacity_bytes: int | None
    """Device capacity the run was configured with (``None``: unlimited / not known)."""


@dataclass(frozen=True, slots=True)
class AllocationDecision:
    """A plugin's answer to an :class:`AllocationRequest`.

    ``granted=False`` defers the job (it stays pending and is offered again whenever memory is
    released). ``lane`` names the concurrency domain the job's iterations run in: iterations
    in one lane run one at a time, different lanes run concurrently. ``reject`` refuses the job
    for good (e.g. it can never fit); the string is shown to the user.
    """

    granted: bool
    lane: str = "default"
    reason: str = ""
    reject: str | None = None


@dataclass(frozen=True, slots=True)
class JobState:
    """A snapshot of one admitted job at an iteration boundary."""

    job: JobInfo
    lane: str
    iterations_done: int
    service_seconds: float
    """Wall time this job's iterations have run so far."""
    last_iteration_seconds: float | None
    admitted_at_s: float

    @property
    def remaining_iterations(self) -> int:
        return self.job.iterations - self.iterations_done


@dataclass(frozen=True, slots=True)
class IterationContext:
    """Facts about the iteration that is about to start or has just ended."""

    job: JobInfo
    lane: str
    iteration: int
    now_s: float


@dataclass(frozen=True, slots=True)
class IterationResult:
    """What one iteration measured."""

    job_id: str
    iteration: int
    start_s: float
    end_s: float
    loss: float | None
    samples: int

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One parameter or gradient transfer between two processes of a cluster."""

    job_id: str
    iteration: int
    source: int
    destination: int
    tensor: str
    nbytes: int
    layer_index: int
    kind: TransferKind


@dataclass(frozen=True, slots=True)
class LayerOffer:
    """A layer offered to plugins once, at model build time.

    ``path`` is the dotted module path inside the model (``""`` for the model itself),
    ``index`` its position in the model's module order; ``in_features``/``out_features``
    are filled for Linear-like layers so plugins can decide without isinstance checks.
    """

    job: JobInfo
    path: str
    index: int
    module: Any
    module_type: str
    in_features: int | None = None
    out_features: int | None = None


@dataclass(frozen=True, slots=True)
class RunInfo:
    """The run as a whole: where it writes, which plugins are active, on which device."""

    run_dir: str
    device: str
    plugins: tuple[str, ...]
    jobs: tuple[JobInfo, ...]
    seed: int


@dataclass(frozen=True, slots=True)
class ReportRow:
    """One line a plugin contributes to the run summary: what it did, or why it did nothing."""

    plugin: str
    summary: str
    metrics: dict[str, float | int | str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CliCommand:
    """A subcommand a plugin adds to ``accelopt`` (``accelopt <name> ...``).

    ``run`` receives the remaining command-line arguments and returns an exit code.
    """

    name: str
    help: str
    run: Any
