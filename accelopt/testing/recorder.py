"""Record every hook call of a run, in order, so a test can assert what the core asked.

The recorder is an ordinary plugin (it implements every hook, marked ``tryfirst`` and
answering ``None``), added to the run's selection by :func:`accelopt.testing.run_workload`.
Being a plugin rather than a pluggy call monitor means it also sees the calls the host makes
outside pluggy's dispatch (``accelopt_configure`` through ``call_one``, ``accelopt_layer_build``
through ``chain``), and it needs nothing from ``execute()``.

Five things a test author should know:

* ``tryfirst`` puts it ahead of every other implementation, so it sees ``firstresult``
  hooks (allocate, select_next, transfer_order) even when another plugin answers them.
* Because it implements every hook, the core makes every call it would skip when no
  active plugin implements a hook (e.g. the per-iteration ``accelopt_allocate``). It always
  answers "no opinion", so the defaults still decide; only the call count changes. One
  exception: ``accelopt_state_save`` returns a small marker (its call count), so a resumed
  run calls ``accelopt_state_load`` and a test can see both.
* It sees its own ``accelopt_configure`` call only: each plugin is configured separately,
  with its own config (twice per run: once in the up-front validation, once for the run).
* In a cluster run (``cluster.mode=ps|allreduce``) every rank is a process with its own
  recorder plugin; each writes its calls into the run directory at ``accelopt_run_end`` and
  :func:`~accelopt.testing.run_workload` reads them back, so the parent's recorder holds every
  rank's calls, each tagged with its ``rank``. The launching process makes calls of its
  own, tagged :data:`LAUNCHER`: ``accelopt_configure`` when it validates the selection
  before the ranks start, and ``accelopt_configure`` and ``accelopt_layer_build`` when it
  rebuilds each finished job's model to score it. Tensors arrive as copies, a
  mapping of tensors (the gradients view) as a dict of copies, and values that cannot cross
  a process boundary (a live model) as a :class:`Shipped` description.
* A one-process run (``cluster.mode=none``) tags the run's calls rank 0 and the up-front
  validation's calls :data:`LAUNCHER`, as a cluster run does: the validation configures
  plugin objects of its own and drops them before anything runs, so its
  ``accelopt_configure`` is not the run's. ``count(hook, rank=0)`` therefore counts the
  same calls in every mode (``count("configure", rank=0) == 1``). The validation's calls
  are told apart by the recorder plugin object that made them (:attr:`HookCall.source`)
  when :func:`~accelopt.testing.run_workload` collects the run's calls.
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelopt import hookspecs
from accelopt.hookspecs import hookimpl
from accelopt.plugin import PluginSpec
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
    TransferRecord,
)

LAUNCHER = -1
"""The ``rank`` of calls made outside the run by the process that started it: the up-front
validation in every mode (``accelopt_configure`` of plugin objects dropped before the run),
and in a cluster run the launcher's scoring after the ranks end; so that they never count as
rank 0's, in a one-process run either."""

RECORDER_NAME = "hook_recorder"
"""The plugin name the recorder runs under (it appears in ``RunInfo.plugins``)."""

HOOK_PREFIX = "accelopt_"


def hook_names() -> list[str]:
    """Every hook the core declares, in declaration order (read from the hookspecs, so the
    list can never drift from what pluggy knows)."""
    marker = f"{hookspecs.PROJECT}_spec"
    return [name for name, obj in vars(hookspecs).items() if hasattr(obj, marker)]


def normalize_hook(name: str) -> str:
    """Accept ``"iteration_end"`` or ``"accelopt_iteration_end"``; refuse anything else, so
    a typo in a test fails loudly instead of counting zero calls."""
    full = name if name.startswith(HOOK_PREFIX) else HOOK_PREFIX + name
    known = hook_names()
    if full not in known:
        raise ValueError(f"{name!r} is not an accelopt hook; hooks: {', '.join(known)}")
    return full


@dataclass(frozen=True)
class HookCall:
    """One recorded call: the hook's full name, the keyword arguments it was given, the
    rank of the process that made it (0 in a one-process run; :data:`LAUNCHER` for the
    up-front validation in every mode and the launching process of a cluster run) and the
    run it belongs to (0 for the first run the recorder was passed to, 1 for the next:
    :meth:`HookRecorder.runs`)."""

    hook: str
    kwargs: dict[str, Any]
    rank: int = 0
    run: int = 0
    source: int = 0
    """Which recorder plugin object of its process made the call (1, 2, ...: every
    activation of the plugin selection builds one, the validation's and the run's apart;
    0 for a call given to :meth:`HookRecorder.record`)."""


