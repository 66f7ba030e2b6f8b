"""How a cluster run stopped under torchrun (Ctrl-C, SIGTERM, a lost peer, a rank's error)
is told and kept, and the torchrun launch that has no cluster to run."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest
from clirun import cli_env
from test_cluster import make_cfg
from test_cluster_torchrun import _free_port

from accelopt.config import JobConfig
from accelopt.drivers.cluster import faults, launch
from accelopt.errors import ConfigError, RankFailed, Terminated
from accelopt.job import job_id_for
from accelopt.plugin import Registry
from accelopt.report.console import default_console
from accelopt.runtime import run

pytestmark = pytest.mark.timeout(240)


def _two_jobs(mode: str = "allreduce"):
    """Job 'a' (5 iterations) then job 'b' (100), each a global batch of 16."""
    from omegaconf import OmegaConf

    cfg = make_cfg(mode, timeout_s=1)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name=name, model="mlp", width=32, batch_size=16, iterations=iterations, seed=0))
        for name, iterations in (("a", 5), ("b", 100))]
    return cfg


def _as_torchrun_rank(monkeypatch, rank: int, world: int) -> None:
    for key, value in {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def sigterm_kept():
    """A torchrun rank that stopped ignores SIGTERM from then on: restored after the test."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def _execute_cluster(cfg, run_dir):
    return run._execute_cluster(cfg, run_dir, Registry(), default_console(), {}, None, [])


def test_a_ctrl_c_under_torchrun_keeps_the_jobs_that_ended_and_the_iteration_reached(
        tmp_path, monkeypatch, sigterm_kept):
    """Ctrl-C of a torchrun run failed every job at iteration 0 in metrics.json, one that
    had finished all its iterations included (SIGTERM kept them)."""
    cfg = _two_jobs()
    a, b = (job_id_for(i, s) for i, s in enumerate(run.job_specs(cfg)))

    def leader_then_ctrl_c(*args, progress, **kwargs):
        faults.record_ended(progress.path.parent, {
            a: {"status": "done", "error": "", "iterations": 5, "jct_s": 1.0,
                "queueing_s": 0.0, "service_s": 1.0, "samples": 80},
            b: {"status": "running", "current": True, "iterations": 80, "queueing_s": 1.0,
                "service_s": 8.0, "carried_service_s": 0.0}})
        progress.set(84, b, "b")
        raise KeyboardInterrupt

    _as_torchrun_rank(monkeypatch, 0, 2)
    monkeypatch.setattr(launch, "run_rank", leader_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt) as raised:
        _execute_cluster(cfg, tmp_path)
    assert type(raised.value) is KeyboardInterrupt  # still a Ctrl-C, not a rank's failure
    jobs = json.loads((tmp_path / "metrics.json").read_text())["jobs"]
    assert [(j["status"], j["iterations"], j["samples"]) for j in jobs] == [
        ("done", 5, 80), ("failed", 84, 84 * 16)]
    assert jobs[1]["first_start_s"] is not None
    assert "interrupted (Ctrl-C)" in jobs[1]["error"]
    assert jobs[1]["quality_note"] == "the job did not finish (the run stopped)"


def test_a_rank_stopped_under_torchrun_names_its_job(monkeypatch):
    """A SIGTERM's and a lost peer's lines named the iteration only: whose, when several
    jobs share the ranks, was not said (a raise in the job's code did say it)."""
    at = faults.At(84, "01-b", "b")
    terminated = faults.torchrun_failure(Terminated(), rank=0, world=2, role="server", at=at)
    assert "was terminated (SIGTERM) at iteration 84 of job 'b';" in str(terminated)

    monkeypatch.setattr(faults, "_default_store", lambda: object())  # in the process group
    monkeypatch.setattr(faults, "peer_failure", lambda *a: None)  # the peer left no note
    lost = faults.torchrun_failure(RuntimeError("Connection closed by peer"), rank=0, world=2,
                                   role="worker", at=faults.At(39, "01-b", "b"))
    assert isinstance(lost, RankFailed)
    assert "lost its peers at iteration 39 of job 'b' (" in str(lost)


def test_a_cluster_job_failed_by_a_ranks_error_says_why_it_has_no_score(tmp_path, monkeypatch):
    """One process gives a failed job "the job did not finish (failed)"; a cluster run
    stopped by a rank's error left its quality_note empty."""
    import accelopt.drivers.cluster as cluster

    cfg = _two_jobs()
    a = job_id_for(0, run.job_specs(cfg)[0])

    def rank_raises(*args, **kwargs):
        raise RankFailed("rank 1 (worker, pid 1) raised RuntimeError: boom at iteration 2 of "
                         "job 'a'; the cluster run was stopped", rank=1, pid=1, iteration=2,
                         cause="RuntimeError: boom", exit_code=3, job_id=a)

    monkeypatch.setattr(cluster, "run_cluster", rank_raises)
    with pytest.raises(RankFailed):
        _execute_cluster(cfg, tmp_path)
    jobs = json.loads((tmp_path / "metrics.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["failed", "failed"]
    assert [j["quality_note"] for j in jobs] == [  # as one process says them
        "the job did not finish (failed)", "the job did not finish (the run stopped)"]


def test_no_cluster_under_a_torchrun_of_several_processes_is_refused(tmp_path, monkeypatch):
    cfg = _two_jobs("none")
    _as_torchrun_rank(monkeypatch, 0, 2)
    with pytest.raises(ConfigError, match="set cluster.mode=ps or cluster.mode=allreduce") as info:
        run.execute(cfg, run_dir=tmp_path / "run", registry=Registry(),
                    console=default_console(), overrides=[])
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()  # nothing written, nothing claimed
    _as_torchrun_rank(monkeypatch, 0, 1)  # one process is a plain run
    run.refuse_torchrun_without_cluster(cfg)


def test_torchrun_without_a_cluster_is_one_line_before_anything_trains(tmp_path):
    """Each torchrun process ran the whole workload into the one run directory, the last
    writer's files winning, and the command exited 0."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "accelopt.cli.main", "run", "workload=single", "workload.jobs.0.iterations=3",
           "cluster.timeout_s=30", "run.compare=none", "run.progress=false",
           f"hydra.run.dir={run_dir}"]
    env = {**cli_env(), "TMPDIR": str(tmp_path)}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=200)
    assert result.returncode != 0
    line = ("error: cluster.mode=none under torchrun: each of its 2 processes would run every "
            "job on its own, into the same run directory; set cluster.mode=ps or "
            "cluster.mode=allreduce")
    assert result.stderr.count(line) == 2, result.stderr[-2000:]  # each rank says it
    # torchrun's own ChildFailedError traceback follows; none through accelopt's code
    assert not re.search(r'File ".*/accelopt/', result.stderr), result.stderr[-2000:]
    assert "Run:" not in result.stdout
    assert not (run_dir / "metrics.json").exists()
