"""Small plugins used by the core's tests: each exercises one hook point for real."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from accelopt import (
    AllocationDecision,
    AllocationRequest,
    JobState,
    LayerOffer,
    PluginSpec,
    ReportRow,
    RunInfo,
    hookimpl,
)


class LastArrivalFirst:
    """A scheduler that always runs the most recently arrived job (LIFO)."""

    def __init__(self, config: Any) -> None:
        self.choices: list[str] = []

    @hookimpl
    def accelopt_select_next(self, lane: str, ready: Sequence[JobState], now_s: float) -> str:
        job = max(ready, key=lambda s: (s.job.arrival_s, s.job.job_id)).job.job_id
        self.choices.append(job)
        return job

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        return [ReportRow("lifo", f"made {len(self.choices)} choices")]


LIFO = PluginSpec(name="lifo", factory=LastArrivalFirst, slots=("scheduler",),
                  description="last arrival first (test)")
OTHER_SCHEDULER = PluginSpec(name="other_sched", factory=LastArrivalFirst, slots=("scheduler",),
                             description="a second scheduler (test)")


@dataclass
class LanesConfig:
    capacity_jobs: int = 1
    """How many jobs may be admitted at once; the rest are deferred."""


class OneLanePerJob:
    """Admits up to ``capacity_jobs`` jobs, each in its own lane; defers the rest."""

    def __init__(self, config: LanesConfig) -> None:
        self.capacity = config.capacity_jobs
        self.admitted: set[str] = set()
        self.deferred: list[str] = []
        self.released: list[tuple[str, str]] = []
        self.max_concurrent = 0

    @hookimpl
    def accelopt_allocate(self, request: AllocationRequest) -> AllocationDecision | None:
        if request.phase == "iteration":
            return None
        if len(self.admitted) >= self.capacity:
            self.deferred.append(request.job.job_id)
            return AllocationDecision(granted=False, reason="full")
        self.admitted.add(request.job.job_id)
        self.max_concurrent = max(self.max_concurrent, len(self.admitted))
        return AllocationDecision(granted=True, lane=request.job.job_id)

    @hookimpl
    def accelopt_release(self, job: Any, lane: str, status: str) -> None:
        self.admitted.discard(job.job_id)
        self.released.append((job.job_id, status))


LANES = PluginSpec(name="lanes", factory=OneLanePerJob, config=LanesConfig,
                   description="one lane per job, bounded admission (test)")


class Rejector:
    @hookimpl
    def accelopt_allocate(self, request: AllocationRequest) -> AllocationDecision:
        return AllocationDecision(granted=False, reject="too big for this test")


REJECT = PluginSpec(name="reject", factory=lambda c: Rejector(), description="rejects (test)")


class Boom:
    @hookimpl
    def accelopt_iteration_end(self, context: Any, result: Any) -> None:
        raise ValueError("boom")


BOOM = PluginSpec(name="boom", factory=lambda c: Boom(), description="raises (test)")


class MisspelledHook:
    @hookimpl
    def accelopt_iteration_ends(self, context: Any, result: Any) -> None:
        """Named like no hook (one letter too many): pluggy would refuse it with a traceback."""


MISSPELLED = PluginSpec(name="misspelled", factory=lambda c: MisspelledHook(),
                        description="implements a hook that does not exist (test)")


class ExtraArgument:
    @hookimpl
    def accelopt_iteration_end(self, context: Any, result: Any, bogus: Any) -> None:
        """Declares an argument the hookspec does not have."""


EXTRA_ARGUMENT = PluginSpec(name="extra_arg", factory=lambda c: ExtraArgument(),
                            description="declares an argument no hook passes (test)")


class DefaultedArgument:
    @hookimpl
    def accelopt_iteration_end(self, context: Any, result: Any = None) -> None:
        """Gives an argument a default: pluggy would never pass it."""


DEFAULTED_ARGUMENT = PluginSpec(name="defaulted_arg", factory=lambda c: DefaultedArgument(),
                                description="gives a hook argument a default (test)")


class AsyncHook:
    @hookimpl
    async def accelopt_iteration_end(self, context: Any, result: Any) -> None:
        """A coroutine: calling it runs nothing."""


ASYNC_HOOK = PluginSpec(name="async_hook", factory=lambda c: AsyncHook(),
                        description="an async def hook (test)")


class TimesTwo(nn.Module):
    """Wraps a Linear and doubles its output: a visible, checkable replacement."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Any) -> Any:
        return self.inner(x) * 2


@dataclass
class WrapConfig:
    paths: list[str] = field(default_factory=list)


