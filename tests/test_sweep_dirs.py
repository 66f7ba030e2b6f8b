"""Where a run or a sweep's points write, resolved before Hydra writes anything: two points of
a sweep never share a directory, and a ``${...}`` in a named directory is the directory
checked (it was taken literally, and the run it named was written over)."""

from __future__ import annotations

from pathlib import Path

import pytest
from clirun import accelopt, accelopt_in_process, run_files

from accelopt.cli.hydra_run import prepared_configs
from accelopt.cli.run_dirs import pin_run_dir
from accelopt.errors import ConfigError
from accelopt.plugin import Registry

pytestmark = pytest.mark.timeout(180)

TINY = ["workload=tiny", "run.progress=false"]
SHARED = ("points #0 and #1 of the sweep both write to {dir} (hydra.sweep.subdir="
          "${{workload.name}}), each over the one before; make hydra.sweep.subdir differ per "
          "point: include ${{hydra.job.num}} (e.g. hydra.sweep.subdir=${{workload.name}}_"
          "${{hydra.job.num}}) or drop it")


@pytest.mark.parametrize("sweep", [["run.seed=0,1"], ["workload.jobs.0.lr=0.01,0.1"],
                                   ["workload.jobs.0.lr=0.01,0.1", "hydra/launcher=salus",
                                    "cluster.mode=none"]],
                         ids=["seeds", "lrs", "salus-launcher"])
def test_two_points_of_a_sweep_in_one_directory_refuse_the_sweep_before_it_runs(tmp_path, capfd,
                                                                                 sweep):
    """``hydra.sweep.subdir=${workload.name}`` in a seed sweep: both points printed the same
    run directory, the second wrote over the first, and the sweep exited 0 (its subdir has a
    ``${``, which was all that was checked; the points run in one process, whose claim on the
    directory the second point took for its own)."""
    result = accelopt_in_process("run", "-m", *TINY, *sweep,
                                 "hydra.sweep.subdir=${workload.name}", "hydra.sweep.dir=sw",
                                 cwd=tmp_path, capfd=capfd)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"error: {SHARED.format(dir='sw/tiny')}"
    assert not (tmp_path / "sw").exists()


def test_points_are_resolved_one_by_one_as_hydra_numbers_them(tmp_path):
    """In-process, no subprocess: a subdir that differs per point (Hydra's own
    ``${hydra.job.override_dirname}``, ``${hydra:...}``, a swept key) is taken, one that does
    not is refused at its second point."""
    registry = Registry.discover()
    sweep = [*TINY, "run.seed=0,1", f"hydra.sweep.dir={tmp_path / 'sw'}"]
    for subdir in ["${hydra.job.override_dirname}", "${hydra:job.override_dirname}",
                   "s${run.seed}", "${hydra.job.num}"]:
        configs = prepared_configs([*sweep, f"hydra.sweep.subdir={subdir}"], registry,
                                   multirun=True)
        assert [c.run.seed for c in configs] == [0, 1]
    for subdir in ["${workload.name}", "fixed", "${hydra:job.name}"]:
        with pytest.raises(ConfigError, match=r"^points #0 and #1 of the sweep both write to "):
            prepared_configs([*sweep, f"hydra.sweep.subdir={subdir}"], registry, multirun=True)
    assert not (tmp_path / "sw").exists()


def test_a_point_whose_directory_resolves_only_when_it_runs_is_refused_then(
        tmp_path, monkeypatch, capsys):
    """The same check where the directory resolved only once Hydra ran the point (here: the
    up-front check left out): the second point is refused in one line, the first point's
    outputs and claim stay, and the sweep ends non-zero naming it."""
    import accelopt.cli.hydra_run as hydra_run
    from accelopt.cli.main import main
    from accelopt.runtime.run_dir import CLAIM_FILE

    monkeypatch.setattr(hydra_run, "refuse_one_directory_for_two_points", lambda where: None)
    with pytest.raises(SystemExit) as ended:
        main(["run", "-m", *TINY, "cluster.mode=none", "run.seed=0,1",
              f"hydra.sweep.dir={tmp_path / 'sw'}", "hydra.sweep.subdir=fixed"])
    assert ended.value.code == 2
    first = tmp_path / "sw" / "fixed"
    assert (first / "metrics.json").is_file() and (first / CLAIM_FILE).is_file()
    assert "seed: 0" in (first / "config.yaml").read_text()
    shared = SHARED.replace("${{workload.name}}", "fixed").format(dir=first)
    assert capsys.readouterr().err.strip().splitlines()[-2:] == [
        f"error: {shared}", f"error: 1 of 2 runs of the sweep failed: #1 ({shared})"]


