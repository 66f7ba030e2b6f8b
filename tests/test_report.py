"""Tests for accelopt.report: hand-built RunRecords, checked against hand-computed figures."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from rich.console import Console

from accelopt.atomic import atomic_open
from accelopt.records import JobResult, RunRecord, Span, TelemetrySample
from accelopt.report import (
    JobProgress,
    chrome_trace,
    job_metrics,
    load_metrics,
    plot_timeline,
    render_summary,
    run_metrics,
    write_run_outputs,
)
from accelopt.report.metrics import JOB_COLUMNS, percentile
from accelopt.types import JobInfo, JobProfile, ReportRow, RunInfo

MIB = 2**20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _job(job_id: str, name: str, arrival: float, profile: bool = True) -> JobInfo:
    prof = JobProfile(
        persistent_bytes=4 * MIB,
        peak_bytes=6 * MIB,
        ephemeral_bytes=2 * MIB,
        iteration_seconds=0.01,
        device="cpu",
        method="test",
    )
    return JobInfo(job_id, name, "mlp", "train", arrival, 10, 8, prof if profile else None)


def make_record(plugins: tuple[str, ...] = ("noop", "swap")) -> RunRecord:
    """Three jobs: two done (JCT 3.0 and 5.0), one failed with an error and no profile."""
    a = _job("j0", "mlp-a", 0.0)
    b = _job("j1", "mlp-b", 1.0)
    c = _job("j2", "mlp-c", 2.0, profile=False)
    jobs = [
        JobResult(a, "done", "default", "", 0.0, 0.5, 3.0, 10, 2.0, 80, 0.25, [0.5, 0.25]),
        JobResult(b, "done", "lane1", "", 1.0, 2.0, 6.0, 10, 4.0, 80, float("nan")),
        JobResult(c, "failed", "default", "out of memory [bold]x", 2.0, 3.0, None, 3, 0.5, 24),
    ]
    spans = [
        Span("iter 0", "lane default", 0.5, 1.5, args={"job": "mlp-a", "iteration": 0}),
        Span("iter 1", "lane default", 1.5, 3.0, args={"job": "mlp-a", "iteration": 1}),
        Span("iter 0", "lane lane1", 2.0, 6.0, args={"job": "mlp-b", "iteration": 0}),
        Span("swap", "hooks", 2.5, 2.6, category="hook", process="plugins"),
    ]
    telemetry = [TelemetrySample(t, "process", 50.0 + t, 100 * MIB) for t in (0.5, 1.0, 1.5)]
    info = RunInfo("runs/2024-01-01_test", "cpu", plugins, (a, b, c), 7)
    rows = [
        ReportRow("noop", "did nothing: no hooks implemented", {}),
        ReportRow("swap", "swapped 3 tensors", {"swapped": 3}),
    ]
    return RunRecord(
        info=info,
        duration_s=6.5,
        jobs=jobs,
        spans=spans,
        plugin_rows=rows if plugins else [],
        telemetry=telemetry,
        telemetry_note="no NVIDIA GPU found (NVML: test): sampling this process's CPU and RSS",
        metrics={"custom": 1},
    )


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 95) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([3.0, 5.0], 95) == pytest.approx(3.0 + 0.95 * 2.0)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0


def test_run_metrics_against_hand_values() -> None:
    s = run_metrics(make_record())
    assert (s["n_jobs"], s["n_done"], s["n_failed"]) == (3, 2, 1)
    assert s["avg_jct_s"] == pytest.approx(4.0)  # (3.0 + 5.0) / 2, failed job excluded
    assert s["p95_jct_s"] == pytest.approx(4.9)  # 3.0 + 0.95 * (5.0 - 3.0)
    assert s["makespan_s"] == pytest.approx(6.0)  # first arrival 0.0 to last end 6.0
    assert s["avg_queueing_s"] == pytest.approx((0.5 + 1.0) / 2)  # done jobs only, as avg_jct_s
    assert s["duration_s"] == 6.5
    assert s["custom"] == 1


def test_run_metrics_empty_record_gives_none() -> None:
    record = RunRecord(info=RunInfo("runs/empty", "cpu", (), (), 0))
    s = run_metrics(record)
    assert s["n_jobs"] == 0
    assert s["avg_jct_s"] is None and s["p95_jct_s"] is None and s["makespan_s"] is None


def test_job_metrics_fields_and_nan_cleaning() -> None:
    record = make_record()
    a, b, c = (job_metrics(j) for j in record.jobs)
    assert list(a) == list(JOB_COLUMNS)
    assert a["throughput"] == pytest.approx(40.0) and a["jct_s"] == 3.0
    assert a["persistent_bytes"] == 4 * MIB and a["iteration_seconds"] == 0.01
    assert b["final_loss"] is None  # NaN would make strict JSON readers fail
    assert c["jct_s"] is None and c["persistent_bytes"] is None and c["status"] == "failed"


def test_write_outputs_round_trip_and_no_temp_files(tmp_path: Path) -> None:
    record = make_record()
    paths = write_run_outputs(record, tmp_path)
    assert set(paths) == {"metrics.json", "metrics.csv", "trace.json", "timeline.png"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(paths)  # no .tmp left

    loaded = load_metrics(tmp_path)
    assert loaded["summary"]["avg_jct_s"] == pytest.approx(4.0)
    assert [j["name"] for j in loaded["jobs"]] == ["mlp-a", "mlp-b", "mlp-c"]
    assert loaded["run"] == {
        "run_dir": "runs/2024-01-01_test",
        "device": "cpu",
        "plugins": ["noop", "swap"],
        "seed": 7,
        "warnings": [],
    }
    assert [p["plugin"] for p in loaded["plugins"]] == ["noop", "swap"]
    assert len(loaded["telemetry"]["samples"]) == 3
    assert load_metrics(paths["metrics.json"]) == loaded

    with paths["metrics.csv"].open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 3
    assert list(rows[0]) == list(JOB_COLUMNS)
    assert rows[2]["jct_s"] == ""  # None stays empty, not "None"

    assert paths["timeline.png"].read_bytes()[:8] == PNG_MAGIC


def test_chrome_trace_is_valid_and_tracks_are_named(tmp_path: Path) -> None:
    record = make_record()
    write_run_outputs(record, tmp_path)
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace == chrome_trace(record)  # deterministic
    events = trace["traceEvents"]
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    processes = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 4
    for e in spans:
        assert e["ts"] >= 0 and e["dur"] >= 0
        assert (e["pid"], e["tid"]) in threads
    assert spans[0]["ts"] == 500_000 and spans[0]["dur"] == 1_000_000
    assert spans[0]["args"] == {"job": "j0", "name": "mlp-a", "iteration": 0}
    assert spans[3]["cat"] == "hook"
    assert sorted(threads.values()) == ["hooks", "lane default", "lane lane1"]
    assert set(processes.values()) == {"executor", "plugins", "telemetry"}
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == 6 and all("value" in e["args"] for e in counters)


def test_complete_events_of_one_thread_nest_as_viewers_require() -> None:
    """Transfers in flight together on one link overlapped on one thread; Perfetto drops
    complete events that overlap without nesting, and showed a fraction of a link's
    transfers. Overlapping ones go to sub-threads; nested ones and ones in turn stay."""
    record = RunRecord(info=RunInfo("runs/x", "cpu", (), (), 0), spans=[
        Span("w", "link 1->0", 0.0, 4.0, category="comm", process="rank 1"),
        Span("b", "link 1->0", 1.0, 5.0, category="comm", process="rank 1"),  # overlaps w
        Span("c", "link 1->0", 2.0, 3.0, category="comm", process="rank 1"),  # inside w
        Span("d", "link 1->0", 4.5, 6.0, category="comm", process="rank 1"),  # after w
        Span("e", "link 1->0", 5.5, 7.0, category="comm", process="rank 1"),  # overlaps d
    ])
    events = chrome_trace(record)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    thread = {e["name"]: names[e["tid"]] for e in events if e["ph"] == "X"}
    assert thread == {"w": "link 1->0", "b": "link 1->0 #2", "c": "link 1->0",
                      "d": "link 1->0", "e": "link 1->0 #2"}
    by_thread: dict[int, list[tuple[float, float]]] = {}
    for e in (e for e in events if e["ph"] == "X"):
        by_thread.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():  # every pair in one thread: apart, or one inside the other
        for (_, a1), (b0, b1) in ((x, y) for x in spans for y in spans if x < y):
            assert a1 <= b0 or b1 <= a1, spans


def test_plot_timeline_without_spans(tmp_path: Path) -> None:
    record = RunRecord(info=RunInfo("runs/empty", "cpu", (), (), 0))
    out = plot_timeline(record, tmp_path / "t.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert [p.name for p in tmp_path.iterdir()] == ["t.png"]


def test_load_metrics_rejects_malformed(tmp_path: Path) -> None:
    bad = tmp_path / "metrics.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not a metrics.json written by accelopt") as info:
        load_metrics(tmp_path)
    assert str(bad) in str(info.value) and "\n" not in str(info.value)

    bad.write_text(json.dumps({"run": {}}))
    with pytest.raises(ValueError, match="missing key"):
        load_metrics(tmp_path)
    with pytest.raises(ValueError, match="file not found"):
        load_metrics(tmp_path / "nowhere")


def _render(record: RunRecord) -> str:
    console = Console(record=True, width=100, force_terminal=False, color_system=None)
    render_summary(record, console)
    return console.export_text()


def test_summary_renders_jobs_plugins_and_errors() -> None:
    text = _render(make_record())
    for name in ("mlp-a", "mlp-b", "mlp-c"):
        assert name in text
    assert "did nothing: no hooks implemented" in text and "swapped 3 tensors" in text
    assert "out of memory [bold]x" in text  # error shown, markup escaped
    assert "avg JCT 4.00 s" in text and "p95 JCT 4.90 s" in text
    assert "no NVIDIA GPU found" in text
    assert "no plugins active" not in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_a_one_job_cluster_run_reports_its_wall_throughput() -> None:
    """One job's iterations may overlap (an early update), so one over the median iteration
    is no throughput there: the line gives the steady iterations over their wall time; a
    run without that figure gives one over the median iteration, labelled so."""
    cluster = {"cluster_mode": "ps", "cluster_backend": "gloo", "cluster_workers": 2,
               "iterations_per_s": 12.5, "mc_s": 0.01, "pc_s": 0.02}
    one = make_record()
    one.metrics = {**cluster, "wall_iterations_per_s": 9.75}
    text = " ".join(_render(one).split())
    assert "2 workers 9.75 it/s (wall)" in text and "12.5" not in text
    assert "it/s (wall): the iterations after the warm-up over their wall time" in text
    several = make_record()
    several.metrics = dict(cluster)
    text = " ".join(_render(several).split())
    assert "2 workers 12.50 it/s (1/median iteration)" in text and "(wall)" not in text


def test_summary_baseline_run_says_no_plugins() -> None:
    assert "no plugins active (baseline run)" in _render(make_record(plugins=()))


def test_job_progress_disabled_is_noop() -> None:
    console = Console(record=True, width=100, force_terminal=False)
    with JobProgress(console, enabled=True) as progress:  # not a terminal: disabled
        assert not progress.enabled
        progress.add_job("j0", "mlp-a", 10)
        progress.advance("j0")
        progress.finish("j0", "failed")
    assert console.export_text() == ""


def test_job_progress_enabled_marks_failed() -> None:
    console = Console(record=True, width=100, force_terminal=True, color_system=None)
    with JobProgress(console, enabled=True) as progress:
        progress.add_job("j0", "mlp-a", 4)
        progress.add_job("j1", "mlp-b", 4)
        progress.advance("j0", 4)
        progress.advance("j1")
        progress.advance("unknown")  # ignored, never raises
        progress.finish("j0", "done")
        progress.finish("j1", "failed")
    text = console.export_text()
    assert "4/4" in text and "1/4" in text
    assert "✗ mlp-b (failed)" in text


def test_interrupted_write_keeps_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "metrics.json"
    target.write_text("old")
    with pytest.raises(KeyboardInterrupt), atomic_open(target) as fh:
        fh.write("half a fi")
        raise KeyboardInterrupt
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_a_non_finite_span_argument_becomes_null_in_the_trace(tmp_path: Path) -> None:
    record = make_record()
    record.spans.append(Span("x", "hooks", 3.0, 3.1, category="hook",
                             args={"loss": float("inf")}))
    write_run_outputs(record, tmp_path)  # strict JSON: allow_nan=False would raise
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    (event,) = [e for e in events if e.get("name") == "x"]
    assert event["args"]["loss"] is None


def test_the_timeline_draws_sub_pixel_spans_as_one_bar_and_keeps_wide_ones_apart() -> None:
    from accelopt.report.timeline_png import _bars

    rows = [("executor", "t")]
    tiny = [Span(f"s{i}", "t", i * 0.001, i * 0.001 + 0.0008, args={"job": "a"})
            for i in range(100)]  # back to back, 0.8 ms each
    wide = [Span("w0", "t", 1.0, 2.0, args={"job": "a"}),
            Span("w1", "t", 2.0, 3.0, args={"job": "a"})]
    bars = _bars(tiny + wide, rows, pixel_s=0.01)[(0, "a")]
    assert bars[0] == (0.0, pytest.approx(0.0998))  # the hundred tiny spans: one bar
    assert bars[1:] == [(1.0, 1.0), (2.0, 1.0)]  # wide spans keep their own bars
    assert len(_bars(tiny, rows)[(0, "a")]) == 100  # no pixel size: every span as it is


def test_every_export_is_what_it_names_after_every_module_is_imported() -> None:
    """The package's exports load on first use; a submodule imported earlier under the same
    name (``chrome_trace``) must not take an export's place."""
    import importlib
    import pkgutil
    import types

    import accelopt.report as report

    for module in pkgutil.iter_modules(report.__path__):
        importlib.import_module(f"accelopt.report.{module.name}")
    for name in report.__all__:
        assert not isinstance(getattr(report, name), types.ModuleType), name
    assert callable(report.chrome_trace)


