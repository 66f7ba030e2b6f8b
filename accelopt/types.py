"""Small frozen records that the core passes to plugin hooks.

Hooks never receive the runtime's mutable objects (no "god object"): each hook gets the
few facts it needs as immutable dataclasses, so a plugin cannot corrupt core state by
accident and a recorded hook call can be compared later (see ``accelopt.testing``).

The facts a plugin needs about *where* it runs (rank, role, world size, the cluster's
settings) are in :class:`RunInfo`, and the facts about a job's model (its parameter table,
gradient buckets, optimizer) in :class:`JobInfo`: a plugin never rebuilds a job or reads
environment variables to learn them. The exceptions that hold live objects on purpose are
marked as such (:class:`LayerOffer`, :class:`BuiltJob`): a plugin may change or inspect them
during the call and must not keep them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:  # annotations only: importing torch here would slow every import
    import torch

JobKind = Literal["train", "infer"]
AllocationPhase = Literal["admission", "iteration"]
TransferKind = Literal["param", "grad"]
ClusterMode = Literal["none", "ps", "allreduce"]
Role = Literal["single", "server", "worker"]
"""What a process does for its jobs: ``single`` (one process trains them), ``server`` (holds a
shard of each job's parameters and takes its optimizer step: PS mode) or ``worker`` (runs
forward and backward on its rows of every batch)."""
Scope = Literal["run", "job"]
"""How many instances of a plugin a process makes: one (``run``) or one per job (``job``)."""
_R = TypeVar("_R")


def made_often(cls: type[_R]) -> type[_R]:
    """Give a frozen dataclass a constructor that stores its fields straight into the
    instance's ``__dict__``.

    Why: a frozen dataclass's generated ``__init__`` sets every field through
    ``object.__setattr__`` (about 100 ns a field), and the records decorated with this are
    made every iteration or every transfer of every job, on the path whose overhead
    ``benchmarks/overhead.py`` holds to 1% of an iteration. The record stays a frozen
    dataclass in every other respect (equality, hashing, ``dataclasses.replace``, assignment
    refused); it has no ``__slots__``, since a slot can only be set through the slow path.
    """
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    defaults = {f"_default_{f.name}": f.default for f in fields
                if f.default is not dataclasses.MISSING}
    params = ", ".join(f.name + (f"=_default_{f.name}" if f"_default_{f.name}" in defaults
                                 else "") for f in fields)
    stores = "".join(f"    d[{f.name!r}] = {f.name}\n" for f in fields)
    namespace: dict[str, Any] = dict(defaults)
    exec(f"def __init__(self, {params}):\n    d = self.__dict__\n{stores}", namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init  # type: ignore[misc]
    return cls


@dataclass(frozen=True, slots=True)
class JobProfile:
    """Measured memory and time of one job (never guessed; see ``job/profile.py``).

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
class ParamInfo:
    """One parameter tensor of a job's model, as built (after every plugin's layer build).

    ``index`` is its position in the job's parameter table (the id both ends of a transfer
    share); ``layer_index`` the position of its owning module among the modules that own
    parameters, in module (forward) order; ``module`` that module's dotted path.
    """

    index: int
    name: str
    layer_index: int
    nbytes: int
    module: str
    shape: tuple[int, ...] = ()
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class JobInfo:
    """Identity, plan and model facts of a job, as a plugin sees it.

    ``parameters`` and ``buckets`` are filled once the model is built (empty in the records a
    plugin sees while the model is being built, ``accelopt_layer_build``). ``buckets`` are the
    gradient buckets an all-reduce would send (the parameters that require grad when the job
    is built: a frozen one is never sent, as in DDP), in backward order, as indices into
    ``parameters`` (``cluster.bucket_mb`` each, a tensor larger than that alone).
    """

    job_id: str
    name: str
    model: str
    kind: JobKind
    arrival_s: float
    iterations: int
    batch_size: int
    profile: JobProfile | None = None
    optimizer: str = "sgd"
    lr: float = 0.0
    momentum: float = 0.0
    parameters: tuple[ParamInfo, ...] = ()
    buckets: tuple[tuple[int, ...], ...] = ()

    def parameter(self, name: str) -> ParamInfo:
        """The parameter called ``name`` (``KeyError`` naming the known ones otherwise)."""
        for info in self.parameters:
            if info.name == name:
                return info
        raise KeyError(f"job {self.job_id!r} has no parameter {name!r}")


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """The cluster settings of a run (``mode="none"``: one process, no transfers)."""

    mode: ClusterMode = "none"
    workers: int = 1
    servers: int = 0
    backend: str = "none"
    bucket_bytes: int = 2**20
    timeout_s: float = 30.0
    bandwidth_bps: int | None = None
    latency_s: float | None = None
    topology: str = "none"
    """``none`` (the machine's loopback), ``shared`` (one shaped loopback) or ``hosts`` (a
    network namespace and a link per rank)."""
    link_bandwidth_bps: tuple[int | None, ...] = ()
    """Hosts topology: each rank's link rate (None: unlimited), by rank."""

    @property
    def world_size(self) -> int:
        if self.mode == "none":
            return 1
        return self.workers + (self.servers if self.mode == "ps" else 0)


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


