"""``accelopt matrix`` edges: a plugin that fits in no set under ``--max-size``, malformed
``--plugins`` lists, ``--no-check`` still checking the overrides; and two sweep lines of
``accelopt run -m``: the inert note beside a failed run, and the stop line of a run whose
directory holds only the weights of jobs that had ended."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from clirun import accelopt, sweep_in_process, the_error_line

from accelopt.plugin import PluginSpec

REQ = PluginSpec(name="req", factory=lambda c: object(), requires=("slota",),
                 description="requires slota (test)")
SLOTA = PluginSpec(name="slota", factory=lambda c: object(), description="required (test)")
NEEDS_REQ = PluginSpec(name="needs_req", factory=lambda c: object(), requires=("req",),
                       description="requires req (test)")
PLUGS = "test_matrix_edges:REQ,test_matrix_edges:SLOTA,test_matrix_edges:NEEDS_REQ"


def _matrix(*args: str, capsys) -> tuple[list[str], str]:
    """``accelopt matrix ARGS`` in this process (the command line is what is read, not an
    interpreter's start): its sets and its stderr."""
    from accelopt.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["matrix", *args])
    out, err = capsys.readouterr()
    assert exc.value.code == 0, err
    return [entry["plugins"] for entry in json.loads(out)["include"]], err


def test_a_plugin_whose_smallest_set_exceeds_max_size_is_named(monkeypatch, capsys):
    """``req`` needs ``slota``: under --max-size 1 it is in no set, and it vanished without
    a line (as it is named when slota is not in --plugins)."""
    monkeypatch.setenv("ACCELOPT_PLUGINS", PLUGS)
    sets, err = _matrix("--plugins", "req,slota,needs_req", "--max-size", "1", "--no-check",
                        capsys=capsys)
    assert sets == ["[]", "[slota]"]
    assert [ln for ln in err.splitlines() if ln.startswith("left out plugin")] == [
        "left out plugin 'req': its smallest set [req,slota] has 2 plugins; give "
        "--max-size 2 (or more) to list it",
        "left out plugin 'needs_req': its smallest set [needs_req,req,slota] has 3 plugins; "
        "give --max-size 3 (or more) to list it",
    ]
    sets, err = _matrix("--plugins", "req,slota", "--no-check", capsys=capsys)
    assert sets == ["[]", "[slota]", "[req,slota]"] and "left out" not in err
    sets, err = _matrix("--plugins", "req,slota", "--max-size", "0", "--no-check",
                        capsys=capsys)
    assert sets == ["[]"] and "left out" not in err  # the baseline alone, as asked


def test_a_plugin_requiring_a_left_out_plugin_is_named(monkeypatch, capsys):
    """``needs_req`` requires ``req``, itself left out (slota not in --plugins): named too."""
    monkeypatch.setenv("ACCELOPT_PLUGINS", PLUGS)
    sets, err = _matrix("--plugins", "req,needs_req", "--no-check", capsys=capsys)
    assert sets == ["[]"]
    assert "left out plugin 'req': it requires slota, add it to --plugins" in err
    assert "left out plugin 'needs_req': it requires req, which is left out" in err


def test_a_plugin_in_no_set_is_named_by_the_command(tmp_path):
    """The same through the real command, with the configuration checked (no --no-check)."""
    result = accelopt("matrix", "--plugins", "req,slota", "--max-size", "1", "workload=tiny",
                      cwd=tmp_path, ACCELOPT_PLUGINS=PLUGS)
    assert result.returncode == 0, result.stderr
    assert [e["plugins"] for e in json.loads(result.stdout)["include"]] == ["[]", "[slota]"]
    assert ("left out plugin 'req': its smallest set [req,slota] has 2 plugins; give "
            "--max-size 2 (or more) to list it") in result.stderr.splitlines()


@pytest.mark.parametrize("given", [["--plugins="], ["--plugins", ""], ["--plugins", " "],
                                   ["--plugins", ",clip"], ["--plugins", "clip,,noop"],
                                   ["--plugins", "clip,"]])
def test_a_malformed_plugins_list_is_refused(tmp_path, given):
    """An empty list read as "every plugin" (512 sets), an empty item was dropped."""
    from accelopt.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["matrix", *given, "--no-check"])
    assert exc.value.code == 2


