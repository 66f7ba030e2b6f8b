"""Record every hook call of a run, in order, so a test can assert what the core asked.

The recorder is an ordinary plugin (it implements every hook, marked ``tryfirst`` and
answering ``None``), added to the run's selection by :func:`accelopt.testing.run_workload`.
Being a plugin rather than a pluggy call monitor means it also sees the calls the host makes
outside pluggy's dispatch (``accelopt_configure`` through ``call_one``, ``accelopt_layer_build``
through ``chain``), and it needs nothing from ``execute()``.

Three things a test author should know:

* ``tryfirst`` puts it ahead of every other implementation, so it sees ``firstresult``
  hooks (allocate, select_next, transfer_order) even when another plugin answers them.
* Because it implements every hook, the core makes every call it would skip when no
  active plugin implements a hook (e.g. the per-iteration ``accelopt_allocate``). It always
  answers "no opinion", so the defaults still decide; only the call count changes.
* It sees its own ``accelopt_configure`` call only: each plugin is configured separately,
  with its own config.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from accelopt import hookspecs
from accelopt.hookspecs import hookimpl
from accelopt.plugin import PluginSpec
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
    """One recorded call: the hook's full name and the keyword arguments it was given."""

    hook: str
    kwargs: dict[str, Any]


class HookRecorder:
    """Every hook call of a run, in the order the core made them.

    Pass it to :func:`run_workload` (``recorder=HookRecorder()``), then ask it questions.
    Hook names may be given with or without the ``accelopt_`` prefix.
    """

    def __init__(self) -> None:
        self.records: list[HookCall] = []

    # -- recording -----------------------------------------------------------------------

    def record(self, hook: str, **kwargs: Any) -> None:
        """Append one call (the executor holds its lock around hook calls, so no two
        threads append at once)."""
        self.records.append(HookCall(hook, kwargs))

    def spec(self) -> PluginSpec:
        """The plugin that feeds this recorder; :func:`run_workload` selects it for you."""
        return PluginSpec(
            name=RECORDER_NAME,
            factory=lambda _config: RecorderPlugin(self),
            description="accelopt.testing: records every hook call of the run",
        )

    def clear(self) -> None:
        self.records.clear()

    # -- questions -----------------------------------------------------------------------

    def names(self) -> list[str]:
        """The hook names of every call, in order."""
        return [call.hook for call in self.records]

    def calls(self, hook: str) -> list[dict[str, Any]]:
        """The keyword arguments of every call of ``hook``, in order."""
        full = normalize_hook(hook)
        return [call.kwargs for call in self.records if call.hook == full]

    def count(self, hook: str) -> int:
        """How many times ``hook`` was called."""
        return len(self.calls(hook))

    def assert_order(self, hooks: Sequence[str]) -> None:
        """Assert that ``hooks`` occur in this order (as a subsequence: other calls may come
        in between). The message shows where the expectation broke and the actual sequence."""
        wanted = [normalize_hook(h) for h in hooks]
        actual = self.names()
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


class RecorderPlugin:
    """Implements every hook: records the call and answers "no opinion".

    Written out hook by hook (rather than generated) because pluggy reads each
    implementation's argument names from its code object; ``tests/test_testing_kit.py``
    fails if a hookspec is added without a method here.
    """

    def __init__(self, recorder: HookRecorder) -> None:
        self.recorder = recorder

    @hookimpl(tryfirst=True)
    def accelopt_configure(self, config: Any, run_config: Any) -> None:
        self.recorder.record("accelopt_configure", config=config, run_config=run_config)

    @hookimpl(tryfirst=True)
    def accelopt_run_start(self, run: RunInfo) -> None:
        self.recorder.record("accelopt_run_start", run=run)

    @hookimpl(tryfirst=True)
    def accelopt_run_end(self, run: RunInfo, metrics: dict[str, Any]) -> None:
        self.recorder.record("accelopt_run_end", run=run, metrics=metrics)

    @hookimpl(tryfirst=True)
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        self.recorder.record("accelopt_report_rows", run=run)
        summary = f"recorded {len(self.recorder)} hook calls (accelopt.testing)"
        return [ReportRow(plugin=RECORDER_NAME, summary=summary)]

    @hookimpl(tryfirst=True)
    def accelopt_cli_commands(self) -> Sequence[CliCommand] | None:
        self.recorder.record("accelopt_cli_commands")
        return None

    @hookimpl(tryfirst=True)
    def accelopt_allocate(self, request: AllocationRequest) -> AllocationDecision | None:
        self.recorder.record("accelopt_allocate", request=request)
        return None

    @hookimpl(tryfirst=True)
    def accelopt_release(self, job: JobInfo, lane: str, status: str) -> None:
        self.recorder.record("accelopt_release", job=job, lane=lane, status=status)

    @hookimpl(tryfirst=True)
    def accelopt_select_next(
        self, lane: str, ready: Sequence[JobState], now_s: float
    ) -> str | None:
        self.recorder.record("accelopt_select_next", lane=lane, ready=ready, now_s=now_s)
        return None

    @hookimpl(tryfirst=True)
    def accelopt_iteration_start(self, context: IterationContext) -> None:
        self.recorder.record("accelopt_iteration_start", context=context)

    @hookimpl(tryfirst=True)
    def accelopt_iteration_end(self, context: IterationContext, result: IterationResult) -> None:
        self.recorder.record("accelopt_iteration_end", context=context, result=result)

    @hookimpl(tryfirst=True)
    def accelopt_transfer_order(
        self, transfers: Sequence[TransferRecord], destination: int
    ) -> Sequence[str] | None:
        self.recorder.record(
            "accelopt_transfer_order", transfers=transfers, destination=destination
        )
        return None

    @hookimpl(tryfirst=True)
    def accelopt_transfer_encode(self, record: TransferRecord, payload: Any) -> Any | None:
        self.recorder.record("accelopt_transfer_encode", record=record, payload=payload)
        return None

    @hookimpl(tryfirst=True)
    def accelopt_transfer_decode(self, record: TransferRecord, payload: Any) -> Any | None:
        self.recorder.record("accelopt_transfer_decode", record=record, payload=payload)
        return None

    @hookimpl(tryfirst=True)
    def accelopt_transfer_filter(self, record: TransferRecord) -> bool | None:
        self.recorder.record("accelopt_transfer_filter", record=record)
        return None

    @hookimpl(tryfirst=True)
    def accelopt_transfer_done(self, record: TransferRecord, start_s: float, end_s: float) -> None:
        self.recorder.record(
            "accelopt_transfer_done", record=record, start_s=start_s, end_s=end_s
        )

    @hookimpl(tryfirst=True)
    def accelopt_layer_build(self, layer: LayerOffer) -> Any | None:
        self.recorder.record("accelopt_layer_build", layer=layer)
        return None
