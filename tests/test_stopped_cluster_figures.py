"""A stopped cluster run's summary gives the run-level figures a finished run of that shape
gives, from what its ranks left (their timelines and iteration records): a stopped run of
several jobs left ``efficiency_e``, ``mc_s``, ``iteration_s`` ... and ``cluster_backend``
null at the run level though each job's ``job.<name>.<key>`` was filled. Built in-process
from recorded spans and records, so nothing depends on timing."""

from __future__ import annotations

import types

import pytest
import torch
from omegaconf import OmegaConf

from accelopt.config import ClusterConfig
from accelopt.drivers.cluster.outcome import build_outcome, held_bytes, stopped_outcome
from accelopt.drivers.cluster.ps import PsServer, PsWorker
from accelopt.drivers.cluster.rank import JobPart, RankResult, RankSoFar, model_param_bytes
from accelopt.drivers.cluster.settings import settings_from
from accelopt.records import JobResult, Span
from accelopt.types import JobInfo

RUN_FIGURES = ("efficiency_e", "efficiency_e_with_warmup", "mc_s", "pc_s", "iteration_s",
               "iterations_per_s", "wall_iterations_per_s", "iteration_makespan_s", "ratio_a",
               "cluster_backend", "expected_bytes_per_iteration")
"""The run-level keys a stopped run of several jobs left null."""


def _settings():
    cfg = OmegaConf.structured(ClusterConfig)
    cfg.mode, cfg.workers, cfg.servers = "ps", 1, 1  # rank 0 the server, rank 1 the worker
    return settings_from(cfg)


def _info(name: str, index: int) -> JobInfo:
    return JobInfo(job_id=f"0{index}-{name}", name=name, model="mlp", kind="train",
                   arrival_s=0.0, iterations=5, batch_size=4)


def _job(index: int, n: int = 5) -> tuple[list[Span], list[dict]]:
    """One job's spans and worker records: ``n`` iterations 10 s apart, after the earlier
    jobs' (50 s each); the first two (the warm-up) slower than the rest, each job its own
    rates so the run's medians are not any one job's."""
    spans, records = [], []
    for it in range(n):
        base = 50.0 * index + 10.0 * it
        slow = 2.0 if it < 2 else 0.0
        comp = (1.0 + index, 4.0 + index + slow)
        for process, track, (a, b), category, args in (
            ("rank 1 (worker)", "link 0->1", (0.0, 2.0 + slow), "comm",
             {"source": 0, "destination": 1, "bytes": 100}),
            ("rank 1 (worker)", "compute", comp, "compute", {}),
            ("rank 0 (server)", "link 1->0", (comp[1] - 1.0, comp[1] + 1.0), "comm",
             {"source": 1, "destination": 0, "bytes": 100}),
            ("rank 1 (worker)", "iteration", (0.0, comp[1] + 1.0), "iteration", {}),
        ):
            spans.append(Span("s", track, base + a, base + b, category, {"iteration": it, **args},
                              process))
        records.append({"iteration": it, "start_s": base, "end_s": base + comp[1] + 1.0,
                        "loss": 1.0 / (it + 1), "samples": 4})
    return spans, records


PARAMS = {"w": torch.zeros(3, 5), "b": torch.zeros(5)}
"""The server's shard (the whole model: one server): 80 bytes."""


def _finished_and_stopped(names: list[str]):
    settings = _settings()
    jobs = {_info(name, i).job_id: (_info(name, i), *_job(i)) for i, name in enumerate(names)}
    server = RankResult(rank=0, role="server", pid=1, backend="gloo", train_t0=0.0,
                        statuses={job_id: ("done", "") for job_id in jobs})
    worker = RankResult(rank=1, role="worker", pid=2, backend="gloo")
    for job_id, (info, spans, records) in jobs.items():
        server.parts[job_id] = JobPart(rank=0, role="server", job=info, params=dict(PARAMS),
                                       spans=[s for s in spans if s.process.startswith("rank 0")])
        worker.parts[job_id] = JobPart(rank=1, role="worker", job=info, iterations=records,
                                       spans=[s for s in spans if s.process.startswith("rank 1")])
    finished = build_outcome([server, worker], settings).metrics
    left = [RankSoFar(r.rank, {j: p.spans for j, p in r.parts.items()},
                      {j: p.iterations for j, p in r.parts.items()}, [], backend="gloo",
                      param_bytes={j: held_bytes([server.parts[j]]) for j in r.parts})
            for r in (server, worker)]
    results = [JobResult(info) for info, _, _ in jobs.values()]
    return finished, stopped_outcome(left, results, settings).metrics


