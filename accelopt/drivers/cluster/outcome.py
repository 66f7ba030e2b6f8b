"""Turn the ranks' raw results into what the runner records: one JobResult per job, the
merged timeline, run-level metrics and the plugins' report rows."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from accelopt.drivers.cluster import metrics as cm
from accelopt.drivers.cluster.driver import on_training_clock
from accelopt.drivers.cluster.rank import JobPart, RankResult, RankSoFar, trainable_bytes
from accelopt.drivers.cluster.settings import ClusterSettings
from accelopt.drivers.rows import merge_rows, of_plugins, representative_rows
from accelopt.job.checkpoint import finished_before_the_resume, started_before_the_resume
from accelopt.job.params import shard_rows
from accelopt.records import JobResult, Span
from accelopt.types import ReportRow
from accelopt.units import format_bytes


@dataclass
class ClusterOutcome:
    """What a cluster run hands back to the single-process runner.

    ``results``: one JobResult for the job (losses are the global batch's); ``spans``: every
    rank's timeline (process ``"rank N (role)"``, tracks ``compute``, ``wait``,
    ``iteration`` and ``link A->B``); ``metrics``: flat run-level figures;
    ``plugin_rows``: the ranks' report rows, deduplicated; ``state``: the trained
    parameters (plus the first worker's buffers); ``per_iteration``: Mc/Pc/U/E/a per worker
    and iteration; ``primary``: False on torchrun ranks other than 0 (write no outputs).
    """

    results: list[JobResult] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    plugin_rows: list[ReportRow] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    per_iteration: list[dict[str, Any]] = field(default_factory=list)
    ranks: list[RankResult] = field(default_factory=list)
    primary: bool = True
    starts: list[float] = field(default_factory=list)
    """One job's outcome: when each of its iterations run in this run started (the first
    worker's start), for the run's wall throughput over several jobs."""
    steady: tuple[float, float] | None = None
    """One job's outcome: its first steady iteration's start to its last iteration's end."""
    warnings: list[str] = field(default_factory=list)
    """What the run did other than its settings said (said after it, kept in metrics.json)."""


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def build_outcome(ranks: list[RankResult], settings: ClusterSettings) -> ClusterOutcome:
    """Every job's outcome as if it were alone (its own spans and transfers), run-level
    figures over all of them (one job: that job's figures), and the plugins' rows merged over
    the ranks. Every job's times are on the training clock
    (``driver.on_training_clock``: 0 when every rank had built every job), so its arrival is
    the configured one (on a resumed run's clock: negative for a job that had arrived) and
    JCT and queueing delay exclude process start-up; the timeline keeps the run's own time
    origin."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    leader = ranks[0]
    t0 = float(leader.train_t0 or 0.0)
    job_ids = list(leader.parts)
    names = [leader.parts[j].job.name for j in job_ids]
    out = ClusterOutcome(ranks=ranks)
    outcomes = {}
    for job_id in job_ids:
        one = _job_outcome([r.parts[job_id] for r in ranks], settings,
                           leader.statuses.get(job_id))
        result = on_training_clock(one.results[0], t0)
        result.admitted_s = result.job.arrival_s
        if result.end_s is None and result.status == "done" and result.carried_s:
            finished_before_the_resume(result)
        else:  # started before the resume: its first start then, not its first one here
            started_before_the_resume(result)
        outcomes[job_id] = one
        out.results.append(result)
        out.spans.extend(one.spans)
    for rank in ranks:
        out.spans.extend(rank.hook_spans)
    if len(job_ids) == 1:
        one = outcomes[job_ids[0]]
        out.metrics, out.state = one.metrics, one.state
        out.per_iteration = [{"job": job_ids[0], **row} for row in one.per_iteration]
    else:
        _aggregate(out, outcomes, names, settings)
    switches = sum(1 for a, b in zip(leader.schedule, leader.schedule[1:], strict=False)
                   if a["run"] != b["run"])
    out.metrics = {**out.metrics, "scheduling_decisions": len(leader.schedule),
                   "job_switches": switches}
    out.metrics = summary_figures(out.metrics, names, settings)
    job_scoped = of_plugins(leader.job_scoped)
    rows = representative_rows([r.plugin_rows for r in ranks], [r.role for r in ranks],
                               job_scoped)
    # as a one-process run merges them (drivers/lifecycle.py): only a job-scoped plugin's
    # rows, which the core tagged with their job; a run-scoped plugin's rows, taken from one
    # rank above, stay as the plugin returned them (its own "job" key included)
    out.plugin_rows = merge_rows(rows, names, job_ids, only=job_scoped)
    out.warnings = idle_servers(ranks, job_ids)
    for job_id in job_ids:  # each line once (a rank's own, or one said by several)
        for rank in ranks:
            out.warnings += [line for line in rank.parts[job_id].warnings
                             if line not in out.warnings]
    for job_id, name in zip(job_ids, names, strict=True):
        out.warnings += unconstrained_link(name, outcomes[job_id].metrics,
                                           [r.parts[job_id] for r in ranks], settings)
    return out


OVER_THE_RATE = 1.1
"""Achieved bandwidth above the configured rate by more than this (timing noise aside): the
shaper did not hold the job to the rate."""


def unconstrained_link(name: str, metrics: dict[str, Any], parts: list[JobPart],
                       settings: ClusterSettings) -> list[str]:
    """A line when the shaped network did not constrain the job: its ranks sent no more per
    iteration than tbf lets through at once after an idle moment (its burst), or, on the
    one shaped loopback every transfer crosses, the transfers ran above its rate. Why: a
    tiny job on a 50 Mbit/s link read 147 Mbit/s achieved under "shaped loopback 50
    Mbit/s", with nothing saying the link never held it back."""
    if not settings.bandwidth_bps or settings.network == "none":
        return []
    skip = int(metrics.get("warmup_iterations", 0) or 0)
    counts = [[float(n) for _, n in sorted(p.stats.bytes_by_iteration.items())] for p in parts]
    sent = [_median(c[skip:] or c) for c in counts]  # each rank's, past the warm-up
    if settings.network == "shared":
        total = metrics.get("bytes_per_iteration")
        fits = total is not None and total <= settings.link(0).burst_bytes
        achieved = metrics.get("achieved_bandwidth_bps")
        over = achieved is not None and achieved > OVER_THE_RATE * settings.bandwidth_bps
        what = f"its ranks sent {format_bytes(total or 0)} per iteration"
        burst = settings.link(0).burst_bytes
    else:  # a link per host: each within its own link's burst
        shapes = settings.links()
        fits = all(n is None or not shape.bandwidth_bps or n <= shape.burst_bytes
                   for n, shape in zip(sent, shapes, strict=True))
        over = False
        what = f"each rank sent at most {format_bytes(max(n or 0 for n in sent))} per iteration"
        burst = min(s.burst_bytes for s in shapes if s.bandwidth_bps)
    if not (fits or over):
        return []
    rate = settings.bandwidth_bps / 1e6
    why = [f"{what}, within tbf's burst of {format_bytes(burst)}, which leaves at the "
           "machine's speed"] if fits else [what]
    if over:
        why.append(f"its transfers ran at {metrics['achieved_bandwidth_bps'] / 1e6:.1f} Mbit/s,"
                   " above the rate")
    return [f"job '{name}': the shaped network ({rate:g} Mbit/s) did not constrain it: "
            f"{'; '.join(why)}; its times and bandwidth are not the link's (a job that sends "
            "more per iteration than the burst is held to the rate)"]


def idle_servers(ranks: list[RankResult], job_ids: list[str]) -> list[str]:
    """A parameter server that held none of a job's parameters (more servers than the model
    has tensors) ran idle for it: the run trains, but cluster.servers says more servers
    than worked."""
    lines = []
    servers = [r for r in ranks if r.role == "server"]
    for job_id in job_ids:
        idle = [r.rank for r in servers if not r.parts[job_id].params]
        if idle:
            tensors = sum(len(r.parts[job_id].params) for r in servers)
            name = ranks[0].parts[job_id].job.name
            lines.append(f"job '{name}': server rank(s) {', '.join(map(str, idle))} held none "
                         f"of its {tensors} parameter tensors ({len(servers)} servers): they "
                         "ran idle; cluster.servers at most the model's tensors uses them all")
    return lines


def combined_loss(rows: list[dict[str, Any]], shares: list[float]) -> float | None:
    """One iteration's loss over the whole batch from each worker's, weighted as one
    process's mean over the batch is: by the worker's ``weight`` where its record has one
    (its labelled positions over the batch's, where the model's loss is a mean over them:
    ``Job.loss_share``), else by its share of the rows. A worker of weight 0 adds nothing
    (its loss, a mean over no position, is nan, and ``0 * nan`` is nan). None for an
    inference iteration."""
    if any(r["loss"] is None for r in rows):
        return None
    total = 0.0
    for r, share in zip(rows, shares, strict=True):
        weight = r.get("weight")
        weight = share if weight is None else weight
        if weight:
            total += r["loss"] * weight
    return total


def worker_shares(batch: int, settings: ClusterSettings) -> list[float]:
    """Each worker's share of a batch's rows."""
    return [(b - a) / batch for a, b in shard_rows(batch, settings.workers)]


@dataclass
class StoppedOutcome:
    """What the ranks of a stopped run left, as a finished run's outcome gives it."""

    spans: list[Span]
    """Every span the ranks left (the trace), the last iteration of each cut by the stop."""
    per_iteration: list[dict[str, Any]]
    """Each job's per-(worker, iteration) Mc/Pc/U/E rows from those spans."""
    metrics: dict[str, Any]
    """The run-level figures over the iterations every worker finished (one job: its
    medians, as a finished one-job run's; several: ``job.<name>.<key>`` each), and the
    cluster's settings, under the keys a finished run's has (:func:`summary_figures`):
    ``None`` for a figure the ranks did not leave (or, with no worker's records, any)."""


def stopped_outcome(left: list[RankSoFar], results: list[JobResult],
                    settings: ClusterSettings) -> StoppedOutcome:
    """The outcome of a stopped run from what its ranks left: the trace, the per-iteration
    rows, each job's losses (set on its result where every worker left its records) and
    the run's figures so far: each job's, and the run's (several jobs: over every job's, as
    a finished run's :func:`_aggregate` gives them), from the iterations every worker
    finished."""
    spans = [s for r in left for part in r.job_spans.values() for s in part]
    spans += [s for r in left for s in r.hook_spans]
    per_iteration: list[dict[str, Any]] = []
    figures: dict[str, dict[str, Any]] = {}
    measured: list[tuple[list[dict[str, Any]], int, dict[int, float]]] = []
    timed: list[ClusterOutcome] = []
    # a worker killed outright left no timeline: rows for it from its peers' link spans
    # alone (Pc 0, U = Mc) would be measurements nobody made
    present = [rank for rank in settings.worker_ranks() if rank in {r.rank for r in left}]
    for result in results:
        job_id = result.job.job_id
        job_spans = [s for r in left for s in r.job_spans.get(job_id, [])]
        rows = cm.per_worker_iteration(job_spans, present)
        per_iteration += [{"job": job_id, **row} for row in rows]
        losses = losses_so_far(left, job_id, result.job.batch_size, settings)
        if losses and result.iterations_done:  # a worker's loss of an iteration the run
            losses = losses[:result.iterations_done]  # did not finish is not the job's
        if losses:
            result.losses, result.final_loss = losses, losses[-1]
        one = _job_mode_figures(left, job_id, settings)
        finished = _finished_iterations(left, job_id, settings)
        if finished:  # the cut iteration of each job is not one of them: its U is the stop's
            kept = [r for r in rows if r["iteration"] in finished]
            summary = cm.summarize(kept, list(finished.values()))
            skip = int(summary["warmup_iterations"] or 0)
            starts, ends = _finished_times(left, job_id, settings, finished)
            window, wall = steady_window(starts, ends, skip)
            one.update({k: v for k, v in summary.items() if v is not None})
            if wall is not None:
                one["wall_iterations_per_s"] = wall
            measured.append((kept, skip, finished))
            timed.append(ClusterOutcome(starts=starts, steady=window))
        figures[result.job.name] = one
    metrics: dict[str, Any] = {}
    backend = next((r.backend for r in sorted(left, key=lambda r: r.rank) if r.backend), None)
    if len(results) == 1:  # one job's figures are the run's, as in a finished run
        metrics.update(next(iter(figures.values()), {}))
    else:
        for name, one in figures.items():
            metrics.update({f"job.{name}.{key}": one[key] for key in JOB_METRICS if key in one})
        if measured:
            metrics.update({k: v for k, v in several_jobs_figures(measured, timed).items()
                            if v is not None})
        for key in MODE_METRICS:  # the run's: their median over the jobs, as a finished one
            values = [float(one[key]) for one in figures.values() if one.get(key) is not None]
            if values:
                metrics[key] = _median(values)
    metrics.update({"cluster_mode": settings.mode, "cluster_workers": settings.workers,
                    "cluster_servers": settings.servers})
    if backend:
        metrics["cluster_backend"] = backend
    return StoppedOutcome(spans, per_iteration,
                          summary_figures(metrics, [r.job.name for r in results], settings))


def _job_mode_figures(left: list[RankSoFar], job_id: str,
                      settings: ClusterSettings) -> dict[str, Any]:
    """What a stopped run knows of one job before any iteration: the bytes of its
    parameters (``param_bytes``, as :func:`held_bytes` counts a finished run's; every rank
    built the whole model, so any rank's count) and, in ps mode, the bytes an iteration is
    to move (``expected_bytes_per_iteration``, as :func:`_job_outcome` gives it); nothing
    where no rank left its count."""
    param_bytes = next((r.param_bytes[job_id] for r in sorted(left, key=lambda r: r.rank)
                        if job_id in r.param_bytes), None)
    if param_bytes is None:
        return {}
    out: dict[str, Any] = {"param_bytes": param_bytes}
    if settings.mode == "ps":
        trainable = next((r.trainable_bytes[job_id] for r in sorted(left, key=lambda r: r.rank)
                          if job_id in r.trainable_bytes), None)
        out["expected_bytes_per_iteration"] = ps_bytes_per_iteration(
            param_bytes, trainable, settings.workers)
    return out


def _finished_times(left: list[RankSoFar], job_id: str, settings: ClusterSettings,
                    finished: dict[int, float]) -> tuple[list[float], list[float]]:
    """The starts (the first worker's) and ends (the last worker's) of the iterations of one
    job that every worker finished in this run, in order, as :func:`_job_outcome` takes
    them for its wall throughput."""
    records = workers_records(left, job_id, settings) or []
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    for worker in records:
        for it in worker:
            i = int(it["iteration"])
            if i in finished and not it.get("carried"):
                starts[i] = min(starts.get(i, it["start_s"]), it["start_s"])
                ends[i] = max(ends.get(i, it["end_s"]), it["end_s"])
    order = sorted(starts)
    return [starts[i] for i in order], [ends[i] for i in order]


def _finished_iterations(left: list[RankSoFar], job_id: str,
                         settings: ClusterSettings) -> dict[int, float]:
    """The iterations of one job that every worker finished in this run (not carried from
    a checkpoint), each with its length (the slowest worker's); empty unless every worker
    left its records."""
    records = workers_records(left, job_id, settings)
    if not records or any(not r for r in records):
        return {}
    lengths: dict[int, list[float]] = {}
    for worker in records:
        for it in worker:
            if not it.get("carried"):
                lengths.setdefault(int(it["iteration"]), []).append(it["end_s"] - it["start_s"])
    return {i: max(v) for i, v in sorted(lengths.items()) if len(v) == len(records)}


def service_so_far(left: list[RankSoFar], job_id: str,
                   settings: ClusterSettings) -> float | None:
    """A stopped run's service time of one job in this run, from what its workers left: its
    iterations every worker finished added up (each the slowest worker's), as a finished
    run's (:func:`_job_outcome`); ``None`` unless every worker left its records."""
    finished = _finished_iterations(left, job_id, settings)
    return sum(finished.values()) if finished else None


def losses_so_far(left: list[RankSoFar], job_id: str, batch: int,
                  settings: ClusterSettings) -> list[float] | None:
    """A stopped run's losses of one job, from what its workers left (None unless every
    worker left its records: a share missing would weigh the loss wrong)."""
    rows = workers_records(left, job_id, settings)
    if rows is None:
        return None
    shares = worker_shares(batch, settings)
    n_iter = min(len(r) for r in rows)
    losses = [combined_loss([r[i] for r in rows], shares) for i in range(n_iter)]
    return [loss for loss in losses if loss is not None]


def workers_records(left: list[RankSoFar], job_id: str,
                     settings: ClusterSettings) -> list[list[dict[str, Any]]] | None:
    """Every worker's iteration records of one job, in worker order, as a stopped run's
    ranks left them; ``None`` unless every worker left its records."""
    by_rank = {r.rank: r.iterations.get(job_id) for r in left}
    records = [by_rank.get(rank) for rank in settings.worker_ranks()]
    return None if any(r is None for r in records) else records  # type: ignore[return-value]


def _job_outcome(parts: list[JobPart], settings: ClusterSettings,
                 status: tuple[str, str] | None = None) -> ClusterOutcome:
    """One job's outcome from every rank's part of it."""
    workers = [r for r in parts if r.role == "worker"]
    info = workers[0].job
    batch = info.batch_size
    shares = worker_shares(batch, settings)
    n_iter = min(len(w.iterations) for w in workers)
    losses, starts, ends, seconds, samples = [], [], [], [], 0
    resumed_at = 0  # iterations carried from a checkpoint: their times are another run's
    for i in range(n_iter):
        rows = [w.iterations[i] for w in workers]
        loss = combined_loss(rows, shares)
        if loss is not None:  # inference iterations have no loss
            losses.append(loss)
        samples += sum(r["samples"] for r in rows)
        if any(r.get("carried") for r in rows):
            resumed_at = i + 1
            continue
        seconds.append(max(r["end_s"] - r["start_s"] for r in rows))  # this run's only
        starts.append(min(r["start_s"] for r in rows))
        ends.append(max(r["end_s"] for r in rows))
    state_status, error = status or (("done", "") if n_iter == info.iterations else
                                     ("failed", "the run ended before the job did"))
    result = JobResult(
        job=info, status=state_status, lane=f"cluster {settings.mode}", error=error,  # type: ignore[arg-type]
        admitted_s=starts[0] if starts else None, first_start_s=starts[0] if starts else None,
        end_s=ends[-1] if ends else None, iterations_done=n_iter,
        # the job's own iterations added up (each the slowest worker's), as one process
        # adds up its iterations' spans: not its first start to its last end, which counts
        # the time other jobs held the cluster in between. Samples count the carried
        # iterations, so the service time does too: throughput is over the whole job, as a
        # single-process resume's is
        service_s=max(p.carried_service_s for p in workers) + sum(seconds),
        samples=samples, final_loss=losses[-1] if losses else None, losses=losses,
        carried_s=max(p.carried_s for p in parts),
        # the earliest worker's, as first_start_s is (None: no checkpoint carried one)
        carried_queueing_s=min((p.carried_queueing_s for p in workers
                                if p.carried_queueing_s is not None), default=None),
    )
    spans = [s for r in parts for s in r.spans]
    worker_ranks = settings.worker_ranks()
    per_iter = cm.per_worker_iteration(spans, worker_ranks)
    summary = cm.summarize(per_iter, seconds, cm.link_bandwidth(spans))
    skip = int(summary["warmup_iterations"] or 0)
    if not starts:  # every iteration carried from a checkpoint: none was measured here
        summary.update(dict.fromkeys(("iteration_s", "iteration_s_with_warmup",
                                      "iterations_per_s", "iterations_per_s_with_warmup")))

    param_bytes = held_bytes(parts[:1] if settings.mode == "allreduce" else parts)
    wire = [sum(r.stats.bytes_by_iteration.get(i, 0) for r in parts)
            for i in range(resumed_at, n_iter)]
    handed = [sum(r.stats.collective_bytes_by_iteration.get(i, 0) for r in parts)
              for i in range(resumed_at, n_iter)]
    window, wall = steady_window(starts, ends, skip)
    metrics: dict[str, Any] = {
        "wall_iterations_per_s": wall,
        "cluster_mode": settings.mode,
        "cluster_workers": settings.workers,
        "cluster_servers": settings.servers,
        "cluster_backend": parts[0].backend,
        "param_bytes": param_bytes,
        "bytes_per_iteration": _median(wire[skip:]) if wire[skip:] else _median(wire),
        "transfers": sum(r.stats.transfers for r in parts),
        "transfers_dropped": sum(r.stats.dropped for r in parts),
        "transfers_ordered": sum(r.stats.ordered for r in parts),
        "transfers_held": sum(r.stats.held for r in parts),
        "transfers_overtaken": sum(r.stats.overtaken for r in parts),
        "transfers_partitioned": sum(r.stats.partitioned for r in parts),
        "tensors_updated_early": sum(r.stats.updated_early for r in parts),
    }
    ordered = metrics["transfers_ordered"]
    metrics["out_of_order_fraction"] = (
        sum(r.stats.inversions for r in parts) / ordered if ordered else 0.0
    )
    if settings.mode == "ps":
        metrics["expected_bytes_per_iteration"] = ps_bytes_per_iteration(
            param_bytes, trainable_bytes(parts[0].job), settings.workers)
    elif any(handed):  # beside what went on the wire: what the ranks handed gloo / NCCL
        metrics["collective_bytes_per_iteration"] = (_median(handed[skip:]) if handed[skip:]
                                                     else _median(handed))
    metrics.update(network_metrics(settings))
    sent = _wire_bytes_per_iteration(parts, settings)
    if sent:
        # the mean, not the median: each rank reads its counter as an iteration starts, while
        # a shaped link may still queue the end of the last one, so single iterations' counts
        # shift by what is queued at their two marks; over consecutive iterations the
        # shifts cancel but at the window's two ends
        metrics["wire_bytes_per_iteration"] = statistics.fmean(sent[skip:] or sent)
        if settings.network == "shared":
            metrics["loopback_bytes_per_iteration"] = metrics["wire_bytes_per_iteration"]
    metrics.update(summary)
    state: dict[str, Any] = {}
    for r in parts:
        state.update(r.buffers)
        state.update(r.params)
    return ClusterOutcome(
        results=[result], spans=spans,
        metrics={k: v for k, v in metrics.items() if v is not None},
        state=state, per_iteration=per_iter, starts=starts, steady=window,
    )


def steady_window(starts: list[float], ends: list[float],
                  skip: int) -> tuple[tuple[float, float] | None, float | None]:
    """A job's steady window (its first steady iteration's start to its last iteration's
    end) and its wall throughput, the iterations that started in it over its length: 1 /
    median iteration is no throughput once iterations overlap (an early update sends the
    next iteration's parameters inside this one). ``starts``/``ends``: its measured
    iterations' in order; a finished and a stopped run count them alike."""
    steady = starts[skip:] if len(starts) > skip else starts
    window = (steady[0], ends[-1]) if steady and ends[-1] > steady[0] else None
    return window, len(steady) / (window[1] - window[0]) if window else None


def ps_bytes_per_iteration(param_bytes: int, trainable: int | None, workers: int) -> int:
    """What one ps iteration is to move: each worker pulls every parameter and pushes the
    gradients of the trainable ones (``trainable`` bytes; ``None``: unknown, taken as all).
    A frozen parameter's gradient never goes (a header says it has none), so counting every
    parameter twice put the bound of a partly frozen model above what its iterations move."""
    return (param_bytes + (param_bytes if trainable is None else trainable)) * workers


def held_bytes(parts: list[JobPart]) -> int:
    """The bytes of the parameters ``parts`` hold, each storage once: a parameter server's
    state names a tied weight under each of its names (``PsServer.final_state``, so the
    gathered state loads back), and summing the names counted an embedding tied to the
    output layer twice, while the wire and the layer order carry it once. The names of one
    tensor share its data (one pointer, a pickle of the rank's state keeps them one); two
    ranks' tensors are never one."""
    seen: dict[tuple[int, int], int] = {}
    for part in parts:
        for p in part.params.values():
            seen[(id(part), p.data_ptr())] = p.numel() * p.element_size()
    return sum(seen.values())


def wall_throughput(outcomes: list[ClusterOutcome]) -> float | None:
    """Several jobs' wall throughput: the iterations (of any job) that started while some job
    was in its steady iterations (its first steady start to its last end), over the length
    of those windows put together. The leader's idle waits for the next arrival and the
    jobs' warm-ups outside the windows do not count; one job gives its own figure. One over
    the median iteration is no throughput here: jobs run at different rates, and the median
    is close to the fastest job's."""
    windows = sorted(o.steady for o in outcomes if o.steady is not None)
    length = cm.union_length(windows)
    if not length:
        return None
    ran = sum(1 for o in outcomes for start in o.starts
              if any(a <= start < b for a, b in windows))
    return ran / length


def network_metrics(settings: ClusterSettings) -> dict[str, Any]:
    """The configured network: its rate and delay, the topology and, with a host per rank,
    each link's rate (``link_bandwidth_bps.worker1``; absent: unlimited)."""
    out: dict[str, Any] = {"network_topology": settings.network}
    if settings.bandwidth_bps:
        out["configured_bandwidth_bps"] = settings.bandwidth_bps
    if settings.latency_s:
        out["configured_latency_s"] = settings.latency_s
    if settings.network == "hosts":
        for rank, shape in enumerate(settings.links()):
            if shape.bandwidth_bps:
                out[f"link_bandwidth_bps.{settings.link_name(rank)}"] = shape.bandwidth_bps
    return out


def _wire_bytes_per_iteration(parts: list[JobPart], settings: ClusterSettings) -> list[int]:
    """What the kernel counted leaving the ranks' interfaces per iteration: the shared
    topology's one ``lo`` (every rank sees the same counter) or the sum of every host's
    ``eth0``."""
    counted = [parts[0]] if settings.network == "shared" else parts
    per_rank = []
    for part in counted:
        marks = part.wire_bytes
        per_rank.append({i: b - a for (i, a), (_, b) in zip(marks, marks[1:], strict=False)})
    if not per_rank or not all(per_rank):
        return []
    common = sorted(set.intersection(*(set(d) for d in per_rank)))
    return [sum(d[i] for d in per_rank) for i in common]


JOB_METRICS = ("efficiency_e", "efficiency_e_with_warmup", "iteration_s", "mc_s", "pc_s",
               "ratio_a", "iteration_makespan_s", "bytes_per_iteration",
               "achieved_bandwidth_bps", "wire_bytes_per_iteration",
               "loopback_bytes_per_iteration", "collective_bytes_per_iteration",
               "expected_bytes_per_iteration")
"""Per-job figures copied into the run's metrics as ``job.<name>.<key>``."""


TRANSFER_COUNTS = ("transfers", "transfers_dropped", "transfers_ordered", "transfers_held",
                   "transfers_overtaken", "transfers_partitioned", "tensors_updated_early")
"""The transport's counts, per job and summed over the jobs."""

MEDIANS = ("mc_s", "pc_s", "iteration_makespan_s", "efficiency_e", "ratio_a")
"""The per-iteration figures a run gives as medians (``cm.summarize``)."""

ONE_JOB_METRICS = (
    "wall_iterations_per_s", "cluster_mode", "cluster_workers", "cluster_servers",
    "cluster_backend", "param_bytes", "bytes_per_iteration", *TRANSFER_COUNTS,
    "out_of_order_fraction", *(f"{key}{suffix}" for key in MEDIANS
                               for suffix in ("", "_with_warmup")),
    "iteration_s", "iteration_s_with_warmup", "iterations_per_s",
    "iterations_per_s_with_warmup", "achieved_bandwidth_bps",
    "achieved_bandwidth_bps_with_warmup", "worker_bytes_per_iteration", "warmup_iterations",
    "scheduling_decisions", "job_switches")
"""The summary keys of a one-job cluster run (beside the network's and the mode's:
:func:`summary_figures`)."""

SEVERAL_JOBS_METRICS = (
    "cluster_mode", "cluster_workers", "cluster_servers", "cluster_backend", "cluster_jobs",
    "efficiency_e", "efficiency_e_with_warmup", "iteration_s", "iterations_per_s",
    "wall_iterations_per_s", "bytes_per_iteration", "mc_s", "pc_s", "iteration_makespan_s",
    "ratio_a", *TRANSFER_COUNTS, "out_of_order_fraction", "scheduling_decisions",
    "job_switches")
"""The run-level summary keys of a cluster run of several jobs (each job's own:
``job.<name>.<key>``, :data:`JOB_METRICS`)."""


MODE_METRICS = ("expected_bytes_per_iteration", "collective_bytes_per_iteration",
                "wire_bytes_per_iteration", "loopback_bytes_per_iteration")
"""Figures only some modes and networks have (:func:`summary_figures`)."""


def summary_figures(metrics: dict[str, Any], names: list[str],
                    settings: ClusterSettings) -> dict[str, Any]:
    """``metrics`` under every key a cluster run of these jobs reports, ``None`` where a
    figure is unknown (not measured, or a stopped run's ranks did not leave it). Finished
    and stopped runs both go through it, so their summaries have the same keys and a script
    reading ``summary["bytes_per_iteration"]`` gets ``null``, not a KeyError, from a run
    that failed. The mode and the network decide the rest: ``expected_bytes_per_iteration``
    (ps), ``collective_bytes_per_iteration`` (all-reduce), ``wire_bytes_per_iteration`` (a
    shaped network) and ``loopback_bytes_per_iteration`` (its shared loopback): a run of
    several jobs has each job's (``job.<name>.<key>``) and the run's, their median over the
    jobs, as ``bytes_per_iteration``."""
    extra = [key for key, wanted in (
        ("expected_bytes_per_iteration", settings.mode == "ps"),
        ("collective_bytes_per_iteration", settings.mode == "allreduce"),
        ("wire_bytes_per_iteration", settings.shaped),
        ("loopback_bytes_per_iteration", settings.shaped and settings.network == "shared"))
        if wanted]
    if len(names) == 1:
        keys = [*ONE_JOB_METRICS, *extra]
    else:
        per_job = [key for key in JOB_METRICS if key not in MODE_METRICS or key in extra]
        keys = [*SEVERAL_JOBS_METRICS, *extra,
                *(f"job.{name}.{key}" for name in names for key in per_job)]
    out = {key: metrics.get(key) for key in keys}
    out.update({"cluster_mode": settings.mode, "cluster_workers": settings.workers,
                "cluster_servers": settings.servers, **network_metrics(settings)})
    if len(names) > 1:
        out["cluster_jobs"] = len(names)
    for key, value in metrics.items():  # a figure the lists do not name is kept as well
        out.setdefault(key, value)
    return out


def several_jobs_figures(jobs: list[tuple[list[dict[str, Any]], int, dict[int, float]]],
                         outcomes: list[ClusterOutcome]) -> dict[str, Any]:
    """The run-level medians of several jobs, one code for a finished run
    (:func:`_aggregate`) and a stopped one (:func:`stopped_outcome`), so a stopped run's
    summary gives what a finished one of that shape gives. ``jobs``: each job's
    per-(worker, iteration) rows, its warm-up iterations and its iterations' lengths (each
    the slowest worker's, by iteration); ``outcomes``: each job's ``starts`` and ``steady``
    window, for the wall throughput (:func:`wall_throughput`)."""
    steady_e: list[float] = []
    all_e: list[float] = []
    steady_rows: list[dict[str, Any]] = []
    iteration_s: list[float] = []
    for rows, skip, lengths in jobs:
        for row in rows:
            if row["iteration"] >= skip:
                steady_rows.append(row)
            if row["efficiency_e"] is not None:
                all_e.append(row["efficiency_e"])
                if row["iteration"] >= skip:
                    steady_e.append(row["efficiency_e"])
        iteration_s.extend(v for i, v in lengths.items() if i >= skip)
    return {
        "efficiency_e": _median(steady_e) if steady_e else _median(all_e),
        "efficiency_e_with_warmup": _median(all_e),
        "iteration_s": _median(iteration_s),
        "iterations_per_s": 1.0 / _median(iteration_s) if iteration_s else None,
        "wall_iterations_per_s": wall_throughput(outcomes),
        **{key: _median([r[key] for r in steady_rows if r.get(key) is not None])
           for key in ("mc_s", "pc_s", "iteration_makespan_s", "ratio_a")},
    }


def _aggregate(out: ClusterOutcome, outcomes: dict[str, ClusterOutcome], names: list[str],
               settings: ClusterSettings) -> None:
    """Several jobs on the same processes: run-level figures over every job's."""
    leader = out.ranks[0]
    jobs: list[tuple[list[dict[str, Any]], int, dict[int, float]]] = []
    wire: list[float] = []
    by_mode: dict[str, list[float]] = {}
    """The mode's and the network's figures of each job (:data:`MODE_METRICS`): the run's
    is their median over the jobs, as ``bytes_per_iteration``'s is."""
    totals = {"transfers": 0, "transfers_dropped": 0, "transfers_ordered": 0,
              "transfers_held": 0, "transfers_overtaken": 0, "transfers_partitioned": 0,
              "tensors_updated_early": 0}
    inversions = 0
    for job_id, one in outcomes.items():
        parts = [r.parts[job_id] for r in out.ranks]
        out.state[job_id] = one.state
        skip = int(one.metrics.get("warmup_iterations", 0) or 0)
        out.per_iteration += [{"job": job_id, **row} for row in one.per_iteration]
        if one.metrics.get("bytes_per_iteration") is not None:
            wire.append(float(one.metrics["bytes_per_iteration"]))
        for key in MODE_METRICS:
            if one.metrics.get(key) is not None:
                by_mode.setdefault(key, []).append(float(one.metrics[key]))
        worker_rows = [it for p in parts if p.role == "worker" for it in p.iterations]
        by_iter: dict[int, float] = {}
        for it in worker_rows:
            by_iter[it["iteration"]] = max(by_iter.get(it["iteration"], 0.0),
                                           it["end_s"] - it["start_s"])
        jobs.append((one.per_iteration, skip, by_iter))
        for key in totals:
            totals[key] += int(one.metrics.get(key, 0))
        inversions += sum(p.stats.inversions for p in parts)
        name = one.results[0].job.name
        for key in JOB_METRICS:
            if one.metrics.get(key) is not None:
                out.metrics[f"job.{name}.{key}"] = one.metrics[key]
    out.metrics.update({
        "cluster_mode": settings.mode,
        "cluster_workers": settings.workers,
        "cluster_servers": settings.servers,
        "cluster_backend": leader.backend,
        "cluster_jobs": len(outcomes),
        **several_jobs_figures(jobs, list(outcomes.values())),
        "bytes_per_iteration": _median(wire),
        **{key: _median(values) for key, values in by_mode.items()},
        **totals,
        "out_of_order_fraction": inversions / totals["transfers_ordered"]
        if totals["transfers_ordered"] else 0.0,
    })
    out.metrics.update(network_metrics(settings))
    out.metrics = {k: v for k, v in out.metrics.items() if v is not None}
