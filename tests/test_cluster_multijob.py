"""Several jobs on one parameter-server cluster (accelopt/cluster/multijob.py): real
processes on 127.0.0.1, tiny models, a few iterations each.

What must hold: every job is trained on every rank and ends bitwise equal to the same job
trained alone in PS mode, whatever the interleaving (FIFO without plugins; a random salus
policy that switches at arbitrary boundaries, with tictac enforcing per-job orders); jobs
arriving later wait for their arrival; config mistakes are one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from accelopt import AllocationDecision, PluginSpec, hookimpl
from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.cluster import run_cluster
from accelopt.errors import ConfigError

pytestmark = pytest.mark.timeout(150)
TESTS = str(Path(__file__).parent)
JOBS = [
    JobConfig(name="mlp", model="mlp", width=16, batch_size=8, iterations=4, seed=1),
    # transformer: MultiheadAttention reads out_proj's weight without calling its forward
    JobConfig(name="tfm", model="transformer", width=16, batch_size=8, iterations=3, seed=2,
              arrival_s=0.0, optimizer="adam", lr=1e-3),
    JobConfig(name="late", model="mlp", width=8, batch_size=4, iterations=2, seed=3,
              arrival_s=0.8),
]


def make_cfg(jobs=JOBS, plugins: dict | None = None, mode: str = "ps"):
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(j) for j in jobs]
    cfg.cluster.mode = mode
    cfg.cluster.workers = 2
    cfg.cluster.servers = 1
    cfg.cluster.timeout_s = 20
    if plugins:
        cfg.plugins = plugins
    return cfg


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """Each job trained alone in PS mode: its final parameters and buffers."""
    states = {}
    for spec in JOBS[:2]:
        out = run_cluster(make_cfg([spec]), run_dir=tmp_path_factory.mktemp("run"))
        states[spec.name] = out.state
    return states


def assert_bitwise(state: dict, reference: dict) -> None:
    assert set(state) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name


def job_ids(out) -> dict[str, str]:
    return {r.job.name: r.job.job_id for r in out.results}


def test_fifo_without_plugins_trains_every_job_bitwise_equal_to_alone(alone, tmp_path):
    out = run_cluster(make_cfg(), run_dir=str(tmp_path))
    ids = job_ids(out)
    assert [r.status for r in out.results] == ["done"] * 3
    assert [r.iterations_done for r in out.results] == [4, 3, 2]
    # run to completion in arrival order: each job's iterations are contiguous
    order = [d["run"][0] for d in out.ranks[0].schedule]
    assert order == [ids["mlp"]] * 4 + [ids["tfm"]] * 3 + [ids["late"]] * 2
    assert out.metrics["job_switches"] == 2
    for name in ("mlp", "tfm"):
        assert_bitwise(out.state[ids[name]], alone[name])
    # the late job arrives 0.8 s after training starts: it never starts before that
    late = next(r for r in out.results if r.job.name == "late")
    assert late.first_start_s >= late.job.arrival_s
    assert late.queueing_s is not None and late.queueing_s >= 0
    # per-job E and a run-level median; every span and transfer names its job
    for name in ("mlp", "tfm", "late"):
        assert f"job.{name}.efficiency_e_with_warmup" in out.metrics
    assert "efficiency_e_with_warmup" in out.metrics
    assert {row["job"] for row in out.per_iteration} == set(ids.values())
    links = [s for s in out.spans if s.category == "comm"]
    assert links and all(s.args["job"] in ids.values() for s in links)


def test_random_interleaving_with_salus_and_tictac_is_bitwise_equal(alone, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    plugins = {
        "salus": {"policy": "multijob_policies:RandomPolicy"},
        "tictac": {"heuristic": "tac", "force": True, "oracle_runs": 1},
    }
    out = run_cluster(make_cfg(plugins=plugins), run_dir=str(tmp_path))
    ids = job_ids(out)
    assert [r.status for r in out.results] == ["done"] * 3
    order = [d["run"][0] for d in out.ranks[0].schedule]
    assert sorted(order) == sorted([ids["mlp"]] * 4 + [ids["tfm"]] * 3 + [ids["late"]] * 2)
    # the random policy interleaved the first two jobs (seed 7): not run to completion
    first_two = [j for j in order if j != ids["late"]]
    assert first_two != sorted(first_two, key=[ids["mlp"], ids["tfm"]].index)
    assert out.metrics["job_switches"] >= 2
    for name in ("mlp", "tfm"):
        assert_bitwise(out.state[ids[name]], alone[name])
    # tictac planned and enforced each job's own order (keyed by job: its own tensors)
    assert out.metrics["transfers_ordered"] > 0 and out.metrics["out_of_order_fraction"] == 0
    orders = {}
    for name, job_id in ids.items():
        plan = json.loads((tmp_path / "jobs" / job_id / "tictac" / "plan-rank0.json").read_text())
        assert plan["enforced"] is True
        assert plan["order"] and set(plan["order"]) <= set(out.state[job_id])
        orders[name] = plan["order"]
    assert any("self_attn" in t for t in orders["tfm"])
    assert not any("self_attn" in t for t in orders["mlp"])
    rows = {r.plugin: r.summary for r in out.plugin_rows if r.plugin == "salus"}
    assert "3 job(s)" in rows["salus"] and "over 9 iterations" in rows["salus"]
    assert "decided on the leader (rank 0) and broadcast" in rows["salus"]


def test_several_jobs_share_the_ranks_in_allreduce_mode_too(tmp_path):
    """The same leader-broadcast driver runs every mode: FIFO over all-reduce jobs, each
    bitwise equal to the same job trained alone in all-reduce mode."""
    alone = run_cluster(make_cfg([JOBS[0]], mode="allreduce"), run_dir=str(tmp_path / "a"))
    out = run_cluster(make_cfg(JOBS[:2], mode="allreduce"), run_dir=str(tmp_path / "b"))
    ids = job_ids(out)
    assert [r.status for r in out.results] == ["done", "done"]
    order = [d["run"][0] for d in out.ranks[0].schedule]
    assert order == [ids["mlp"]] * 4 + [ids["tfm"]] * 3
    assert_bitwise(out.state[ids["mlp"]], alone.state)


def test_pack_in_a_cluster_is_arrival_order(tmp_path):
    """Lanes cannot run at once in a cluster: pack's jobs, each in a lane of its own, were
    interleaved in whatever order the leader's lane threads took the lock."""
    out = run_cluster(make_cfg(JOBS[:2], plugins={"salus": {"policy": "pack"}},
                               mode="allreduce"), run_dir=str(tmp_path))
    ids = job_ids(out)
    order = [d["run"][0] for d in out.ranks[0].schedule]
    assert order == [ids["mlp"]] * 4 + [ids["tfm"]] * 3