@pytest.mark.parametrize("names", [["a", "b"], ["a", "b", "c"], ["solo"]])
def test_a_stopped_run_gives_the_run_figures_a_finished_run_of_that_shape_gives(names):
    finished, stopped = _finished_and_stopped(names)
    for key in RUN_FIGURES:
        assert finished.get(key) is not None, key
        assert stopped[key] == pytest.approx(finished[key]), key
    for key in finished:  # each job's own figures, as before (the transport's counts and
        if key.startswith("job.") and stopped[key] is not None:  # bytes: not handed over)
            assert stopped[key] == pytest.approx(finished[key]), key
    assert set(stopped) >= set(finished)  # the same keys, null where not left


def test_a_stopped_runs_figures_leave_out_the_iteration_the_stop_cut():
    """Iteration 4 of job b has a worker span but no record (the stop cut it): the run's
    figures are over the iterations every worker finished, as each job's are."""
    settings = _settings()
    infos = [_info("a", 0), _info("b", 1)]
    (sa, ra), (sb, rb) = _job(0), _job(1)
    cut = [s for s in sb if s.args["iteration"] == 4]
    left = [RankSoFar(0, {}, {i.job_id: [] for i in infos}, [], backend="gloo",
                      param_bytes={i.job_id: 80 for i in infos}),
            RankSoFar(1, {infos[0].job_id: sa, infos[1].job_id: sb},
                      {infos[0].job_id: ra, infos[1].job_id: rb[:4]}, [], backend="gloo")]
    whole = stopped_outcome(left, [JobResult(i) for i in infos], settings).metrics
    left[1].job_spans[infos[1].job_id] = [s for s in sb if s not in cut]
    without = stopped_outcome(left, [JobResult(i) for i in infos], settings).metrics
    for key in RUN_FIGURES:
        assert whole[key] == pytest.approx(without[key]), key
    assert whole["expected_bytes_per_iteration"] == 2 * 80 * 1


def test_figures_the_ranks_did_not_leave_stay_null():
    """A worker killed outright left no records: no figure is made up (the backend and the
    parameters' bytes, known before the start, are still given)."""
    settings = _settings()
    infos = [_info("a", 0), _info("b", 1)]
    left = [RankSoFar(0, {}, {i.job_id: [] for i in infos}, [], backend="gloo",
                      param_bytes={i.job_id: 80 for i in infos})]
    metrics = stopped_outcome(left, [JobResult(i) for i in infos], settings).metrics
    for key in RUN_FIGURES[:-2]:
        assert metrics[key] is None, key
    assert metrics["cluster_backend"] == "gloo"
    assert metrics["expected_bytes_per_iteration"] == 160
    left[0].param_bytes = {}  # no rank said: unknown, not 0
    metrics = stopped_outcome(left, [JobResult(i) for i in infos], settings).metrics
    assert metrics["expected_bytes_per_iteration"] is None


def test_a_rank_counts_the_parameters_as_a_finished_run_does():
    """What a stopped rank leaves as its job's parameters' bytes is what ``held_bytes``
    counts of the state the servers of a finished run hand over: every distinct tensor
    once (a tied one once); unknown for an exchange that is not the cluster's own."""
    model = torch.nn.Sequential(torch.nn.Embedding(6, 4), torch.nn.Linear(4, 6))
    model[1].weight = model[0].weight  # tied: the output layer is the embedding
    shard = {n: p.detach() for n, p in model.named_parameters()}
    finished = held_bytes([types.SimpleNamespace(params=shard)])
    assert finished == (6 * 4 + 6) * 4
    for exchange in (object.__new__(PsServer), object.__new__(PsWorker)):
        assert model_param_bytes(exchange, model) == finished
    assert model_param_bytes(object(), model) is None
