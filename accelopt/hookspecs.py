"""The hook points of accelopt (pluggy project ``accelopt``).

Every hook is called with keyword arguments only (pluggy refuses positional calls) and receives small frozen records from
:mod:`accelopt.types`. Four hook points come from the design card (allocation, iteration
boundary, send/recv, layer forward); the rest are lifecycle hooks. ``docs/hooks.md``
documents each one with an example, and ``tests/test_hook_docs.py`` fails when a hookspec
lacks its documentation or a test that exercises it.

Why these shapes:

* Decisions that only one plugin can make (admit a job, pick the next iteration, order
  transfers) are ``firstresult`` hooks: the first plugin (command-line order) that answers
  something other than ``None`` wins, and ``None`` means "no opinion, ask the next one".
* Observations (iteration start/end, job end) go to every plugin.
* Nothing here is called inside a layer's forward pass: ``accelopt_layer_build`` is asked
  once at model build time and what it returns is an ordinary ``torch.nn.Module``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pluggy

from accelopt.types import (
    AllocationDecision,
    AllocationRequest,
    CliCommand,
    IterationContext,
    IterationResult,
    JobInfo,
    JobState,
    LayerOffer,
    ReportRow,
    RunInfo,
    TransferRecord,
)

PROJECT = "accelopt"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- lifecycle --------------------------------------------------------------------------


@hookspec
def accelopt_configure(config: Any, run_config: Any) -> None:
    """Receive this plugin's validated config object and the whole resolved run config.

    Called once per run, before any job is built. ``config`` is the plugin's own structured
    config (an instance of the dataclass it declared); ``run_config`` is the read-only
    OmegaConf tree of the run.
    """


@hookspec
def accelopt_run_start(run: RunInfo) -> None:
    """The run is about to execute its jobs; ``run.run_dir`` exists."""


@hookspec
def accelopt_run_end(run: RunInfo, metrics: dict[str, Any]) -> None:
    """The run has finished (jobs done, failed or rejected); ``metrics`` is the run summary."""


@hookspec
def accelopt_report_rows(run: RunInfo) -> list[ReportRow] | None:
    """Contribute lines to the run summary: what the plugin did, or why it did nothing.

    Every active plugin should answer, so the user never has to guess whether a plugin
    was inert on this workload.
    """


@hookspec
def accelopt_cli_commands() -> Sequence[CliCommand] | None:
    """Contribute subcommands to the ``accelopt`` command line (``accelopt NAME ...``).

    Asked of every *installed* plugin (no plugin config exists yet), so implement it as a
    function that does not depend on ``accelopt_configure`` having been called.
    """


# --- allocation -------------------------------------------------------------------------


@hookspec(firstresult=True)
def accelopt_allocate(request: AllocationRequest) -> AllocationDecision | None:
    """Serve, defer or reject a memory request.

    ``request.phase == "admission"`` when a job arrives (its persistent bytes plus the
    ephemeral bytes of one iteration); ``"iteration"`` before each iteration (its ephemeral
    bytes). The default (no plugin answers) grants everything in the single lane
    ``"default"``: one job at a time, exclusively.
    """


@hookspec
def accelopt_release(job: JobInfo, lane: str, status: str) -> None:
    """An admitted job left the device (``status`` is ``done`` or ``failed``); free what was
    granted to it. Called only for jobs that were granted a lane. Pending jobs are offered to
    ``accelopt_allocate`` again right after."""


# --- iteration boundary -----------------------------------------------------------------


@hookspec(firstresult=True)
def accelopt_select_next(lane: str, ready: Sequence[JobState], now_s: float) -> str | None:
    """Choose which admitted job of ``lane`` runs its next iteration; return its ``job_id``.

    Called at every iteration boundary of the lane where there is a choice (two or more
    ready jobs; with one the answer is forced and the call is skipped). Returning
    ``None`` leaves the choice to the next plugin or the default (earliest arrival first,
    which runs each job to completion: FIFO).
    """


@hookspec
def accelopt_iteration_start(context: IterationContext) -> None:
    """An iteration is about to start (ephemeral memory is empty here)."""


@hookspec
def accelopt_iteration_end(context: IterationContext, result: IterationResult) -> None:
    """An iteration has ended; this is where checkpoints are safe and profiles are refined."""


# --- send / recv ------------------------------------------------------------------------


@hookspec(firstresult=True)
def accelopt_transfer_order(
    transfers: Sequence[TransferRecord], destination: int
) -> Sequence[str] | None:
    """Give the order (tensor names, first = highest priority) in which the sender starts
    the transfers of one iteration to ``destination``. The transport enforces it: a transfer
    with priority p starts only after those before it to that destination have started.
    ``None``: send in the order the sender issues them.
    """


@hookspec
def accelopt_transfer_encode(record: TransferRecord, payload: Any) -> Any | None:
    """Transform an outgoing payload (e.g. compress it). Return the new payload, or ``None``
    to leave it unchanged. Chained: encoders run in plugin order, each on the previous
    one's output; decoders run in reverse order."""


@hookspec
def accelopt_transfer_decode(record: TransferRecord, payload: Any) -> Any | None:
    """Undo ``accelopt_transfer_encode`` on the receiving side; ``None`` leaves it as is."""


@hookspec
def accelopt_transfer_filter(record: TransferRecord) -> bool | None:
    """Return ``False`` to drop a transfer (e.g. a gradient below a threshold whose value the
    plugin keeps as error feedback). ``None``/``True`` keep it."""


@hookspec
def accelopt_transfer_done(record: TransferRecord, start_s: float, end_s: float) -> None:
    """A transfer finished; observers (timelines, bandwidth estimators) see it here."""


TRANSFER_HOOKS = frozenset({
    "accelopt_transfer_order", "accelopt_transfer_filter", "accelopt_transfer_encode",
    "accelopt_transfer_decode", "accelopt_transfer_done",
})
"""The send/recv hooks. A plugin that implements any of them acts on one job's transfers, so
it is a per-job plugin: each job of a multi-job cluster gets its own instance, and every
rank's report rows of it count (a server's plan and a worker's view differ)."""


# --- layer forward ----------------------------------------------------------------------


@hookspec
def accelopt_layer_build(layer: LayerOffer) -> Any | None:
    """Offered each layer of a job's model once, at build time: return a replacement
    ``torch.nn.Module`` (a sampled output layer, a pruned layer, a wrapper that installs
    saved-tensor hooks) or ``None`` to keep it. Never called during forward.

    Chained in plugin order: each plugin is offered the module as the plugins before it
    left it, so one plugin may prune a layer and the next wrap the pruned layer.
    """