@dataclass(frozen=True)
class Shipped:
    """A value a rank's recorder could not send to the parent as it was (a live model, a
    closure): its type and a short description."""

    type: str
    text: str


DUMP_DIR = ".accelopt-hook-recorder"
_RECORDERS: weakref.WeakValueDictionary[str, HookRecorder] = weakref.WeakValueDictionary()
"""The recorders of this process by token: a rank process has none, so its recorder plugin
records locally and writes its calls for the parent to read. Weak: a recorder's calls hold
the run's models and tensors, and a test suite making one recorder per test kept them all."""


class HookRecorder:
    """Every hook call of a run, in the order the core made them (in a cluster run: every
    rank's calls, each rank's in its own order, ranks one after another).

    Pass it to :func:`run_workload` (``recorder=HookRecorder()``), then ask it questions.
    Hook names may be given with or without the ``accelopt_`` prefix; ``rank=N`` restricts a
    question to one rank's calls.

    One recorder per run is the rule. A recorder passed to several runs (a checkpointed run,
    then its resume) keeps every run's calls, each tagged with its run (0, 1, ...: see
    :meth:`runs`); ``run=N`` restricts a question to one run's calls. Without it,
    :meth:`names`, :meth:`calls` and :meth:`count` cover every run, and :meth:`assert_order`
    refuses (a ValueError naming the fix): an order across two runs (run 0's ``run_end``
    before run 1's ``run_start``) is no order of either. :meth:`clear` forgets every call.
    """

    def __init__(self) -> None:
        self.records: list[HookCall] = []
        self.token = uuid.uuid4().hex
        self._run = -1
        """The run calls are recorded into (-1: none begun; calls made then are run 0's)."""
        self._sources = 0
        """How many recorder plugin objects this recorder has fed (:attr:`HookCall.source`)."""
        _RECORDERS[self.token] = self

    # -- recording -----------------------------------------------------------------------

    def record(self, hook: str, **kwargs: Any) -> None:
        """Append one call (the core calls a process's hooks one at a time, so no two
        threads append at once)."""
        self._append(hook, kwargs, 0)

    def _append(self, hook: str, kwargs: dict[str, Any], source: int) -> None:
        """Append one call made by recorder plugin object ``source`` (0: none), which
        :meth:`collect` needs to tell the validation's calls from the run's."""
        self.records.append(HookCall(hook, kwargs, run=max(self._run, 0), source=source))

    def new_source(self) -> int:
        """A number for the next recorder plugin object (:attr:`HookCall.source`)."""
        self._sources += 1
        return self._sources

    def begin_run(self) -> int:
        """Record the calls that follow as a new run's, and return its number (what
        :func:`run_workload` does before each run it is given this recorder for)."""
        self._run = max(self._run, self.records[-1].run if self.records else -1) + 1
        return self._run

    def spec(self) -> PluginSpec:
        """The plugin that feeds this recorder; :func:`run_workload` selects it for you. Its
        factory travels to a cluster run's ranks (a module-level callable with a token)."""
        return PluginSpec(
            name=RECORDER_NAME,
            factory=RecorderFactory(self.token),
            description="accelopt.testing: records every hook call of the run",
        )

    def clear(self) -> None:
        """Forget every recorded call: the next run is run 0 again."""
        self.records.clear()
        self._run = -1

    def collect(self, run_dir: str | Path, run_began_at: int | None = None) -> int:
        """Read the calls the ranks of a cluster run wrote into ``run_dir`` (what
        :func:`run_workload` does after every run); returns how many ranks reported.
        ``run_began_at``: how many calls were recorded before the run; when ranks reported,
        the calls this process recorded since are the launcher's (:data:`LAUNCHER`); when
        none did (a one-process run), those of the recorder plugin objects that never saw
        ``accelopt_run_start`` are (the up-front validation's)."""
        folder = Path(run_dir) / DUMP_DIR / self.token
        files = sorted(folder.glob("rank-*.pkl"), key=lambda p: int(p.stem.split("-")[1]))
        if run_began_at is not None:
            since = self.records[run_began_at:]
            in_run = {c.source for c in since if c.hook == "accelopt_run_start"}
            self.records[run_began_at:] = [
                dataclasses.replace(c, rank=LAUNCHER)
                if files or (in_run and c.source not in in_run) else c for c in since]
        run = max(self._run, 0)
        for path in files:
            with open(path, "rb") as fh:
                self.records.extend(dataclasses.replace(c, run=run) for c in pickle.load(fh))
        return len(files)

    # -- questions -----------------------------------------------------------------------

    def ranks(self) -> list[int]:
        """The ranks whose calls were recorded."""
        return sorted({call.rank for call in self.records})

    def runs(self) -> list[int]:
        """The runs whose calls were recorded (``[0]`` for a recorder used once)."""
        return sorted({call.run for call in self.records})

    def _of(self, rank: int | None, run: int | None = None) -> list[HookCall]:
        return [c for c in self.records
                if (rank is None or c.rank == rank) and (run is None or c.run == run)]

    def names(self, rank: int | None = None, run: int | None = None) -> list[str]:
        """The hook names of every call (of every run unless ``run`` is given), in order."""
        return [call.hook for call in self._of(rank, run)]

    def calls(self, hook: str, rank: int | None = None,
              run: int | None = None) -> list[dict[str, Any]]:
        """The keyword arguments of every call of ``hook`` (of every run unless ``run`` is
        given), in order."""
        full = normalize_hook(hook)
        return [call.kwargs for call in self._of(rank, run) if call.hook == full]

    def count(self, hook: str, rank: int | None = None, run: int | None = None) -> int:
        """How many times ``hook`` was called (in every run unless ``run`` is given)."""
        return len(self.calls(hook, rank, run))

    def assert_order(self, hooks: Sequence[str], rank: int | None = None,
                     run: int | None = None) -> None:
        """Assert that ``hooks`` occur in this order (as a subsequence: other calls may come
        in between). The message shows where the expectation broke and the actual sequence.
        In a cluster run, name the ``rank`` whose order you mean; in a recorder given to
        several runs, the ``run`` (without it, a ValueError: an order across runs proves
        nothing about either)."""
        runs = self.runs()
        if run is None and len(runs) > 1:
            raise ValueError(f"assert_order: this HookRecorder holds the calls of {len(runs)} "
                             f"runs; name one with run=N (N in {runs}), or give each run a "
                             "fresh HookRecorder() (or call recorder.clear() between them)")
        wanted = [normalize_hook(h) for h in hooks]
        actual = self.names(rank, run)
        position = 0
        for index, hook in enumerate(wanted):
            try:
                position = actual.index(hook, position) + 1
            except ValueError:
                after = f" after {_short(wanted[index - 1])}" if index else ""
                seen = "never called" if hook not in actual else f"not called{after}"
                raise AssertionError(
                    f"hook order: expected {' < '.join(_short(h) for h in wanted)}, but "
                    f"{_short(hook)} was {seen}; actual sequence: {summarize(actual)}"
                ) from None

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        return f"HookRecorder({summarize(self.names())})"