def test_finite_json_encodes_once_and_writes_non_finite_numbers_as_null() -> None:
    from accelopt.report.metrics import finite_json

    assert finite_json({"a": [1.5, float("nan")], "b": {"c": float("-inf")}}) == (
        '{"a": [1.5, null], "b": {"c": null}}')
    assert finite_json({"a": 1}, indent=2) == '{\n  "a": 1\n}'
    record = make_record()
    record.spans.append(Span("x", "hooks", 3.0, 3.1, args={"loss": float("nan")}))
    from accelopt.report import chrome_trace

    (event,) = [e for e in chrome_trace(record)["traceEvents"] if e.get("name") == "x"]
    assert event["args"]["loss"] is None  # the public export stays finite


def _two_jobs(hot_diverged: bool, hot_quality: float, ok_quality: float) -> RunRecord:
    """Two done jobs, ``hot`` diverged (unscored) or scored, ``ok`` scored."""
    from accelopt.records import Quality

    hot, ok = _job("j0", "hot", 0.0), _job("j1", "ok", 0.0)
    losses = [2.0, float("nan")] if hot_diverged else [2.0, 1.0]
    jobs = [JobResult(hot, "done", "default", "", 0.0, 0.0, 1.0, 10, 1.0, 80, losses[-1], losses,
                      quality=None if hot_diverged else Quality("accuracy", hot_quality, 100)),
            JobResult(ok, "done", "default", "", 0.0, 0.0, 1.0, 10, 1.0, 80, 1.0, [2.0, 1.0],
                      quality=Quality("accuracy", ok_quality, 100))]
    return RunRecord(info=RunInfo("r", "cpu", (), (hot, ok), 0), duration_s=1.0, jobs=jobs)


