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
    assert any(e.get("ph") == "X" and e["name"] == "tiny-mlp" for e in events)
