"""The tictac hooks: answer ``accelopt_transfer_order`` for parameter transfers.

Where it acts: in parameter-server mode the servers send every parameter to every worker
each iteration; the transport asks the order hook once per (iteration, destination) and
enforces the answer (priority p starts only after 0..p-1 to that destination have started).
TIC/TAC order only ``param`` transfers: gradients leave in the order autograd produces them.
``heuristic=priority`` answers :class:`~accelopt.TransferPriorities` instead, on servers
(parameters, with the early update) and workers (gradients, first layer first): priority
scheduling through a credit window, tuned by measurement where asked (``tuning.py``).

The plan (trace -> oracle -> order -> simulator prediction) is made on each server rank when
the job is built (``accelopt_job_built``: the core hands over the built model and a worker's
batch, before the clock starts), cached in the run directory, and made again after the
warm-up iterations with the link the transport actually measured. tictac is job-scoped: one
instance per job, so each plan belongs to one job by construction. TIC/TAC stay out of the way when
the predicted gain over the transport's default order does not pay for the plugin's own
measured overhead (``force=true`` overrides); the report row says which happened.
"""

from __future__ import annotations

import copy
import json
import math
import random
import statistics
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from accelopt_plugins.tictac.config import (
    EXECUTIONS,
    HEURISTIC_CHOICES,
    ORDERED_BY,
    TictacConfig,
)
from accelopt_plugins.tictac.tuning import Window, WindowTuner, candidates_from, label

from accelopt import (
    BuiltJob,
    ConfigError,
    ReportRow,
    RunInfo,
    TransferPriorities,
    TransferRecord,
    UserError,
    hookimpl,
)
from accelopt.job import inputs as job_inputs
from accelopt.plugin import PluginWarning
from accelopt.runtime.run_dir import shown_path
from accelopt.types import (
    INERT,
    CliCommand,
    ClusterInfo,
    IterationContext,
    IterationResult,
)

DEFAULT_BYTES_PER_S = 125e6  # 1 Gbit/s when nothing better is known


PRIORITY_ONLY = ("credit_bytes", "partition_bytes", "pace")
"""The settings only ``heuristic=priority`` reads (its credit window, chunks and pacing)."""


PRIORITY_GRIDS = ("tune_credits", "tune_partitions")
"""The tuning grids only ``heuristic=priority`` reads (with ``credit_bytes`` or
``partition_bytes`` at -1)."""


def refuse_priority_settings(c: Any) -> None:
    """A priority-only setting given with another heuristic is refused in one line: the run
    went ahead with the setting unread and a row that never mentioned it (``tac`` with
    ``credit_bytes=65536``: no window, and no word of it). A tuning grid counts as given
    where it differs from its default: ``tune_credits=[]`` with ``tac`` is no less unread."""
    defaults = TictacConfig()
    given = [f"{key}={getattr(c, key)}" for key in PRIORITY_ONLY if getattr(c, key) != 0]
    given += [f"{key}={list(getattr(c, key))}" for key in PRIORITY_GRIDS
              if [int(x) for x in getattr(c, key)] != getattr(defaults, key)]
    if given and c.heuristic != "priority":
        raise ConfigError(
            f"plugins.tictac.{', plugins.tictac.'.join(given)}: read by heuristic=priority "
            f"only, and heuristic={c.heuristic} would run without "
            f"{'it' if len(given) == 1 else 'them'}; set plugins.tictac.heuristic=priority, "
            f"or drop {'it' if len(given) == 1 else 'them'}")


MAX_CHUNKS = 1024
"""The most chunks ``partition_bytes`` may cut one tensor into: each chunk is a message with
its own header, receive and credit return, so a 1 MiB tensor in 64 B chunks (16384) takes
longer than the cluster's timeout to cross and the run dies waiting for it."""