def test_run_compare_scores_quality_over_the_jobs_scored_in_both_runs() -> None:
    """Without plugins job hot diverged (not scored): the comparison set one job's score
    beside the mean of two (0.117 -> 0.099), and nothing said the reference run diverged."""
    from accelopt.runtime.compare import BASELINE, attach, table

    base = _two_jobs(hot_diverged=True, hot_quality=0.0, ok_quality=0.5)
    mine = _two_jobs(hot_diverged=False, hot_quality=0.1, ok_quality=0.4)
    mine.info = RunInfo("r", "cpu", ("clip",), mine.info.jobs, 0)
    out = table(mine, {BASELINE: base})
    console = Console(record=True, width=400, file=__import__("io").StringIO())
    console.print(out)
    text = console.export_text()
    assert "held-out top-1 (mean) │      0.500 │ 0.400 (-0.100)" in text  # ok alone, both
    caption = str(out.caption)
    assert "this run: not the same jobs finished: hot (diverged without plugins, done here)\n" \
        "times are compared over the jobs every run finished: ok\nheld-out quality is " \
        "compared over the jobs scored in every run: ok\n" in caption
    assert "the run without plugins: 1 of 2 jobs did not finish: hot diverged (its loss is " \
        "not finite from loss 2 of 2" in caption
    attach(mine, {BASELINE: base})
    assert mine.metrics["compare.baseline.avg_quality"] == pytest.approx(0.5)
    (gain,) = [r.summary for r in mine.plugin_rows if r.plugin == "clip"]
    assert "held-out top-1 (mean) 0.500 -> 0.400 (-0.100)" in gain
    assert "[held-out quality is compared over the jobs scored in every run: ok]" in gain