def test_a_run_directory_with_an_interpolation_is_checked_where_it_resolves(tmp_path):
    """``hydra.run.dir=ip_${workload.name}`` into a directory holding a run: the run was
    refused only after Hydra had rewritten the earlier run's .hydra/ (its config, seed 7)
    and the refusal was appended to its log; now it is refused before anything is written."""
    out = tmp_path / "ip_tiny"
    out.mkdir()
    (out / "metrics.json").write_text("{}\n")
    (out / "accelopt.log").write_text("the earlier run\n")
    before = run_files(out)
    again = accelopt("run", *TINY, "run.seed=7", "hydra.run.dir=ip_${workload.name}",
                     cwd=tmp_path)
    assert again.returncode == 2
    assert again.stderr.strip() == (
        "error: ip_tiny already holds a run (metrics.json); give this run another directory "
        "(hydra.run.dir / run_dir), or remove that one: results are never overwritten")
    assert run_files(out) == before


def test_a_sweep_directory_with_an_interpolation_is_checked_where_it_resolves(tmp_path):
    """The same for ``hydra.sweep.dir=sp_${workload.name}``: multirun.yaml and each point's
    .hydra/ were rewritten before a point was refused."""
    earlier = tmp_path / "sp_tiny"
    (earlier / "0").mkdir(parents=True)
    (earlier / "multirun.yaml").write_text("the earlier sweep\n")
    (earlier / "0" / "metrics.json").write_text("{}\n")
    before = run_files(earlier)
    again = accelopt("run", "-m", *TINY, "run.seed=3,4", "hydra.sweep.dir=sp_${workload.name}",
                     cwd=tmp_path)
    assert again.returncode == 2
    assert again.stderr.strip() == (
        "error: hydra.sweep.dir sp_tiny already holds files (an earlier sweep's runs?); give "
        "this sweep another directory, or remove that one: results are never overwritten")
    assert run_files(earlier) == before


def test_the_resolved_run_directory_is_the_one_hydra_is_given():
    """What was checked is what is claimed and written (a ``${now:...}`` resolves once)."""
    args = ["workload=tiny", "hydra.run.dir=out/${workload.name}/${now:%f}", "run.seed=1"]
    assert pin_run_dir(args, "out/tiny/123456") == [
        "workload=tiny", "hydra.run.dir=out/tiny/123456", "run.seed=1"]
    assert pin_run_dir(["++hydra.run.dir=${x}"], "/abs/y") == ["++hydra.run.dir=/abs/y"]
    # what an override could not give unquoted, and nothing resolved: left to Hydra
    assert pin_run_dir(args, "out/a b,c") == args
    assert pin_run_dir(args, None) == args


def test_a_named_directory_without_an_interpolation_is_composed_once(tmp_path):
    """Resolving the directories costs nothing where there is nothing to resolve: a single
    run's literal hydra.run.dir is composed without Hydra's own node."""
    import accelopt.cli.hydra_run as hydra_run

    seen: list[int | None] = []
    real = hydra_run.compose_point

    def spy(overrides, job_num=None, *rest):
        seen.append(job_num)
        return real(overrides, job_num, *rest)

    hydra_run.compose_point = spy
    try:
        hydra_run.prepare([*TINY, f"hydra.run.dir={tmp_path / 'x'}"], Registry.discover(),
                          multirun=False)
        modes, pinned = hydra_run.prepare([*TINY, f"hydra.run.dir={tmp_path}/${{workload.name}}"],
                                          Registry.discover(), multirun=False)
    finally:
        hydra_run.compose_point = real
    assert seen == [None, 0] and pinned == str(Path(tmp_path) / "tiny") and modes == set()
