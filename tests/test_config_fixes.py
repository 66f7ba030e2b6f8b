"""Settings and command lines said in one line: an SGD momentum of 1 or more (refused: it
diverges, or passes unnoticed on a short job), a momentum the job's optimizer does not read
(a warning), an override Hydra cannot parse and a plugin selection split over two overrides
(refused, naming the fix)."""

from __future__ import annotations

import pytest
from clirun import accelopt

from accelopt.config import JobConfig
from accelopt.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

TINY = ["workload=tiny", "run.progress=false"]


@pytest.mark.parametrize("momentum", [1.0, 1.5, 2.0])
def test_a_momentum_of_one_or_more_is_refused(momentum):
    """SGD's velocity then never decays: momentum=1.5 diverged after ~100 iterations (blamed
    on the learning rate), momentum=2 on a 6-iteration job exited 0."""
    from accelopt.job.specs import validate_spec

    with pytest.raises(ConfigError) as refused:
        validate_spec(JobConfig(name="a", momentum=momentum))
    assert str(refused.value) == (f"job 'a': momentum must be in [0, 1) (SGD's velocity decay; "
                                  f"0.9 is usual), got {momentum}")
    for kept in (0.0, 0.9, 0.999):
        validate_spec(JobConfig(name="a", momentum=kept))


def test_a_momentum_that_is_not_a_number_names_the_range():
    from accelopt.job.specs import validate_spec

    with pytest.raises(ConfigError, match=r"momentum must be a finite number in \[0, 1\), got "
                                          r"inf"):
        validate_spec(JobConfig(name="a", momentum=float("inf")))


def test_a_momentum_set_for_an_optimizer_that_ignores_it_is_named():
    """``optimizer=adam momentum=0.5`` ran without a word, as ``min_lr`` under a constant
    schedule is named; the default momentum (never chosen) is not."""
    from accelopt.job.specs import spec_warnings

    assert spec_warnings(JobConfig(name="a", optimizer="adam", momentum=0.5)) == [
        "job 'a': momentum=0.5 has no effect with optimizer=adam (its betas are its own); "
        "optimizer=sgd uses it"]
    assert spec_warnings(JobConfig(name="a", optimizer="adamw", momentum=0.0))[0].startswith(
        "job 'a': momentum=0.0 has no effect with optimizer=adamw")
    assert spec_warnings(JobConfig(name="a", optimizer="adam")) == []  # the default
    assert spec_warnings(JobConfig(name="a", optimizer="sgd", momentum=0.5)) == []
    assert spec_warnings(JobConfig(name="a", kind="infer", optimizer="adam", momentum=0.5)) == []


FORM = ("an override is key=value (a list: key=[a,b]; plugins: +plugins=[a,b]), quoted for the "
        "shell where it holds a space or brackets: 'key=[a, b]'")


@pytest.mark.parametrize("override, line", [
    ("run.seed=[1", f"cannot read the override 'run.seed=[1': a '[' is never closed; {FORM}"),
    ("run.seed==1", "cannot read the override 'run.seed==1': '=' twice; write one: run.seed=1"),
    ("run.seed=1]", f"cannot read the override 'run.seed=1]': a ']' closes nothing; {FORM}"),
    ("run.name='abc", f"cannot read the override 'run.name='abc': a ' quote is never closed; "
                      f"{FORM}"),
    ("run.seed", f"cannot read the override 'run.seed': it has no '=' (run.seed=VALUE sets a "
                 f"key); {FORM}"),
    ("run.name=a;b", "cannot read the override 'run.name=a;b': Hydra reads ';' in a value only "
                     "inside quotes; quote the value for Hydra, and that for the shell: "
                     "\"run.name='a;b'\""),
    ("run.name=a=b", "cannot read the override 'run.name=a=b': Hydra reads '=' in a value only "
                     "inside quotes; quote the value for Hydra, and that for the shell: "
                     "\"run.name='a=b'\""),
    ("run..seed=1", "cannot read the override 'run..seed=1': its key 'run..seed' is not names "
                    f"joined by single dots (run.seed; a leading + adds a key, ~ removes one); "
                    f"{FORM}"),
])
def test_an_override_hydra_cannot_parse_is_named_with_the_fix(override, line):
    """Hydra's first line named neither ("no viable alternative at input '[1'") or the
    override only ("Error parsing override 'run.seed==1'")."""
    from accelopt.cli.hydra_run import plugin_selections

    with pytest.raises(ConfigError) as refused:
        plugin_selections(["workload=tiny", override])
    assert str(refused.value) == line


