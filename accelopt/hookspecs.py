"""The hook points of accelopt (pluggy project ``accelopt``).

Every hook is called with keyword arguments only (pluggy refuses positional calls) and
receives small frozen records from :mod:`accelopt.types`. Four hook points come from the
design card (allocation, iteration boundary, send/recv, layer build); the iteration events
around them (after forward, before the optimizer step, after it) and the lifecycle hooks
complete the contract. ``docs/hooks.md`` documents each one with an example, and
``tests/test_hook_docs.py`` fails when a hookspec and its documentation disagree, or when no
test makes the core call it.

Each docstring below ends with three lines, modelled on pytest's ``hookspec.py``:

* ``Called:`` in which phase and by whom (the driver, the job's step, the transport);
* ``Ranks:`` on which processes (``single`` is a one-process run; in a cluster run every
  rank is a process: the ``leader`` is rank 0, ``server`` and ``worker`` its roles);
* ``Thread:`` on which thread. A *lane's thread* runs the lane's iterations: a thread of its
  own, except in a one-process run of a single job, where the thread that started the run
  (the main thread) runs them. Whatever the thread, the core calls a process's hooks one at
  a time (one lock per process; where one thread makes every call, a single job in one
  process, the step's events skip the lock), so a plugin never sees two of its hook calls
  at once. A thread may serve later work (a PS rank's receiving threads are reused), so a
  hook leaves thread-local state (torch's grad mode, autocast) as it found it: ``with``
  blocks do.

The same sequence of events runs in every mode; a mode only changes how gradients and
parameters move (``docs/ARCHITECTURE.md``, "One step"). Per job and iteration::

    iteration_start -> [forward] -> after_forward -> [backward] -> [gradient exchange]
      -> before_optimizer_step -> [optimizer step] -> after_step -> iteration_end

Why these shapes: decisions only one plugin can make (admit a job, pick the next iteration,
order transfers) are ``firstresult`` hooks (the first answer that is not ``None`` wins);
transformations of one object (a layer, a payload, the loss, the optimizer) are *chained*,
each plugin receiving the previous one's output; observations go to every plugin. Nothing
here is called inside a layer's forward pass.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

from accelopt.types import (
    AllocationDecision,
    AllocationRequest,
    BuiltJob,
    CliCommand,
    IterationContext,
    IterationResult,
    JobInfo,
    JobState,
    LayerOffer,
    OptimizerRebuild,
    ReportRow,
    RunInfo,
    TransferPriorities,
    TransferRecord,
)

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

    from accelopt.job.gradients import Gradients

PROJECT = "accelopt"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- lifecycle --------------------------------------------------------------------------


@hookspec
def accelopt_configure(config: Any, run_config: DictConfig) -> None:
    """Receive this plugin's validated config object and the whole resolved run config.

    ``config`` is the plugin's own structured config (an instance of the dataclass it
    declared); ``run_config`` is the read-only OmegaConf tree of the run. Raise
    :class:`accelopt.UserError` for a bad setting: it is reported in one line (exit 2) before
    anything is trained, because every selected plugin set (the run's and each
    ``run.compare`` reference set) is configured once up front to validate it.

    Called: once per plugin instance, before any job is built (and once more, on a fresh
    instance, during the up-front validation).
    Ranks: every process: single, every rank of a cluster run, and the process that launched
    the ranks (it validates the selection before they start and rebuilds each finished job
    to score it).
    Thread: the process's main thread.
    """


@hookspec
def accelopt_job_built(run: RunInfo, job: BuiltJob) -> None:
    """A job's model is built, on its device and attached to its exchange: inspect it.

    ``job.job`` carries the parameter table and buckets; ``job.model``, ``job.inputs`` and
    ``job.loss`` let a plugin trace or time the model (on a copy if that runs it). Use it for
    work that belongs before the clock starts, such as planning a transfer order.

    Called: once per job, after every job of the run is built and before
    ``accelopt_run_start``.
    Ranks: every process that builds the job: single, and every rank.
    Thread: the process's main thread.
    """


@hookspec
def accelopt_run_start(run: RunInfo) -> None:
    """The run is about to execute its jobs; ``run.run_dir`` exists.

    ``run.rank``/``role``/``world_size``/``leader`` say where this process is; ``run.job`` is
    the job a job-scoped plugin instance serves (``None`` for run-scoped plugins).

    Called: once per plugin instance, after every job is built, before the first arrives.
    Ranks: every process: single, and every rank.
    Thread: the process's main thread.
    """


@hookspec
def accelopt_report_rows(run: RunInfo) -> list[ReportRow] | None:
    """Contribute lines to the run summary: what the plugin did, or why it did nothing.

    Every active plugin should answer, so the user never has to guess whether a plugin
    was inert on this workload. In a cluster run each rank answers for itself; a job-scoped
    plugin's rows are kept from every rank, a run-scoped plugin's from one (the first worker
    that reported, else the first rank): answer ``[]`` on a rank with nothing of its own to
    say (a follower of the leader's decisions, say). A metric of nan or inf is kept, but
    ``metrics.json`` writes it as null (JSON has neither), said once in a warning naming
    the plugin and the metric; the conformance kit fails such a row.

    Called: once per plugin instance, after the last job ended, before ``accelopt_run_end``.
    Ranks: every process: single, and every rank.
    Thread: the process's main thread.
    """


@hookspec
def accelopt_run_end(run: RunInfo, metrics: dict[str, Any]) -> None:
    """The run has finished (jobs done, failed or rejected); ``metrics`` is this process's
    summary of it (a cluster rank's own view: its iterations, its times).

    Called: once per plugin instance, last, after ``accelopt_report_rows``.
    Ranks: every process: single, and every rank.
    Thread: the process's main thread.
    """


@hookspec
def accelopt_cli_commands() -> Sequence[CliCommand] | None:
    """Contribute subcommands to the ``accelopt`` command line (``accelopt NAME ...``).

    Asked of every *installed* plugin (no plugin config exists yet), so implement it as a
    function that does not depend on ``accelopt_configure`` having been called.

    Called: by the ``accelopt`` command, when it lists or dispatches commands; never in a run.
    Ranks: the command's own process only.
    Thread: the process's main thread.
    """


# --- allocation -------------------------------------------------------------------------


@hookspec(firstresult=True)
def accelopt_allocate(request: AllocationRequest) -> AllocationDecision | None:
    """Serve, defer or reject a memory request.

    ``request.phase == "admission"`` when a job arrives (its persistent bytes plus the
    ephemeral bytes of one iteration); ``"iteration"`` before each iteration (its ephemeral
    bytes). The default (no plugin answers) grants everything in the single lane
    ``"default"``: one job at a time, exclusively. A cluster run has no memory profile of its
    jobs (the request's bytes are 0) and runs one iteration at a time on all ranks: lanes
    there order iterations but do not run them concurrently.

    Called: by the driver, when a job arrives (and again for each pending job whenever one
    is released) and before each of its iterations.
    Ranks: single, and the leader of a cluster run (its decision is broadcast).
    Thread: the driver's main thread (admission) or the lane's thread (iteration).
    """


@hookspec
def accelopt_release(job: JobInfo, lane: str, status: str) -> None:
    """An admitted job left the device (``status`` is ``done`` or ``failed``); free what was
    granted to it. Called only for jobs that were granted a lane. Pending jobs are offered to
    ``accelopt_allocate`` again right after.

    Called: by the driver, when an admitted job ends, fails or is cancelled.
    Ranks: single, and the leader of a cluster run.
    Thread: the lane's thread where the job ended (the main thread for a cancellation).
    """


# --- iteration boundary and the events of one iteration ---------------------------------


@hookspec(firstresult=True)
def accelopt_select_next(lane: str, ready: Sequence[JobState], now_s: float) -> str | None:
    """Choose which admitted job of ``lane`` runs its next iteration; return its ``job_id``.

    Called at every iteration boundary of the lane where there is a choice (two or more
    ready jobs; with one the answer is forced and the call is skipped). Returning
    ``None`` leaves the choice to the next plugin or the default (earliest arrival first,
    which runs each job to completion: FIFO). The same choice function serves one process and
    a cluster (where every rank then runs the chosen iteration).

    Called: by the driver, at an iteration boundary of the lane where two or more jobs
    are ready (never with one).
    Ranks: single, and the leader of a cluster run (its choice is broadcast).
    Thread: the lane's thread.
    """


@hookspec
def accelopt_iteration_start(context: IterationContext) -> None:
    """An iteration of ``context.job`` is about to start (its ephemeral memory is empty).

    Called: by the job's step, first, before any data is read.
    Ranks: every process that runs the iteration: single, and every rank (servers too).
    Thread: the thread running the iteration (single process: its lane's thread; a cluster
    rank: the leader's lane thread on rank 0, the main thread elsewhere).
    """


@hookspec
def accelopt_after_forward(context: IterationContext, loss: torch.Tensor) -> torch.Tensor | None:
    """The forward pass and the loss are computed, backward has not started.

    ``loss`` is the scalar tensor backward will start from. Return a replacement (a scaled
    loss for mixed precision, a regularised one) or ``None`` to keep it; chained in plugin
    order. The reported loss stays the job's own. A replacement is computed from ``loss``:
    a new leaf tensor is refused (backward from it would reach no parameter).

    Called: by the job's step of a training job, after the loss, before backward.
    Ranks: every process that runs forward: single and workers (never a parameter server).
    Thread: the thread running the iteration.
    """


@hookspec
def accelopt_before_optimizer_step(context: IterationContext, gradients: Gradients) -> None:
    """The gradients are final, the optimizer has not stepped: read, clip, scale or skip them.

    ``gradients`` maps parameter names to the tensors the optimizer will apply: after local
    backward and after the exchange (the all-reduced sum; in PS mode the workers' average, on
    the server that holds the shard). Change them in place or assign tensors of the same
    shape; ``gradients.norm()`` is the norm of the job's *whole* gradient in every mode (a
    parameter server's partial norms are combined across servers); ``gradients.skip(why)``
    skips the step. A clipping plugin written on this hook works identically in every mode.

    Called: by the job's step of a training job, once per iteration, after the exchange.
    Ranks: every process that takes the optimizer step: single, all-reduce workers, PS servers.
    Thread: the thread running the iteration.
    """


@hookspec
def accelopt_after_step(context: IterationContext, stepped: bool) -> OptimizerRebuild | None:
    """The optimizer step is done (``stepped`` is ``False`` when a plugin skipped it).

    Answer :class:`~accelopt.types.OptimizerRebuild` when the model changed (a plugin pruned
    or replaced parameters it got from ``accelopt_layer_build`` or ``accelopt_job_built``): the
    core then builds the job's optimizer again over the current parameters, carrying each
    unchanged parameter's state over, and offers it to ``accelopt_optimizer_build``.

    Called: by the job's step of a training job, after the optimizer step (or its skip).
    Ranks: every process that takes the optimizer step: single, all-reduce workers, PS servers.
    Thread: the thread running the iteration.
    """


@hookspec
def accelopt_iteration_end(context: IterationContext, result: IterationResult) -> None:
    """An iteration has ended; ``result`` has its start/end time, loss and sample count (on a
    worker: its own rows). Checkpoints are safe after it.

    Called: by the job's step, last.
    Ranks: every process that runs the iteration: single, and every rank.
    Thread: the thread running the iteration.
    """


@hookspec
def accelopt_optimizer_build(job: JobInfo, optimizer: torch.optim.Optimizer,
                             parameters: dict[str, torch.nn.Parameter],
                             previous: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """Wrap or replace a job's optimizer; chained in plugin order.

    ``optimizer`` is the one the core built from the job's settings over ``parameters`` (the
    parameters this process updates: all of them, or a server's shard). ``previous`` is
    ``None`` at the first build and the optimizer being replaced at a rebuild (see
    ``accelopt_after_step``), so a plugin can carry over state the core could not (that of a
    parameter it resized). Return the optimizer to use, or ``None`` to keep it; one that
    holds none of ``parameters`` is refused (its steps would never change the model).

    Called: when the job is built, and at every rebuild a plugin asked for.
    Ranks: every process that takes the optimizer step: single, all-reduce workers, PS servers.
    Thread: the main thread at build; the thread running the iteration at a rebuild.
    """


@hookspec
def accelopt_state_save(job: JobInfo) -> dict[str, Any] | None:
    """This plugin's state for ``job``, kept in the job's checkpoint so that a resumed run
    continues exactly (an error-feedback residual, a momentum buffer of its own, a counter).
    Return a dict of tensors and plain values (``torch.save`` writes it), or ``None`` when
    there is nothing to keep. Called for each plugin on its own: the state goes back to the
    plugin that saved it (``accelopt_state_load``), never to another. A plugin implementing
    this hook without ``accelopt_state_load`` is refused when it is built (selected, or
    checked by the conformance kit): its checkpoints could never be resumed.

    Called: whenever the job's checkpoint is written (every ``run.checkpoint_every``
    iterations and when the job ends), after the iteration it follows.
    Ranks: every process that writes a part of the job's checkpoint: single, and every rank.
    Thread: the thread that ran the iteration the checkpoint follows.
    """


@hookspec
def accelopt_state_load(job: JobInfo, state: dict[str, Any]) -> None:
    """Restore what this plugin's ``accelopt_state_save`` returned for ``job`` when the
    checkpoint being resumed was written. A checkpoint holding the state of a plugin that is
    not active, or that does not implement this hook (another version of it), is refused in
    one line saying which (its state would be lost silently). Implementing this hook without
    ``accelopt_state_save`` is harmless (no state is ever handed back). A plugin that
    changed the model during the run changes the freshly built one the same way here:
    weights that did not fit the model as built load after every plugin's state is back
    (the optimizer rebuilt first if the parameters changed).

    Called: when a resumed run has loaded the job's checkpoint, after
    ``accelopt_run_start`` and before the job's next iteration.
    Ranks: every process that loads a part of the job's checkpoint: single, and every rank.
    Thread: the main thread.
    """


# --- send / recv ------------------------------------------------------------------------


@hookspec(firstresult=True)
def accelopt_transfer_order(
    transfers: Sequence[TransferRecord], destination: int
) -> Sequence[str] | TransferPriorities | None:
    """Give the order (tensor names, first = highest priority) in which the sender starts
    the transfers of one iteration to ``destination``. The transport enforces it: a transfer
    with priority p starts only after those before it to that destination have started.
    ``None``: send in the order the sender issues them. A
    :class:`~accelopt.types.TransferPriorities` asks for priority scheduling instead (the
    best posted transfer starts whenever the credit window has room; on a PS server's
    parameters, optionally the early update that lets them cross into the next iteration);
    all-reduce takes its order as a strict one.

    Called: by the transport, once per (job, iteration, destination), before the first send
    (all-reduce: when the iteration starts; in a user's own DDP script through
    ``accelopt.ddp.comm_hook``: at the iteration's first bucket).
    Ranks: every sender of a cluster run: PS servers (parameters), workers (gradients),
    all-reduce workers (buckets, destination -1); never in a one-process run.
    Thread: the thread running the iteration (a user's DDP script: autograd's thread).
    """


@hookspec
def accelopt_transfer_encode(record: TransferRecord, payload: Any) -> Any | None:
    """Transform an outgoing payload (e.g. compress it). Return the new payload, or ``None``
    to leave it unchanged. Chained: encoders run in plugin order, each on the previous
    one's output; decoders run in reverse order. In parameter-server mode a payload may
    become any picklable object that a decoder turns back; where no plugin implements
    ``accelopt_transfer_decode``, what the encoders give is what the receiver uses, so it
    must be a tensor of ``record.nbytes`` (refused on the sender, naming the encoder).

    Called: by the transport, when a kept transfer is posted (all-reduce: from DDP's
    communication hook, once per logical bucket, when DDP's reducer hands over its gradients).
    Ranks: the sending rank of a cluster run.
    Thread: the thread that posts it: the iteration's thread, or autograd's thread for a
    gradient posted the moment it was accumulated (every all-reduce bucket).
    """


@hookspec
def accelopt_transfer_decode(record: TransferRecord, payload: Any) -> Any | None:
    """Undo ``accelopt_transfer_encode`` on the receiving side; ``None`` leaves it as is.
    ``record.wire_bytes`` is what crossed the link. What the decoders give back is the
    tensor the encoders replaced: parameter-server mode refuses one of another size than
    ``record.nbytes`` (it would broadcast into a parameter), all-reduce one of another
    number of elements than the bucket (it may come back in another dtype).

    Called: by the transport, when a transfer has arrived.
    Ranks: the receiving rank (all-reduce: every rank, for every bucket).
    Thread: a receiving thread of the transport (PS: one per peer; all-reduce: the
    completion thread).
    """


@hookspec
def accelopt_transfer_filter(record: TransferRecord) -> bool | None:
    """Return ``False`` to drop a transfer (e.g. a gradient below a threshold whose value the
    plugin keeps as error feedback). ``None``/``True`` keep it; any ``False`` drops it.

    Called: by the transport, when a transfer is posted, before encoding.
    Ranks: the sending rank of a cluster run.
    Thread: the thread that posts it (as for ``accelopt_transfer_encode``).
    """


@hookspec
def accelopt_transfer_done(record: TransferRecord, start_s: float, end_s: float) -> None:
    """A transfer finished; observers (timelines, bandwidth estimators, byte counters) see it
    here. ``record.wire_bytes`` is what crossed the link for it (0 for a dropped one's
    payload: only its header), the figure the core sums into ``bytes_per_iteration``.

    Called: by the transport, once per transfer, when it has arrived and been decoded.
    Ranks: the receiving rank (all-reduce: every rank, for its own contribution).
    Thread: a receiving thread of the transport (as for ``accelopt_transfer_decode``).
    """


RUN_DECISION_HOOKS = frozenset({
    "accelopt_allocate", "accelopt_release", "accelopt_select_next",
})
"""Decisions across jobs: a job-scoped plugin (one instance per job) cannot implement them."""

TRANSFER_HOOKS = frozenset({
    "accelopt_transfer_order", "accelopt_transfer_encode", "accelopt_transfer_decode",
    "accelopt_transfer_filter", "accelopt_transfer_done",
})
"""Transfers between ranks: called in a cluster run only, never in a one-process run."""


# --- layer build ------------------------------------------------------------------------


@hookspec
def accelopt_layer_build(layer: LayerOffer) -> torch.nn.Module | None:
    """Offered each layer of a job's model once, at build time: return a replacement
    ``torch.nn.Module`` (a sampled output layer, a pruned layer, a wrapper that installs
    saved-tensor hooks) or ``None`` to keep it. Never called during forward.

    Chained in plugin order: each plugin is offered the module as the plugins before it
    left it, so one plugin may prune a layer and the next wrap the pruned layer. Every
    process builds the same model the same way (a parameter server and its workers must agree
    on the parameters' shapes).

    Called: once per submodule (pre-order; the whole model last, under path ``""``), while
    the job is built, before it moves to its device.
    Ranks: every process that builds the job: single, every rank, and the process that
    launched a cluster run's ranks (it rebuilds each finished job to score it).
    Thread: the process's main thread.
    """


# --- answers the core uses --------------------------------------------------------------
#
# Each check below receives one plugin's answer that is not ``None`` (its name, the answer,
# and the call's arguments in the hookspec's order) and returns ``None`` when the core can
# use it, else what was expected. The host applies them to every implementation of the hook
# (:mod:`accelopt.host`), so a wrong answer stops the run in one line naming the plugin and
# the hook, where it was given, instead of an ``AttributeError`` deep in the core or a
# silent no-op (an answer the core would ignore is wrong too).


def _check_allocate(plugin: str, answer: Any, args: tuple[Any, ...]) -> str | None:
    if not isinstance(answer, AllocationDecision):
        return "an accelopt.AllocationDecision or None"
    # a dataclass checks no types: granted="no" would grant, lane=5 fail in the summary
    if not isinstance(answer.granted, bool):
        return "an AllocationDecision whose granted is True or False"
    if not isinstance(answer.lane, str) or not answer.lane:
        return "an AllocationDecision whose lane is a name (a non-empty str)"
    if not isinstance(answer.reason, str) or not isinstance(answer.reject, (str, type(None))):
        return "an AllocationDecision whose reason is a str and reject a str or None"
    return None


def _check_select_next(plugin: str, answer: Any, args: tuple[Any, ...]) -> str | None:
    lane, ready = args[0], args[1]
    ids = [state.job.job_id for state in ready]
    if isinstance(answer, str) and answer in ids:
        return None
    return f"the job_id of a ready job of lane '{lane}' ({', '.join(ids)}) or None"


def _check_report_rows(plugin: str, answer: Any, args: tuple[Any, ...]) -> str | None:
    rows = [answer] if isinstance(answer, ReportRow) else answer
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, ReportRow) for r in rows):
        return "a list of accelopt.ReportRow or None"
    if any(row.plugin != plugin for row in rows):  # a row under another plugin's name
        return f"rows of its own: ReportRow(plugin='{plugin}', ...)"
    for row in rows:  # what metrics.json and the summary can write
        if not isinstance(row.summary, str):
            return "ReportRow summaries that are str"
        if not isinstance(row.metrics, dict):
            return "ReportRow metrics that are a dict"
        for key, value in row.metrics.items():
            if not isinstance(key, str) or not isinstance(value, (int, float, str)):
                return (f"ReportRow metrics of str keys and int, float or str values; metric "
                        f"{key!r} is a {type(value).__name__} (a tensor's value: .item())")
            if isinstance(value, float) and not math.isfinite(value):
                _warn_non_finite(plugin, key, value)
    return None


_NON_FINITE_SAID: set[tuple[str, str]] = set()
"""(plugin, metric) pairs :func:`_warn_non_finite` has warned of in this process."""


def _warn_non_finite(plugin: str, metric: str, value: float) -> None:
    """A nan or inf metric is kept (a plugin may rightly have no value, and the run is not
    the place to fail it: the conformance kit does) but JSON has no nan or inf, so
    metrics.json holds null: said once per plugin and metric, naming both, so a null there
    is never a mystery."""
    if (plugin, metric) in _NON_FINITE_SAID:
        return
    _NON_FINITE_SAID.add((plugin, metric))
    from accelopt.plugin import PluginWarning

    warnings.warn(f"plugin '{plugin}' reported metric '{metric}' as {value}, which JSON cannot "
                  "hold: metrics.json records it as null; report a finite number, or leave "
                  "the metric out when there is none", PluginWarning, stacklevel=2)


def _check_cli_commands(plugin: str, answer: Any, args: tuple[Any, ...]) -> str | None:
    if isinstance(answer, (list, tuple)) and all(isinstance(c, CliCommand) for c in answer):
        return None
    return "a list of accelopt.CliCommand or None"


def _check_after_forward(plugin: str, answer: Any, args: tuple[Any, ...]) -> str | None:
    import torch

    if isinstance(answer, torch.Tensor) and answer.numel() == 1 and answer.requires_grad:
        if answer.grad_fn is None and not args[1].is_leaf:
            # torch.tensor(loss.item(), requires_grad=True): backward reaches no parameter,
            # and the job would run to "done" without training
            return ("a loss computed from the one it was given (this one is a new leaf "
                    "tensor: backward from it reaches no parameter)")
        return None
    return "a one-element torch.Tensor that requires grad (the loss backward starts from) or None"


def _check_after_step(plugin: str, answer: Any, args: tuple[Any, ...]) -> str | None:
    if isinstance(answer, OptimizerRebuild):
        return None
    return "an accelopt.OptimizerRebuild (to rebuild the optimizer) or None"


def _check_optimizer_build(plugin: str, answer: Any, args: tuple[Any, ...]) -> str | None:
    import torch

    if isinstance(answer, torch.optim.Optimizer):
        held = {id(p) for group in answer.param_groups for p in group["params"]}
        parameters = args[2]
        if parameters and not any(id(p) in held for p in parameters.values()):
            # its steps would change tensors the model does not use: the job would run to
            # "done" untrained
            return (f"a torch.optim.Optimizer over job '{args[0].name}''s parameters (the "
                    "`parameters` it was given); this one holds none of them")
        return None
    return f"a torch.optim.Optimizer for job '{args[0].name}' or None"


def _check_layer_build(plugin: str, answer: Any, args: tuple[Any, ...]) -> str | None:
    import torch

    if isinstance(answer, torch.nn.Module):
        return None
    return f"a torch.nn.Module for layer '{args[0].path or '<model>'}' or None"


def _check_state_save(plugin: str, answer: Any, args: tuple[Any, ...]) -> str | None:
    if isinstance(answer, dict) and all(isinstance(k, str) for k in answer):
        return None
    return "a dict with str keys (what accelopt_state_load gets back) or None"


def _check_transfer_order(plugin: str, answer: Any, args: tuple[Any, ...]) -> str | None:
    transfers = args[0]
    names = answer.order if isinstance(answer, TransferPriorities) else answer
    expected = ("a list of the transfers' tensor names (first = highest priority), "
                "an accelopt.TransferPriorities or None")
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        return expected
    if not all(isinstance(n, str) for n in names):
        return expected
    sent = {t.tensor for t in transfers}
    if names and sent and not sent.intersection(names):  # an order of something else
        shown = ", ".join(sorted(sent)[:3]) + (", ..." if len(sent) > 3 else "")
        return f"names of the transfers it was given ({shown}); it named none of them"
    return None


def _check_transfer_filter(plugin: str, answer: Any, args: tuple[Any, ...]) -> str | None:
    return None if isinstance(answer, bool) else "False (drop the transfer), True or None"


def _check_decoded(plugin: str, answer: Any, args: tuple[Any, ...]) -> str | None:
    import torch

    record = args[0]
    if isinstance(answer, torch.Tensor):
        if record.destination == -1:  # a summed bucket may come back in another dtype
            return None  # (DDP casts it into its buffer); its size is checked there
        if answer.numel() * answer.element_size() == record.nbytes:
            return None
        # a parameter server copies a parameter from it, or sums gradients with it: a
        # tensor of another size would broadcast into the model in silence
        return (f"the tensor accelopt_transfer_encode replaced for transfer "
                f"'{record.tensor}' ({record.nbytes} bytes), got {answer.numel()} elements "
                f"of {answer.dtype} ({answer.numel() * answer.element_size()} bytes)")
    return (f"a torch.Tensor for transfer '{record.tensor}' (the decoders must give back the "
            "tensor accelopt_transfer_encode replaced)")


def _check_encoded(plugin: str, answer: Any, args: tuple[Any, ...]) -> str | None:
    import torch

    if args[0].destination != -1:  # a PS payload may become any picklable object
        return None
    if isinstance(answer, torch.Tensor) or (
            isinstance(answer, tuple) and all(isinstance(p, torch.Tensor) for p in answer)):
        return None
    return ("an all-reduce payload: a torch.Tensor (summed) or a tuple of tensors (gathered) "
            f"for transfer '{args[0].tensor}'")


AnswerCheck = Callable[[str, Any, tuple[Any, ...]], "str | None"]

ANSWER_CHECKS: dict[str, AnswerCheck] = {
    "accelopt_allocate": _check_allocate,
    "accelopt_select_next": _check_select_next,
    "accelopt_report_rows": _check_report_rows,
    "accelopt_cli_commands": _check_cli_commands,
    "accelopt_after_forward": _check_after_forward,
    "accelopt_after_step": _check_after_step,
    "accelopt_optimizer_build": _check_optimizer_build,
    "accelopt_layer_build": _check_layer_build,
    "accelopt_state_save": _check_state_save,
    "accelopt_transfer_order": _check_transfer_order,
    "accelopt_transfer_filter": _check_transfer_filter,
}
"""hook -> the check of each plugin's answer that is not ``None`` (see above)."""

CHAIN_RESULT_CHECKS: dict[str, AnswerCheck] = {
    "accelopt_transfer_encode": _check_encoded,
    "accelopt_transfer_decode": _check_decoded,
}
"""hook -> the check of a chained hook's final value, when a plugin changed it (one link
may hand the next any object: only the last answer must be what the core uses)."""

CHAIN_SOURCES: dict[str, str] = {
    "accelopt_transfer_decode": "accelopt_transfer_encode",
}
"""hook -> the hook whose chain gave the value it receives. Where no plugin implements the
hook, the source chain's result is what the core uses, so it gets the hook's check where it
is made (an encoder without a decoder: its payload must be what a decoder would have to give
back); and a value no link changed is named as the source's plugins' answer."""