def refuse_too_many_chunks(c: Any, candidates: Sequence[Any], parameters: Sequence[Any]) -> None:
    """A chunk size that cuts the job's largest tensor into more than :data:`MAX_CHUNKS`
    chunks is refused before training, in one line naming the tensor, its bytes, the chunk
    count and the smallest size that keeps to the limit; run, it would die at the cluster's
    timeout with an error blaming a server "paused, stuck or overloaded"."""
    sizes = sorted({w.partition_bytes for w in candidates if w is not None and w.partition_bytes})
    if not sizes or not parameters:
        return
    big = max(parameters, key=lambda p: p.nbytes)
    part = sizes[0]
    chunks = -(-big.nbytes // part)
    if chunks <= MAX_CHUNKS:
        return
    least = -(-big.nbytes // MAX_CHUNKS)
    key = (f"partition_bytes={c.partition_bytes}" if c.partition_bytes >= 0
           else f"tune_partitions={list(c.tune_partitions)}")
    raise ConfigError(f"plugins.tictac.{key}: chunks of {part} B cut tensor {big.name!r} "
                      f"({big.nbytes} B) into {chunks} chunks, more than the {MAX_CHUNKS} per "
                      f"tensor allowed (each chunk is a message of its own); use chunk sizes "
                      f">= {least} B, or 0 for whole tensors")


class TictacPlugin:
    """One instance per job and process (each cluster rank activates its own)."""

    def __init__(self, config: TictacConfig) -> None:
        self.config = config
        self.mode = "none"
        self.rank = 0
        self.role = "single"
        self.cluster = ClusterInfo()
        self.run_dir: str | None = None
        self.out_dir: Path | None = None
        self.source: tuple[Any, ...] | None = None
        """(model copy, one worker's inputs, loss) while the run lasts: a stale plan is
        rebuilt from it; dropped at the run's end."""
        self.plan: Any = None
        self.plan_s = 0.0
        self.enforce = True
        self.decision = ""
        self.link: tuple[float, float] | None = None
        self.link_source = ""
        self.samples: dict[int, list[tuple[float, float, int]]] = {}
        self.hook_s = 0.0
        self.calls = 0
        self.skipped = 0
        self.replanned = False
        self.first_iteration: int | None = None
        self.last_iteration: int | None = None
        """The latest iteration a hook has seen: what ran last, where tuning never ended."""
        self.run_config: Any = None
        self.whole_step = ""
        """Why the server takes the whole optimizer step where priority asks to update each
        tensor early ('': nothing in the job's config refuses it)."""
        """The first iteration this run executes (past 0 in a resumed run): the warm-up,
        ``replan_iteration`` and the tuning window count from it, so a resumed run measures
        its link and tunes as an uninterrupted one does."""
        self.warnings: list[str] = []
        self.sent: set[str] = set()
        """The tensors this sender's order hook was asked about: its shard of the model."""
        self.shard: set[str] | None = None
        """A server's shard of the job's tensors, as the transport places them (None: not a
        server of several). Empty: more servers than tensors left it none, so no order hook
        is ever called on it and ``sent`` alone cannot tell it from a rank that never ran."""
        self.model_tensors = 0
        """The job's parameter tensors, over all servers."""
        self.unplanned = ""
        """Why no plan could be made for the job ('' : none refused)."""
        self.iterations = 1
        self.gain_s = 0.0
        self.overhead_s = 0.0
        self.order_source = "computed"
        self.tuner = _tuner(config)
        self.cross: dict[Window | None, float] = {}
        """priority: the cross-iteration simulator's steady iteration (s) per tuning candidate
        (``None``: the default order and whole step)."""
        self.update_rate: float | None = None
        """The server's measured optimizer rate (parameter bytes/s), measured once."""
        self.cross_inputs: dict[str, float] = {}
        """What the simulator assumed: compute per iteration, the server's update rate."""
        self.cross_saved: dict[str, Any] = {}
        """The simulator's inputs, saved with the plan (``crossiter.resimulate``)."""

    # -- lifecycle -------------------------------------------------------------------------

    @hookimpl
    def accelopt_configure(self, config: Any, run_config: Any) -> None:
        c = config
        if c.heuristic not in HEURISTIC_CHOICES:
            raise ConfigError(f"plugins.tictac.heuristic={c.heuristic!r} is not one of "
                              f"{', '.join(HEURISTIC_CHOICES)}; pick one of them")
        if c.execution not in EXECUTIONS:
            raise ConfigError(f"plugins.tictac.execution={c.execution!r} must be eager or "
                              "dataflow")
        if c.oracle_runs < 1:
            raise ConfigError("plugins.tictac.oracle_runs must be >= 1 (the oracle keeps the "
                              "minimum over that many runs)")
        if not 0 <= c.pace <= 1:
            raise ConfigError(f"plugins.tictac.pace={c.pace} must be in [0, 1] (a fraction of "
                              "the link's rate; 0: no pacing)")
        if c.tune_block < 2:
            raise ConfigError(f"plugins.tictac.tune_block={c.tune_block} must be >= 2 (a "
                              "block's first iteration still carries its predecessor's mode "
                              "and is not timed)")
        if c.tune_rounds < 1:
            raise ConfigError(f"plugins.tictac.tune_rounds={c.tune_rounds} must be >= 1")
        # written so that nan fails them too (nan < 0 is false: nan was read as "measure")
        if not 0 <= c.bandwidth_bytes_per_s < math.inf:
            raise ConfigError(f"plugins.tictac.bandwidth_bytes_per_s={c.bandwidth_bytes_per_s} "
                              "must be a finite number >= 0 (bytes/s; 0: measure)")
        if not (0 <= c.message_s < math.inf or c.message_s == -1):
            raise ConfigError(f"plugins.tictac.message_s={c.message_s} must be >= 0 and finite "
                              "(seconds per transfer) or -1 (fit it from the transport)")
        if c.replan_iteration < 0:
            raise ConfigError(f"plugins.tictac.replan_iteration={c.replan_iteration} must be >= 0 "
                              "(warm-up iterations from the run's first, after which "
                              "measured times replace the profile's)")
        if c.order_file and not Path(c.order_file).exists():
            raise ConfigError(f"plugins.tictac.order_file={c.order_file!r} does not exist; "
                              "give a JSON list of tensor names or leave it empty")
        if c.order_file and c.heuristic in ("random", "off"):
            raise ConfigError(f"plugins.tictac.order_file is one fixed order; heuristic="
                              f"{c.heuristic} never uses it: drop it or pick tac, tic, "
                              "priority, reverse or named")
        self.tuner = _tuner(c)  # its values checked first: the fix of a wrong one is its own
        refuse_priority_settings(c)
        self.config = c
        self.run_config = run_config
        cluster = run_config.get("cluster") if run_config is not None else None
        self.mode = str(cluster.get("mode", "none")) if cluster is not None else "none"

    def _place(self, run: RunInfo) -> None:
        """Where this instance runs, from the run's record (never the environment)."""
        self.rank, self.role, self.cluster = run.rank, run.role, run.cluster
        self.mode = run.cluster.mode
        self.run_dir = run.run_dir
        job = run.job
        many = len(run.jobs) > 1 and job is not None
        base = Path(run.run_dir) / "jobs" / job.job_id if many else Path(run.run_dir)  # type: ignore[union-attr]
        self.out_dir = base / "tictac" if run.run_dir else None

    @hookimpl
    def accelopt_job_built(self, run: RunInfo, job: BuiltJob) -> None:
        self._place(run)
        self.iterations = int(job.job.iterations)
        self.shard = _shard_of(self.rank, self.role, self.cluster, job.job.parameters)
        self.model_tensors = len(job.job.parameters)
        if self.mode == "ps" and self.config.heuristic == "priority":
            refuse_too_many_chunks(self.config, self.tuner.candidates, job.job.parameters)
        if (self.mode == "ps" and self.role == "server" and self.config.heuristic != "off"
                and self.shard != set()):  # a server holding no tensor has nothing to order
            # Plan before the clock: a cluster rank builds every job and then announces it,
            # before the barrier that starts training, so the fx trace and the time oracle
            # never land inside a job's first iteration. Only the parameter senders (servers)
            # plan; workers never order a transfer. The plan traces and times a copy: the
            # oracle's forward and backward must not touch the job's own model.
            y = job.targets.detach().cpu()
            self.source = (copy.deepcopy(job.model).cpu(), job_inputs.detached(job.inputs),
                           oracle_loss(job.loss, y), f"{job.job.model}-{job.job.job_id}",
                           job.job.kind, job_labels(job.loss, y))
            if self.config.heuristic == "priority":
                self.whole_step = whole_step_reason(self.run_config, job.job)
                if self.whole_step:
                    self._warn(f"tictac: early update refused ({self.whole_step}): the whole "
                               "optimizer step instead, parameters sent after it by priority")
            try:
                self._make_plan()
            except UserError as exc:
                # A model no tracer can read keeps the transport's default order for this
                # job (its row says why); the run and the other jobs' plans go on.
                self.source, self.plan = None, None
                self.unplanned = str(exc).removeprefix("tictac: ")

    @hookimpl
    def accelopt_run_start(self, run: RunInfo) -> None:
        self._place(run)

    @hookimpl
    def accelopt_run_end(self, run: RunInfo, metrics: dict[str, Any]) -> None:
        self.source = None  # the model copy is not kept past the run

    def _since_first(self, iteration: int) -> int:
        """``iteration`` counted from the first iteration this run executes. A run resumed
        from a checkpoint starts past 0 (past ``replan_iteration`` too): counted from 0, it
        would never measure its link nor replan, and would skip tuning. Every hook that sees
        an iteration reports it here (the transfer hooks, priority's iteration end: no
        iteration hook of its own, which would cost every iteration a call)."""
        if self.first_iteration is None or iteration < self.first_iteration:
            self.first_iteration = iteration
            self.tuner.begin_at(iteration)
        if self.last_iteration is None or iteration > self.last_iteration:
            self.last_iteration = iteration
        return iteration - self.first_iteration

    # -- the order -------------------------------------------------------------------------

    @hookimpl
    def accelopt_transfer_order(self, transfers: Sequence[TransferRecord],
                                destination: int) -> Sequence[str] | TransferPriorities | None:
        if not transfers or destination < 0 or self.config.heuristic == "off":
            return None
        self._since_first(transfers[0].iteration)
        if transfers[0].kind == "param":
            self.sent.update(t.tensor for t in transfers)
        if self.config.heuristic == "priority":
            return self._priorities(transfers, destination)
        if transfers[0].kind != "param":
            return None
        iteration = transfers[0].iteration
        if self.plan is None:
            if self.source is None:
                return None  # no plan was made (no job was announced): the default order
            self._make_plan()
        else:
            self._replan_after_warmup(iteration)
        t0 = time.perf_counter()  # planning is counted in plan_s, not here
        self.calls += 1
        if not self.enforce:
            self.skipped += 1
            self.hook_s += time.perf_counter() - t0
            return None
        names = self._names(iteration, destination)
        answer = self._restrict(names, transfers)
        self.hook_s += time.perf_counter() - t0
        return answer

    def _priorities(self, transfers: Sequence[TransferRecord],
                    destination: int) -> TransferPriorities | None:
        """Cross-iteration priorities: what the next forward needs first goes first. A
        server's parameters follow the plan's order (TAC's, from the traced DAG; the
        parameter order where no plan could be made) and are updated early; a worker's
        gradients follow the parameter order (a worker does not trace: its first layers'
        gradients come last out of backward and overtake the later layers' still queued)."""
        if transfers[0].kind == "param" and self.plan is not None:
            self._replan_after_warmup(transfers[0].iteration)  # counted in plan_s
        t0 = time.perf_counter()
        self.calls += 1
        window = self.tuner.candidate(transfers[0].iteration)
        if window is None:  # off: the default order (tuning's baseline, or its choice)
            self.skipped += 1
            self.hook_s += time.perf_counter() - t0
            return None
        settings = {"credit_bytes": window.credit_bytes,
                    "partition_bytes": window.partition_bytes,
                    "pace_bytes_per_s": self._pace()}
        if transfers[0].kind == "grad":
            order = [t.tensor for t in sorted(transfers, key=lambda t: t.layer_index)]
            self.hook_s += time.perf_counter() - t0
            return TransferPriorities(tuple(order), **settings)
        if self.plan is None and self.source is not None:
            self._make_plan()
        if self.plan is None:
            order = [t.tensor for t in sorted(transfers, key=lambda t: t.layer_index)]
        else:
            order = self._restrict(self._names(transfers[0].iteration, destination), transfers)
        self.hook_s += time.perf_counter() - t0
        return TransferPriorities(tuple(order), early_update=True, **settings)

    def _pace(self) -> float:
        """Bytes/s to pace one destination's window at (``pace`` x its share of the shaped
        rate), 0.0 without shaping or pacing."""
        rate = self._shaped_rate()
        if not self.config.pace or not rate:
            return 0.0
        workers = max(1, self.cluster.workers)
        sharing = workers if self.cluster.topology == "hosts" else 2 * workers
        return self.config.pace * rate / sharing

    def _predict_cross(self) -> None:
        """The steady iteration the cross-iteration simulator (``crossiter.py``) predicts for
        the default order and for each tuning candidate: this plan's DAG, op times and link,
        the run's workers and topology, the server's measured update rate."""
        from accelopt_plugins.tictac import crossiter, oracle

        plan = self.plan
        self.cross = {}
        if not plan.dag.backward_of:
            return  # no gradients: nothing crosses an iteration
        if self.update_rate is None:
            self.update_rate = (oracle.update_bytes_per_s(self.source[0])
                                if self.source is not None else float("inf"))
        h = self.config.heuristic
        work = crossiter.Workload.from_dag(plan.dag, plan.times,
                                           plan.order_for(ORDERED_BY.get(h, h)))
        link = crossiter.Link(plan.bytes_per_s, plan.message_s,
                              workers=max(1, self.cluster.workers),
                              shared=self.cluster.topology != "hosts",
                              update_bytes_per_s=self.update_rate)
        try:
            self.cross, self.cross_saved = crossiter.predict(work, link, self.tuner.candidates)
        except ValueError as exc:  # a prediction is an extra view: the run goes on without
            self._warn(f"tictac: the cross-iteration simulator cannot predict this job: {exc}")
            return
        self.cross_inputs = {"compute_ms": 1e3 * work.compute_s,
                             "update_mb_per_s": self.update_rate / 1e6}

    def _names(self, iteration: int, destination: int) -> list[str]:
        h = ORDERED_BY.get(self.config.heuristic, self.config.heuristic)
        rng = random.Random(f"{self.config.seed}-{iteration}-{destination}") \
            if h == "random" else None
        return [self.plan.dag.recv_names[r] for r in self.plan.order_for(h, rng)]

    def _restrict(self, names: list[str], transfers: Sequence[TransferRecord]) -> list[str]:
        """The plan's order limited to what this sender sends (a server sends its shard); a
        tensor the plan does not know means the plan is stale: rebuild it once, warn."""
        wanted = {t.tensor for t in transfers}
        known = set(names)
        if not wanted <= known:
            missing = sorted(wanted - known)[:3]
            self._warn(f"tictac: the priority list does not match the model (unknown tensor(s) "
                       f"{missing}); rebuilding the plan")
            self._make_plan(ignore_files=True)
            names = self._names(transfers[0].iteration, transfers[0].destination)
            known = set(names)
        order = [n for n in names if n in wanted]
        order += [t.tensor for t in transfers if t.tensor not in known]
        return order

    # -- planning --------------------------------------------------------------------------

    def _link(self) -> tuple[float, float]:
        """(per-message seconds, bytes/s): configured, measured, shaped rate, or default."""
        c = self.config
        message = max(0.0, c.message_s)
        if c.bandwidth_bytes_per_s > 0:
            self.link_source = "configured"
            return message, c.bandwidth_bytes_per_s
        if self.link is not None:
            self.link_source = ("shaped rate + per-message cost measured from the transport"
                                if self._shaped_rate() else "measured from the transport")
            return (self.link[0] if c.message_s < 0 else message), self.link[1]
        shaped = self._shaped_rate()
        if shaped:
            self.link_source = "shaped-network rate"
            return message, shaped
        self.link_source = "default 1 Gbit/s"
        return message, DEFAULT_BYTES_PER_S

    def _shaped_rate(self) -> float | None:
        """Bytes/s of the shaped network (``cluster.network.bandwidth``), else None."""
        bps = self.cluster.bandwidth_bps
        return bps / 8.0 if bps else None

    def _make_plan(self, ignore_files: bool = False) -> None:
        from accelopt_plugins.tictac.plan import plan_measured

        t0 = time.perf_counter()
        self.order_source = "computed"
        assert self.source is not None
        model, x, loss, name, kind, labels = self.source
        message, bw = self._link()
        self.plan = plan_measured(
            model, x, name=name, kind=kind,
            bytes_per_s=bw, message_s=message, execution=self.config.execution,  # type: ignore[arg-type]
            runs=self.config.oracle_runs, run_dir=self.run_dir, loss=loss, threads=None,
            labels=labels)
        if not ignore_files:
            self._load_order_file()
        self._decide_counting_plan(t0)
        self._save()

    def _replan_after_warmup(self, iteration: int) -> None:
        """Once, ``replan_iteration`` iterations after the run's first: plan again with the
        link the transport measured in the warm-up (TIC/TAC's orders and decision;
        priority's cross-iteration prediction), unless the link's rate was configured."""
        if (not self.replanned and self._since_first(iteration) >= self.config.replan_iteration
                and self.config.bandwidth_bytes_per_s == 0):
            self._replan()

    def _replan(self) -> None:
        """After warm-up: the link as measured, then the orders and the decision again."""
        from accelopt_plugins.tictac import oracle

        self.replanned = True
        samples = [s for it in sorted(self.samples) for s in self.samples[it]]
        shaped = self._shaped_rate()
        fit = oracle.fit_link_or_why(samples, shaped) if samples else None
        if fit is None:
            self.link_source += "; " + unmeasured_link(len(samples), self.cluster.servers)
            return
        if isinstance(fit, str):
            self.link_source += "; " + refused_link(len(samples), self.cluster.servers, fit)
            return
        t0 = time.perf_counter()
        self.link = fit
        message, bw = self._link()
        plan = self.plan
        plan.times = oracle.op_times(plan.dag, plan.compute, bw, message)
        plan.bytes_per_s, plan.message_s = bw, message
        h = ORDERED_BY.get(self.config.heuristic, self.config.heuristic)
        keep = {h: plan.orders[h]} if self.order_source != "computed" and h in plan.orders else {}
        plan.orders, plan.predicted = keep, {}
        self._decide_counting_plan(t0)
        self._save()

    def _load_order_file(self) -> None:
        """A user-given or previously saved priority list, if it still matches the model; a
        stale or unreadable one is warned about (and said in the row) and the order rebuilt."""
        if not self.config.order_file:
            return
        try:
            self.use_order_file()
        except UserError as exc:
            self._warn(f"{exc}; rebuilt the {self.config.heuristic} order instead")

    def use_order_file(self) -> None:
        """Make ``order_file``'s list the plan's order for the heuristic (the order it ranks
        by: TAC's for priority); a file that is not a JSON list of this model's tensor names
        raises :class:`UserError` saying what is wrong with it (the CLI refuses it)."""
        path = self.config.order_file
        current = self.plan.dag.recv_names
        names = read_order_file(path)
        if sorted(names) != sorted(current):
            raise UserError(f"tictac: order_file {path} does not match the model's "
                            f"{len(current)} parameters ({order_file_mismatch(names, current)})"
                            ": stale or edited")
        index = {n: i for i, n in enumerate(current)}
        key = ORDERED_BY.get(self.config.heuristic, self.config.heuristic)
        self.plan.orders[key] = [index[n] for n in names]
        self.plan.schedule_s[key] = 0.0
        self.order_source = f"order_file {path}"

    def _decide_counting_plan(self, t0: float) -> None:
        """Add the planning time so far to ``plan_s`` *before* deciding (the decision weighs
        the plugin's own overhead, planning included), then the decision's own time."""
        t1 = time.perf_counter()
        self.plan_s += t1 - t0
        self._decide()
        self.plan_s += time.perf_counter() - t1

    def _decide(self) -> None:
        """Predict the gain over the transport's default (named) order; compare with the
        plugin's own overhead per iteration; enforce only if it pays (TIC/TAC)."""
        plan = self.plan
        h = self.config.heuristic
        if h == "priority":
            self.enforce = True
            self._predict_cross()
            predicted = ", ".join(f"{label(c)} {1e3 * s:.1f} ms"
                                  for c, s in self.cross.items()) or "not simulated"
            self.decision = (
                f"enforced priority: cross-iteration, the next forward's need first (servers "
                f"update each tensor early and send it at once wherever the job's step allows "
                f"it: tensors_updated_early in the run metrics counts them, a refusal is logged "
                f"with its reason), gradients first-layer first, credit "
                f"{self.config.credit_bytes} bytes per link, chunks of "
                f"{self.config.partition_bytes} bytes (0: whole tensors; -1: tuned), a = "
                f"{plan.ratio_a:.2f}; the cross-iteration simulator's steady iteration "
                f"(compute from the oracle; the cores the ranks share not modelled): "
                f"{predicted}")
            return
        plan.predict(("named", h) if h != "named" else ("named",), samples=200,
                     seed=self.config.seed)
        base = plan.predicted["named"]["makespan_s"]
        mine = plan.predicted[h]["makespan_s"]
        gain = base - mine
        per_iter = self.plan_s / max(1, self.iterations) + self.hook_s / max(1, self.calls)
        per_iter += plan.schedule_s.get(h, 0.0) / max(1, self.iterations)
        self.gain_s, self.overhead_s = gain, per_iter
        given = "" if self.order_source == "computed" else f" ({self.order_source})"
        if h in ("tic", "tac") and not self.config.force and gain <= per_iter:
            self.enforce = False
            self.decision = (f"stayed out of the way: predicted gain {gain * 1e3:.3f} ms/iteration "
                             f"of {h}{given} over the default order <= own overhead "
                             f"{per_iter * 1e3:.3f} ms (a = {plan.ratio_a:.2f}); force=true "
                             "enforces anyway")
        else:
            self.enforce = True
            self.decision = (f"enforced {h}{given}: predicted makespan {mine * 1e3:.2f} ms vs "
                             f"{base * 1e3:.2f} ms for the default order (gain "
                             f"{gain * 1e3:.3f} ms, own overhead {per_iter * 1e3:.3f} ms, "
                             f"a = {plan.ratio_a:.2f})")

    def _save(self) -> None:
        if self.out_dir is None or self.plan is None:
            return
        from accelopt_plugins.tictac.simulate import Simulator

        out = self.out_dir
        out.mkdir(parents=True, exist_ok=True)
        plan, h = self.plan, self.config.heuristic
        order = plan.order_for(ORDERED_BY.get(h, h), random.Random(self.config.seed))
        sim = Simulator(plan.dag, plan.times, plan.execution)
        result = sim.run(order)
        data = {
            "heuristic": h, "enforced": self.enforce, "decision": self.decision,
            "order": [plan.dag.recv_names[r] for r in order],
            "fingerprint": plan.dag.fingerprint(), "predicted": plan.predicted,
            "bytes_per_s": plan.bytes_per_s, "message_s": plan.message_s,
            "link_source": self.link_source, "ratio_a": plan.ratio_a,
            "schedule_s": plan.schedule_s, "oracle_cache": plan.cache,
            "cross_iteration_s": {label(c): v for c, v in self.cross.items()},
            "cross_iteration": self.cross_saved,
        }
        suffix = f"-rank{self.rank}" if self.mode != "none" else ""
        (out / f"plan{suffix}.json").write_text(json.dumps(data, indent=1))
        trace = {"traceEvents": sim.chrome_trace(result, order, f"predicted {h}")}
        (out / f"predicted{suffix}.trace.json").write_text(json.dumps(trace))

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        warnings.warn(message, PluginWarning, stacklevel=3)

    # -- observing the link ----------------------------------------------------------------

    @hookimpl
    def accelopt_transfer_done(self, record: TransferRecord, start_s: float,
                               end_s: float) -> None:
        warmup = self._since_first(record.iteration) < self.config.replan_iteration
        if self.role != "server" or not warmup:
            return
        self.samples.setdefault(record.iteration, []).append((start_s, end_s, record.nbytes))

    # -- reports ---------------------------------------------------------------------------

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        if self.mode != "ps":
            return [ReportRow("tictac", nothing_to_order(self.mode), {INERT: 1})]
        if self.role == "server" and self.shard == set() and self.config.heuristic != "off":
            return [self._idle_row()]
        if self.config.heuristic == "priority":
            return self._priority_rows()
        if self.role == "worker":
            return [ReportRow("tictac", "workers take parameters in the order the servers "
                              "send them (the servers' rows say whether that is tictac's or "
                              "the transport's default); measured E per iteration is in the "
                              "run metrics (efficiency_e, with and without warm-up)",
                              {INERT: 1})]
        if self.config.heuristic == "off":
            return [ReportRow("tictac", "heuristic=off: the transport's default order was used",
                              {INERT: 1})]
        if self.plan is None and self.unplanned:
            return [ReportRow("tictac", f"not applied: {self.unplanned}; transfers kept the "
                              "transport's default order", {INERT: 1})]
        if self.plan is None:
            return [ReportRow("tictac", "no parameter transfers were ordered (no iteration ran)",
                              {INERT: 1})]
        metrics: dict[str, float | int | str] = {
            "heuristic": self.config.heuristic, "enforced": int(self.enforce),
            "calls": self.calls, "skipped": self.skipped,
            "plan_s": round(self.plan_s, 4), "hook_ms": round(1e3 * self.hook_s
                                                              / max(1, self.calls), 4),
            "predicted_gain_ms": round(1e3 * self.gain_s, 4),
            "overhead_ms": round(1e3 * self.overhead_s, 4),
            "link_bytes_per_s": round(self.plan.bytes_per_s, 1),
            "message_ms": round(1e3 * self.plan.message_s, 4),
            "ratio_a": round(self.plan.ratio_a, 3), "warnings": len(self.warnings),
            "order_source": self.order_source, "rank": self.rank,
            INERT: int(not self.enforce),  # stayed out of the way: the default order ran
        }
        for h, p in self.plan.predicted.items():
            metrics[f"predicted_{h}_ms"] = round(1e3 * p["makespan_s"], 4)
        moved, total = self._moved_vs_default()
        metrics.update(tensors=total, moved_vs_default=moved, traced_by=self.plan.traced_by)
        tensors = f"{total} tensor{'' if total == 1 else 's'}" + (
            " of this server's shard" if self._sharded() else "")
        differs = (f"its order moves {moved} of {tensors} from the default order"
                   if moved else f"its order is the default order ({tensors})")
        summary = (f"{self._who()}: {self.decision}; {differs}; traced by "
                   f"{self.plan.traced_by}; {self._link_words()}; plan in {self.plan_s:.3f} s; "
                   + (f"predicted schedule in {shown_path(self.out_dir)}/" if self.out_dir
                      else "predicted schedule not saved (no run directory)")
                   + self._warned())
        return [ReportRow("tictac", summary, metrics)]

    def _idle_row(self) -> ReportRow:
        """A server the transport gave no tensor of the job (more servers than tensors): it
        sent nothing, so nothing was ordered. Without this its row compared the whole
        model's order (sharded rows need the tensors it sent: none) and read "enforced tic:
        its order is the default order (3 tensors)", or "no iteration ran" under priority,
        where every iteration ran."""
        metrics: dict[str, float | int | str] = {
            "heuristic": self.config.heuristic, "enforced": 0, "calls": self.calls,
            "tensors": 0, "moved_vs_default": 0, "rank": self.rank,
            "warnings": len(self.warnings), INERT: 1}
        summary = (f"{self._who()}: held no tensors of this job ({self.cluster.servers} "
                   f"servers for its {self.model_tensors} parameter tensors): it sent no "
                   "parameters and ordered nothing; the transport's default order is what "
                   "the other servers' rows describe" + self._warned())
        return ReportRow("tictac", summary, metrics)

    def _who(self) -> str:
        """Which rank a row speaks for: several servers (and workers) each report a job."""
        return f"{self.role} rank {self.rank}"

    def _link_words(self) -> str:
        return f"link {self.plan.bytes_per_s / 1e6:.2f} MB/s ({self.link_source})"

    def _warned(self) -> str:
        """The plugin's warnings, in its row (a rank's stderr is easily missed)."""
        return f"; warnings: {' | '.join(self.warnings)}" if self.warnings else ""

    def _priority_rows(self) -> list[ReportRow]:
        tuner = self.tuner
        metrics: dict[str, float | int | str] = {
            "heuristic": "priority", "calls": self.calls, "off_calls": self.skipped,
            "hook_ms": round(1e3 * self.hook_s / max(1, self.calls), 4),
            "chosen_credit_bytes": -1 if tuner.chosen is None else tuner.chosen.credit_bytes,
            "chosen_partition_bytes": -1 if tuner.chosen is None
            else tuner.chosen.partition_bytes,
        }
        for c, values in tuner.timed().items():
            if values:
                key = "off" if c is None else c.key
                metrics[f"measured_{key}_ms"] = round(1e3 * statistics.median(values), 3)
        for c, seconds in self.cross.items():
            metrics[f"predicted_{'off' if c is None else c.key}_ms"] = round(1e3 * seconds, 3)
        for key, value in self.cross_inputs.items():
            metrics[f"simulated_{key}"] = round(value, 3)
        # what ran: a tuning stopped early ran its candidates so far, the last one last;
        # where every iteration ran the default order, no schedule is named (none ran)
        never = self.skipped == self.calls
        ran = (None if never else tuner.chosen if tuner.decided
               else tuner.candidate(self.last_iteration or 0))
        if ran in self.cross:
            metrics["predicted_ms"] = round(1e3 * self.cross[ran], 3)
            metrics["predicted_schedule"] = "off" if ran is None else ran.key
        if len(tuner.candidates) == 1:
            choice = (f"{label(tuner.candidates[0])} per link (configured"
                      f"{_unwindowed_chunks(tuner.candidates[0])})")
        else:
            choice = tuner.describe()
        stayed = tuner.decided and tuner.chosen is None
        if self.role == "worker":
            what = "gradients pushed first-layer first"
        else:
            what = (f"parameters by the plan's order, traced by {self.plan.traced_by}"
                    if self.plan is not None else
                    f"parameters by layer order ({self.unplanned or 'no plan'})")
            what += (f", the early update refused ({self.whole_step}): the whole optimizer "
                     "step, each parameter sent after it" if self.whole_step else
                     ", each tensor updated early and sent at once wherever the job's step "
                     "allows it (tensors_updated_early in the run metrics counts them)")
        if stayed:
            head = "stayed out of the way: the default order measured fastest"
        elif never:
            head = self._never_words()
        else:
            head = f"enforced priority (cross-iteration: {what})"
        metrics[INERT] = int(stayed or never)
        metrics.update(rank=self.rank, warnings=len(self.warnings))
        if self.plan is not None and self.role == "server":
            metrics.update(link_bytes_per_s=round(self.plan.bytes_per_s, 1),
                           link_source=self.link_source)
        summary = f"{self._who()}: {head}, {choice}{self._predicted_words(ran)}{self._warned()}"
        return [ReportRow("tictac", summary, metrics)]

    def _never_words(self) -> str:
        """Why no iteration ran a priority schedule: none ran, or each ran tuning's baseline
        (the default order) and the run ended before tuning got past it."""
        if not self.calls:
            return "no transfer was ordered (no iteration ran)"
        tuner = self.tuner
        first = self.first_iteration or 0
        ran = (self.last_iteration or first) - first + 1
        needed = tuner.end - tuner.first + 1
        return (f"ran the default order (whole step) throughout, no priority schedule: "
                f"{ran} iteration(s), all warm-up or tuning's baseline (off); tuning needs "
                f"{needed} iterations to run its choice (set workload.jobs.N.iterations >= "
                f"{needed}, or credit_bytes and partition_bytes >= 0 to skip it)")

    def _predicted_words(self, ran: Any) -> str:
        """The server's cross-iteration prediction for what ran, and the link it assumed."""
        if self.plan is None or self.role != "server":
            return ""
        if ran not in self.cross:
            return f"; not simulated; {self._link_words()}"
        # the simulator's candidates update early: a refused early update did not run so
        refused = (" with the early update, which the step refused" if self.whole_step
                   and ran is not None else "")
        measured = self.tuner.timed().get(ran) or []
        beside = (f", measured {1e3 * statistics.median(measured):.3f} ms (median of "
                  f"{len(measured)} timed iterations)" if measured else "")
        return (f"; predicted steady iteration {1e3 * self.cross[ran]:.3f} ms ({label(ran)}"
                f"{refused}{self._chunk_caveat(ran)}) at {self._link_words()}{beside}")

    def _chunk_caveat(self, ran: Any) -> str:
        """Why a chunked prediction is no prediction: the simulator charges the per-message
        cost to every chunk, but that cost was fitted on whole-tensor arrivals (the warm-up's
        transfers, one record per tensor), so with small chunks it is charged many times over
        what a chunk costs (a 16 B chunk predicted 2.4 s against 82 ms measured)."""
        plan = self.plan
        if (ran is None or not ran.partition_bytes or not ran.credit_bytes
                or self.config.message_s >= 0 or plan.message_s <= 0):
            return ""
        sizes = [int(plan.dag.nbytes[op]) for op in plan.dag.recvs]
        chunks = sum(max(1, -(-n // ran.partition_bytes)) for n in sizes)
        if chunks == len(sizes):
            return ""
        return (f"; not a prediction for chunks: the per-message cost "
                f"{1e3 * plan.message_s:.3f} ms was fitted on whole tensors and is charged to "
                f"each of {chunks} chunks per worker and direction instead of {len(sizes)} "
                "tensors")

    def _sharded(self) -> bool:
        """Whether this server sends a shard of the model (several servers) and knows which
        tensors it holds (its transfers, seen by the order hook, else its placement)."""
        return self.cluster.servers > 1 and bool(self._held())

    def _held(self) -> set[str]:
        """The tensors this server sends: those its order hook saw, else its shard."""
        return self.sent or self.shard or set()

    def _moved_vs_default(self) -> tuple[int, int]:
        """(tensors whose position differs from the transport's default order, tensors)."""
        plan, h = self.plan, self.config.heuristic
        mine = plan.order_for(ORDERED_BY.get(h, h), random.Random(self.config.seed))
        default = plan.order_for("named")
        if self._sharded():  # each server orders its own shard: compare those tensors only
            names, held = plan.dag.recv_names, self._held()
            mine = [r for r in mine if names[r] in held]
            default = [r for r in default if names[r] in held]
        return sum(a != b for a, b in zip(mine, default, strict=True)), len(default)

    @hookimpl
    def accelopt_cli_commands(self) -> Sequence[CliCommand]:
        from accelopt_plugins.tictac.cli import order_command

        return [CliCommand("tictac", "TicTac: print the transfer order and predicted makespan "
                           "(accelopt tictac order workload=... plugins.tictac.heuristic=tac)",
                           order_command)]


def read_order_file(path: str) -> list[str]:
    """The tensor names of an order file: a JSON list of names, or a saved plan (``order``)."""
    try:
        names = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"tictac: order_file {path} is not a readable JSON file ({exc})") \
            from None
    if isinstance(names, dict):
        names = names.get("order")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UserError(f"tictac: order_file {path} is not a JSON list of tensor names (nor a "
                        "saved plan with one under 'order')")
    return names


def order_file_mismatch(names: Sequence[str], current: Sequence[str], first: int = 3) -> str:
    """What an order file gets wrong against the model's tensor names: the names it repeats,
    the model's names it leaves out and the names the model does not have (the first
    ``first`` of each), so the file can be mended rather than guessed at."""
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    known = set(current)
    parts = []
    for what, found in (("named more than once", [n for n, k in counts.items() if k > 1]),
                        ("missing", [n for n in current if n not in counts]),
                        ("not in the model", [n for n in counts if n not in known])):
        if found:
            more = f" and {len(found) - first} more" if len(found) > first else ""
            parts.append(f"{what}: {', '.join(found[:first])}{more}")
    return "; ".join(parts)


def unmeasured_link(arrivals: int, servers: int) -> str:
    """Why the warm-up measured no link for this rank (its row keeps the assumed rate): a
    server sends only its shard, which may be one tensor or none, and a fit needs three
    arrivals spread in time."""
    where = "this server's shard" if servers > 1 else "this server's links"
    return (f"nothing measured: {arrivals} arrival{'' if arrivals == 1 else 's'} on {where} "
            "in the warm-up, too few or too close together to fit a rate")


def refused_link(arrivals: int, servers: int, why: str) -> str:
    """Why the warm-up's fit was not used (its row keeps the assumed rate): the arrivals
    gave a line, but not a link (:func:`oracle.fit_link_or_why`)."""
    where = "this server's shard" if servers > 1 else "this server's links"
    return (f"nothing measured: the fit over {arrivals} arrival{'' if arrivals == 1 else 's'} "
            f"on {where} in the warm-up was refused ({why})")


def _shard_of(rank: int, role: str, cluster: ClusterInfo,
              parameters: Sequence[Any]) -> set[str] | None:
    """The tensor names a server of several sends, placed as the transport places them
    (servers are ranks 0..servers-1, each rank's shard by ``shard_by_bytes``); None for any
    other rank."""
    if role != "server" or cluster.mode != "ps" or cluster.servers <= 1:
        return None
    from accelopt.job.params import shard_by_bytes

    shards = shard_by_bytes(list(parameters), cluster.servers)
    return {p.name for p in shards[rank]} if 0 <= rank < len(shards) else None


def _unwindowed_chunks(window: Any) -> str:
    """What chunks do without a credit window: every chunk starts as soon as it is posted,
    so chunking preempts nothing and the order is the one without chunks ('' otherwise)."""
    if window is None or not window.partition_bytes or window.credit_bytes:
        return ""
    return ("; with no window every chunk starts when posted: the chunks change no order, "
            "they only add messages; set credit_bytes > 0 for chunks to be preempted")


def _tuner(c: TictacConfig) -> WindowTuner:
    """The config's tuner; a grid with no setting left to run is refused (the product of the
    credits and chunk sizes, less the chunked settings without a window)."""
    _check_tuned("credit_bytes", c.credit_bytes, "tune_credits", c.tune_credits,
                 "no window", "credit windows", "[0,65536]")
    _check_tuned("partition_bytes", c.partition_bytes, "tune_partitions",
                 c.tune_partitions, "whole tensors", "chunk sizes", "[0,262144]")
    grid = candidates_from(c.credit_bytes, c.tune_credits, c.force, c.partition_bytes,
                           c.tune_partitions)
    if not [w for w in grid if w is not None]:
        raise ConfigError(
            f"plugins.tictac: credit_bytes={c.credit_bytes} (tune_credits={list(c.tune_credits)})"
            f" with partition_bytes={c.partition_bytes} (tune_partitions="
            f"{list(c.tune_partitions)}) leaves no setting to run: chunks need a credit window "
            "> 0 (without one every chunk starts at once), so each chunked setting with credit "
            "0 is dropped; add a credit > 0 or a chunk size of 0")
    return WindowTuner.for_config(c)


def _check_tuned(key: str, value: int, grid_key: str, grid: Sequence[int], zero: str,
                 what: str, example: str) -> None:
    """A priority setting is a size >= 0 or -1 (measured over its grid of sizes >= 0); the
    refusal names the setting that is wrong, the value or its grid."""
    if value < -1:
        raise ConfigError(f"plugins.tictac.{key} must be >= 0 (0: {zero}) or -1 (tune over "
                          f"{grid_key}), not {value}")
    negative = [int(x) for x in grid if int(x) < 0]
    if negative:
        raise ConfigError(f"plugins.tictac.{grid_key}={list(grid)} holds {negative}: each "
                          f"entry is a size >= 0 (0: {zero}), e.g. {example}")
    if value == -1 and not grid:
        raise ConfigError(f"plugins.tictac.{grid_key} is empty; give the {what} to measure, "
                          f"e.g. {example}, or set {key}")


def nothing_to_order(mode: str) -> str:
    """Why tictac stays out of a run outside parameter-server mode: the run's row and
    ``accelopt tictac order``'s answer (one text, so the two never disagree)."""
    why = ("cluster.mode=none: no parameter transfers" if mode == "none"
           else f"cluster.mode={mode}: all-reduce has no parameter recvs to "
           "order, and DDP waits for every bucket before backward returns, so no "
           "transfer can cross into the next forward")
    # The advice names the driver too: inside accelopt.attach (a loop of the user's
    # own, one process) cluster.mode cannot be set at all.
    return (f"nothing to order ({why}); tictac orders the parameter transfers of "
            "`accelopt run ... cluster.mode=ps`")


def whole_step_reason(run_config: Any, info: Any) -> str:
    """Why the job's config makes its step one over every gradient (the core then refuses
    priority's early update and logs it; this says so in the plugin's row too, in the
    core's words: :func:`~accelopt.job.job.settings_read_every_gradient`). '' where the
    config allows the early update."""
    if run_config is None or run_config.get("workload") is None:
        return ""
    from accelopt.job.job import settings_read_every_gradient
    from accelopt.job.specs import job_specs

    spec = next((s for s in job_specs(run_config) if s.name == info.name), None)
    if spec is None or spec.kind != "train":
        return ""
    return settings_read_every_gradient(spec)


def oracle_loss(loss: Any, y: torch.Tensor) -> Any:
    """``out -> loss`` for the plan's oracle: the job's ``loss`` over targets ``y``, a
    model's own loss summed where its traced output has none (:func:`_oracle_loss`). A run
    and ``accelopt tictac order`` both plan with it: a loss of their own made the CLI fail
    on a model the run plans."""
    return lambda out: _oracle_loss(loss, out, y)


def job_labels(loss: Any, y: torch.Tensor) -> torch.Tensor | None:
    """The labels ``y`` where the job's ``loss`` is the model's own (``loss: model``: its step
    calls ``model(x, labels=y)``), else None (it calls ``model(x)``): the plan traces and
    times the call the job makes. A run and ``accelopt tictac order`` both plan with it."""
    from accelopt.job.job import model_loss

    return y if loss is model_loss else None


def _oracle_loss(loss: Any, out: Any, y: torch.Tensor) -> torch.Tensor:
    """The job's loss for the oracle's backward. A model that computes its own loss (``loss:
    model``) is traced with its labels, as the job calls it, so its output holds that loss;
    an output that still has none (a model returning no loss even given labels) is summed
    instead (the backward through the model is what is timed, not the loss)."""
    from accelopt_plugins.tictac.oracle import _sum_loss

    try:
        return loss(out, y)
    except UserError:
        return _sum_loss(out)


class TictacPriority(TictacPlugin):
    """``heuristic=priority``: times its own iterations, which tune its window and chunk
    size (and decide whether scheduling pays at all: :mod:`accelopt_plugins.tictac.tuning`)."""

    @hookimpl
    def accelopt_iteration_end(self, context: IterationContext,
                               result: IterationResult) -> None:
        self._since_first(result.iteration)
        self.tuner.record(result.iteration, result.seconds)


class TictacOff(TictacPlugin):
    """``heuristic=off``: the transport's own order, and no transfer hooks at all, so the
    plugin costs nothing per transfer (its report row still says what was used). The
    transfer hooks are called on receiving threads under the process's hook lock; a plugin
    that has nothing to say about transfers should not be in that path."""

    accelopt_transfer_order = None  # type: ignore[assignment]
    accelopt_transfer_done = None  # type: ignore[assignment]