class WrapLinears:
    def __init__(self, config: WrapConfig) -> None:
        self.offers: list[LayerOffer] = []

    @hookimpl
    def accelopt_layer_build(self, layer: LayerOffer) -> nn.Module | None:
        self.offers.append(layer)
        if layer.module_type == "Linear":
            return TimesTwo(layer.module)
        return None


WRAP = PluginSpec(name="wrap", factory=WrapLinears, config=WrapConfig,
                  description="wraps every Linear (test)")


class RaiseOnCall(nn.Module):
    """Wraps a model and raises on its ``fail_at``-th forward: a job failing mid-run."""

    def __init__(self, inner: nn.Module, fail_at: int) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0
        self.fail_at = fail_at

    def forward(self, x: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"injected failure at call {self.calls}")
        return self.inner(x)


@dataclass
class SabotageConfig:
    job: str = "tiny-mlp"
    fail_at: int = 3


class Sabotage:
    def __init__(self, config: SabotageConfig) -> None:
        self.config = config

    @hookimpl
    def accelopt_layer_build(self, layer: LayerOffer) -> nn.Module | None:
        if layer.path == "" and layer.job.name == self.config.job:
            return RaiseOnCall(layer.module, self.config.fail_at)
        return None


SABOTAGE = PluginSpec(name="sabotage", factory=Sabotage, config=SabotageConfig,
                      description="makes one job raise mid-run (test)")


class Greeter:
    """Contributes ``accelopt greet`` through accelopt_cli_commands."""

    def __init__(self, config: Any) -> None:
        pass

    @hookimpl
    def accelopt_cli_commands(self) -> list[Any]:
        from accelopt import CliCommand

        def greet(args: list[str]) -> int:
            print("hello " + " ".join(args))
            return 0

        return [CliCommand("greet", "say hello", greet)]


GREETER = PluginSpec(name="greeter", factory=Greeter, description="adds a command (test)")


class NeedsPartner:
    """Refuses, at configure time, to run without the noop plugin: in a run that selects
    both it is fine, but ``run.compare=each``'s "this plugin alone" reference set cannot run."""

    def __init__(self, config: Any) -> None:
        pass

    @hookimpl
    def accelopt_configure(self, config: Any, run_config: Any) -> None:
        from accelopt import UserError

        if "noop" not in (run_config.get("plugins") or {}):
            raise UserError("plugins.partnered: needs the noop plugin; select +plugins=[partnered,noop]")

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        return [ReportRow("partnered", "ran next to noop")]


PARTNERED = PluginSpec(name="partnered", factory=NeedsPartner,
                       description="refuses to run without noop (test)")


class RankReporter:
    """Says which rank it ran on, from its RunInfo (module-level: a spec that can travel)."""

    def __init__(self, config: Any) -> None:
        self.rank = -1

    @hookimpl
    def accelopt_run_start(self, run: RunInfo) -> None:
        self.rank = run.rank

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        return [ReportRow("rank_reporter", f"{run.role} rank {self.rank}", {"rank": self.rank})]


RANK_REPORTER = PluginSpec(name="rank_reporter", factory=RankReporter,
                           description="reports its rank (test)", scope="job")


class ShrinkAfter:
    """At iteration ``at`` (after the step) halves the hidden width of the job's MLP in
    place (new, smaller Parameters for net.1 and net.3) and asks for an optimizer rebuild;
    wraps the optimizer once at build to show accelopt_optimizer_build."""

    at = 2

    def __init__(self, config: Any) -> None:
        self.model: nn.Module | None = None
        self.builds: list[tuple[str, bool]] = []
        self.shrunk_at: int | None = None

    @hookimpl
    def accelopt_layer_build(self, layer: LayerOffer) -> Any | None:
        if layer.path == "":
            self.model = layer.module  # a test plugin: it keeps the model for the run
        return None

    @hookimpl
    def accelopt_optimizer_build(self, job, optimizer, parameters, previous):
        self.builds.append((type(optimizer).__name__, previous is not None))
        return None

    @hookimpl
    def accelopt_after_step(self, context, stepped):
        import torch

        from accelopt import OptimizerRebuild

        if context.iteration != self.at or self.model is None:
            return None
        first, second = self.model.net[1], self.model.net[3]
        keep = first.out_features // 2
        with torch.no_grad():
            first.weight = nn.Parameter(first.weight[:keep].clone())
            first.bias = nn.Parameter(first.bias[:keep].clone())
            first.out_features = keep
            second.weight = nn.Parameter(second.weight[:, :keep].clone())
            second.in_features = keep
        self.shrunk_at = context.iteration
        return OptimizerRebuild(f"hidden width halved to {keep}")

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        self.model = None
        return [ReportRow("shrink", f"shrunk at {self.shrunk_at}",
                          {"builds": ";".join(f"{n}:{p}" for n, p in self.builds)})]