def test_config_mistakes_are_one_line(tmp_path):
    small = [JOBS[0], JobConfig(name="tiny-batch", batch_size=1, iterations=1)]
    with pytest.raises(ConfigError, match="job 'tiny-batch': batch_size 1 is smaller"):
        run_cluster(make_cfg(small), run_dir=tmp_path)


def test_cli_error_for_a_job_list_that_cannot_run_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "accelopt.cli.main", "run", "cluster.mode=allreduce",
         "cluster.workers=40", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() + proc.stdout.splitlines() if ln.strip()]
    assert len([ln for ln in lines if ln.startswith("error:")]) == 1
    assert "'cnn-b': batch_size 32 is smaller than cluster.workers=40" in proc.stderr
    assert not (tmp_path / "metrics.json").exists()  # refused before anything ran


def test_run_compare_runs_the_baseline_in_the_same_invocation(run_tiny):
    from accelopt_plugins.noop import PLUGIN as NOOP

    record = run_tiny(NOOP, overrides=["run.compare=baseline"])
    assert "compare.baseline.avg_jct_s" in record.metrics
    gains = [r.summary for r in record.plugin_rows if r.plugin == "noop"
             and r.summary.startswith("measured gain")]
    assert len(gains) == 1 and "avg JCT s" in gains[0]
    baseline = Path(record.info.run_dir) / "compare" / "baseline" / "metrics.json"
    assert json.loads(baseline.read_text())["run"]["plugins"] == []


