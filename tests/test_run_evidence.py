"""What a run leaves in its directory: its timeline on one clock from 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from accelopt.testing import run_workload

pytestmark = pytest.mark.timeout(120)


def test_hook_calls_before_the_clock_leave_the_trace_and_chart_at_time_0(tmp_path: Path):
    """accelopt_run_start fires before the jobs' profiling and the clock: trace.json began
    at -3.4 s and the timeline's axis gave the run 5% of the chart."""
    from accelopt.runtime.run import SET_UP_TRACK

    record = run_workload(["noop"], ["cluster.mode=none", "run.compare=none"],
                          tmp_path=tmp_path)
    assert min(s.start_s for s in record.spans) >= 0
    (start,) = [s for s in record.spans if s.name == "accelopt_run_start"]
    assert start.track == SET_UP_TRACK and start.start_s == 0.0
    assert start.args["before_clock_s"] > 0  # when it really began, kept
    (run_dir,) = [p for p in tmp_path.iterdir() if (p / "trace.json").is_file()]
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    assert min(e["ts"] for e in events if "ts" in e) >= 0
    assert any(e.get("ph") == "X" and e["name"] == "tiny-mlp iteration 0" for e in events)


def test_a_stopped_cluster_runs_iterations_are_those_every_worker_finished(tmp_path, monkeypatch):
    """SIGTERM on a ps run: metrics.json said 158 iterations (and 158 x batch samples), the
    parameter server's progress, where its losses and trace held the 153 both workers had
    finished."""
    import accelopt.drivers.cluster as cluster
    from accelopt.drivers.cluster.rank import RankSoFar
    from accelopt.errors import Terminated
    from accelopt.testing import run_workload

    def records(n: int) -> dict[str, list[dict[str, float]]]:
        return {"00-mlp": [{"iteration": i, "start_s": i * 0.01, "end_s": i * 0.01 + 0.005,
                            "loss": 1.0 / (i + 1), "samples": 16} for i in range(n)]}

    def stopped(cfg, **_kwargs):
        exc = Terminated()
        exc.ended = {"00-mlp": {"status": "running", "current": True, "iterations": 0,
                                "train_t0": 1.0}}
        exc.reached = 158  # the leader (the server, rank 0) was in iteration 158
        exc.so_far = [RankSoFar(0, {}, {"00-mlp": []}, []),
                      RankSoFar(1, {}, records(153), []), RankSoFar(2, {}, records(154), [])]
        raise exc

    monkeypatch.setattr(cluster, "run_cluster", stopped)
    with pytest.raises(Terminated):
        run_workload([], ["workload.jobs.0.iterations=2000", "workload.jobs.0.batch_size=32",
                          "cluster.mode=ps", "cluster.workers=2", "cluster.servers=1",
                          "run.compare=none"], tmp_path=tmp_path, workload="single")
    (run_dir,) = [p for p in tmp_path.iterdir() if (p / "metrics.json").is_file()]
    (job,) = json.loads((run_dir / "metrics.json").read_text())["jobs"]
    assert (job["iterations"], len(job["losses"]), job["samples"]) == (153, 153, 153 * 32)
