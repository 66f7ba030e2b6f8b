"""``accelopt.run``: the CLI's run as a Python function, returning the run's record."""

from __future__ import annotations

import json

import pytest

import accelopt
from accelopt.errors import ConfigError, UserError

pytestmark = pytest.mark.timeout(120)
TINY = ["workload=tiny", "run.progress=false", "run.telemetry_interval_s=5"]


def test_run_returns_the_record_and_writes_the_outputs(tmp_path):
    record = accelopt.run([*TINY, "run.compare=none"], run_dir=tmp_path / "out")
    assert [j.status for j in record.jobs] == ["done", "done"]
    assert record.info.run_dir == str(tmp_path / "out")
    written = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert written["summary"]["makespan_s"] == pytest.approx(record.summary["makespan_s"])
    assert (tmp_path / "out" / "config.yaml").exists()


def test_plugins_added_in_code_run_and_report(tmp_path, monkeypatch):
    from plugins_for_tests import RANK_REPORTER

    monkeypatch.chdir(tmp_path)
    registry = accelopt.Registry.discover()
    registry.add(RANK_REPORTER)
    record = accelopt.run([*TINY, "+plugins=[rank_reporter]", "run.compare=none"],
                          registry=registry)
    assert [row.plugin for row in record.plugin_rows] == ["rank_reporter"]
    assert list(tmp_path.glob("runs/*/*/metrics.json")), "the CLI's default run directory"


class _RaisesAtTheEnd:
    def __init__(self, config: object = None) -> None:
        pass

    @accelopt.hookimpl
    def accelopt_report_rows(self, run):
        raise RuntimeError("boom in report_rows")


def test_a_plugin_raising_after_every_job_ended_keeps_the_runs_outputs(tmp_path):
    """A plugin raising in accelopt_report_rows (or accelopt_run_end) stopped a one-process
    run whose jobs had all finished with nothing but config.yaml and the weights."""
    registry = accelopt.Registry.discover()
    registry.add(accelopt.PluginSpec(name="raises_at_end", factory=_RaisesAtTheEnd))
    with pytest.raises(accelopt.PluginHookError, match="plugin 'raises_at_end' raised in hook "
                       "accelopt_report_rows: RuntimeError: boom"):
        accelopt.run([*TINY, "+plugins=[raises_at_end]", "run.compare=none"],
                     run_dir=tmp_path / "out", registry=registry)
    written = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert [j["status"] for j in written["jobs"]] == ["done", "done"]
    assert written["summary"]["error"].startswith("plugin 'raises_at_end' raised in hook")
    assert (tmp_path / "out" / "trace.json").exists()


@pytest.mark.parametrize("overrides, words", [
    (["+plugins=[nosuch]"], "nosuch"),
    (["run.sed=1"], "did you mean 'run.seed'"),
    ("workload=tiny", "list of overrides"),
    (["-m", "run.seed=1,2"], "once per point"),
])
def test_bad_input_raises_one_line(overrides, words, tmp_path):
    with pytest.raises(UserError, match=words) as info:
        accelopt.run(overrides, run_dir=tmp_path / "never")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "never").exists()


def test_torch_is_left_as_the_caller_set_it(tmp_path):
    """A notebook calling accelopt.run was left seeded, single-threaded and deterministic."""
    import random

    import numpy as np
    import torch

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        torch.set_num_threads(2)
        torch.use_deterministic_algorithms(False)
        torch.manual_seed(123)
        random.seed(5)
        np.random.seed(7)
        before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
        accelopt.run(["workload=tiny", "cluster.mode=none", "run.threads=1",
                      "run.progress=false"], run_dir=tmp_path / "run")
        assert torch.get_num_threads() == 2
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.equal(torch.get_rng_state(), before[0])
        assert random.getstate() == before[1]
        assert (np.random.get_state()[1] == before[2]).all()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