def summarize(names: Iterable[str], limit: int = 80) -> str:
    """Run-length summary of a call sequence (``layer_build x26, run_start, ...``), cut in
    the middle beyond ``limit`` entries so an assertion message stays readable for long
    runs (the start and the end are where order mistakes usually show)."""
    parts = []
    for name, group in itertools.groupby(_short(n) for n in names):
        n = len(list(group))
        parts.append(name if n == 1 else f"{name} x{n}")
    if not parts:
        return "(no hook calls)"
    if len(parts) > limit:
        head, tail = parts[: limit // 2], parts[-limit // 2 :]
        parts = [*head, f"... {len(parts) - len(head) - len(tail)} more ...", *tail]
    return ", ".join(parts)


def _short(hook: str) -> str:
    return hook.removeprefix(HOOK_PREFIX)


@dataclass(frozen=True)
class RecorderFactory:
    """Builds the recorder plugin: bound to the recorder of this process when there is one
    (a one-process run), else recording locally and writing the calls at run end (a rank)."""

    token: str

    def __call__(self, _config: Any) -> RecorderPlugin:
        recorder = _RECORDERS.get(self.token)
        if recorder is not None:
            return RecorderPlugin(recorder, source=recorder.new_source())
        return RecorderPlugin(HookRecorder(), dump_token=self.token)


def _portable(value: Any, depth: int = 0) -> Any:
    """``value`` as it can cross a process boundary: tensors copied, records field by field,
    anything else that pickle refuses described (:class:`Shipped`)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, torch.nn.Module):
        return Shipped(type(value).__name__, f"a module of {sum(1 for _ in value.parameters())} "
                       "parameters (not sent)")
    if isinstance(value, torch.optim.Optimizer):
        # not sent: unpickling one runs Optimizer.__setstate__, which patches the step of
        # its class for the whole receiving process (a plugin's optimizer subclass that
        # skips Optimizer.__init__ then fails in every later run of that process)
        groups = getattr(value, "param_groups", None)
        count = sum(len(g.get("params", ())) for g in groups) if isinstance(groups, list) else 0
        return Shipped(type(value).__name__, f"an optimizer of {count} parameters (not sent)")
    if depth < 3 and dataclasses.is_dataclass(value) and not isinstance(value, type):
        try:
            return dataclasses.replace(value, **{
                f.name: _portable(getattr(value, f.name), depth + 1)
                for f in dataclasses.fields(value) if f.init})
        except Exception:  # noqa: BLE001 - a record that cannot be rebuilt is described
            return Shipped(type(value).__name__, repr(value)[:120])
    if depth < 3 and isinstance(value, dict):
        return {k: _portable(v, depth + 1) for k, v in value.items()}
    if depth < 3 and isinstance(value, (list, tuple)):
        items = [_portable(v, depth + 1) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if hasattr(value, "keys") and hasattr(value, "__getitem__") and not hasattr(value, "_metadata"):
        try:  # a mapping view (the gradients): its tensors
            return {k: _portable(value[k], depth + 1) for k in value.keys()}
        except Exception:  # noqa: BLE001
            pass
    try:
        pickle.dumps(value)
        return value
    except Exception:  # noqa: BLE001
        return Shipped(type(value).__name__, repr(value)[:120])


class RecorderPlugin:
    """Implements every hook: records the call and answers "no opinion".

    Written out hook by hook (rather than generated) because pluggy reads each
    implementation's argument names from its code object; ``tests/test_testing_kit.py``
    fails if a hookspec is added without a method here.
    """

    def __init__(self, recorder: HookRecorder, dump_token: str | None = None,
                 source: int = 1) -> None:
        self.recorder = recorder
        self.dump_token = dump_token
        self.source = source
        self.rank = 0
        self.run_dir: str | None = None

    def _dump(self) -> None:
        """In a rank process: write this rank's calls where the parent's recorder reads."""
        if self.dump_token is None or not self.run_dir:
            return
        folder = Path(self.run_dir) / DUMP_DIR / self.dump_token
        folder.mkdir(parents=True, exist_ok=True)
        calls = [HookCall(c.hook, _portable(c.kwargs), self.rank, source=c.source)
                 for c in self.recorder.records]
        tmp = folder / f".rank-{self.rank}.tmp"
        with open(tmp, "wb") as fh:
            pickle.dump(calls, fh)
        tmp.replace(folder / f"rank-{self.rank}.pkl")

    def _record(self, hook: str, **kwargs: Any) -> None:
        """Record one call as this plugin object's (:attr:`HookCall.source`)."""
        self.recorder._append(hook, kwargs, self.source)

    @hookimpl(tryfirst=True)
    def accelopt_configure(self, config: Any, run_config: Any) -> None:
        self._record("accelopt_configure", config=config, run_config=run_config)

    @hookimpl(tryfirst=True)
    def accelopt_job_built(self, run: RunInfo, job: BuiltJob) -> None:
        self._record("accelopt_job_built", run=run, job=job)

    @hookimpl(tryfirst=True)
    def accelopt_run_start(self, run: RunInfo) -> None:
        self.rank, self.run_dir = run.rank, run.run_dir
        self._record("accelopt_run_start", run=run)

    @hookimpl(tryfirst=True)
    def accelopt_run_end(self, run: RunInfo, metrics: dict[str, Any]) -> None:
        self._record("accelopt_run_end", run=run, metrics=metrics)
        self._dump()

    @hookimpl(tryfirst=True)
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        self._record("accelopt_report_rows", run=run)
        summary = f"recorded {len(self.recorder)} hook calls (accelopt.testing)"
        return [ReportRow(plugin=RECORDER_NAME, summary=summary)]

    @hookimpl(tryfirst=True)
    def accelopt_cli_commands(self) -> Sequence[CliCommand] | None:
        self._record("accelopt_cli_commands")
        return None

    @hookimpl(tryfirst=True)
    def accelopt_allocate(self, request: AllocationRequest) -> AllocationDecision | None:
        self._record("accelopt_allocate", request=request)
        return None

    @hookimpl(tryfirst=True)
    def accelopt_release(self, job: JobInfo, lane: str, status: str) -> None:
        self._record("accelopt_release", job=job, lane=lane, status=status)

    @hookimpl(tryfirst=True)
    def accelopt_select_next(
        self, lane: str, ready: Sequence[JobState], now_s: float
    ) -> str | None:
        self._record("accelopt_select_next", lane=lane, ready=ready, now_s=now_s)
        return None

    @hookimpl(tryfirst=True)
    def accelopt_iteration_start(self, context: IterationContext) -> None:
        self._record("accelopt_iteration_start", context=context)

    @hookimpl(tryfirst=True)
    def accelopt_after_forward(self, context: IterationContext, loss: Any) -> Any | None:
        self._record("accelopt_after_forward", context=context, loss=loss)
        return None

    @hookimpl(tryfirst=True)
    def accelopt_before_optimizer_step(self, context: IterationContext, gradients: Any) -> None:
        self._record("accelopt_before_optimizer_step", context=context,
                             gradients=gradients)

    @hookimpl(tryfirst=True)
    def accelopt_after_step(self, context: IterationContext,
                            stepped: bool) -> OptimizerRebuild | None:
        self._record("accelopt_after_step", context=context, stepped=stepped)
        return None

    @hookimpl(tryfirst=True)
    def accelopt_iteration_end(self, context: IterationContext, result: IterationResult) -> None:
        self._record("accelopt_iteration_end", context=context, result=result)

    @hookimpl(tryfirst=True)
    def accelopt_optimizer_build(self, job: JobInfo, optimizer: Any, parameters: Any,
                                 previous: Any) -> Any | None:
        self._record("accelopt_optimizer_build", job=job, optimizer=optimizer,
                             parameters=parameters, previous=previous)
        return None

    @hookimpl(tryfirst=True)
    def accelopt_state_save(self, job: JobInfo) -> dict[str, Any] | None:
        self._record("accelopt_state_save", job=job)
        return {"recorded_calls": len(self.recorder.records)}  # a marker: exercises the load

    @hookimpl(tryfirst=True)
    def accelopt_state_load(self, job: JobInfo, state: dict[str, Any]) -> None:
        self._record("accelopt_state_load", job=job, state=state)

    @hookimpl(tryfirst=True)
    def accelopt_transfer_order(
        self, transfers: Sequence[TransferRecord], destination: int
    ) -> Sequence[str] | None:
        self._record(
            "accelopt_transfer_order", transfers=transfers, destination=destination
        )
        return None

    @hookimpl(tryfirst=True)
    def accelopt_transfer_encode(self, record: TransferRecord, payload: Any) -> Any | None:
        self._record("accelopt_transfer_encode", record=record, payload=payload)
        return None

    @hookimpl(tryfirst=True)
    def accelopt_transfer_decode(self, record: TransferRecord, payload: Any) -> Any | None:
        self._record("accelopt_transfer_decode", record=record, payload=payload)
        return None

    @hookimpl(tryfirst=True)
    def accelopt_transfer_filter(self, record: TransferRecord) -> bool | None:
        self._record("accelopt_transfer_filter", record=record)
        return None

    @hookimpl(tryfirst=True)
    def accelopt_transfer_done(self, record: TransferRecord, start_s: float, end_s: float) -> None:
        self._record(
            "accelopt_transfer_done", record=record, start_s=start_s, end_s=end_s
        )

    @hookimpl(tryfirst=True)
    def accelopt_layer_build(self, layer: LayerOffer) -> Any | None:
        self._record("accelopt_layer_build", layer=layer)
        return None
