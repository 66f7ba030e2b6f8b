"""slide's inputs and its row: label ids past int32 (refused in one line naming the file, the
line and the limit), a feature listed twice in one point (refused the same way), a thread
count above numba's maximum (the row names the count used), and a resumed job's row (it
says what the checkpoint carried: every piece of the layers' state, only not the row's
counters)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numba
import pytest
from accelopt_plugins.slide.config import SlideConfig
from accelopt_plugins.slide.plugin import SlidePlugin
from accelopt_plugins.slide.xcdata import XCSpec, generate, read_xc, write_xc
from clirun import accelopt_in_process, run_in_process, the_error_line
from test_slide_data_edges import Wide400, slide_row_after_one_batch

from accelopt import LayerOffer

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_numba_thread")]

MAX_LABELS = 1 << 31
"""Label ids are stored as int32: every id below this, so a header's L at most this."""


def _xc_run(train: Path, test: Path, *extra: str) -> list[str]:
    return ["workload=xc", "run.device=cpu", "+plugins=[slide]", "plugins.slide.threads=1",
            "plugins.slide.min_width=200", "plugins.slide.l=4", "run.profile=false",
            "run.progress=false", "run.compare=none", "workload.jobs.0.batch_size=8",
            "workload.jobs.0.dataset=accelopt_plugins.slide.xcdata:from_files",
            f"workload.jobs.0.dataset_kwargs={{train_path: {train}, test_path: {test}}}",
            *extra]


def tiny_xc_run(folder: Path, *extra: str) -> list[str]:
    """:func:`_xc_run` on a small synthetic XC problem written into ``folder``."""
    train, test = generate(XCSpec(n_labels=300, n_features=64, n_train=48, n_test=16,
                                  cluster_size=10, pool_per_cluster=20, signature=6,
                                  noise_words=3.0))
    write_xc(folder / "train.txt", train)
    write_xc(folder / "test.txt", test)
    return _xc_run(folder / "train.txt", folder / "test.txt", *extra)


def test_a_label_count_past_int32_is_refused_in_one_line_naming_file_line_and_limit(
        tmp_path, capfd) -> None:
    """Label ids are stored as int32: 99999999998 failed with numpy's OverflowError, naming
    no file. The header's L bounds every id, so L is what is checked (on line 1)."""
    huge = tmp_path / "huge.txt"
    huge.write_text("3 100 99999999999\n1,2 3:0.5\n99999999998 5:0.1\n6 7:1\n")
    got = accelopt_in_process("run", *_xc_run(huge, huge), cwd=tmp_path, capfd=capfd)
    assert got.returncode != 0 and "Traceback" not in got.stderr
    line = the_error_line(got)
    assert f"{huge}:1: the header's label count 99999999999 is above the limit {MAX_LABELS}" \
        in line and "int32" in line and "OverflowError" not in line
    edge = tmp_path / "edge.txt"  # the largest L whose ids all fit is read
    edge.write_text(f"1 10 {MAX_LABELS}\n{MAX_LABELS - 1} 3:0.5\n")
    assert int(read_xc(edge).labels[0]) == MAX_LABELS - 1


def test_a_feature_listed_twice_in_a_point_is_refused_naming_file_line_and_values(
        tmp_path) -> None:
    """``3:0.5 3:0.7`` has no one reading (sum? the last?): refused, where a repeated label
    (the same fact twice) is dropped and logged."""
    path = tmp_path / "rep.txt"
    path.write_text("2 10 5\n1,2 3:0.5 4:0.1\n0 3:0.5 3:0.7\n")
    with pytest.raises(ValueError) as info:
        read_xc(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:3: feature 3 is listed twice") and "\n" not in msg
    assert "0.5" in msg and "0.7" in msg and "once per line" in msg


def _row_after_one_batch(threads: int) -> str:
    return slide_row_after_one_batch(threads=threads).summary


def test_a_thread_count_above_numbas_maximum_is_named_as_reduced_in_the_row() -> None:
    """threads=1000 ran on NUMBA_NUM_THREADS threads, and the row said nothing of it."""
    most = numba.config.NUMBA_NUM_THREADS
    summary = _row_after_one_batch(1000)
    assert (f"; {most} numba thread" in summary
            and f"plugins.slide.threads=1000 reduced to numba's maximum here "
                f"(NUMBA_NUM_THREADS={most})" in summary)
    assert "; 1 numba thread (plugins.slide.threads)" in _row_after_one_batch(1)
    assert "numba thread" not in _row_after_one_batch(0)  # numba's default: nothing to say


def test_a_resumed_row_says_the_tables_came_back_and_only_its_counters_restart(
        tmp_path) -> None:
    """The core's note for a plugin without accelopt_state_save ("keeps no state in
    checkpoints") read as if the LSH tables were lost; they are buffers of the model and
    come back with it. The row now says what came back and what restarted."""
    first = tmp_path / "first"
    run_in_process(*tiny_xc_run(tmp_path, "workload.jobs.0.iterations=4",
                                "run.checkpoint_every=2"),
                   run_dir=first)
    resumed = run_in_process(f"run.resume={first}", "run.resume_finished=true",
                             "run.progress=false", run_dir=tmp_path / "resumed")
    (row,) = [r for r in resumed.plugin_rows if r.plugin == "slide"]
    assert "keeps no state in checkpoints" not in row.summary
    assert ("resumed at iteration 4: the LSH tables and hash functions, the sparse Adam "
            "moments" in row.summary and "came back with the model" in row.summary)
    assert "cover only the iterations after the resume" in row.summary
    assert row.metrics["since_resume_at"] == 4


def test_the_state_kept_is_the_iteration_count_only_and_only_for_jobs_with_slide_layers(
        ) -> None:
    plugin = SlidePlugin(SlideConfig(min_width=350, lr=1e-2, l=4, bucket_size=16))
    job = SimpleNamespace(name="j", kind="train")
    assert plugin.accelopt_state_save(job) is None  # nothing replaced: nothing to say
    plugin.accelopt_layer_build(LayerOffer(
        job=job, path="", index=0, module=Wide400(), module_type="Wide400", in_features=None,
        out_features=None))
    plugin.accelopt_iteration_start(SimpleNamespace(job=job, iteration=6))
    assert plugin.accelopt_state_save(job) == {"iterations": 7}
    other = SlidePlugin(SlideConfig(min_width=350, lr=1e-2, l=4, bucket_size=16))
    other.accelopt_state_load(job, {"iterations": 7})
    assert other.resumed == {"j": 7}