FIRST_CALL = {
    "run": 'accelopt.run(["workload=tiny", "cluster.mode=none", "run.progress=false"], '
           'run_dir=sys.argv[1])',
    "attach": "accelopt.attach(torch.nn.Linear(2, 2), run_dir=sys.argv[1])",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call", sorted(FIRST_CALL))
def test_the_first_call_in_a_process_leaves_pythons_random_as_it_was(tmp_path, call):
    """The first call imports libraries that draw from ``random`` as they load (rich.style
    took 24 bits): in a fresh process, before any state was saved."""
    import subprocess
    import sys

    code = ("import random, sys, torch, accelopt\n"
            "random.seed(5); expected = random.random(); random.seed(5)\n"
            f"{FIRST_CALL[call]}\n"
            "print(random.random() == expected)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=100)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


def test_a_finished_run_directory_is_never_overwritten(tmp_path):
    out = tmp_path / "out"
    accelopt.run([*TINY, "run.compare=none"], run_dir=out)
    before = (out / "metrics.json").read_bytes()
    with pytest.raises(ConfigError, match="already holds a run"):
        accelopt.run([*TINY, "run.compare=none"], run_dir=out)
    assert (out / "metrics.json").read_bytes() == before
    # two directories for one run: run_dir won, hydra.run.dir was dropped in silence
    with pytest.raises(ConfigError, match="name two directories for one run"):
        accelopt.run([*TINY, f"hydra.run.dir={tmp_path / 'x'}"], run_dir=tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_the_documented_example_runs(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "your-model.md").read_text()
    code = doc.split("## From Python", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code.replace('"workload=tiny"', '"workload=tiny", "run.progress=false"'),
                 "docs/your-model.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "salus" in printed and (tmp_path / "runs" / "salus-tiny" / "metrics.json").exists()


GUARDS = {
    "top level": ("{call}\n", True),
    "under the guard": ('if __name__ == "__main__":\n    {call}\n', False),
    "under the guard, reversed": ('if "__main__" == __name__:\n    {call}\n', False),
    "a function called under the guard": (
        'def main():\n    {call}\n\n\nif __name__ == "__main__":\n    main()\n', False),
    "a function called at the top level": ('def main():\n    {call}\n\n\nmain()\n', True),
    "another condition": ('if __name__ != "x":\n    {call}\n', True),
    "under the guard inside a try": (
        'try:\n    if __name__ == "__main__":\n        {call}\nexcept KeyboardInterrupt:\n'
        '    pass\n', False),
    "in a try at the top level": ('try:\n    {call}\nfinally:\n    pass\n', True),
}


@pytest.mark.parametrize("where", GUARDS)
def test_a_cluster_run_outside_the_main_guard_is_refused(where, tmp_path):
    """Ranks import the starting script again: a call at its top level would start the
    run again in each of them. The check itself, torch-free, on each shape of script."""
    import subprocess
    import sys

    text, refused = GUARDS[where]
    script = tmp_path / "train.py"
    call = ("from accelopt.drivers.processes import refuse_unguarded_main; "
            "refuse_unguarded_main()")
    script.write_text(text.format(call=call))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    assert (out.returncode != 0) is refused, out.stderr
    if refused:
        last = out.stderr.strip().splitlines()[-1]
        assert f"top level of {script}" in last
        assert 'put the call under `if __name__ == "__main__":`' in last


@pytest.mark.parametrize("how", ["a script without .py", "a script on standard input"])
def test_scripts_multiprocessing_reruns_by_path_are_checked_too(how, tmp_path):
    """Both were let through: the first started the run again in each rank (pages of
    multiprocessing's tracebacks), the second failed in each rank on '<stdin>'."""
    import subprocess
    import sys

    call = ("from accelopt.drivers.processes import refuse_unguarded_main\n"
            "refuse_unguarded_main()\n")
    if how == "a script on standard input":
        out = subprocess.run([sys.executable, "-"], input=call, capture_output=True,
                             text=True, timeout=60, cwd=tmp_path)
        words = "from a script read from <stdin>"
    else:
        (tmp_path / "train").write_text(call)
        out = subprocess.run([sys.executable, str(tmp_path / "train")], capture_output=True,
                             text=True, timeout=60, cwd=tmp_path)
        words = "is called at the top level of"
    assert out.returncode != 0 and words in out.stderr.strip().splitlines()[-1], out.stderr


@pytest.mark.parametrize("module, refused", [("train", True), ("pkg", False)])
def test_a_module_run_with_dash_m_is_checked_as_multiprocessing_imports_it(module, refused,
                                                                          tmp_path):
    """``python -m train`` is imported again in each rank; ``python -m pkg`` (its
    ``__main__.py``) is not, so a call at its top level is fine."""
    import os
    import subprocess
    import sys

    call = ("from accelopt.drivers.processes import refuse_unguarded_main\n"
            "refuse_unguarded_main()\n")
    (tmp_path / "train.py").write_text(call)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__main__.py").write_text(call)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, env=env)
    assert (out.returncode != 0) is refused, out.stderr


@pytest.mark.parametrize("caller", ["accelopt.run", "run_workload"])
def test_an_unguarded_cluster_run_is_refused_before_any_rank_starts(tmp_path, caller):
    """``run_workload`` was not checked: from the top level of a script it started the run
    again in each rank, which failed there, leaving "rank 0 ... exited with code 1 before
    its first iteration"."""
    import subprocess
    import sys

    script, out = tmp_path / "train.py", tmp_path / "out"
    call = (f"import accelopt\naccelopt.run({['cluster.mode=ps', *TINY]!r}, run_dir={str(out)!r})"
            if caller == "accelopt.run" else
            "from accelopt.testing import run_workload\n"
            f"run_workload([], ['cluster.mode=ps'], tmp_path={str(out)!r})")
    script.write_text(call + "\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=100)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"accelopt.errors.UserError: {caller} is called at the top level of")
    assert done.stderr.count("Traceback") == 1  # this process's error, no rank's
    assert not out.exists()  # nothing started, nothing written


def test_a_setting_the_run_could_not_use_is_in_the_record(tmp_path):
    """From Python the console is discarded by default: the record says it instead."""
    record = accelopt.run(["workload=tiny", "cluster.network.bandwidth=1gbit",
                           "run.progress=false"], run_dir=tmp_path / "run")
    assert record.warnings == [
        "cluster.network.bandwidth=1gbit has no effect: cluster.mode=none runs one process (no "
        "ranks, no process group, no links); set cluster.mode=ps or cluster.mode=allreduce to "
        "use it"]