def test_a_plugin_that_changed_nothing_is_not_credited_with_the_noise(run_tiny):
    """tictac stays out of a one-process run (nothing to order) and gradcomm too, yet their
    'measured gain' rows credited them with 1.2-1.5x of run-to-run noise."""
    from accelopt_plugins.gradcomm import PLUGIN as GRADCOMM
    from accelopt_plugins.noop import PLUGIN as NOOP
    from accelopt_plugins.tictac import PLUGIN as TICTAC

    from accelopt import PluginSpec, ReportRow, hookimpl

    class Acts:  # a plugin whose row says it did something (not inert)
        def __init__(self, _config=None) -> None:
            pass

        @hookimpl
        def accelopt_report_rows(self, run):
            return [ReportRow("acts", "did something")]

    acts = PluginSpec(name="acts", factory=Acts)
    record = run_tiny(TICTAC, GRADCOMM, NOOP, acts,
                      overrides=["run.compare=each", "cluster.mode=none"])
    gains = {r.plugin: r.summary for r in record.plugin_rows
             if r.summary.startswith("measured gain")}
    # noop too: its difference is its hook calls' cost plus noise, never a gain to credit
    for plugin in ("tictac", "gradcomm", "noop"):
        assert f"{plugin} changed nothing in this run, its rows say so: this difference " \
               "is run-to-run noise" in gains[plugin]
    assert "changed nothing" not in gains["acts"]


class _RejectsTheCnn:
    """Test-only plugin: admission control that turns the tiny workload's CNN away."""

    def __init__(self, _config=None) -> None:
        pass

    @hookimpl
    def accelopt_allocate(self, request):
        if request.job.name == "tiny-cnn":
            return AllocationDecision(granted=False, reject="rejected by the test")
        return AllocationDecision(granted=True, lane="default")


def test_run_compare_says_when_the_runs_did_not_finish_the_same_jobs(run_tiny):
    """salus rejected a large job the baseline ran, and the table read 5.95x faster."""
    spec = PluginSpec(name="rejects", factory=_RejectsTheCnn)
    record = run_tiny(spec, overrides=["run.compare=baseline", "cluster.mode=none"])
    (gain,) = [r.summary for r in record.plugin_rows if r.plugin == "rejects"
               and r.summary.startswith("measured gain")]
    assert "[not the same jobs finished: tiny-cnn (done without plugins, rejected here)] " \
        "[times are compared over the jobs every run finished: tiny-mlp]" in gain
    import copy

    from accelopt.runtime.compare import BASELINE, job_set_note, table

    assert job_set_note(record, record) == ""  # the same jobs: nothing said
    base = copy.deepcopy(record)
    for job in base.jobs:
        job.status = "done"
    assert "tiny-cnn (done without plugins, rejected here)" in table(record, {BASELINE: base}).caption
    assert table(base, {BASELINE: base}).caption is None


@pytest.mark.timeout(120)
def test_a_job_that_stops_the_cluster_run_leaves_the_finished_ones_done(run_tiny, tmp_path,
                                                                       monkeypatch):
    """In a cluster run a job that raises stops the run; the jobs that had finished before
    it were all marked failed with 0 iterations (the launcher knew nothing of them)."""
    from accelopt.errors import RankFailed

    monkeypatch.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    jobs = ("workload.jobs=[{name:first,model:mlp,width:8,batch_size:8,iterations:3,seed:1},"
            "{name:boom,model:'byo_models:raises_after',dataset:synthetic_vectors,"
            "model_kwargs:{after:2},batch_size:8,iterations:6,seed:2}]")
    with pytest.raises(RankFailed, match="boom at forward 3"):
        run_tiny(overrides=["cluster.mode=ps", "cluster.workers=1", jobs])
    (metrics,) = tmp_path.glob("run*/metrics.json")
    first, boom = json.loads(metrics.read_text())["jobs"]
    assert (first["status"], first["iterations"]) == ("done", 3)
    assert first["jct_s"] > 0 and first["queueing_s"] >= 0
    assert "not scored: the run stopped before" in first["quality_note"]
    assert boom["status"] == "failed" and "boom at forward 3" in boom["error"]