@pytest.mark.parametrize("override, fix", [
    ("++plugins=salus", "select plugins with +plugins=[salus]"),
    ("++plugins=[salus,tictac]", "select plugins with +plugins=[salus,tictac]"),
    ("++workload=tiny", "select workload with workload=tiny"),
])
def test_a_force_added_config_group_names_how_to_select_it(override, fix, tmp_path):
    """Hydra's "force-add of config groups is not supported" named no fix."""
    import accelopt

    with pytest.raises(ConfigError) as refused:
        accelopt.run([*TINY, override], run_dir=tmp_path / "never")
    assert str(refused.value) == (f"'{override}': ++ (force-add) sets keys, not config "
                                  f"groups; {fix}")
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("overrides, line", [
    (["+plugins=[noop]", "+plugins=[noop]"],
     "plugins are selected twice ('+plugins=[noop]' and '+plugins=[noop]'); list every "
     "plugin in one override: +plugins=[noop]"),
    (["+plugins=[noop]", "+plugins=[salus,tictac]"],
     "plugins are selected twice ('+plugins=[noop]' and '+plugins=[salus,tictac]'); list "
     "every plugin in one override: +plugins=[noop,salus,tictac]"),
    (["+plugins=noop", "+plugins=salus", "+plugins=[tictac]"],
     "plugins are selected 3 times ('+plugins=noop' and '+plugins=salus' and "
     "'+plugins=[tictac]'); list every plugin in one override: +plugins=[noop,salus,tictac]"),
    (["+plugins=[noop],[salus]", "+plugins=[tictac]"],
     "plugins are selected twice ('+plugins=[noop],[salus]' and '+plugins=[tictac]'); list "
     "every plugin in one override: one +plugins=[a,b] (a sweep: one -m '+plugins=[a],[a,b]')"),
])
def test_plugins_selected_by_two_overrides_are_refused(overrides, line):
    """Hydra adds both lists: ``'+plugins=[noop]' '+plugins=[noop]'`` ran noop once without a
    word, where ``+plugins=[noop,noop]`` is refused."""
    from accelopt.cli.hydra_run import plugin_selections

    with pytest.raises(ConfigError) as refused:
        plugin_selections(["workload=tiny", *overrides])
    assert str(refused.value) == line
    assert plugin_selections(["workload=tiny", "+plugins=[noop,salus]", "~plugins"]) == [
        ["noop", "salus"]]


def test_the_command_line_refuses_them_in_one_line_exit_2(tmp_path):
    """What a user types: exit 2, one line, no traceback, nothing written."""
    result = accelopt("run", *TINY, "+plugins=[noop]", "+plugins=[noop]", "run.seed==1",
                      f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path)
    assert (result.returncode, result.stderr.strip()) == (
        2, "error: cannot read the override 'run.seed==1': '=' twice; write one: run.seed=1")
    assert not (tmp_path / "out").exists()
    result = accelopt("run", *TINY, "+plugins=[noop]", "+plugins=[noop]",
                      f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path)
    assert (result.returncode, result.stderr.strip()) == (
        2, "error: plugins are selected twice ('+plugins=[noop]' and '+plugins=[noop]'); list "
           "every plugin in one override: +plugins=[noop]")
    assert not (tmp_path / "out").exists()
