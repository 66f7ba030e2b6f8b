"""A resume runs the old run's configuration: an override that would change it is refused
in one line (an empty plugin list included, which a new run drops as the default), and one
the old run was started with (its command line pasted back, plus ``run.resume``) changes
nothing, so it is taken."""

from __future__ import annotations

import pytest
from clirun import accelopt_in_process, the_error_line
from omegaconf import OmegaConf

pytestmark = pytest.mark.timeout(180)

FIRST = ["workload=tiny", "run.progress=false", "+plugins=[noop]"]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """A finished run of ``FIRST`` (``.hydra/overrides.yaml`` and all), made in this
    process; each test resumes it with ``run.resume_finished=true``."""
    import torch

    from accelopt.cli.main import main

    where = tmp_path_factory.mktemp("first")
    threads = torch.get_num_threads()
    try:
        main(["run", *FIRST, f"hydra.run.dir={where / 'run'}"])
    except SystemExit as exc:
        assert not exc.code, exc.code
    finally:
        torch.set_num_threads(threads)
    assert (where / "run" / "metrics.json").is_file()
    return where / "run"


@pytest.mark.parametrize("empty", ["+plugins=[]", "plugins=[]", "++plugins=[ ]"])
def test_an_empty_plugin_list_on_a_resume_is_refused(first, tmp_path, capfd, empty):
    result = accelopt_in_process("run", f"run.resume={first}", "run.resume_finished=true",
                                 empty, "hydra.run.dir=again", cwd=tmp_path, capfd=capfd)
    assert result.returncode == 2, result.stderr
    assert the_error_line(result) == (
        f"error: run.resume continues {first} with the configuration it ran with, so "
        f"{empty} would be ignored; drop it (a new run takes them)")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "again").exists()


def test_another_plugin_list_is_still_refused(first, tmp_path, capfd):
    result = accelopt_in_process("run", f"run.resume={first}", "run.resume_finished=true",
                                 "+plugins=[clip]", "workload=tiny", "hydra.run.dir=again",
                                 cwd=tmp_path, capfd=capfd)
    assert result.returncode == 2, result.stderr
    assert the_error_line(result).endswith("so +plugins=[clip] would be ignored; drop it "
                                           "(a new run takes them)")


def test_the_runs_own_overrides_repeated_are_taken(first, tmp_path, capfd):
    result = accelopt_in_process("run", f"run.resume={first}", "run.resume_finished=true",
                                 "workload=tiny", "+plugins=[ noop ]", "run.progress=false",
                                 "hydra.run.dir=again", cwd=tmp_path, capfd=capfd)
    assert result.returncode == 0, result.stderr
    assert "would be ignored" not in result.stderr
    again = tmp_path / "again"
    assert (again / "metrics.json").is_file()
    assert "+plugins=[ noop ]" in OmegaConf.load(again / ".hydra" / "overrides.yaml")
    assert "noop" in OmegaConf.load(again / "config.yaml").plugins


def test_a_sweeps_empty_point_resumed_with_its_own_empty_list(tmp_path, capfd):
    """A sweep's ``+plugins=[]`` point was started with that override: repeated on its
    resume it changes nothing, and is taken (Hydra cannot compose it on a single run)."""
    result = accelopt_in_process("run", "-m", "+plugins=[],[noop]", "workload=tiny",
                                 "run.progress=false", "hydra.sweep.dir=sw", cwd=tmp_path,
                                 capfd=capfd)
    assert result.returncode == 0, result.stderr
    point = tmp_path / "sw" / "0"
    assert "+plugins=[]" in OmegaConf.load(point / ".hydra" / "overrides.yaml")
    result = accelopt_in_process("run", f"run.resume={point}", "run.resume_finished=true",
                                 "+plugins=[]", "hydra.run.dir=again", cwd=tmp_path,
                                 capfd=capfd)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "again" / "metrics.json").is_file()
