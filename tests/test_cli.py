"""The ``accelopt`` command as a user runs it: outputs, sweeps, and one-line errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from clirun import accelopt, accelopt_in_process, the_error_line

pytestmark = pytest.mark.timeout(180)

TINY = ["workload=tiny", "run.progress=false"]


def _run_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob("runs/**/metrics.json"))


def _here(capfd, monkeypatch, *args: str, cwd: Path, **env: str):
    """``accelopt ARGS`` in this process with ``env`` set (:func:`accelopt_in_process`): for
    the tests that read a command's exit code, lines and files, not its process (an
    interpreter's start and imports are seconds a command; ``test_run_writes_every_output``
    and the refusals of ``test_user_errors_are_one_line_as_real_commands`` stay commands)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return accelopt_in_process(*args, cwd=cwd, capfd=capfd)


def test_run_writes_every_output(tmp_path):
    result = accelopt("run", *TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (run_dir,) = _run_dirs(tmp_path)
    for name in ("config.yaml", "metrics.json", "metrics.csv", "trace.json", "timeline.png"):
        assert (run_dir / name).is_file(), name
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert [j["status"] for j in metrics["jobs"]] == ["done", "done"]
    trace = json.loads((run_dir / "trace.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])
    assert "no plugins active" in result.stdout
    # the telemetry line names what it samples: NVML's GPU, or this process's CPU and RSS
    assert re.search(r"no NVIDIA GPU found \(NVML: [^)]+\): sampling this process's CPU and "
                     r"RSS|GPU \d+ .+: sampling utilization and memory via NVML", result.stdout)


def test_a_reference_set_that_cannot_run_is_refused_before_anything_trains(tmp_path, capfd,
                                                                            monkeypatch):
    """run.compare=each runs the baseline, then each plugin alone, then the selection: a
    plugin that cannot run alone is found by the up-front validation, so nothing trains."""
    result = _here(capfd, monkeypatch, "run", "+plugins=[partnered,noop]", "run.compare=each",
                   *TINY, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                   ACCELOPT_PLUGINS="plugins_for_tests:PARTNERED")
    assert result.returncode == 2, result.stderr
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ["error: plugins.partnered: needs the noop plugin; select "
                      "+plugins=[partnered,noop]"]
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.rglob("metrics.json"))  # no reference run, no run: nothing trained
    assert not (tmp_path / "run" / "compare").exists()
    ok = _here(capfd, monkeypatch, "run", "+plugins=[partnered,noop]", *TINY, cwd=tmp_path,
               ACCELOPT_PLUGINS="plugins_for_tests:PARTNERED")
    assert ok.returncode == 0, ok.stderr  # the selection itself is fine


def test_a_refused_run_leaves_nothing_in_the_working_directory(tmp_path, capfd, monkeypatch):
    """A refusal found once Hydra had made runs/<date>/<time> removed that directory but
    left an empty runs/<date>/ behind."""
    result = _here(capfd, monkeypatch, "run", *TINY, "run.compare=bogus", cwd=tmp_path)
    assert result.returncode == 2 and "run.compare: 'bogus' is not one of" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_cluster_setting_a_one_process_run_cannot_use_is_said_where_the_run_is_read(
        tmp_path):
    result = accelopt("run", *TINY, "cluster.network.bandwidth=100mbit", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    line = ("warning: cluster.network.bandwidth=100mbit has no effect: cluster.mode=none runs "
            "one process (no ranks, no process group, no links); set cluster.mode=ps or "
            "cluster.mode=allreduce to use it")
    assert line in result.stdout.splitlines()  # one line, however wide the terminal
    (run_dir,) = _run_dirs(tmp_path)
    assert line in (run_dir / "accelopt.log").read_text().splitlines()
    run = json.loads((run_dir / "metrics.json").read_text())["run"]  # read later, still said
    assert run["warnings"] == [line.removeprefix("warning: ")]


def test_a_plugins_warning_in_a_rank_process_is_one_line_as_the_commands_are(tmp_path):
    """A plugin warning on a cluster's leader (a rank process of its own) printed as
    accelopt's source line, ``.../plugin.py:185: PluginWarning: ...``, and the line
    below it: the rank processes had not the command's one-line format."""
    result = accelopt("run", "+plugins=[salus]", "cluster.mode=ps", "cluster.workers=1",
                      "workload=single", "workload.jobs.0.iterations=2", "run.progress=false",
                      "plugins.salus.capacity=1KiB", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "plugins.salus.capacity" in line]
    assert said and said[0].startswith("warning: plugins.salus.capacity=1KiB has no effect")
    assert "PluginWarning" not in result.stderr


def test_plugin_summary_line(tmp_path, capfd, monkeypatch):
    result = _here(capfd, monkeypatch, "run", "+plugins=[noop]", *TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "noop" in result.stdout and "hook calls" in result.stdout


def _refused_into_out(tmp_path, line: str) -> None:
    """A one-process run into ``hydra.run.dir=out`` is refused with ``line`` (exit 2), and
    the directory's files are as they were, byte for byte."""
    from clirun import run_files

    before = run_files(tmp_path / "out")
    again = accelopt("run", *TINY, "cluster.mode=none", "hydra.run.dir=out", cwd=tmp_path)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [f"error: {line}"]
    assert run_files(tmp_path / "out") == before


def test_a_run_directory_that_holds_a_run_is_refused_before_anything_is_written(tmp_path):
    """The CI recipe's hydra.run.dir=out, run twice: the second run's files landed beside
    and over the first's (a PS run's per_iteration.json stayed beside a one-process run's
    metrics, Hydra's .hydra/ rewritten)."""
    first = accelopt("run", *TINY, "cluster.mode=none", "hydra.run.dir=out", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    _refused_into_out(tmp_path, "out already holds a run (metrics.json); give this run another "
                      "directory (hydra.run.dir / run_dir), or remove that one: results are "
                      "never overwritten")


def test_the_directory_of_a_killed_run_is_refused_while_its_checkpoints_are_in_it(tmp_path):
    """A run SIGKILLed (out of memory, a CI runner) writes no metrics.json; a second run into
    its directory was accepted and replaced its checkpoints, which run.resume needed."""
    from clirun import run_files

    import accelopt as accelopt_api

    checkpoint = tmp_path / "out" / "checkpoints" / "00-tiny-mlp.pt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"the killed run's state")
    (tmp_path / "out" / "config.yaml").write_text("killed: run\n")
    before = run_files(tmp_path / "out")
    _refused_into_out(tmp_path, "out holds the checkpoints of a run that did not finish; "
                      "continue it with run.resume=out, or give this run another directory "
                      "(hydra.run.dir / run_dir): results are never overwritten")
    with pytest.raises(accelopt_api.ConfigError, match="holds the checkpoints of a run"):
        accelopt_api.run([*TINY], run_dir=tmp_path / "out")
    assert run_files(tmp_path / "out") == before


def test_a_run_directory_another_run_has_claimed_is_refused_untouched(tmp_path):
    """Two runs started at once into one hydra.run.dir (a CI matrix's out): both looked for
    metrics.json, which a run writes at its end, both exited 0, and the directory held one
    run's results and both runs' log. The first run's claim is taken here, in-process."""

    from accelopt.runtime.run_dir import claim, release

    out = tmp_path / "out"
    claim(out)  # the run that started first, still running
    try:  # no .hydra/, no log, no config of the second run
        _refused_into_out(tmp_path, "out is taken by another run (running now, or stopped "
                          "before it wrote its results: .accelopt-run); give this run another "
                          "directory (hydra.run.dir / run_dir), or remove that one: results "
                          "are never overwritten")
    finally:
        release(out)


def test_a_directory_holding_a_file_the_run_would_write_is_refused(tmp_path):
    """A user's own metrics.csv or trace.json in hydra.run.dir was written over in silence;
    a refused run leaves its directory as it found it and can be run again once fixed."""
    from clirun import run_files

    out = tmp_path / "out"
    out.mkdir()
    (out / "trace.json").write_text("mine\n")
    _refused_into_out(tmp_path, "out already holds trace.json, which this run would write "
                      "over; give this run another directory (hydra.run.dir / run_dir), or "
                      "remove that one: results are never overwritten")
    assert run_files(out) == {"trace.json": b"mine\n"}
    refused = accelopt("run", *TINY, "run.compare=bogus", "hydra.run.dir=new", cwd=tmp_path)
    assert refused.returncode == 2 and not (tmp_path / "new").exists()  # its claim given back


def test_multirun_sweep_gives_every_run_its_metrics(tmp_path, capfd):
    """Both sweeps in this process (what each writes and prints is checked; CI's sweeps and
    ``accelopt bench`` run ``run -m`` as a command)."""
    result = accelopt_in_process("run", "-m", "+plugins=[],[noop]", *TINY, cwd=tmp_path,
                                 capfd=capfd)
    assert result.returncode == 0, result.stderr
    runs = _run_dirs(tmp_path)
    assert len(runs) == 2
    # to the microsecond, as single runs: two sweeps started in one second wrote into one
    assert re.fullmatch(r"\d\d-\d\d-\d\d-\d{6}", runs[0].parent.name), runs[0]
    plugins = sorted(tuple(json.loads((r / "metrics.json").read_text())["run"]["plugins"])
                     for r in runs)
    assert plugins == [(), ("noop",)]
    # run.compare asked for, not run in a sweep: the line says so (it went missing silently)
    asked = accelopt_in_process("run", "-m", "+plugins=[noop]", "run.compare=each", *TINY,
                                cwd=tmp_path, capfd=capfd)
    assert asked.returncode == 0, asked.stderr
    assert "run.compare=each: no reference runs here: a sweep (-m) compares its own " \
        "points" in " ".join(asked.stdout.split())


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["+plugins=[nosuch]"], "unknown plugin 'nosuch' (available: "),
        (["+plugins=[nop]"], "did you mean 'noop'"),
        (["run.seed=abc"], "run.seed:"),
        (["run.nokey=1"], "run.nokey"),
        (["run.sed=1"], "did you mean 'run.seed'"),
        (["+plugins=[noop]", "plugins.noop.recrd=1"], "did you mean 'plugins.noop.record'"),
        (["workload.jobs.0.modle=x"], "did you mean 'workload.jobs.0.model'"),
        # a leading + appends a key Hydra would otherwise refuse: a typo there once ran the
        # baseline (exit 0) or, in a job, raised a traceback
        (["+plugin=[noop]"], "unknown config key 'plugin'; did you mean 'plugins'?"),
        (["+run.sed=1"], "did you mean 'run.seed'"),
        (["+plugins=[noop]", "+plugins.noop.recrd=1"], "did you mean 'plugins.noop.record'"),
        (["+plugins.noop.record=true"], "which this run does not select; add +plugins=[noop]"),
        (["+workload.jobs.0.iteratons=3"], "did you mean 'workload.jobs.0.iterations'"),
        (["+cluster.network.foo=1"], "unknown config key 'cluster.network.foo'"),
        # a dict override names the unknown key inside it, not the key it set
        (["+plugins=[salus]", "plugins.salus={policy: fifo, bogus: 2}"],
         "unknown config key 'plugins.salus.bogus' (keys of plugins.salus: capacity,"),
        (["run={sed: 2}"], "unknown config key 'run.sed'; did you mean 'run.seed'?"),
        (["+plugins=[noop]", "plugins.noop.record=maybe"], "plugins.noop.record"),
        (["+plugins=[noop,noop]"], "selected twice"),
        (["workload=nosuch"], "no workload 'nosuch' (workloads: default, digits, lm,"),
        (["workload.jobs.0.model=foo"], "unknown model 'foo'"),
        (["workload.jobs.0.optimizer=rmsprop"], "optimizer must be one of"),
        (["run.device=tpu"], "run.device"),
        (["run.device=mps"], "run.device: 'mps' is not supported"),
        (["run.telemetry_interval_s=0", "cluster.mode=none"], "run.telemetry_interval_s must be > 0"),
        # psutil's CPU share over 1e-6 s read 0% and 9427% (CPU time counts in ~10 ms ticks)
        (["run.telemetry_interval_s=1e-6", "cluster.mode=none"],
         "run.telemetry_interval_s must be at least 0.05 (CPU time is counted in ~10 ms"),
        (["run.telemetry_interval_s=nan", "cluster.mode=none"],
         "run.telemetry_interval_s must be a finite number > 0"),
        (["run.hook_watchdog_s=inf", "cluster.mode=none"],
         "run.hook_watchdog_s must be a finite number >= 0"),
        (["run.threads=-2"], "run.threads must be in [0, 1024]"),
        (["run.threads=100000"], "run.threads must be in [0, 1024]"),
        (["+plugins=[salus]", "plugins.salus.threads=100000", "cluster.mode=none"],
         "plugins.salus.threads must be in [0, 1024]"),
        # nan compares False with every bound: it crashed in a hook or trained in silence
        (["+plugins=[salus]", "plugins.salus.headroom=nan", "cluster.mode=none"],
         "plugins.salus.headroom must be a finite number >= 1.0"),
        (["+plugins=[slide]", "plugins.slide.beta1=1.5", "cluster.mode=none"],
         "plugins.slide.beta1 must be in [0, 1), got 1.5"),
        (["+plugins=[slide]", "plugins.slide.lr=nan", "cluster.mode=none"],
         "plugins.slide.lr must be a finite number > 0, got nan"),
        # found when the first conv job was profiled, the line blaming the model's inputs
        (["+plugins=[gpu_kernels]", "plugins.gpu_kernels.conv_autotune=true",
          "plugins.gpu_kernels.conv_cache=/proc/nope/x.json", "cluster.mode=none"],
         "; give plugins.gpu_kernels.conv_cache a path you can write"),
        (["run.memory_capacity=abc"], "run.memory_capacity: cannot read 'abc'"),
        (["workload.jobs.0.arrival_s=-3"], "arrival_s must be in [0, 1e+09]"),
        (["workload.jobs.0.dataset=nope"], "unknown dataset 'nope'"),
        (["workload.jobs.0.model=nomod:fn", "workload.jobs.0.dataset=digits"],
         "cannot import 'nomod'"),
        (["workload.jobs.0.model=byo_models:kw_mlp"], "is a reference: set the job's dataset"),
        (["workload.jobs.0.model=byo_models:raises", "workload.jobs.0.dataset=digits",
          "cluster.mode=none"], "model 'byo_models:raises' raised RuntimeError: boom"),
    ],
)
def test_user_errors_are_one_line_exit_2(tmp_path, capfd, args, needle):
    """Each refusal in this process (the command's code, without an interpreter's start per
    case); ``test_user_errors_are_one_line_as_real_commands`` runs some as commands."""
    result = accelopt_in_process("run", *TINY, *args, cwd=tmp_path, capfd=capfd)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("args", "needle"), [
    (["+plugins=[nosuch]"], "unknown plugin 'nosuch' (available: "),
    (["workload.jobs.0.model=byo_models:raises", "workload.jobs.0.dataset=digits",
      "cluster.mode=none"], "model 'byo_models:raises' raised RuntimeError: boom"),
])
def test_user_errors_are_one_line_as_real_commands(tmp_path, args, needle):
    """Two of the refusals above as the command a user types: one line from the real
    process too (its exit path, what the interpreter prints), no traceback."""
    result = accelopt("run", *TINY, *args, cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert [ln for ln in result.stderr.splitlines() if ln.strip()] == [the_error_line(result)]
    assert needle in the_error_line(result) and "Traceback" not in result.stderr


def test_an_output_directory_that_cannot_be_written_is_one_line_before_any_work(tmp_path):
    """A path through a file (or a read-only filesystem) was an OSError traceback from
    Hydra's first write, in a single run, a sweep and the Python API alike."""
    import accelopt as api

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for args, fix in [(["hydra.run.dir=file/x"], "hydra.run.dir=DIR"),
                      (["-m", "hydra.sweep.dir=file/m", "run.seed=1,2"], "hydra.sweep.dir=DIR")]:
        result = accelopt("run", *TINY, *args, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        (line,) = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert line.endswith(f"is a file, not a directory; choose another with {fix}"), line
    with pytest.raises(api.UserError, match="is a file, not a directory; pass another run_dir"):
        api.run(TINY, run_dir=blocker / "y")
    assert blocker.read_text() == "not a directory" and sorted(tmp_path.iterdir()) == [blocker]


def test_a_sweep_never_writes_over_an_earlier_sweep_nor_trains_before_a_bad_point(tmp_path,
                                                                                  capfd):
    """A second sweep into the same hydra.sweep.dir wrote its runs 0, 1, ... over the first
    one's; a point with a value out of range failed only when its turn came, after the
    points before it had trained. Every command runs in this process (exit codes, lines and
    files are what is checked, not an interpreter's start)."""
    from clirun import run_files

    first = accelopt_in_process("run", "-m", *TINY, "hydra.sweep.dir=sweep", "run.seed=1,2",
                                cwd=tmp_path, capfd=capfd)
    assert first.returncode == 0, first.stderr
    before = run_files(tmp_path / "sweep")
    again = accelopt_in_process("run", "-m", *TINY, "hydra.sweep.dir=sweep", "run.seed=3,4",
                                cwd=tmp_path, capfd=capfd)
    assert again.returncode == 2
    assert again.stderr.strip() == (
        "error: hydra.sweep.dir sweep already holds files (an earlier sweep's runs?); give this "
        "sweep another directory, or remove that one: results are never overwritten")
    assert run_files(tmp_path / "sweep") == before
    bad = accelopt_in_process("run", "-m", *TINY, "hydra.sweep.dir=other",
                              "workload.jobs.0.iterations=2,-1", cwd=tmp_path, capfd=capfd)
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("error: sweep point #1 (workload.jobs.0.iterations=-1): job "
                                  "'tiny-mlp': iterations must be >= 1, got -1")
    assert not (tmp_path / "other").exists()
    # a fixed subdir: every point in one directory, each over the one before, exit 0
    fixed = accelopt_in_process("run", "-m", *TINY, "hydra.sweep.dir=third", "run.seed=1,2",
                                "hydra.sweep.subdir=fixed", cwd=tmp_path, capfd=capfd)
    assert fixed.returncode == 2
    assert fixed.stderr.strip() == (
        "error: points #0 and #1 of the sweep both write to third/fixed (hydra.sweep.subdir="
        "fixed), each over the one before; make hydra.sweep.subdir differ per point: include "
        "${hydra.job.num} (e.g. hydra.sweep.subdir=fixed_${hydra.job.num}) or drop it")
    assert not (tmp_path / "third").exists()


def test_an_empty_sweep_is_refused_not_passed(tmp_path, capfd, monkeypatch):
    """``-m key=range(0)`` ran nothing and exited 0: a CI step that tested nothing."""
    result = _here(capfd, monkeypatch, "run", *TINY, "-m", "workload.jobs.0.iterations=range(0)",
                   "run.seed=1,2", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: the sweep has no points (workload.jobs.0.iterations=range(0) sweeps over no "
        "values); give each swept key at least one value")
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None,
                    reason="mounting a small tmpfs needs root")
def test_a_disk_that_fills_up_under_a_run_is_one_line_and_keeps_what_was_written(tmp_path):
    """A run whose outputs fill the disk ended in an OSError traceback (and a second one
    from writing its log)."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40k", "tmpfs", str(small)],
                      capture_output=True).returncode != 0:
        pytest.skip("tmpfs cannot be mounted here")
    try:
        result = accelopt("run", *TINY, "hydra.run.dir=small/x", cwd=tmp_path)
        assert result.returncode == 1
        assert "Traceback" not in result.stderr
        assert result.stderr.splitlines()[0].startswith("error: cannot write ") and \
            "No space left on device (what was written is kept in " in result.stderr
        assert (small / "x" / "config.yaml").is_file()
    finally:
        subprocess.run(["umount", str(small)], check=False)


@pytest.mark.parametrize(("yaml", "needle"), [
    ("jobs: 5\n", "In 'workload/mine': ValidationError raised while composing config: Invalid "
                  "value assigned: AnyNode is not a ListConfig, list or tuple. full_key: "
                  "workload.jobs"),
    ("jobs:\n  - {name: a, model: mlp, colour: red}\n", "Key 'colour' not in 'JobConfig'"),
    ("jobs: [ {name: a\n", "a YAML file does not parse: while parsing a flow mapping in "),
])
def test_a_broken_workload_file_says_why_in_one_line(tmp_path, capfd, yaml, needle):
    """The reason used to be cut off after its first line ("... raised while composing
    config:", "while parsing a flow mapping")."""
    (tmp_path / "cfg" / "workload").mkdir(parents=True)
    (tmp_path / "cfg" / "workload" / "mine.yaml").write_text(yaml)
    result = accelopt_in_process("run", f"hydra.searchpath=[file://{tmp_path / 'cfg'}]",
                                 "workload=mine", "cluster.mode=none", cwd=tmp_path,
                                 capfd=capfd)
    assert result.returncode == 2
    (line,) = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert needle in line and "Traceback" not in result.stderr


def test_a_workload_of_ones_own_from_config_dir(tmp_path):
    """Hydra's --config-dir DIR: its workload was refused ("no workload 'mine'") by the
    checks composed before Hydra, which did not search DIR."""
    (tmp_path / "cfg" / "workload").mkdir(parents=True)
    (tmp_path / "cfg" / "workload" / "mine.yaml").write_text(
        "jobs:\n  - {name: mine, model: mlp, iterations: 2, batch_size: 8, width: 8}\n")
    result = accelopt("run", "--config-dir", str(tmp_path / "cfg"), "workload=mine",
                      "cluster.mode=none", "run.progress=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (run_dir,) = _run_dirs(tmp_path)
    assert [j["name"] for j in json.loads((run_dir / "metrics.json").read_text())["jobs"]] == [
        "mine"]


def test_a_job_index_past_the_workloads_jobs_names_the_fix(tmp_path, capfd, monkeypatch):
    result = _here(capfd, monkeypatch, "run", *TINY, "workload.jobs.5.lr=0.1", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: workload.jobs.5 is not a job of this workload (it has fewer); set a key of "
        "an existing job, or give the whole list, one mapping per job: "
        "workload.jobs=[{name: a, model: mlp},{name: b, model: cnn}]")


def test_conflicting_plugins_one_line(tmp_path, capfd, monkeypatch):
    result = _here(capfd, monkeypatch, "run", *TINY, "+plugins=[lifo,other_sched]", cwd=tmp_path,
                   ACCELOPT_PLUGINS="plugins_for_tests:LIFO,plugins_for_tests:OTHER_SCHEDULER")
    assert result.returncode == 2
    assert "'lifo' and 'other_sched' both fill the exclusive slot 'scheduler'" in result.stderr


def test_plugin_raising_names_plugin_and_hook(tmp_path, capfd, monkeypatch):
    """Both commands in this process: the line and the --debug traceback are what
    ``cli.main.main`` prints on stderr, read through the file descriptor as from a command."""
    monkeypatch.setenv("ACCELOPT_PLUGINS", "plugins_for_tests:BOOM")
    result = accelopt_in_process("run", *TINY, "+plugins=[boom]", cwd=tmp_path, capfd=capfd)
    assert result.returncode == 1
    assert "plugin 'boom' raised in hook accelopt_iteration_end: ValueError: boom" in result.stderr
    assert "Traceback" not in result.stderr
    debug = accelopt_in_process("run", *TINY, "+plugins=[boom]", "--debug", cwd=tmp_path,
                                capfd=capfd)
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr


@pytest.mark.parametrize(("plugin", "message"), [
    ("misspelled", "plugin 'misspelled' implements accelopt_iteration_ends, which is not an "
                   "accelopt hook; did you mean accelopt_iteration_end?"),
    ("extra_arg", "plugin 'extra_arg': accelopt_iteration_end declares bogus, which the hook "
                  "does not pass; declare any of (context, result) (docs/hooks.md)"),
    # accepted, and the hook always saw its default (None): the conformance kit said so, a
    # run did not
    ("defaulted_arg", "plugin 'defaulted_arg': accelopt_iteration_end gives argument 'result' "
                      "a default, so the hook never passes it (it always sees the default); "
                      "remove the default (docs/hooks.md)"),
    # ran as a coroutine never awaited: its body never ran, a RuntimeWarning the only sign
    ("async_hook", "plugin 'async_hook': accelopt_iteration_end is async: hooks are called "
                   "synchronously and a coroutine is never awaited"),
])
def test_a_plugin_pluggy_refuses_is_one_line_before_anything_runs(tmp_path, capfd, monkeypatch,
                                                                plugin, message):
    monkeypatch.setenv("ACCELOPT_PLUGINS", "plugins_for_tests:MISSPELLED,"
                       "plugins_for_tests:EXTRA_ARGUMENT,plugins_for_tests:DEFAULTED_ARGUMENT,"
                       "plugins_for_tests:ASYNC_HOOK")
    result = accelopt_in_process("run", *TINY, f"+plugins=[{plugin}]", cwd=tmp_path,
                                 capfd=capfd)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: {message}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not _run_dirs(tmp_path)  # nothing trained


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["none", "ps"])
def test_a_user_error_raised_in_a_hook_exits_2_in_every_mode(tmp_path, mode):
    """Bad input a plugin finds mid-run is a user error on a rank too (it exited 1 there).
    The run had started, so its evidence is kept in every mode: one process left only
    accelopt.log and config.yaml, as if the run had been refused before it began."""
    result = accelopt("run", *TINY, "+plugins=[refuses_mid_run]", f"cluster.mode={mode}",
                      "cluster.timeout_s=30", cwd=tmp_path, timeout=110,
                      ACCELOPT_PLUGINS="plugins_for_tests:REFUSES_MID_RUN")
    assert result.returncode == 2, result.stderr
    assert "refuses_mid_run: this input cannot work; fix it" in result.stderr
    assert "Traceback" not in result.stderr
    (run_dir,) = _run_dirs(tmp_path)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert "refuses_mid_run: this input cannot work" in metrics["summary"]["error"]
    assert (run_dir / "trace.json").is_file()
    assert f"(outputs kept in {run_dir})" in result.stderr


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["none", "ps"])
def test_sigterm_stops_a_run_as_ctrl_c_does_and_keeps_its_evidence(tmp_path, mode):
    """A CI runner's timeout or `kill` sends SIGTERM: a one-process run died with nothing
    but config.yaml and an empty log; a cluster run kept metrics.json but no log line."""
    import signal
    import subprocess
    import time

    from clirun import accelopt_cmd, cli_env

    proc = subprocess.Popen(
        accelopt_cmd("run", "workload=single", "workload.jobs.0.iterations=1000000",
                     f"cluster.mode={mode}", "cluster.timeout_s=30", "run.checkpoint_every=20",
                     "run.progress=false", "hydra.run.dir=out"),
        cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not list((tmp_path / "out").rglob("checkpoints/**/*.pt")) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling for the first checkpoint (not its temp file): it trains
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    # the last line says where the outputs so far are, and how to go on from the checkpoint
    out = tmp_path / "out"
    assert err.strip().splitlines()[-1] == (
        f"terminated (SIGTERM): what ran is kept in {out} (metrics.json, trace.json); "
        f"continue it from its checkpoints with: accelopt run run.resume={out}"), err
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["summary"]["error"] == "terminated (SIGTERM)"
    assert [j["status"] for j in metrics["jobs"]] == ["failed"]
    # how far it got: it had written a checkpoint at iteration 20 (a cluster run said 0),
    # its losses and its timeline up to the stop (a cluster run's were empty)
    (job,) = metrics["jobs"]
    assert job["iterations"] >= 20 and len(job["losses"]) >= 20, job
    assert job["final_loss"] == job["losses"][-1]
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())["traceEvents"]
    assert sum(e.get("ph") == "X" for e in trace) >= 20
    if mode == "ps":  # and its per-iteration Mc/Pc/U/E, as a finished cluster run writes
        rows = json.loads((tmp_path / "out" / "per_iteration.json").read_text())
        assert {r["rank"] for r in rows} == {1, 2} and len(rows) >= 2 * 20, rows[:2]
        # and the run's figures so far, over the iterations both workers finished
        summary = metrics["summary"]
        assert summary["cluster_mode"] == "ps" and summary["cluster_workers"] == 2, summary
        assert summary["mc_s"] > 0 and summary["pc_s"] > 0 and summary["iteration_s"] > 0
        assert summary["iterations_per_s"] == pytest.approx(1 / summary["iteration_s"])
    assert (tmp_path / "out" / "accelopt.log").read_text().strip().endswith(  # the whole line
        f"terminated (SIGTERM): what ran is kept in {out} (metrics.json, trace.json); "
        f"continue it from its checkpoints with: accelopt run run.resume={out}")


@pytest.mark.timeout(180)
def test_a_failed_run_keeps_its_evidence(tmp_path):
    """A plugin raising stops the run; its directory still holds metrics.json (every job
    failed with the error; the error line in the summary), the trace so far and
    accelopt.log with what the run printed and the error. (A cluster run killed mid-way
    keeps the same: tests/test_cluster_checkpoint.py.)"""
    result = accelopt("run", *TINY, "+plugins=[boom]", cwd=tmp_path, timeout=170,
                      ACCELOPT_PLUGINS="plugins_for_tests:BOOM")
    assert result.returncode == 1
    (run_dir,) = _run_dirs(tmp_path)
    line = the_error_line(result)
    assert line.endswith(f"(outputs kept in {run_dir})"), line  # where to look, said
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert "plugin 'boom' raised in hook accelopt_iteration_end" in metrics["summary"]["error"]
    assert metrics["jobs"] and all(j["status"] == "failed" for j in metrics["jobs"])
    assert all("boom" in j["error"] for j in metrics["jobs"])
    trace = json.loads((run_dir / "trace.json").read_text())
    assert trace["traceEvents"]
    log = (run_dir / "accelopt.log").read_text()
    assert "error: " in log and "boom" in log


def test_a_sweep_whose_run_fails_goes_on_and_says_which_at_the_end(tmp_path, capfd,
                                                                    monkeypatch):
    """A failed point's error scrolled away under the next points' tables: the sweep's last
    line names every run that failed, and the exit code is non-zero."""
    result = _here(capfd, monkeypatch, "run", "-m", *TINY, "+plugins=[boom],[]", cwd=tmp_path,
                   ACCELOPT_PLUGINS="plugins_for_tests:BOOM")
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: 1 of 2 runs of the sweep failed: #0 (plugin 'boom' raised in hook "
        "accelopt_iteration_end: ValueError: boom)")
    statuses = sorted(json.loads((r / "metrics.json").read_text())["jobs"][0]["status"]
                      for r in _run_dirs(tmp_path))
    assert statuses == ["done", "failed"]  # the other point ran to its end
    # the same in sweep.json, for a CI step to read instead of the prose on stderr
    summary_line = result.stdout.strip().splitlines()[-1]
    assert summary_line.startswith("sweep summary: ") and summary_line.endswith("sweep.json")
    summary = json.loads((tmp_path / summary_line.removeprefix("sweep summary: ")).read_text())
    assert (summary["complete"], summary["exit_code"], summary["failed"]) == (True, 1, [0])
    points = summary["points"]
    assert [(p["point"], p["status"], p["exit_code"], p["run_dir"]) for p in points] == [
        (0, "failed", 1, "0"), (1, "done", 0, "1")]
    assert "+plugins=[boom]" in points[0]["overrides"] and "boom" in points[0]["error"]
    assert points[1]["error"] is None


def test_a_sweep_over_plugin_sets_takes_a_plugins_setting_for_the_sets_that_select_it(
        tmp_path, capfd, monkeypatch):
    """The CI recipe (a matrix of sets, the same overrides for every run) failed as soon as
    it set a plugin's option: the point without the plugin could not compose it (exit 2)."""
    import yaml

    env = {"ACCELOPT_PLUGINS": "plugins_for_tests:WRAP"}
    result = _here(capfd, monkeypatch, "run", "-m", *TINY, "+plugins=[],[wrap]",
                   "plugins.wrap.paths=[net.0]", "run.profile=false", cwd=tmp_path, **env)
    assert result.returncode == 0, result.stderr
    plugins = sorted(((json.loads((r / "metrics.json").read_text())["run"]["plugins"],
                       yaml.safe_load((r / "config.yaml").read_text()).get("plugins") or {})
                      for r in _run_dirs(tmp_path)), key=lambda p: p[0])
    assert plugins == [([], {}), (["wrap"], {"wrap": {"paths": ["net.0"]}})]
    # still type-checked where it applies, and refused where no point selects the plugin
    (tmp_path / "bad").mkdir()
    (tmp_path / "nobody").mkdir()
    bad = _here(capfd, monkeypatch, "run", "-m", *TINY, "+plugins=[],[wrap]",
                "plugins.wrap.paths=7", cwd=tmp_path / "bad", **env)
    assert bad.returncode == 2 and "plugins.wrap.paths" in bad.stderr, bad.stderr
    nobody = _here(capfd, monkeypatch, "run", "-m", *TINY, "+plugins=[],[noop]",
                   "plugins.wrap.paths=[a]", cwd=tmp_path / "nobody", **env)
    assert nobody.returncode == 2, nobody.stderr
    assert "sets an option of plugin 'wrap', which this run does not select" in nobody.stderr


def test_a_run_whose_job_diverged_exits_3(tmp_path, capfd, monkeypatch):
    """A job trained to "done" on a loss of nan exited 0: a CI step passed a plugin that
    broke the numerics (the summary's line is not what a pipeline reads)."""
    result = _here(capfd, monkeypatch, "run", *TINY, "run.compare=none",
                   "workload.jobs.0.lr=1.0e+12", "workload.jobs.1.lr=1.0e+12", cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    line = the_error_line(result)
    assert "jobs diverged; tiny-" in line and "(outputs kept in " in line
    (run_dir,) = _run_dirs(tmp_path)
    assert json.loads((run_dir / "metrics.json").read_text())["summary"]["n_diverged"] >= 1


def test_impossible_memory_budget_exits_nonzero_keeping_outputs(tmp_path, capfd, monkeypatch):
    result = _here(capfd, monkeypatch, "run", *TINY, "run.memory_capacity=1KiB", cwd=tmp_path)
    assert result.returncode == 3
    assert "too much" in result.stderr and "memory_capacity" in result.stderr
    assert _run_dirs(tmp_path)  # nothing already written is lost


def test_plugins_command_lists_installed(tmp_path):
    result = accelopt("plugins", "--json", cwd=tmp_path,
                      ACCELOPT_PLUGINS="plugins_for_tests:LIFO,no_such_module:PLUGIN")
    assert result.returncode == 0
    listed = {p["name"]: p for p in json.loads(result.stdout)}
    assert listed["noop"]["source"] == "accelopt_plugins.noop:PLUGIN"
    # a broken one is listed as the other formats list it (JSON left it out)
    assert listed["lifo"]["broken"] is None
    assert listed["no_such_module:PLUGIN"]["broken"].startswith("ModuleNotFoundError")
    # the source is where it loads from, the origin how: "(ACCELOPT_PLUGINS)" was in both,
    # and printed twice
    assert (listed["lifo"]["source"], listed["lifo"]["origin"]) == (
        "plugins_for_tests:LIFO", "ACCELOPT_PLUGINS")
    text = accelopt("plugins", cwd=tmp_path, ACCELOPT_PLUGINS="plugins_for_tests:LIFO").stdout
    assert "  source: plugins_for_tests:LIFO (ACCELOPT_PLUGINS)" in text.splitlines()


def test_matrix_leaves_out_plugins_it_cannot_combine_and_says_so(tmp_path):
    """An installed plugin whose config is no schema failed the whole matrix (exit 2, no
    matrix for anyone who had it installed); one whose `requires` is not installed was
    absent without a word."""
    env = {"ACCELOPT_PLUGINS": "plugins_for_tests:ANY_CONFIG,plugins_for_tests:NEEDS_ABSENT"}
    result = accelopt("matrix", "--max-size", "1", "--format", "hydra", cwd=tmp_path, **env)
    assert result.returncode == 0, result.stderr
    sets = result.stdout.strip().removeprefix("+plugins=").split("],[")
    assert "noop" in sets and not any("anycfg" in s or "needs_absent" in s for s in sets)
    lines = result.stderr.splitlines()
    assert any(ln.startswith("left out plugin 'anycfg': AnyConfig is not a valid OmegaConf "
                             "schema") for ln in lines), lines
    assert any(ln.startswith("left out plugin 'needs_absent': it requires ") and
               ln.endswith("which is not installed") for ln in lines), lines


def test_matrix_json_and_hydra(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("ACCELOPT_PLUGINS",
                       "plugins_for_tests:LIFO,plugins_for_tests:OTHER_SCHEDULER")
    # pairs at most: every set of the default (1,024 with these) took a minute to check,
    # and past the subprocess's timeout under load; CI's smoke sweep runs the whole matrix.
    # Both commands in this process: their output is what is checked
    result = accelopt_in_process("matrix", "--max-size", "2", cwd=tmp_path, capfd=capfd)
    assert result.returncode == 0, result.stderr
    include = json.loads(result.stdout)["include"]
    sets = [entry["plugins"] for entry in include]
    assert "[]" in sets and "[noop]" in sets and "[lifo,noop]" in sets
    assert "[lifo,other_sched]" not in sets  # one scheduler slot
    monkeypatch.delenv("ACCELOPT_PLUGINS")
    hydra = accelopt_in_process("matrix", "--format", "hydra", "--plugins", "noop",
                                cwd=tmp_path, capfd=capfd)
    assert hydra.stdout.strip() == "+plugins=[],[noop]"


def test_matrix_leaves_out_the_sets_the_runs_configuration_refuses(tmp_path, capfd):
    """The default workload is a parameter-server cluster, where slide refuses to run: the
    matrix for it must not hand CI a job that exits 2; for a one-process workload it must.
    Every command in this process (their lines and exit codes are what is checked)."""

    def matrix(*args: str):
        return accelopt_in_process("matrix", *args, cwd=tmp_path, capfd=capfd)

    default = matrix("--format", "hydra", "--plugins", "slide,noop")
    assert default.returncode == 0, default.stderr
    assert default.stdout.strip() == "+plugins=[],[noop]"
    (line,) = default.stderr.splitlines()
    assert line.startswith("left out 2 set(s) that the default configuration refuses "
                           "([slide], [noop,slide]): plugins.slide: cluster.mode=ps"), line
    local = matrix("--format", "hydra", "--plugins", "slide,noop", "workload=tiny")
    assert local.stdout.strip() == "+plugins=[],[noop],[slide],[noop,slide]", local.stderr
    assert local.stderr == ""
    unchecked = matrix("--format", "hydra", "--plugins", "slide", "--no-check")
    assert unchecked.stdout.strip() == "+plugins=[],[slide]"
    for bad, says in [("+plugins=[noop]", "chooses the plugin sets itself"),
                      ("workload=nosuch", "no workload 'nosuch'")]:
        refused = matrix(bad)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and not refused.stdout


def test_matrix_refuses_a_plugin_setting_the_plugin_refuses_as_run_does(tmp_path):
    """plugins.clip.max_norm=-1: `accelopt run` exits 2, where the matrix left clip out and
    exited 0 (a CI matrix silently without the plugin the user was configuring)."""
    bad = accelopt("matrix", "--max-size", "1", "--plugins", "clip,noop", "workload=tiny",
                   "plugins.clip.max_norm=-1", cwd=tmp_path)
    assert bad.returncode == 2 and not bad.stdout, bad.stderr
    assert bad.stderr.strip() == ("error: plugins.clip.max_norm must be > 0, got -1.0 (given "
                                  "plugins.clip.max_norm=-1; refused by [clip]): fix the "
                                  "setting, or drop it")
    # a set refused by the configuration, not by the setting given: still left out
    ps = accelopt("matrix", "--format", "hydra", "--plugins", "slide,clip",
                  "plugins.clip.max_norm=0.5", cwd=tmp_path)
    assert ps.returncode == 0 and ps.stdout.strip() == "+plugins=[],[clip]", ps.stderr
    assert ps.stderr.startswith("left out 2 set(s)"), ps.stderr


def test_unknown_command(tmp_path):
    result = accelopt("rnu", cwd=tmp_path)
    assert result.returncode == 2
    assert "did you mean 'run'" in result.stderr


def test_hydra_flags_with_values_are_not_overrides(tmp_path):
    from accelopt.cli.main import hydra_overrides

    assert hydra_overrides(["--cfg", "job", "workload=tiny", "-m", "--info", "defaults",
                            "+plugins=[noop]", "--debug"]) == ["workload=tiny", "+plugins=[noop]"]
    result = accelopt("run", "--cfg", "job", "+plugins=[noop]", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "noop:" in result.stdout and "record: true" in result.stdout


@pytest.mark.parametrize("flags, line", [
    (["--config-name", "nope"], "--config-name nope: no nope.yaml in accelopt's configs; drop "
     "--config-name (accelopt run reads its config.yaml) or name a config of --config-dir DIR"),
    (["--config-dir", "nowhere"], "--config-dir nowhere: no such directory; give the directory "
     "of your own configs (its workload/NAME.yaml, experiment/NAME.yaml are then found beside "
     "accelopt's)"),
    (["--config-path=/nonexistent"], "--config-path /nonexistent: no such directory; to add "
     "configs of your own, give --config-dir DIR (accelopt's stay found)"),
])
def test_hydras_config_flags_naming_what_is_not_there_are_one_line_exit_2(tmp_path, capfd,
                                                                          flags, line):
    """Hydra printed a UserWarning with its own file's path, then a several-line error with
    its config search path, and exited 1."""
    result = accelopt_in_process("run", *flags, *TINY, cwd=tmp_path, capfd=capfd)
    assert (result.returncode, result.stderr.strip()) == (2, f"error: {line}")
    assert list(tmp_path.iterdir()) == []


def test_a_plugins_setting_with_a_plus_in_a_sweep_selecting_it_names_the_fix_that_works():
    """``-m '+plugins=[],[salus]' +plugins.salus.policy=srtf`` was told "add
    +plugins=[salus]", which the sweep had: the fix is to drop the + (the setting then
    reaches the points that select salus, and only them)."""
    from accelopt.cli.hydra_run import plugin_selections, prepared_configs
    from accelopt.cli.sweep_settings import force_settings_of_swept_plugins
    from accelopt.errors import ConfigError
    from accelopt.plugin import Registry

    registry = Registry.discover()
    with pytest.raises(ConfigError) as refused:
        prepared_configs([*TINY, "+plugins=[],[salus]", "+plugins.salus.policy=srtf"],
                         registry, multirun=True)
    assert str(refused.value) == (
        "'+plugins.salus.policy=srtf' sets an option of plugin 'salus', which is selected, and "
        "a + adds a key its config has already: drop the +: plugins.salus.policy=srtf (it "
        "reaches the points of the sweep that select it)")
    fixed = [*TINY, "cluster.mode=none", "+plugins=[],[salus]", "plugins.salus.policy=srtf"]
    fixed = force_settings_of_swept_plugins(fixed, plugin_selections(fixed))  # as `run` does
    without, with_salus = prepared_configs(fixed, registry, multirun=True)
    assert with_salus.plugins.salus.policy == "srtf" and "capacity" in with_salus.plugins.salus
    assert "capacity" not in without.plugins.salus  # the stray entry a run drops


@pytest.mark.parametrize("overrides, needle", [
    (["plugins.salus.policy=srtf"], "which this run does not select; add +plugins=[salus]"),
    # Hydra's fixes were on the lines after the one kept, or named another fix
    (["+plugins=salus,tictac"], "'+plugins=salus,tictac' lists several plugins without "
     "brackets; select them all with +plugins=[salus,tictac] (or run one each as a sweep: "
     "add -m)"),
    (["run.seed=0,1"], "'run.seed=0,1' gives several values outside a sweep: add -m to run "
     "one each, give a list (run.seed=[0,1]), or quote them for one string (run.seed='0,1')"),
    (["+experiment=salus_tictac"], "'+experiment=salus_tictac': experiment is in accelopt's "
     "defaults list already (null unless chosen), so the + adds it a second time; drop the +: "
     "experiment=salus_tictac"),
    (["+plugins=[salus]", "+plugins.salus.policy=srtf"], "drop the +: plugins.salus.policy=srtf"),
    (["plugins.salsa.policy=srtf"], "no plugin 'salsa' is installed; did you mean 'salus'?"),
    (["plugins=[salus]"], "plugins are selected with a leading +: +plugins=[salus]"),
    (["workload=digit"], "no workload 'digit'; did you mean 'digits'?"),
    (["cluster.bucket_mb=0"], "cluster.bucket_mb must be > 0 (MiB per gradient bucket), got 0"),
])
def test_config_mistakes_name_the_fix(overrides, needle, tmp_path):
    import accelopt
    from accelopt.errors import UserError

    with pytest.raises(UserError) as info:
        accelopt.run([*TINY, *overrides], run_dir=tmp_path / "never")
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_version_empty_selection_and_refusals_that_leave_no_directory(tmp_path):
    version = accelopt("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("accelopt ")
    assert "torch" in version.stdout
    empty = accelopt("run", *TINY, "+plugins=[]", f"hydra.run.dir={tmp_path / 'empty'}",
                     cwd=tmp_path)
    assert empty.returncode == 0, empty.stderr  # no plugins, as without the override
    assert (tmp_path / "empty" / "metrics.json").exists()
    # refused by the validation inside the run (after Hydra made the directory): exit 2,
    # one line, and no directory left behind; --debug adds the traceback, same exit code
    for extra in ([], ["--debug"]):
        out = tmp_path / f"refused{len(extra)}"
        refused = accelopt("run", *TINY, "run.checkpoint_every=-1", f"hydra.run.dir={out}",
                           *extra, cwd=tmp_path)
        assert refused.returncode == 2, refused.stderr
        assert "run.checkpoint_every must be >= 0" in refused.stderr
        assert ("Traceback" in refused.stderr) == bool(extra)
        assert not out.exists(), sorted(p.name for p in out.rglob("*"))


@pytest.mark.parametrize("outcome,code", [(None, 0), (SystemExit(2), 2), (SystemExit(None), 0),
                                          (SystemExit("bad"), 1)])
def test_the_command_exits_with_mains_code_and_flushed_output(monkeypatch, capsys, outcome,
                                                              code):
    """``console`` (the installed command) ends the process with ``main``'s exit code, its
    output flushed; a message given to ``sys.exit`` is printed, as Python would."""
    import accelopt.cli.main as cli

    def fake_main() -> None:
        print("written")
        if outcome is not None:
            raise outcome

    exits = []

    def fake_exit(value: int) -> None:
        exits.append(value)
        raise KeyboardInterrupt  # stands in for the process ending here

    import accelopt.drivers.processes as processes

    released = []
    monkeypatch.setattr(cli, "main", fake_main)
    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    # what an ending process releases (its pymp-* directory, where this test session's
    # forkserver has its socket) is not this process's to release
    monkeypatch.setattr(processes, "release_before_exit", lambda: released.append(1))
    with pytest.raises(KeyboardInterrupt):
        cli.console()
    assert released == [1]
    captured = capsys.readouterr()
    assert exits == [code]
    assert "written" in captured.out
    assert ("bad" in captured.err) == (code == 1)


_FORKSERVER_AT_RUN = """
import sys
from multiprocessing import forkserver

import accelopt.cli.hydra_run as hydra_run
from accelopt.cli.main import _run

seen = []
hydra_run.run_hydra = lambda rest, registry, debug: seen.append(
    forkserver._forkserver._forkserver_pid is not None) or 0
_run(sys.argv[1:], False)
print("running at run:", seen[0], "after:", forkserver._forkserver._forkserver_pid is not None)
"""


@pytest.mark.parametrize(("args", "at_run"), [
    ([], True),  # the default, a parameter-server run: started before Hydra, kept for it
    (["--cfg", "job"], False),  # prints the config: stopped after composing
    (["cluster.mode=none"], False),  # says it is local: never started
    (["workload=tiny"], False),  # a local workload: started only once composed, if at all
    (["workload=tiny", "cluster.mode=ps"], True),  # says it is a cluster run
])
def test_the_ranks_forkserver_starts_before_the_config_and_only_stays_for_a_cluster_run(
        args, at_run, tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FORKSERVER_AT_RUN, *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"running at run: {at_run} after: False" in out.stdout


def test_hydra_composes_the_run_once_and_its_mode_comes_from_the_command_line(
        tmp_path, monkeypatch):
    """Hydra's ``get_mode`` composed the whole config only to read ``hydra.mode``: now the
    command line's ``-m`` decides (the configs never set it, checked below), one composition
    fewer; a ``hydra.mode`` override still goes through Hydra's own ``get_mode``."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.hydra import Hydra
    from hydra.core.global_hydra import GlobalHydra

    from accelopt.cli.hydra_run import config_dir, mode_from_the_command_line
    from accelopt.cli.main import main
    from accelopt.config import register_schema

    original = Hydra.get_mode
    composed: list[str] = []
    real = Hydra.compose_config

    def counting(self, *args, **kwargs):
        composed.append(str(kwargs.get("run_mode")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Hydra, "compose_config", counting)
    try:
        main(["run", *TINY, f"hydra.run.dir={tmp_path / 'run'}"])
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
    assert (tmp_path / "run" / "metrics.json").is_file()
    assert len(composed) == 2, composed  # accelopt's check and Hydra's run, no get_mode
    assert Hydra.get_mode is original  # put back
    with mode_from_the_command_line(["hydra.mode=MULTIRUN"]):
        assert Hydra.get_mode is original
    # What makes the shortcut right: no config of this project sets hydra.mode.
    GlobalHydra.instance().clear()
    groups = [f"{g.name}={p.stem}" for g in Path(config_dir()).iterdir() if g.is_dir()
              for p in g.glob("*.yaml")]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        for choice in [None, *groups]:
            register_schema([choice] if choice else [])  # a preset's plugins, as a run does
            cfg = compose("config", overrides=[choice] if choice else [],
                          return_hydra_config=True)
            assert cfg.hydra.mode is None, choice
    GlobalHydra.instance().clear()


def test_run_help_says_how_to_select_plugins(tmp_path):
    """Hydra's help listed the workloads and the config but not how to select a plugin
    (the plugin group is registered only for the plugins a command selects)."""
    result = accelopt("run", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("accelopt run [OVERRIDES]: train the configured workload")
    assert "Select plugins with +plugins=[a,b] (`accelopt plugins` lists" in result.stdout
    assert "workload: default, digits, lm" in result.stdout
    assert not (tmp_path / "runs").exists()  # help runs nothing


@pytest.mark.timeout(150)
def test_sigterm_in_the_reference_runs_ends_with_the_command_that_resumes(tmp_path):
    """SIGTERM while a run.compare reference run trained: exit 143 with a bare
    'terminated (SIGTERM)' (the run's own directory held no metrics.json), and the
    directory, without config.yaml, was refused by run.resume."""
    import signal
    import subprocess
    import time

    from clirun import accelopt_cmd, cli_env

    proc = subprocess.Popen(
        accelopt_cmd("run", "workload=single", "workload.jobs.0.iterations=1000000",
                     "workload.jobs.0.width=8", "run.compare=baseline", "+plugins=[noop]",
                     "run.checkpoint_every=10", "run.progress=false", "hydra.run.dir=out"),
        cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    refs = tmp_path / "out" / "compare"
    deadline = time.monotonic() + 90
    while not list(refs.rglob("checkpoints/*.pt")) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling for the reference run's first checkpoint: it trains
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    out = tmp_path / "out"
    assert err.strip().splitlines()[-1] == (
        "terminated (SIGTERM) during the run.compare=baseline reference runs, before this "
        f"run's own jobs began: what they ran is kept in {refs}; run it again (the reference "
        f"runs start over) with: accelopt run run.resume={out}"), err
    from accelopt.runtime.resume_target import resume_target

    assert resume_target(str(out)) == out  # accepted: it holds the config the run needs


def test_a_line_on_stderr_is_one_write_so_ranks_sharing_it_do_not_run_together():
    """torchrun's ranks share stderr; Python wrote a printed line and its newline apart, so
    two ranks' refusals came out as ``...run without torchrunerror: cluster.mode=...``."""
    import io

    from accelopt.cli.main import whole_lines_on_stderr

    class Descriptor(io.RawIOBase):
        def __init__(self) -> None:
            self.writes: list[bytes] = []

        def writable(self) -> bool:
            return True

        def write(self, data) -> int:
            self.writes.append(bytes(data))
            return len(data)

    descriptor = Descriptor()
    stderr = io.TextIOWrapper(descriptor, encoding="utf-8",  # type: ignore[arg-type]
                              write_through=True)  # each write reaches the descriptor
    whole_lines_on_stderr(stderr)
    print("error: one", file=stderr)
    print("progress 50%", end="\r", file=stderr)
    print("error: two", file=stderr)
    assert descriptor.writes == [b"error: one\n", b"progress 50%\r", b"error: two\n"]
