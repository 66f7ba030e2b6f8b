"""A sweep that repeats a point (a bench's repeats of each plugin set) composes and checks
each distinct point once before Hydra starts: composing is ~0.3 s a point, and a 100-run
bench spent half a minute before its first run."""

from __future__ import annotations

import pytest
from clirun import accelopt_in_process

from accelopt.cli import hydra_run
from accelopt.plugin import Registry


@pytest.mark.timeout(120)
def test_repeated_points_are_composed_once_and_each_gets_its_own_directory(tmp_path,
                                                                          monkeypatch):
    calls: list[list[str]] = []
    compose = hydra_run.compose

    def counting(*args, **kwargs):
        calls.append(list(kwargs["overrides"]))
        return compose(*args, **kwargs)

    monkeypatch.setattr(hydra_run, "compose", counting)
    overrides = ["+plugins=[],[noop],[],[noop],[]", "workload=tiny", "run.progress=false",
                 f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.sweep.subdir=${hydra.job.num}"]
    configs, dirs = hydra_run.prepared_points(overrides, Registry.discover(), multirun=True)
    assert len(calls) == 2  # [] and [noop], once each
    assert [d.point for d in dirs] == [str(tmp_path / "sweep" / str(i)) for i in range(5)]
    assert [sorted(c.get("plugins") or {}) for c in configs] == [[], ["noop"], [], ["noop"], []]
    assert configs[0] == configs[2] and configs[0] is not configs[2]
    configs[0].run.seed = 99  # each point's config is its own
    assert configs[2].run.seed != 99 and "hydra" not in configs[2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("sweep", "line"), [
    (["+plugins=[],[salus]", "plugins.salus.max_lanes=-7"],
     "sweep point #1 (+plugins=[salus]): plugins.salus.max_lanes must be -1"),
    (["+plugins=[salus]", "plugins.salus.max_lanes=2,-7"],
     "sweep point #1 (plugins.salus.max_lanes=-7): plugins.salus.max_lanes must be -1"),
    (["+plugins=[],[salus]", "plugins.salus.max_lanes=2,-7"],  # no "++" of its rewrite
     "sweep point #3 (+plugins=[salus] plugins.salus.max_lanes=-7): plugins.salus.max_lanes"),
    (["workload.jobs.0.lr=abc,0.1"],  # the first point, refused alone: a type, composing
     "sweep point #0 (workload.jobs.0.lr=abc): workload.jobs[0].lr: Value 'abc'"),
    (["run.seed=1,2", "workload.jobs.0.lr=-1"],  # every point's setting: no point named
     "job 'tiny-mlp': lr must be a finite number > 0"),
])
def test_a_refused_point_is_named_and_checked_as_it_will_run(tmp_path, sweep, line, capfd):
    """Checked before the sweep runs, a point's refusal did not say which point (of a 12-set
    sweep, the user had to work out which sets select the plugin), and a point that does not
    select a plugin was checked with that plugin's setting, which it will not run with."""
    result = accelopt_in_process("run", "-m", *sweep, "workload=tiny", "cluster.mode=none",
                                 "run.progress=false", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                                 cwd=tmp_path, capfd=capfd)
    err = result.stderr.strip()
    assert result.returncode == 2 and err.startswith(f"error: {line}"), result
    assert len(err.splitlines()) == 1 and not (tmp_path / "sweep").exists()
