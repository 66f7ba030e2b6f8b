"""The benchmark scripts' command-line conventions (``benchmarks/_cli.py``): a bad number, an
unknown name or an existing output file is refused in one line with exit 2, before any work;
accelopt's own errors are one line, not a traceback; results are never overwritten without
``--force``. Fast: argument errors only, no benchmark runs."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _cli  # noqa: E402

from accelopt.errors import ConfigError, RankFailed, Terminated, UserError  # noqa: E402


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", [_cli.positive_int, _cli.positive_float])
@pytest.mark.parametrize("text", ["0", "-1", "x", "nan"])
def test_positive_types_refuse_zero_negative_and_junk(kind, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        kind(text)


@pytest.mark.timeout(10)
def test_types_accept_good_values() -> None:
    assert _cli.positive_int("3") == 3
    assert _cli.nonnegative_int("0") == 0
    assert _cli.positive_float("0.5") == 0.5
    assert _cli.nonnegative_float("0") == 0.0
    for bad in ("-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            _cli.nonnegative_int(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        _cli.nonnegative_float("-0.1")
    assert _cli.names(["a", "b"])("a,b") == "a,b"
    with pytest.raises(argparse.ArgumentTypeError, match="nosuch"):
        _cli.names(["a", "b"])("a,nosuch")


@pytest.mark.timeout(10)
def test_a_bad_number_is_a_one_line_usage_error(capsys) -> None:
    parser = argparse.ArgumentParser(prog="bench.py")
    parser.add_argument("--repeats", type=_cli.positive_int, default=3)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--repeats", "0"])
    assert info.value.code == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert errors == ["bench.py: error: argument --repeats: '0': must be a positive integer (>= 1)"]


@pytest.mark.timeout(10)
def test_refuse_existing_refuses_a_file_and_allows_it_with_force(tmp_path, capsys) -> None:
    new = tmp_path / "new.json"
    _cli.refuse_existing(new, force=False, flag="--json")  # nothing there: allowed
    old = tmp_path / "results.json"
    old.write_text("{}")
    with pytest.raises(SystemExit) as info:
        _cli.refuse_existing(old, force=False, flag="--json")
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists" in err[0] and "--force" in err[0]
    _cli.refuse_existing(old, force=True, flag="--json")  # deliberate regeneration
    assert old.read_text() == "{}"  # refusing never touches the file


@pytest.mark.timeout(10)
def test_an_unwritable_output_path_is_refused_even_with_force(tmp_path, capsys) -> None:
    """A path under a file, or a directory where a file is written, failed with a
    traceback after the benchmark had run (--force did not help: nothing can be written
    there)."""
    old = tmp_path / "keep.json"
    old.write_text("keep")
    for call in (lambda: _cli.refuse_existing(old / "r.json", True, "--json"),
                 lambda: _cli.refuse_existing(tmp_path, True, "--png"),
                 lambda: _cli.refuse_not_a_directory(old, "--out"),
                 lambda: _cli.refuse_not_a_directory(old / "a" / "b", "--out")):
        with pytest.raises(SystemExit) as info:
            call()
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("is a file, not a directory" in err[0]
                                  or "is a directory; give the name of a file" in err[0])
    assert old.read_text() == "keep" and sorted(tmp_path.iterdir()) == [old]
    _cli.refuse_not_a_directory(tmp_path / "new" / "dir", "--out")  # made when it is written
    _cli.refuse_not_a_directory(tmp_path, "--out")  # an existing directory: fine
    _cli.refuse_existing(tmp_path / "sub", True, "--out", directory=True)


def _run(main, capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as info:
        _cli.run(main)
    return info.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("error", "code"), [
    (UserError("no such plugin 'x'"), 2),
    (ConfigError("min_iterations (20) must be <= max_iterations"), 2),
    (RankFailed("rank 1 died", rank=1, pid=None, iteration=3, cause="boom"), 1),
    (Terminated(), 143),
])
def test_run_turns_accelopt_errors_into_one_line(error, code, capsys) -> None:
    def main() -> None:
        raise error

    got, err = _run(main, capsys)
    assert got == code
    assert len(err) == 1 and "Traceback" not in err[0]
    if code == 143:
        assert "terminated (SIGTERM)" in err[0]
    else:
        assert err[0].endswith(f"error: {error}")


@pytest.mark.timeout(10)
def test_run_exits_with_mains_code(capsys) -> None:
    assert _run(lambda: 0, capsys)[0] == 0
    assert _run(lambda: None, capsys)[0] is None  # sys.exit(None): 0
    assert _run(lambda: 3, capsys)[0] == 3


@pytest.mark.timeout(10)
def test_run_ends_quietly_when_the_reader_of_its_output_has_gone(capsys, monkeypatch) -> None:
    """`script | head` raised BrokenPipeError out of the script: a traceback."""
    def main() -> None:
        raise BrokenPipeError(32, "Broken pipe")

    dropped: list[bool] = []
    monkeypatch.setattr(_cli, "_drop_stdout", lambda: dropped.append(True))
    assert _run(main, capsys) == (141, [])
    assert dropped == [True]


@pytest.mark.timeout(30)
def test_tictac_sim_says_none_where_tac_has_no_spread(capsys) -> None:
    """With --jitter 0 every worker finishes TAC's order together: the reduction printed
    "infx" with a division warning."""
    import tictac_sim

    assert tictac_sim.reduction(2.0, 0.5) == "4.0x"
    assert tictac_sim.reduction(2.0, 0.0) == "none (TAC 0)"


@pytest.mark.timeout(20)
def test_run_child_stops_the_child_when_the_script_stops() -> None:
    """An exception while waiting (Ctrl-C, SIGTERM as Terminated, a timeout) stops the child
    and its process group instead of leaving it running."""
    with pytest.raises(subprocess.TimeoutExpired):
        _cli.run_child([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)
    procs: list[subprocess.Popen] = []
    with pytest.raises(KeyboardInterrupt), _cli.stopping(procs, grace_s=2):
        procs.append(_cli.popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        raise KeyboardInterrupt
    assert procs[0].poll() is not None


SCRIPT_ERRORS = [
    ("startup.py", ["--repeats", "0"], "--repeats"),
    ("startup.py", ["--tree", "{existing}"], "not a checkout of accelopt"),  # exited 1
    ("hook_cost.py", ["--calls", "0", "0"], "--calls"),
    ("tictac_sim.py", ["--section", "nosuch"], "nosuch"),
    ("salus_jct.py", ["--max-iterations", "5"], "--max-iterations"),
    ("gradcomm_compare.py", ["--only", "nosuch"], "--only"),
    ("slide_row_index.py", ["--reps", "-1"], "--reps"),
    ("tictac_real.py", ["--json", "{existing}"], "--force"),
    ("tictac_vs_default.py", ["--set", "heurstic=priority"], "plugins.tictac key"),
    # an output path that is an existing file where a directory goes, or under one, or a
    # directory where a file goes: a traceback once the runs were done (or before: salus_jct)
    ("combo_salus_tictac.py", ["--repeats", "1", "--out", "{existing}"],
     "results.json is a file, not a directory"),
    ("salus_jct.py", ["--jobs", "2", "--repeats", "1", "--out", "{existing}"],
     "results.json is a file, not a directory"),
    ("salus_jct.py", ["--out", "{existing}/sub"], "results.json is a file, not a directory"),
    ("tictac_real.py", ["--json", "{existing}/r.json"], "is a file, not a directory"),
    ("tictac_real.py", ["--json", ".", "--force"], "--json . is a directory"),
    ("slide_tta.py", ["--png", ".", "--force"], "--png . is a directory"),
    ("tictac_vs_default.py", ["--keep", "{existing}/kept"], "is a file, not a directory"),
    # a CUDA device the machine does not have: torch's AssertionError after the model's build
    ("offload_compare.py", ["--device", "cuda:99"], "'cuda:99'"),
    ("offload_compare.py", ["--device", "meta"], "cpu or cuda"),
    # tictac_vs_default's sides: each ran, or failed after a calibration run
    ("tictac_vs_default.py", ["--variant", "bad"], "'bad' is not NAME:KEY=VALUE"),
    ("tictac_vs_default.py", ["--variant", "bad:"], "'bad:' is not NAME:KEY=VALUE"),
    ("tictac_vs_default.py", ["--set", "heuristic=foo"], "heuristic='foo' is not one of"),
    ("tictac_vs_default.py", ["--variant", "w:credit_bytes=abc"], "--variant w: plugins.tictac"),
    ("tictac_vs_default.py", ["--variant", "x:heuristic=tac"], "the same settings as the tictac"),
    ("tictac_vs_default.py", ["--variant", "off:heuristic=tic"], "already named 'off'"),
    ("tictac_vs_default.py", ["--set", "heuristic=tic", "heuristic=tac"], "given twice"),
    # a figure format matplotlib cannot write: a traceback from savefig after the whole run
    ("slide_tta.py", ["--png", "curves.txt"], "cannot write .txt figures"),
    # no suffix: savefig writes curves.png, which the refusal to overwrite did not check
    ("slide_tta.py", ["--png", "{existing_png_stem}"], "curves.png exists"),
    # one worker has no spread between workers: the straggler table printed "nanx"
    ("tictac_sim.py", ["--workers", "1"], "at least 2 workers"),
    # this checkout given as another side: run twice a round and compared with itself
    ("startup.py", ["--tree", "{checkout}"], "the same checkout given twice"),
    # an evaluation after the last step: never reached, so the row's figures shifted left
    # under the headers (ms/step printed under "P@1 @5000")
    ("slide_diag.py", ["--width", "2k", "--steps", "20", "--eval-at", "10", "5000", "--", "dense"],
     "--eval-at 5000: after the last step (20)"),
]


def _script_here(script: str, argv: list[str], cwd: Path,
                 capfd: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess:
    """``python benchmarks/SCRIPT ARGV`` in this process (run as ``__main__``), its exit code
    and output as a subprocess gives them: a refusal comes before any work, so an
    interpreter's start and imports per case (seconds) test nothing more; two cases stay
    real processes (``test_a_script_refuses_bad_arguments_as_a_real_process``)."""
    path = str(BENCHMARKS / script)
    argv_before, here, threads = sys.argv, os.getcwd(), torch.get_num_threads()
    capfd.readouterr()
    sys.argv = [path, *argv]
    os.chdir(cwd)
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        sys.argv = argv_before
        os.chdir(here)
        torch.set_num_threads(threads)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([sys.executable, path, *argv], code, out, err)


def _script_process(script: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=50)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("script", "args", "named"), SCRIPT_ERRORS,
                         ids=[f"{s}-{' '.join(a)}" for s, a, _ in SCRIPT_ERRORS])
def test_a_script_refuses_bad_arguments_in_one_line(script, args, named, tmp_path,
                                                    capfd) -> None:
    _refuses_in_one_line(script, args, named, tmp_path,
                         lambda argv: _script_here(script, argv, tmp_path, capfd))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("script", "args", "named"), [SCRIPT_ERRORS[0], SCRIPT_ERRORS[9]],
                         ids=["startup-repeats", "combo-out"])
def test_a_script_refuses_bad_arguments_as_a_real_process(script, args, named,
                                                          tmp_path) -> None:
    _refuses_in_one_line(script, args, named, tmp_path,
                         lambda argv: _script_process(script, argv, tmp_path))


def _refuses_in_one_line(script: str, args: list[str], named: str, tmp_path: Path,
                         run) -> None:
    existing = tmp_path / "results.json"
    existing.write_text("{}")
    argv = [a.format(existing=existing, checkout=BENCHMARKS.parent,
                     existing_png_stem=tmp_path / "curves") for a in args]
    if "{existing_png_stem}" in args:
        (tmp_path / "curves.png").write_text("keep")
    done = run(argv)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [ln for ln in done.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and errors[0] == done.stderr.strip().splitlines()[-1]
    assert errors[0].startswith(f"{script}: error:") and named in errors[0]
    assert done.stdout == ""  # refused before any work
    assert existing.read_text() == "{}" and sorted(
        p.name for p in tmp_path.iterdir() if p.name != "curves.png") == [
        "results.json"]  # nothing written (no runs/ either)


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_offload_compare_says_there_is_no_cuda_device(tmp_path) -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / "offload_compare.py"), "--device",
                           "cuda"], cwd=tmp_path, capture_output=True, text=True, timeout=50)
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "offload_compare.py: error: argument --device: 'cuda': no CUDA device is available on "
        "this machine; use --device cpu")


@pytest.mark.timeout(30)
def test_slide_diag_table_has_one_column_per_evaluation_and_no_line_inside() -> None:
    """The ``# bound`` line sat between the separator and the rows, which ends a markdown
    table; fewer than 5 steps gave a step-0 column that no evaluation filled."""
    import slide_diag

    assert slide_diag.eval_steps(3, None) == [1, 2, 3]
    assert slide_diag.eval_steps(1500, None) == [300, 600, 900, 1200, 1500]
    assert slide_diag.eval_steps(20, [10, 5, 10]) == [5, 10]
    head = slide_diag.table_head([5, 10])
    assert head[0].startswith("# bound:")
    assert head[1:] == ["| variant | P@1 @5 | P@1 @10 | ms/step | active/sample |",
                        "|---|---:|---:|---:|---:|"]


@pytest.mark.timeout(30)
def test_tictac_vs_default_takes_good_sides() -> None:
    import tictac_vs_default

    tictac, variants = tictac_vs_default.tictac_sides(
        ["heuristic=priority"], ["c256k:heuristic=priority,credit_bytes=262144",
                                 "tic:heuristic=tic,message_s=0.001",
                                 "tuned:heuristic=priority,credit_bytes=-1,"
                                 "tune_credits=[0,65536,262144]"])
    assert tictac == {"heuristic": "priority"}
    # values as a run reads them: a list was a string (refused as "AnyNode is not a
    # ListConfig"), and a variant's list was cut at its commas
    assert variants == {"c256k": {"heuristic": "priority", "credit_bytes": 262144},
                        "tic": {"heuristic": "tic", "message_s": 0.001},
                        "tuned": {"heuristic": "priority", "credit_bytes": -1,
                                  "tune_credits": [0, 65536, 262144]}}
    assert tictac_vs_default.tictac_sides(
        ["heuristic=priority", "credit_bytes=-1", "tune_credits=[0,4096]"], [])[0] == {
        "heuristic": "priority", "credit_bytes": -1, "tune_credits": [0, 4096]}
    assert tictac_vs_default.tictac_sides([], []) == ({}, {})


@pytest.mark.timeout(20)
def test_run_all_refuses_an_unknown_check(tmp_path) -> None:
    done = subprocess.run(["bash", str(BENCHMARKS / "gpu" / "run_all.sh"), "nosuch"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=15,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "logs")})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "run_all.sh: error: unknown check 'nosuch' (checks: salus cluster cli tictac kernels "
        "offload slide)"]
    assert not (tmp_path / "logs").exists()


@pytest.mark.timeout(10)
def test_a_scripts_description_is_its_docstrings_first_paragraph() -> None:
    """``--help`` showed the docstring's first line, which stopped mid-sentence ("...average
    JCT over the")."""
    doc = """Avg JCT of each policy over the
    oracle's, on a family of traces.

    Details that --help need not show.
    """
    assert _cli.summary(doc) == "Avg JCT of each policy over the oracle's, on a family of traces."
    assert _cli.summary(None) == ""


