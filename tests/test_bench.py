"""`accelopt bench`: gains, interaction effects, and a real (tiny) interleaved sweep."""

from __future__ import annotations

import json
import math

import pytest
from clirun import accelopt

from accelopt.bench.analysis import SetResult, classify, summarize


def test_gain_orientation_and_interaction():
    results = [
        SetResult((), (10.0, 10.0, 10.0)),
        SetResult(("a",), (5.0, 5.0, 5.0)),        # 2x better (lower is better)
        SetResult(("b",), (8.0, 8.0, 8.0)),        # 1.25x
        SetResult(("a", "b"), (4.0, 4.0, 4.0)),    # 2.5x = 2 * 1.25: independent
    ]
    by = {s.label: s for s in summarize(results, "avg_jct_s")}
    assert by["baseline"].gain == 1.0
    assert by["a"].gain == 2.0 and by["b"].gain == 1.25
    assert by["a+b"].expected_gain == 2.5
    assert math.isclose(by["a+b"].interaction, 1.0)
    assert by["a+b"].verdict.startswith("independent")
    higher = {s.label: s for s in summarize(results, "iterations_per_s")}
    assert higher["a"].gain == 0.5  # for a throughput, a lower value is worse


def test_classify():
    assert classify(1.2) == "synergistic"
    assert classify(0.8) == "interfering"
    assert classify(1.01).startswith("independent")


def test_baseline_required():
    with pytest.raises(ValueError, match="baseline"):
        summarize([SetResult(("a",), (1.0,))], "duration_s")


@pytest.mark.timeout(240)
def test_bench_runs_an_interleaved_sweep(tmp_path):
    out = tmp_path / "bench"
    result = accelopt("bench", "--plugins", "noop", "--repeats", "2", "--metric", "avg_jct_s",
                      "--out", str(out), "workload=tiny", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "bench.json").read_text())
    labels = [s["label"] for s in report["sets"]]
    assert sorted(labels) == ["baseline", "noop"]
    assert all(s["n"] == 2 for s in report["sets"])  # warm-up runs are not counted
    assert len(list((out / "runs").glob("*/metrics.json"))) == 2 * 3
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| baseline |" in (out / "bench.md").read_text()


def test_bench_unknown_metric_is_one_line(tmp_path):
    result = accelopt("bench", "--plugins", "noop", "--repeats", "1", "--metric", "nope",
                      "--out", str(tmp_path / "b"), "workload=tiny", cwd=tmp_path)
    assert result.returncode == 2
    assert "metric 'nope' is not in" in result.stderr and "avg_jct_s" in result.stderr