def test_a_malformed_plugins_list_is_one_line(tmp_path):
    result = accelopt("matrix", "--plugins", "clip,,noop", "workload=tiny", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert the_error_line(result) == (
        "error: --plugins has an empty item ('clip,,noop'): give comma-separated plugin "
        "names, e.g. accelopt matrix --plugins clip,noop (`accelopt plugins` lists them)")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("override,said", [
    ("bogus", "bogus"),
    ("workload=nope", "no workload 'nope'"),
    ("plugins.nope.x=1", "plugins.nope.x"),
    ("workload.jobs.0.iterations=abc", "iterations"),
])
def test_no_check_still_checks_the_overrides(override, said, capsys):
    """--no-check skips configuring each set, not parsing and composing the overrides: a
    typo printed the whole matrix, exit 0 (in this process: the command line is the same)."""
    from accelopt.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["matrix", "--no-check", "--plugins", "clip", override])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert said in line


def test_no_check_still_skips_configuring_the_sets(capsys):
    """A value only configuring a set refuses is still listed under --no-check (its docs)."""
    from accelopt.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["matrix", "--no-check", "--plugins", "clip", "plugins.clip.max_norm=-1"])
    out, _ = capsys.readouterr()
    assert exc.value.code == 0
    assert [e["plugins"] for e in json.loads(out)["include"]] == ["[]", "[clip]"]


def test_the_inert_note_leaves_out_a_failed_run():
    from accelopt.cli.hydra_run import sweep_inert_note

    note = sweep_inert_note([[], ["noop"], [], ["noop"]], ["", "1 of 1 jobs did not complete",
                                                           "", ""])
    assert note.startswith("1 of 4 runs of the sweep had plugins that changed nothing")
    assert "#3 [noop]" in note and "#2" not in note
    assert sweep_inert_note([["noop"], []], ["boom", ""]) == ""


def test_a_sweep_does_not_call_its_failed_run_inert(tmp_path, monkeypatch, capsys):
    """A run whose job failed had its plugins' rows read as inert, and the sweep's note
    named it beside its failure. The runs are stand-ins (no training): point #0 fails."""
    import accelopt.cli.hydra_run as hydra_run
    import accelopt.runtime.run as run

    calls: list[int] = []

    def execute(cfg, run_dir, registry, console):
        calls.append(len(calls))
        return SimpleNamespace(k=len(calls) - 1, info=SimpleNamespace(plugins=("noop",)),
                               plugin_rows=[])

    monkeypatch.setattr(run, "execute", execute)
    monkeypatch.setattr(hydra_run, "inert_plugins", lambda names, rows: list(names))
    monkeypatch.setattr(hydra_run, "unfinished_jobs",
                        lambda record, run_dir: "1 of 1 jobs did not complete"
                        if record.k == 0 else "")
    code = sweep_in_process(["+plugins=[noop]", "run.seed=1,2"], tmp_path / "sweep",
                            "workload=tiny")
    err = capsys.readouterr().err
    assert calls == [0, 1] and code != 0
    (note,) = [ln for ln in err.splitlines() if ln.startswith("note:") and "inert" in ln]
    assert "1 of 2 runs" in note and "#1 [noop]" in note and "#0" not in note


def test_a_stop_after_weights_before_results_says_what_the_dir_holds(tmp_path):
    """A one-process run saves a job's weights as the job ends, its results after the
    executor returns: a Ctrl-C in between (seen in a sweep) left config.yaml and
    weights/00-mlp.pt, and the stop line said nothing of them."""
    from accelopt.cli.hydra_run import stopped_line

    run_dir = tmp_path / "3"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".accelopt-run").write_text("")
    (run_dir / "config.yaml").write_text("run:\n  compare: none\n")
    (run_dir / "accelopt.log").write_text("")
    assert stopped_line("interrupted (Ctrl-C)", run_dir) == ""  # nothing of the run's own
    (run_dir / "weights").mkdir()
    (run_dir / "weights" / "00-mlp.pt").write_bytes(b"")
    assert stopped_line("interrupted (Ctrl-C)", run_dir) == (
        f"interrupted (Ctrl-C): {run_dir} holds the final weights of the job(s) that had "
        "ended (weights/00-mlp.pt) and none of the run's results (no metrics.json, no "
        "checkpoints to resume from); run it again for them")


def test_the_weights_only_line_is_the_sweeps_stop_line(tmp_path):
    """In a sweep, the point's line is followed by the sweep's note (it was the bare error)."""
    from accelopt.cli.hydra_run import interrupted_sweep_note, stopped_line

    run_dir = tmp_path / "sweep" / "3"
    (run_dir / "weights").mkdir(parents=True)
    (run_dir / "weights" / "00-mlp.pt").write_bytes(b"")
    line = stopped_line("interrupted (Ctrl-C)", run_dir) + interrupted_sweep_note(
        3, Path(tmp_path / "sweep"))
    assert "holds the final weights of the job(s) that had ended (weights/00-mlp.pt)" in line
    assert "the sweep stopped at point #3" in line