@pytest.mark.timeout(60)
def test_combo_leaves_out_failed_runs_flags_inert_plugins_and_a_value_below_its_bound(
        tmp_path, monkeypatch, capsys) -> None:
    """combo_salus_tictac credited runs whose job diverged (a None avg JCT was a TypeError
    in its progress line), credited tictac with a gain where its rows said it changed
    nothing, and printed a set far below its own printed bound without a word. The runs
    are faked: the script's own accounting is what is tested."""
    from types import SimpleNamespace

    import combo_salus_tictac as combo

    from accelopt.types import INERT, ReportRow

    measured = {  # (set, repeat): the run's summary
        ((), 0): {"avg_jct_s": 1.0, "makespan_s": 2.0},
        ((), 1): {"avg_jct_s": 1.0, "makespan_s": 2.0},
        (("salus",), 0): {"avg_jct_s": 0.4, "makespan_s": 2.0},
        (("salus",), 1): {"avg_jct_s": 0.4, "makespan_s": 2.0},
        (("tictac",), 0): {"avg_jct_s": None, "makespan_s": None, "n_jobs": 2,
                           "n_diverged": 1},
        (("tictac",), 1): {"avg_jct_s": 0.9, "makespan_s": 2.0},
        (("salus", "tictac"), 0): {"avg_jct_s": 0.4, "makespan_s": 2.0},
        (("salus", "tictac"), 1): {"avg_jct_s": 0.4, "makespan_s": 2.0},
    }

    def execute(cfg, run_dir, registry, console):
        run_dir.mkdir(parents=True)
        repeat = -1 if run_dir.name.startswith("warmup") else int(run_dir.name[1])
        rows = [ReportRow("tictac", "nothing to order", {INERT: 1})] if "tictac" in cfg else []
        return SimpleNamespace(m=measured.get((cfg, repeat)), plugin_rows=rows, jobs=[])

    monkeypatch.setattr(combo, "compose", lambda plugins, overrides, registry: plugins)
    monkeypatch.setattr(combo, "execute", execute)
    monkeypatch.setattr(combo, "run_metrics", lambda record: dict(record.m))
    monkeypatch.setattr(combo, "oracle_bounds", lambda record: (0.5, 1.0))
    monkeypatch.setattr(sys, "argv", ["combo_salus_tictac.py", "--repeats", "2", "--out",
                                      str(tmp_path)])
    assert combo.main() == 3  # runs were left out, as `accelopt bench` exits
    out = capsys.readouterr().out
    assert "repeat 0 tictac        avg JCT       – s" in out
    assert "LEFT OUT: 1 of its 2 job(s) diverged" in out
    assert "left out 1 run(s) that did not measure their set" in out
    assert "tictac (inert)" in out and "tictac 1.11x (inert)" in " ".join(out.split())
    assert "note: tictac changed nothing in every run of its sets, its rows say so: this " \
           "difference is run-to-run noise, not its gain" in " ".join(out.split())
    joined = " ".join(out.split())
    assert "warning: salus 0.400 s, salus+tictac 0.400 s below the avg JCT bound 0.500 s" \
        in joined
    (saved,) = tmp_path.glob("*/combo.json")
    assert [m["avg_jct_s"] for m in json.loads(saved.read_text())["tictac"]] == [0.9]
