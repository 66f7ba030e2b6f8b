"""The local executor's lanes and admission, and the run-level figures, on real runs."""

from __future__ import annotations

import pytest
from accelopt_plugins.salus import PLUGIN

pytestmark = pytest.mark.timeout(120)

FOUR = "workload.jobs=[" + ",".join(
    f"{{name:{name},model:mlp,batch_size:16,iterations:{n},width:32,seed:{seed},evaluate:false}}"
    for seed, (name, n) in enumerate((("a", 30), ("b", 10), ("c", 5), ("d", 20)), 1)
) + "]"
ONE = "workload.jobs=[{name:a,model:mlp,batch_size:16,iterations:1,width:32,evaluate:false}]"
"""The jobs' model alone, once: its profile (the same for each of them) sizes the capacity."""
SERIAL = ["plugins.salus.threads=1", "run.threads=1"]


def _runs(spans: list) -> list[tuple[str, int]]:
    """Iteration spans in the order they ran, as (job, consecutive iterations): what an
    assertion shows when the order is wrong."""
    runs: list[list] = []
    for span in spans:
        name = span.name.split()[0]
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return [(name, count) for name, count in runs]


def test_a_job_waiting_for_memory_is_chosen_from_as_soon_as_a_job_ends(run_tiny):
    """Room for two resident jobs, srtf: when b (10 iterations) ends, c (5) is admitted into
    its memory before the lane chooses again, so c runs next, not a (30) for one more
    iteration first; d (20) is admitted likewise when the next job ends."""
    probe = run_tiny(PLUGIN, overrides=[*SERIAL, "plugins.salus.capacity=1GiB", ONE])
    profile = probe.jobs[0].job.profile
    need = 1.05 * (1.1 * profile.persistent_bytes + profile.ephemeral_bytes)
    record = run_tiny(PLUGIN, overrides=[*SERIAL, f"plugins.salus.capacity={int(need * 2.5)}",
                                         "plugins.salus.policy=srtf", FOUR])
    assert [r.status for r in record.jobs] == ["done"] * 4
    jobs = {r.job.name: r for r in record.jobs}
    spans = sorted((s for s in record.spans if s.category == "iteration"),
                   key=lambda s: s.start_s)
    after_b = [s.name.split()[0] for s in spans if s.start_s >= jobs["b"].end_s]
    assert after_b[0] == "c", _runs(spans)  # not one more iteration of a first
    starts = [s.start_s for s in spans]
    for waiting in (jobs["c"], jobs["d"]):  # each admitted before any iteration after the
        freed = max((r.end_s for r in record.jobs  # departure that made room for it
                     if r.end_s is not None and r.end_s <= waiting.admitted_s), default=None)
        assert freed is not None, waiting
        early = [t for t in starts if freed <= t < waiting.admitted_s]
        assert not early, (waiting.job.name, freed, waiting.admitted_s, early)


def test_a_rejection_names_the_part_of_the_memory_that_is_most_of_the_need(run_tiny):
    """A job whose need is nearly all weights is told to shrink its model, not its batch (a
    smaller batch barely helps); one whose need is mostly activations, its batch_size."""
    jobs = ("workload.jobs=[{name:wide,model:mlp,batch_size:1,iterations:1,width:512,"
            "evaluate:false},{name:conv,model:cnn,batch_size:64,iterations:1,width:4,"
            "evaluate:false}]")
    record = run_tiny(overrides=["run.threads=1", "run.memory_capacity=1KiB", jobs])
    by = {r.job.name: r for r in record.jobs}
    assert [r.status for r in record.jobs] == ["rejected", "rejected"]
    wide, conv = by["wide"].job.profile, by["conv"].job.profile
    assert wide.persistent_bytes > wide.ephemeral_bytes  # the cases the test is about
    assert conv.ephemeral_bytes > conv.persistent_bytes
    assert "batch_size" not in by["wide"].error
    assert "make its model smaller (its width, or the size its model_kwargs give)" in (
        by["wide"].error)
    assert "lower its batch_size or raise run.memory_capacity" in by["conv"].error
    for r in record.jobs:
        assert "too much" in r.error and "\n" not in r.error


def test_avg_queueing_is_over_the_jobs_avg_jct_is_over() -> None:
    """Both averages over the finished jobs: a failed job's wait (here 1.0 s, the finished
    jobs' 0.5 s and 1.0 s) is in neither."""
    from test_report import make_record

    from accelopt.report.metrics import run_metrics

    record = make_record()
    summary = run_metrics(record)
    done = [j for j in record.jobs if j.status == "done"]
    assert len(done) == 2 and any(j.status == "failed" and j.queueing_s is not None
                                  for j in record.jobs)
    assert summary["avg_jct_s"] == pytest.approx(sum(j.jct_s for j in done) / 2)
    assert summary["avg_queueing_s"] == pytest.approx((0.5 + 1.0) / 2)
