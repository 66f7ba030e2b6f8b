"""The clipping example in every mode: inert when the bound is never reached (bitwise), active
when it is, and conformant."""

from __future__ import annotations

import pytest

accelopt_clip = pytest.importorskip(
    "accelopt_clip", reason="the example is not installed: pip install -e examples/plugins/clip")

from accelopt.testing import PluginConformance, run_workload  # noqa: E402
from accelopt.types import INERT  # noqa: E402

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
    """A bound never reached leaves training bit for bit as without the plugin, and its row
    says so (inert: run.compare must not credit it with noise); a bound always reached clips
    every step and changes the losses from the second step on, and its row is not inert."""
    plain = run_workload([], mode_overrides(mode), tmp_path=tmp_path)
    huge = run_workload([PLUGIN], [*mode_overrides(mode), "plugins.clip.max_norm=1e9"],
                        tmp_path=tmp_path)
    assert losses(huge) == losses(plain)
    (row,) = [r for r in huge.plugin_rows if r.plugin == "clip"]
    assert row.metrics["clipped"] == 0 and row.metrics["steps"] == 3
    assert row.metrics.get(INERT) == 1
    tiny = run_workload([PLUGIN], [*mode_overrides(mode), "plugins.clip.max_norm=1e-4"],
                        tmp_path=tmp_path)
    assert losses(tiny)[0] == losses(plain)[0]  # the first step's loss comes before any clip
    assert losses(tiny)[1:] != losses(plain)[1:]
    (row,) = [r for r in tiny.plugin_rows if r.plugin == "clip"]
    assert row.metrics["clipped"] == 3
    assert INERT not in row.metrics


class FakeGradients:
    """A job's gradients of a given norm, for the plugin's bookkeeping alone."""

    def __init__(self, norm: float) -> None:
        self.norm, self.skipped = norm, ""

    def clip_norm_(self, max_norm: float, p: float = 2.0) -> float:
        return self.norm

    def skip(self, reason: str) -> None:
        self.skipped = reason


@pytest.mark.parametrize("norms, inert", [
    ((0.5, 0.9), True),                  # never over the bound: changed nothing
    ((0.5, 2.0), False),                 # one step clipped
    ((0.5, float("nan")), False),        # one step skipped: that changes training too
])
def test_a_row_is_inert_exactly_when_no_step_was_clipped_or_skipped(norms, inert):
    from types import SimpleNamespace

    plugin = accelopt_clip.ClipPlugin(accelopt_clip.ClipConfig(max_norm=1.0))
    context = SimpleNamespace(job=SimpleNamespace(name="m"))
    for norm in norms:
        plugin.accelopt_before_optimizer_step(context=context, gradients=FakeGradients(norm))
    (row,) = plugin.accelopt_report_rows(run=SimpleNamespace(role="single"))
    assert (row.metrics.get(INERT) == 1) is inert


def test_a_rank_without_optimizer_steps_says_it_changed_nothing():
    from types import SimpleNamespace

    plugin = accelopt_clip.ClipPlugin(accelopt_clip.ClipConfig())
    assert plugin.accelopt_report_rows(run=SimpleNamespace(role="worker")) == []
    (row,) = plugin.accelopt_report_rows(run=SimpleNamespace(role="server"))
    assert row.metrics.get(INERT) == 1


def test_bad_settings_are_one_line(tmp_path):
    from accelopt.errors import UserError

    with pytest.raises(UserError, match="plugins.clip.max_norm must be > 0"):
        run_workload([PLUGIN], ["plugins.clip.max_norm=0"], tmp_path=tmp_path)


class TestClipConformance(PluginConformance):
    spec = PLUGIN
    modes = MODES
    overrides = ONE_JOB