def test_run_compare_is_validated_in_one_line(run_tiny):
    from accelopt_plugins.noop import PLUGIN as NOOP

    with pytest.raises(ConfigError, match="run.compare: 'sometimes' is not one of"):
        run_tiny(NOOP, overrides=["run.compare=sometimes"])


def test_default_workload_is_multi_job_ps_with_comparison():
    cfg = OmegaConf.load(Path(__file__).parents[1] / "configs" / "workload" / "default.yaml")
    assert cfg.cluster.mode == "ps" and len(cfg.workload.jobs) >= 3
    assert cfg.run.compare in ("baseline", "each")


def _fake_rt(job_id: str, arrival: float, iterations: int):
    from types import SimpleNamespace

    from accelopt.types import JobInfo

    info = JobInfo(job_id=job_id, name=job_id, model="mlp", kind="train", arrival_s=arrival,
                   iterations=iterations, batch_size=8)
    return SimpleNamespace(job=SimpleNamespace(info=info))


def test_choose_next_is_fifo_by_default_and_checks_a_plugins_answer():
    """The one choice function of the local driver and of the cluster's leader."""
    from accelopt.drivers.scheduling import choose_next
    from accelopt.errors import AccelOptError
    from accelopt.hookspecs import hookimpl
    from accelopt.host import PluginHost
    from accelopt.plugin import PluginSpec
    from accelopt.types import JobState

    def state(job_id, arrival, done=0):
        return JobState(_fake_rt(job_id, arrival, 3).job.info, "l", done, 0.0, None, 0.0)

    ready = [state("b", 0.5), state("a", 0.5), state("c", 0.1, done=2)]
    assert choose_next(PluginHost(), "l", ready, 0.0) == "c"  # earliest arrival, then id
    assert choose_next(PluginHost(), "l", ready[:2], 0.0) == "a"

    class Pick:
        def __init__(self, answer):
            self.answer, self.calls = answer, 0

        @hookimpl
        def accelopt_select_next(self, lane, ready, now_s):
            self.calls += 1
            return self.answer

    picker = Pick("b")
    host = PluginHost([(PluginSpec(name="pick", factory=lambda c: None), picker)])
    assert choose_next(host, "l", ready, 0.0) == "b"
    assert choose_next(host, "l", ready[:1], 0.0) == "b" and picker.calls == 1  # forced
    bogus = PluginHost([(PluginSpec(name="pick", factory=lambda c: None), Pick("zz"))])
    with pytest.raises(AccelOptError, match="plugin 'pick' answered accelopt_select_next with "
                       "str 'zz'; expected the job_id of a ready job of lane 'l'"):
        choose_next(bogus, "l", ready, 0.0)


def test_merge_rows_collapses_what_every_job_says():
    from accelopt.drivers.rows import merge_rows
    from accelopt.types import ReportRow

    same = "workers receive parameters in order"
    rows = [[ReportRow("t", same, {"job": "a"}), ReportRow("t", same, {"job": "b"}),
             ReportRow("t", "planned", {"job": "b", "x": 1}), ReportRow("s", "decided")],
            [ReportRow("t", same, {"job": "a"}), ReportRow("s", "decided")]]
    merged = merge_rows(rows, ["a", "b"])
    assert [(r.plugin, r.summary) for r in merged] == [
        ("t", f"all jobs: {same}"), ("t", "job b: planned"), ("s", "decided")]
    assert merged[1].metrics == {"x": 1, "job": "b"}  # a program reading metrics.json
    assert merged[0].metrics == {"job": "a, b"}  # learns the jobs without parsing the text


def test_a_row_that_names_its_job_itself_is_named_once():
    """The clip example tags its rows with the job's name and starts them with it: a cluster
    run's summary read 'job tiny-mlp: tiny-mlp: clipped ...'."""
    from accelopt.drivers.rows import merge_rows
    from accelopt.types import ReportRow

    rows = [[ReportRow("c", "a: clipped 2", {"job": "a"}), ReportRow("c", "b: clipped 0",
                                                                      {"job": "b"})]]
    merged = merge_rows(rows, ["a", "b"], ["00-a", "01-b"])
    assert [r.summary for r in merged] == ["job a: clipped 2", "job b: clipped 0"]