@made_often
@dataclass(frozen=True)
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


@made_often
@dataclass(frozen=True)
class IterationContext:
    """Facts about the iteration that is about to start or has just ended.

    ``lane`` is the lane the iteration runs in (a cluster run: the lane the leader granted);
    ``now_s`` the time the iteration started, in seconds since the run's clock started.
    """

    job: JobInfo
    lane: str
    iteration: int
    now_s: float


@made_often
@dataclass(frozen=True)
class IterationResult:
    """What one iteration measured (on the process that ran it: a worker's own rows).

    ``end_s`` is when the iteration's work ended, as ``accelopt_iteration_end`` sees it; a
    driver's account of the iteration (its span, the job's service time) runs until the step
    returns, so what that hook's plugins do counts as the job's time too."""

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
class OptimizerRebuild:
    """An answer of ``accelopt_after_step``: the model changed (e.g. it was pruned), so the core
    builds the job's optimizer again over the model's current parameters. ``reason`` is
    recorded in the run's log line."""

    reason: str


@made_often
@dataclass(frozen=True)
class TransferRecord:
    """One parameter or gradient transfer between two processes of a cluster.

    ``nbytes`` is the tensor's own size (what the transfer carries before any encoding);
    ``wire_bytes`` what crossed the link for it, header included, as the core counts it in
    ``bytes_per_iteration``. ``wire_bytes`` is known once the transfer has started, so it is
    0 in the records the order, filter and encode hooks see and filled in the record that
    ``accelopt_transfer_decode`` and ``accelopt_transfer_done`` receive.
    """

    job_id: str
    iteration: int
    source: int
    destination: int
    tensor: str
    nbytes: int
    layer_index: int
    kind: TransferKind
    wire_bytes: int = 0


@dataclass(frozen=True, slots=True)
class TransferPriorities:
    """An answer to ``accelopt_transfer_order`` that asks for *priority* scheduling instead
    of a strict order (ByteScheduler, P3).

    A plain list of names is a strict order: priority p starts only after 0..p-1 have
    started, so a high-priority transfer posted last holds back everything before it. With
    this record the sender starts, whenever fewer than ``credit_bytes`` are in flight to
    that destination, the highest-priority transfer that has been posted (``order[0]``
    first; a tensor it does not name ranks after those it names). A transfer posted late
    but needed early therefore overtakes the low-priority ones still waiting, and the
    credit window bounds how many bytes can be ahead of it on the link. ``credit_bytes=0``
    starts every transfer the moment it is posted (priorities then only break ties between
    transfers posted together).

    ``early_update`` (parameter-server mode, on the servers' parameter transfers): the
    server updates each tensor of its shard as soon as every worker's gradient for it has
    arrived and posts it for the next iteration at once, so the next forward's first layers
    can arrive while the last gradients are still on the link. The arithmetic is the same
    as one optimizer step over the shard (the update is per tensor either way); where it is
    not (gradient clipping, a plugin on ``accelopt_before_optimizer_step``, an fp16 scaler,
    an optimizer that is not torch's SGD, Adam or AdamW) the server keeps the whole step and
    says so in its log.

    ``partition_bytes`` (> 0): a payload larger than this goes as chunks of at most this
    many bytes, each competing for the window with its tensor's priority, so a large
    low-priority tensor already on the link is preempted, between two chunks, by a
    higher-priority one posted meanwhile. Only with a window (``credit_bytes > 0``) does a
    chunk wait; without one every chunk starts at once.

    ``pace_bytes_per_s`` (> 0, with a window): a transfer's credit returns no sooner than
    its bytes take at that rate after the previous ones to that destination, not when its
    sends complete: a send completes once the kernel has its bytes, and the socket buffers
    and a shaped link's queue hold far more than a window, so without pacing the transfers
    the window holds back wait there instead, first posted first. Pace at (a little under)
    the link's rate.

    All-reduce keeps ``order`` as a strict order: every rank must start its collectives in
    the same sequence, which readiness-driven scheduling cannot promise.
    """

    order: tuple[str, ...]
    credit_bytes: int = 0
    early_update: bool = False
    partition_bytes: int = 0
    pace_bytes_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class LayerOffer:
    """A layer offered to plugins once, at model build time.

    ``path`` is the dotted module path inside the model (``""`` for the model itself),
    ``index`` its position in the model's module order; ``in_features``/``out_features``
    are filled for Linear-like layers so plugins can decide without isinstance checks.
    ``module`` is the live module: return a replacement, or change it in place, during the
    call; do not keep it past the run.
    """

    job: JobInfo
    path: str
    index: int
    module: torch.nn.Module
    module_type: str
    in_features: int | None = None
    out_features: int | None = None