def test_the_cluster_line_says_what_was_not_measured_and_what_e_is() -> None:
    """A resume with every iteration carried printed '0.00 MiB/iteration' (null is not 0),
    and E and a beside the medians Mc, Pc, U read as computed from them."""
    record = make_record()
    record.metrics = {"cluster_mode": "ps", "cluster_backend": "gloo", "cluster_workers": 2,
                      "efficiency_e": 0.5}
    text = " ".join(_render(record).split())
    assert "2 workers – it/s (1/median iteration)" in text
    assert "a – – MiB/iteration" in text and "0.00 MiB" not in text
    assert "E, a: medians of per-iteration values (not computed from the medians Mc, Pc, U " \
        "shown)" in text


def test_a_rejected_job_does_not_stretch_the_makespan() -> None:
    """salus turned a job away at 0.05 s while the one job that ran ended at 0.009 s: the
    makespan read 0.05 (first arrival to the rejection)."""
    record = make_record()
    late = _job("j3", "turned-away", 0.0)
    record.jobs.append(JobResult(late, "rejected", "", "does not fit", None, None, 50.0))
    assert run_metrics(record)["makespan_s"] == pytest.approx(6.0)
    for job in record.jobs[:3]:
        job.status = "rejected"
    assert run_metrics(record)["makespan_s"] is None  # no job ran


def test_a_diverged_job_says_so_in_its_own_record(tmp_path: Path) -> None:
    """A job that trained to its end on a loss of nan read ``status: done`` with an empty
    error in metrics.json and metrics.csv: a CI step checking each job passed it."""
    record = make_record()
    record.jobs[1].losses = [0.5, float("nan")]
    paths = write_run_outputs(record, tmp_path)
    jobs = json.loads(paths["metrics.json"].read_text())["jobs"]
    assert [(j["status"], j["diverged"]) for j in jobs] == [
        ("done", False), ("done", True), ("failed", False)]
    with paths["metrics.csv"].open(newline="") as fh:
        assert [r["diverged"] for r in csv.DictReader(fh)] == ["False", "True", "False"]