def test_merge_rows_accepts_job_ids_from_run_level_plugins():
    # rows merge_rows is given tagged with a job's id (not the core's tag: a run passes only
    # job-scoped plugins' rows) still name the job, and an unknown tag does not break it
    from accelopt.drivers.rows import merge_rows
    from accelopt.types import ReportRow

    rows = [[ReportRow("g", "pruned", {"job": "01-b"}), ReportRow("g", "pruned", {"job": "00-a"}),
             ReportRow("o", "moved", {"job": "01-b"}), ReportRow("o", "odd", {"job": "zz"})]]
    merged = merge_rows(rows, ["a", "b"], ["00-a", "01-b"])
    assert [r.summary for r in merged] == ["all jobs: pruned", "job b: moved", "job zz: odd"]


def test_run_level_rows_come_from_one_worker_and_per_job_rows_from_every_rank():
    from accelopt.drivers.rows import merge_rows, of_plugins, representative_rows
    from accelopt.types import INERT, ReportRow

    server = [ReportRow("g", "00-a: nothing to do", {"job": "00-a", INERT: 1}),
              ReportRow("s", "decided"), ReportRow("t", "planned", {"job": "a"})]
    worker1 = [ReportRow("g", "00-a: pruned; 1.2x", {"job": "00-a"}),
               ReportRow("t", "received in order", {"job": "a"})]
    worker2 = [ReportRow("g", "00-a: pruned; 1.1x", {"job": "00-a"})]
    kept = representative_rows([server, worker1, worker2], ["server", "worker", "worker"],
                               of_plugins(["t"]))
    merged = merge_rows(kept, ["a", "b"], ["00-a", "01-b"], only=of_plugins(["t"]))
    # worker 2 measured another figure: the row kept says it is one worker's; g is
    # run-scoped, so its row stays as it returned it (as in a one-process run)
    ones = "00-a: pruned; 1.2x (rank 1's; other workers' rows differ)"
    assert [(r.plugin, r.summary) for r in merged] == [
        ("s", "decided"), ("t", "job a: planned"), ("g", ones),
        ("t", "job a: received in order")]
    assert merged[2].metrics["rank"] == 1
    # a run of one job needs no "job a:" prefix
    alone = merge_rows(kept, ["a"], ["00-a"], only=of_plugins(["t"]))
    assert [r.summary for r in alone] == ["decided", "planned", ones, "received in order"]
    # workers that agree: their row is the job's, and says nothing more
    worker2[0] = ReportRow("g", "00-a: pruned; 1.2x", {"job": "00-a"})
    kept = representative_rows([server, worker1, worker2], ["server", "worker", "worker"],
                               of_plugins(["t"]))
    assert [r.summary for r in merge_rows(kept, ["a"], ["00-a"])][2] == "pruned; 1.2x"


def test_a_servers_differing_row_and_a_silent_worker_are_not_read_as_agreement():
    """A server's row saying the plugin FAILED beside workers' "applied fine" showed only
    "applied fine": only other workers were compared, and a worker that reported nothing
    counted as agreeing. A server's row that only says it had nothing to do (INERT) is no
    disagreement, and a plugin reporting on one rank alone (salus) is not flagged."""
    from accelopt.drivers.rows import representative_rows
    from accelopt.types import INERT, ReportRow

    def kept(*ranks: list[ReportRow]) -> list[str]:
        roles = ["server"] + ["worker"] * (len(ranks) - 1)
        return [r.summary for rows in representative_rows(list(ranks), roles, lambda r: False)
                for r in rows]

    failed, fine = [ReportRow("p", "FAILED to apply")], [ReportRow("p", "applied fine")]
    assert kept(failed, fine, fine) == ["applied fine (rank 1's; other ranks' rows differ)"]
    assert kept(failed, fine, []) == [
        "applied fine (rank 1's; other ranks' rows differ; rank 2 reported nothing)"]
    assert kept([], fine, []) == ["applied fine (rank 1's; rank 2 reported nothing)"]
    idle = [ReportRow("p", "nothing to do", {INERT: 1})]
    assert kept(idle, fine, fine) == ["applied fine"]
    assert kept([ReportRow("p", "decided")], [], []) == ["decided"]
    # done where the optimizer steps (clip): two PS servers report, the workers take no step
    # and say nothing; that silence is no news ("ranks 2, 3 reported nothing" said it was)
    clipped = [ReportRow("p", "clipped 3")]
    roles = ["server", "server", "worker", "worker"]
    rows = representative_rows([clipped, clipped, [], []], roles, lambda r: False)
    assert [r.summary for ranks in rows for r in ranks] == ["clipped 3"]