@dataclass(frozen=True, slots=True)
class BuiltJob:
    """A job whose model is built, moved to its device and attached to its exchange, as
    ``accelopt_job_built`` shows it once, before the first iteration.

    ``inputs``/``targets`` are the rows this process trains on of the job's first batch (a
    parameter server, which trains on none, gets the first worker's rows), ``loss(out, y)``
    the job's training loss. The model is the live one: inspect it (trace it, count its
    FLOPs) on a copy if the inspection runs it, and do not keep a reference to it.
    """

    job: JobInfo
    model: torch.nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    """``loss(model_output, targets)``; the output may be a model's own object (a sampled
    output layer computes its loss from it)."""


@dataclass(frozen=True, slots=True)
class RunInfo:
    """The run as a whole, as this process sees it: where it writes, which plugins are active,
    on which device, and the process's place in a cluster.

    ``rank``/``role``/``world_size``/``leader``: a single-process run is rank 0 of 1, role
    ``single``, leader. In a cluster run every rank is a process of its own; the leader (rank
    0) is where scheduling decisions are made (``accelopt_allocate``, ``accelopt_select_next``)
    and the rank whose view of a run-scoped plugin is reported. ``job`` is set for the
    instances of a job-scoped plugin (``PluginSpec(scope="job")``): the job that instance
    serves; it is ``None`` for run-scoped plugins.
    """

    run_dir: str
    device: str
    plugins: tuple[str, ...]
    jobs: tuple[JobInfo, ...]
    seed: int
    rank: int = 0
    role: Role = "single"
    world_size: int = 1
    leader: bool = True
    cluster: ClusterInfo = field(default_factory=ClusterInfo)
    job: JobInfo | None = None


@dataclass(frozen=True, slots=True)
class ReportRow:
    """One line a plugin contributes to the run summary: what it did, or why it did nothing.

    ``metrics[INERT] = 1`` says this row's plugin changed nothing in this run (nothing to
    do, stayed out of the way): ``run.compare`` then calls a measured difference of a plugin
    whose every row says so what it is, run-to-run noise, instead of crediting it."""

    plugin: str
    summary: str
    metrics: dict[str, float | int | str] = field(default_factory=dict)


INERT = "inert"
"""The :class:`ReportRow` metric saying its plugin changed nothing in this run (value 1)."""


@dataclass(frozen=True, slots=True)
class CliCommand:
    """A subcommand a plugin adds to ``accelopt`` (``accelopt <name> ...``).

    ``run`` receives the remaining command-line arguments and returns an exit code.
    """

    name: str
    help: str
    run: Callable[[list[str]], int | None]


__all__ = [
    "INERT",
    "AllocationDecision",
    "AllocationPhase",
    "AllocationRequest",
    "BuiltJob",
    "CliCommand",
    "ClusterInfo",
    "ClusterMode",
    "IterationContext",
    "IterationResult",
    "JobInfo",
    "JobKind",
    "JobProfile",
    "JobState",
    "LayerOffer",
    "OptimizerRebuild",
    "ParamInfo",
    "ReportRow",
    "Role",
    "RunInfo",
    "Scope",
    "TransferKind",
    "TransferRecord",
]
