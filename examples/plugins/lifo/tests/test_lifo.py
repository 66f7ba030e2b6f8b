"""The LIFO policy reaches salus through its extension point: in one process, in the
reference runs of run.compare=each and in the rank processes of a cluster run."""

from __future__ import annotations

import pytest

accelopt_lifo = pytest.importorskip(
    "accelopt_lifo", reason="the example is not installed: pip install -e examples/plugins/lifo")

from accelopt import extension_point  # noqa: E402
from accelopt.errors import UserError  # noqa: E402
from accelopt.testing import run_workload  # noqa: E402

GROUP = "accelopt_salus.policies"
pytestmark = pytest.mark.timeout(180)
BOTH_READY = ["workload.jobs.1.arrival_s=0.0", "workload.jobs.0.arrival_s=0.0",
              "plugins.salus.threads=1", "run.threads=1"]


def order(record) -> list[str]:
    spans = sorted((s for s in record.spans if s.category == "iteration"),
                   key=lambda s: s.start_s)
    return [s.args["job"] for s in spans]


def test_the_installed_policy_is_found_by_name():
    assert "lifo" in extension_point(GROUP).names()
    assert extension_point(GROUP).get("lifo") is accelopt_lifo.Lifo


def test_salus_runs_it_newest_first(tmp_path):
    record = run_workload(["salus"], ["plugins.salus.policy=lifo", *BOTH_READY],
                          tmp_path=tmp_path)
    assert [j.status for j in record.jobs] == ["done", "done"]
    # both ready at 0: ties go to the larger job id, the second job (tiny-cnn) first
    first = order(record)
    assert first[:4] == ["tiny-cnn"] * 4 and first[4:] == ["tiny-mlp"] * 6


def test_reference_runs_of_compare_each_find_it(tmp_path):
    record = run_workload(["salus", "noop"],
                          ["plugins.salus.policy=lifo", "run.compare=each", *BOTH_READY],
                          tmp_path=tmp_path)
    assert [j.status for j in record.jobs] == ["done", "done"]
    assert "compare.salus.avg_jct_s" in record.metrics  # the salus-alone reference ran


def test_every_rank_of_a_cluster_run_finds_it(tmp_path):
    record = run_workload(["salus"], ["plugins.salus.policy=lifo", *BOTH_READY,
                                      "cluster.mode=ps", "cluster.timeout_s=30"],
                          tmp_path=tmp_path)
    assert [j.status for j in record.jobs] == ["done", "done"]
    (row,) = [r for r in record.plugin_rows if r.plugin == "salus"]
    assert row.summary.startswith("policy lifo:")


def test_another_class_under_its_name_is_refused():
    class Impostor:
        def select(self, lane, ready, now_s):
            return ready[0].job.job_id

    point = extension_point(GROUP)
    point.register("lifo", Impostor)  # refused where the name is used, naming both
    try:
        with pytest.raises(UserError, match="'lifo' is installed by accelopt-lifo"):
            point.get("lifo")
    finally:
        point.unregister("lifo")  # the installed policy again, for the other tests
    assert point.get("lifo") is accelopt_lifo.Lifo


def test_accelopt_bench_sets_find_it(tmp_path, monkeypatch):
    """``accelopt bench`` runs its sets in a process of its own: the installed entry point is
    found there too. The bench itself runs in this process (its sweep is that process of its
    own either way); the runs' held-out evaluation is not what is tested."""
    import json

    from accelopt.bench.runner import bench_command

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "bench"
    assert bench_command(["--plugins", "salus", "--repeats", "1", "--no-eval", "--metric",
                          "avg_jct_s", "--out", str(out), "workload=tiny",
                          "plugins.salus.policy=lifo", "plugins.salus.capacity=1GiB"]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert sorted(s["label"] for s in report["sets"]) == ["baseline", "salus"]
    salus_runs = [p for p in (out / "runs").glob("*/metrics.json")
                  if "salus" in json.loads(p.read_text())["run"]["plugins"]]
    assert salus_runs
    rows = json.loads(salus_runs[0].read_text())["plugins"]
    assert any(r["summary"].startswith("policy lifo:") for r in rows)
