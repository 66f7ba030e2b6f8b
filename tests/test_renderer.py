"""The timeline's drawing process (accelopt/report/renderer.py): it draws exactly the chart
the run would draw itself, the run falls back to drawing when it cannot, and it never
outlives the run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from accelopt.records import RunRecord, Span
from accelopt.report import write_run_outputs
from accelopt.report.renderer import TimelineRenderer
from accelopt.report.timeline_png import TimelineLayout, draw, timeline_layout
from accelopt.types import RunInfo

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record() -> RunRecord:
    spans = [Span(f"iter {i}", f"lane {i % 2}", i * 0.1, i * 0.1 + 0.08,
                  args={"job": f"job-{i % 3}", "iteration": i}) for i in range(30)]
    spans.append(Span("push", "transport", 0.5, 0.5004, args={"job": "job-0"}, process="rank1"))
    return RunRecord(info=RunInfo("runs/renderer-test", "cpu", (), (), 0), spans=spans)


def _started() -> TimelineRenderer:
    renderer = TimelineRenderer.start()
    if renderer is None:
        pytest.fail("the drawing process did not start")
    return renderer


def test_the_layout_survives_its_json_form() -> None:
    layout = timeline_layout(_record())
    again = TimelineLayout.from_json(json.loads(json.dumps(layout.to_json())))
    assert again == layout
    assert len(again.labels) == 3 and again.legend == ["job-0", "job-1", "job-2"]


def test_the_legend_names_a_clusters_jobs_as_the_jobs_table_does() -> None:
    """A cluster's spans carry the job's id ("00-a"), one process's its name: the legend of
    a cluster run read "00-a" where the same run in one process read "a"."""
    from accelopt.records import JobResult
    from accelopt.types import JobInfo

    spans = [Span(f"iter {i}", "lane 0", i * 0.1, i * 0.1 + 0.08,
                  args={"job": ("00-a", "01-b")[i % 2]}) for i in range(4)]
    spans.append(Span("push", "transport", 0.5, 0.6, args={"job": "a"}, process="rank1"))
    jobs = [JobResult(JobInfo(job_id=f"0{k}-{n}", name=n, model="mlp", kind="train",
                              arrival_s=0.0, iterations=2, batch_size=4))
            for k, n in enumerate("ab")]
    layout = timeline_layout(RunRecord(info=RunInfo("runs/t", "cpu", (), (), 0), spans=spans,
                                       jobs=jobs))
    assert layout.legend == ["a", "b"]
    # one colour per job, whether its span names it by id or by name
    assert len({colour for _row, colour, _segments in layout.bars}) == 2


@pytest.mark.timeout(120)
def test_the_process_draws_the_same_png_as_the_run_would(tmp_path: Path) -> None:
    record = _record()
    renderer = _started()
    try:
        paths = write_run_outputs(record, tmp_path / "out", renderer)
    finally:
        renderer.close()
    assert renderer.returncode == 0  # it drew: the fallback was not needed
    here = draw(timeline_layout(record), tmp_path / "here.png")
    assert paths["timeline.png"].read_bytes()[:8] == PNG_MAGIC
    assert paths["timeline.png"].read_bytes() == here.read_bytes()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "metrics.csv", "metrics.json", "timeline.png", "trace.json"]


@pytest.mark.timeout(120)
def test_a_dead_process_leaves_the_drawing_to_the_run(tmp_path: Path) -> None:
    renderer = _started()
    renderer.close()  # gone before the outputs are written
    paths = write_run_outputs(_record(), tmp_path, renderer)
    assert paths["timeline.png"].read_bytes()[:8] == PNG_MAGIC
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.timeout(120)
def test_a_failed_drawing_is_reported_and_drawn_by_the_run(tmp_path: Path) -> None:
    renderer = _started()
    bad = TimelineLayout("t", ["a"], [(0, 0, [(0.0, 1.0)])], [])
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    assert renderer.submit(bad, blocked / "t.png")  # its parent is a file: cannot write
    error = renderer.wait()
    renderer.close()
    assert error is not None and "Error" in error


@pytest.mark.timeout(60)
def test_the_process_ends_with_the_run_when_nothing_is_submitted() -> None:
    renderer = _started()
    assert renderer.returncode is None
    renderer.close()
    assert renderer.returncode is not None  # ended and reaped, nothing left behind
    renderer.close()  # idempotent


@pytest.mark.timeout(120)
def test_the_handed_layout_file_is_gone_even_if_the_run_dies_after_handing_it_over(
        tmp_path: Path) -> None:
    """A run killed right after the hand-over (``accelopt bench`` stopping its sweep on an
    unknown metric did that) never removes the layout's temporary file: the drawing process
    removes it once read, so nothing is left in the temporary directory."""
    renderer = _started()
    assert renderer.submit(timeline_layout(_record()), tmp_path / "t.png")
    handed = renderer._layout_file
    assert handed is not None
    assert renderer._process.wait(timeout=100) == 0  # the run never waits nor closes
    assert not handed.exists()
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC
    renderer.close()


@pytest.mark.timeout(60)
def test_the_process_ends_by_itself_when_the_run_goes_away() -> None:
    renderer = _started()
    renderer._process.stdin.close()  # what a killed run leaves it: no input, ever
    assert renderer._process.wait(timeout=50) == 0


def test_a_process_only_where_matplotlib_is_not_imported_yet() -> None:
    code = ("import matplotlib.figure\n"
            "from accelopt.report.renderer import drawing_process\n"
            "with drawing_process() as r:\n"
            "    print(r is None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "True"
    code = ("from accelopt.report.renderer import drawing_process\n"
            "with drawing_process() as r:\n"
            "    print(r is not None, r.returncode is None)\n"
            "print(r.returncode is not None)\n")  # ended and reaped on leaving
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split() == ["True", "True", "True"]


def test_the_drawing_process_starts_once_and_never_after_it_was_closed() -> None:
    """Started early (a cluster's launcher, when its leader ran the last iteration) or on
    entering, once; a run that failed closes it, and nothing starts after that."""
    code = ("from accelopt.report.renderer import drawing_process\n"
            "d = drawing_process()\n"
            "d.start()\n"
            "first = d._renderer\n"
            "d.start()\n"
            "with d as r:\n"
            "    print(r is first, r.returncode is None)\n"
            "print(r.returncode is not None, d._renderer is None)\n"
            "failed = drawing_process()\n"
            "failed.close()\n"
            "failed.start()\n"
            "print(failed._renderer is None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split() == ["True", "True", "True", "True", "True"]


@pytest.mark.timeout(120)
def test_handing_over_a_large_layout_never_waits_on_the_process(tmp_path: Path) -> None:
    """A layout far above a pipe's buffer (64 KiB) is handed over while the process cannot
    read (stopped): the run never blocks on a drawing process that hangs."""
    renderer = _started()
    layout = TimelineLayout("t", ["a"], [(0, 0, [(float(i), 0.5) for i in range(100_000)])],
                            [])
    assert len(json.dumps(layout.to_json())) > 1_000_000
    os.kill(renderer.pid, signal.SIGSTOP)
    try:
        assert renderer.submit(layout, tmp_path / "big.png")
        handed_over = renderer._layout_file
        assert handed_over is not None and handed_over.exists()
        os.kill(renderer.pid, signal.SIGCONT)
        assert renderer.wait() is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(renderer.pid, signal.SIGCONT)
        renderer.close()
    assert (tmp_path / "big.png").read_bytes()[:8] == PNG_MAGIC
    assert not handed_over.exists()  # the temporary file goes with the drawing


def test_only_an_all_reduce_launcher_imports_matplotlib_while_its_ranks_start() -> None:
    """All-reduce ranks fork from a forkserver that also preloads dynamo, ready well after the
    launcher reaches its fork point: the launcher imports matplotlib then and draws the chart
    itself (no drawing process). A PS launcher forks at once and leaves it to the process."""
    from accelopt.drivers.processes import preloads_dynamo
    from accelopt.report.timeline_png import import_matplotlib
    from accelopt.runtime.run import _before_ranks

    assert preloads_dynamo({"allreduce"}) and not preloads_dynamo({"ps"})
    assert _before_ranks("allreduce") is import_matplotlib
    assert _before_ranks("ps") is None


def test_one_collection_draws_the_pixels_a_bar_chart_per_group_would(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``draw`` puts every bar in one collection (cheaper than ``broken_barh`` per group);
    the chart must stay pixel for pixel what ``broken_barh`` draws."""
    import numpy as np
    from PIL import Image

    from accelopt.report import timeline_png

    layout = timeline_layout(_record())
    draw(layout, tmp_path / "one.png")

    def per_group(ax, layout, cmap) -> None:  # noqa: ANN001 - matplotlib's objects
        for row, colour, segments in layout.bars:
            ax.broken_barh(segments, (row - timeline_png._BAR_HEIGHT / 2,
                                      timeline_png._BAR_HEIGHT),
                           facecolor=timeline_png._colour(cmap, colour),
                           edgecolor="white", linewidth=0.4)

    monkeypatch.setattr(timeline_png, "_draw_bars", per_group)
    draw(layout, tmp_path / "grouped.png")
    one = np.asarray(Image.open(tmp_path / "one.png"))
    grouped = np.asarray(Image.open(tmp_path / "grouped.png"))
    assert one.shape == grouped.shape
    assert not (one != grouped).any()