def test_scope_is_declared_one_instance_per_job_or_per_run():
    """PluginSpec.scope: a job-scoped plugin gets one instance per job (each configured), a
    run-scoped one a single instance; a job-scoped plugin cannot decide across jobs."""
    from accelopt.activation import PluginSet
    from accelopt.errors import UserError
    from accelopt.hookspecs import hookimpl
    from accelopt.plugin import PluginSpec

    class Sender:
        @hookimpl
        def accelopt_transfer_done(self, record, start_s, end_s):
            return None

    class Reporter:
        @hookimpl
        def accelopt_report_rows(self, run):
            return []

    class Chooser:
        @hookimpl
        def accelopt_select_next(self, lane, ready, now_s):
            return None

    run_scoped = PluginSpec(name="reporter", factory=lambda c: Reporter())
    job_scoped = PluginSpec(name="sender", factory=lambda c: Sender(), scope="job")
    plugins = PluginSet([run_scoped, job_scoped], make_cfg())
    a, b = plugins.for_job("00-a"), plugins.for_job("01-b")
    assert a.names == b.names == ("reporter", "sender")
    assert a.instances["reporter"] is b.instances["reporter"]
    assert a.instances["sender"] is not b.instances["sender"]
    assert plugins.job_scoped == ["sender"] and plugins.run.names == ("reporter",)
    wrong = PluginSpec(name="chooser", factory=lambda c: Chooser(), scope="job")
    with pytest.raises(UserError, match="scope='job'.*accelopt_select_next"):
        PluginSet([wrong], make_cfg()).for_job("00-a")
    with pytest.raises(ValueError, match="scope must be one of run, job"):
        PluginSpec(name="x", factory=lambda c: None, scope="rank")


def test_a_job_whose_code_raises_on_a_rank_is_named_and_keeps_its_cause(tmp_path):
    """Rank 1's copy of the first job's model raises at its third forward. The run stops
    (every rank runs every job's iterations), and its line said "at iteration 2" without
    saying whose: it names the job now, and metrics.json gives that job the cause, as a
    one-process run does, and the job that never ran the run's stop."""
    import accelopt
    from accelopt.errors import RankFailed

    with pytest.raises(RankFailed) as info:
        accelopt.run(["workload=tiny", "cluster.mode=ps", "cluster.timeout_s=20",
                      "workload.jobs.0.model=cluster_models:raises_on_rank",
                      "workload.jobs.0.dataset=synthetic_vectors", "run.progress=false"],
                     run_dir=tmp_path / "run")
    error = info.value
    assert str(error).endswith("raised RuntimeError: boom on rank 1 at iteration 2 of job "
                               "'tiny-mlp'; the cluster run was stopped"), str(error)
    assert error.rank == 1 and error.job_id == "00-tiny-mlp"
    jobs = {j["name"]: j for j in
            json.loads((tmp_path / "run" / "metrics.json").read_text())["jobs"]}
    assert jobs["tiny-mlp"]["status"] == "failed"
    assert jobs["tiny-mlp"]["error"] == "RuntimeError: boom on rank 1 (rank 1, iteration 2)"
    assert jobs["tiny-cnn"]["status"] == "failed"
    assert jobs["tiny-cnn"]["error"] == f"the run stopped: {error}"