SHRINK = PluginSpec(name="shrink", factory=ShrinkAfter, description="shrinks a layer (test)")


class _DelegatingOptimizer(torch.optim.Optimizer):
    """A Lookahead-style wrapper: an Optimizer subclass holding the one it wraps as an
    attribute of its own, which torch's ``__getstate__`` does not keep."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self.base = base
        self.steps = 0
        super().__init__(base.param_groups, base.defaults)

    def step(self, closure: Any = None) -> Any:
        self.steps += 1
        return self.base.step(closure)


class WrapsTheOptimizer:
    """Wraps every job's optimizer in :class:`_DelegatingOptimizer` and reports its steps."""

    def __init__(self, config: Any) -> None:
        self.wrapped: list[_DelegatingOptimizer] = []

    @hookimpl
    def accelopt_optimizer_build(self, job, optimizer, parameters, previous):
        self.wrapped.append(_DelegatingOptimizer(optimizer))
        return self.wrapped[-1]

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        steps = [w.steps for w in self.wrapped]
        self.wrapped = []
        return [ReportRow("wrap_optimizer", f"steps {steps}", {"steps": sum(steps)})]


WRAP_OPTIMIZER = PluginSpec(name="wrap_optimizer", factory=WrapsTheOptimizer,
                            description="wraps the optimizer in a subclass (test)")


class NeedsACluster:
    """Refuses a one-process run in configure (a plugin that only means something on ranks)."""

    @hookimpl
    def accelopt_configure(self, config: Any, run_config: Any) -> None:
        from accelopt.errors import UserError

        if run_config.cluster.mode == "none":
            raise UserError("needs_cluster needs cluster.mode=ps or allreduce")

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        return [ReportRow("needs_cluster", f"ran as {run.role}")]


NEEDS_CLUSTER = PluginSpec(name="needs_cluster", factory=lambda c: NeedsACluster(),
                           description="refuses cluster.mode=none (test)")


class RefusesMidRun:
    """Raises a UserError from a hook (bad input it can only see once the run is going)."""

    @hookimpl
    def accelopt_iteration_end(self, context: Any, result: Any) -> None:
        from accelopt.errors import UserError

        raise UserError("refuses_mid_run: this input cannot work; fix it")


REFUSES_MID_RUN = PluginSpec(name="refuses_mid_run", factory=lambda c: RefusesMidRun(),
                             description="raises a UserError in a hook (test)")


def _explodes(config: Any) -> object:
    raise ValueError("factory exploded")


FACTORY_RAISES = PluginSpec(name="factoryboom", factory=_explodes,
                            description="its factory raises (test)")


@dataclass
class SetConfig:
    things: set = field(default_factory=set)  # a type OmegaConf cannot hold


SET_CONFIG = PluginSpec(name="setcfg", factory=lambda c: object(), config=SetConfig,
                        description="a config field OmegaConf cannot hold (test)")


@dataclass
class AnyConfig:
    anything: Any = None  # OmegaConf takes it, and checks nothing


ANY_CONFIG = PluginSpec(name="anycfg", factory=lambda c: object(), config=AnyConfig,
                        description="a config field typed Any (test)")


class CliMischief:
    """Contributes commands named like core ones, and one whose body raises."""

    def __init__(self, config: Any) -> None:
        pass

    @hookimpl
    def accelopt_cli_commands(self) -> list[Any]:
        from accelopt import CliCommand

        def boom(args: list[str]) -> int:
            raise ValueError("command exploded")

        return [CliCommand("run", "hijack run", boom), CliCommand("plugins", "hijack", boom),
                CliCommand("cmdraise", "raises", boom),
                CliCommand("cmdword", "returns a word", lambda args: "done")]


CLI_MISCHIEF = PluginSpec(name="climischief", factory=CliMischief,
                          description="core command names and a raising command (test)")


class CliNotAList:
    @hookimpl
    def accelopt_cli_commands(self) -> Any:
        return "greet"


CLI_NOT_A_LIST = PluginSpec(name="clibad", factory=lambda c: CliNotAList(),
                            description="accelopt_cli_commands answers a str (test)")


class OptimizerBuildRaises:
    @hookimpl
    def accelopt_optimizer_build(self, job: Any, optimizer: Any, parameters: Any,
                                 previous: Any) -> None:
        raise RuntimeError("optimizer_build exploded")


OPTIMIZER_BUILD_RAISES = PluginSpec(name="optboom", factory=lambda c: OptimizerBuildRaises(),
                                    description="raises in accelopt_optimizer_build (test)")


NEEDS_ABSENT = PluginSpec(name="needs_absent", factory=lambda c: object(),
                          requires=("not_installed_anywhere",),
                          description="requires a plugin nobody installed (test)")
