"""A one-process run stopped (Ctrl-C) once its jobs had ended, while its outputs were being
made but before ``metrics.json`` was written: the run left its jobs' weights and no result
at all, since a stop once the writing had begun was left to that writing. Its results are
now written as for a stop just before (``runtime/run.py``: ``_keep_finished``)."""

from __future__ import annotations

import json

import pytest
from clirun import run_in_process

pytestmark = pytest.mark.timeout(120)


def test_a_stop_before_metrics_json_is_written_still_writes_the_results(tmp_path,
                                                                       monkeypatch):
    import accelopt.runtime.run as run_module

    real = run_module.write_run_outputs
    calls = []

    def stopped_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the writing has begun: the summary is made, no file yet
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(run_module, "write_run_outputs", stopped_first)
    run_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_in_process("workload=tiny", "cluster.mode=none", "run.compare=none",
                       "run.progress=false", run_dir=run_dir)
    document = json.loads((run_dir / "metrics.json").read_text())
    assert [job["status"] for job in document["jobs"]] == ["done", "done"]
    assert "interrupted" in document["summary"]["error"], document["summary"]["error"]
    assert (run_dir / "weights").is_dir()
