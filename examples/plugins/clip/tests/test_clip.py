"""The clipping example in every mode: inert when the bound is never reached (bitwise), active
when it is, and conformant."""

from __future__ import annotations

import pytest

accelopt_clip = pytest.importorskip(
    "accelopt_clip", reason="the example is not installed: pip install -e examples/plugins/clip")

from accelopt.testing import PluginConformance, run_workload  # noqa: E402

PLUGIN = accelopt_clip.PLUGIN
MODES = ("none", "ps", "allreduce")
ONE_JOB = ["workload.jobs=[{name: m, model: mlp, width: 16, batch_size: 8, iterations: 3, "
           "seed: 1}]", "cluster.timeout_s=30"]
pytestmark = pytest.mark.timeout(180)


def mode_overrides(mode: str) -> list[str]:
    return [*ONE_JOB, *([f"cluster.mode={mode}"] if mode != "none" else [])]


def losses(record) -> list[float]:
    (job,) = record.jobs
    assert job.status == "done", job.error
    return job.losses


@pytest.mark.parametrize("mode", MODES)
def test_inert_under_a_huge_bound_and_clipping_under_a_tiny_one(tmp_path, mode):
    """A bound never reached leaves training bit for bit as without the plugin; a bound
    always reached clips every step and changes the losses from the second step on."""
    plain = run_workload([], mode_overrides(mode), tmp_path=tmp_path)
    huge = run_workload([PLUGIN], [*mode_overrides(mode), "plugins.clip.max_norm=1e9"],
                        tmp_path=tmp_path)
    assert losses(huge) == losses(plain)
    (row,) = [r for r in huge.plugin_rows if r.plugin == "clip"]
    assert row.metrics["clipped"] == 0 and row.metrics["steps"] == 3
    tiny = run_workload([PLUGIN], [*mode_overrides(mode), "plugins.clip.max_norm=1e-4"],
                        tmp_path=tmp_path)
    assert losses(tiny)[0] == losses(plain)[0]  # the first step's loss comes before any clip
    assert losses(tiny)[1:] != losses(plain)[1:]
    (row,) = [r for r in tiny.plugin_rows if r.plugin == "clip"]
    assert row.metrics["clipped"] == 3


def test_bad_settings_are_one_line(tmp_path):
    from accelopt.errors import UserError

    with pytest.raises(UserError, match="plugins.clip.max_norm must be > 0"):
        run_workload([PLUGIN], ["plugins.clip.max_norm=0"], tmp_path=tmp_path)


class TestClipConformance(PluginConformance):
    spec = PLUGIN
    modes = MODES
    overrides = ONE_JOB
