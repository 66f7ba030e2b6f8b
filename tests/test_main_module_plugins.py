"""A plugin defined where a rank cannot import it, and a run interrupted from Python.

A class of ``__main__`` pickles by name, so one defined in an interactive session or under a
script's ``if __name__ == "__main__":`` passed the up-front check, and every rank then failed
to load it; the run ended ~19 s later with "exited with code 1 before its first iteration".
A Ctrl-C (or SIGTERM) during ``accelopt.run`` reached the caller bare, never saying where the
run's outputs went, where the command prints that line.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

import accelopt
from accelopt.drivers.cluster.carried import Carried
from accelopt.errors import Terminated, UserError
from accelopt.plugin import PluginSpec

pytestmark = pytest.mark.timeout(120)
TINY = ["workload=tiny", "run.progress=false", "run.telemetry_interval_s=5",
        "run.compare=none"]

SCRIPT = '''\
import dataclasses


class AtModuleLevel:
    def __init__(self, config=None):
        pass


if __name__ == "__main__":
    @dataclasses.dataclass
    class GuardedConfig:
        rate: float = 0.5

    class Guarded:
        def __init__(self, config=None):
            pass
'''


def _interactive_main(monkeypatch: pytest.MonkeyPatch) -> type:
    """A ``__main__`` without ``__file__`` (``python -c``, ``python -i``, a notebook) holding
    a plugin class, found there by name as pickle finds it; restored after the test."""
    main = types.ModuleType("__main__")

    class Mine:
        def __init__(self, config: object = None) -> None:
            pass

    Mine.__module__, Mine.__qualname__ = "__main__", "Mine"
    main.Mine = Mine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "__main__", main)
    return Mine


def _script_main(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> types.ModuleType:
    """``SCRIPT`` run as ``python train.py`` runs it: its guard's body too."""
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    main = types.ModuleType("__main__")
    main.__file__ = str(path)
    monkeypatch.setitem(sys.modules, "__main__", main)
    exec(compile(SCRIPT, str(path), "exec"), vars(main))
    return main


def test_a_class_of_an_interactive_session_is_refused_in_one_line(monkeypatch):
    mine = _interactive_main(monkeypatch)
    with pytest.raises(UserError) as info:
        Carried(plugins={"mine": PluginSpec(name="mine", factory=mine)}).check()
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith("plugin 'mine' was added in code and cannot be sent")
    assert "class Mine is defined in an interactive session" in line
    assert line.endswith("define it in a module file and import it")


@pytest.mark.parametrize("field", ["factory", "config"])
def test_a_class_under_the_main_guard_is_refused_naming_its_line(field, monkeypatch, tmp_path):
    main = _script_main(monkeypatch, tmp_path)
    spec = PluginSpec(name="mine", factory=main.Guarded) if field == "factory" else \
        PluginSpec(name="mine", factory=main.AtModuleLevel, config=main.GuardedConfig)
    with pytest.raises(UserError) as info:
        Carried(plugins={"mine": spec}).check()
    line = str(info.value)
    name, number = ("Guarded", 14) if field == "factory" else ("GuardedConfig", 10)
    assert "\n" not in line
    assert (f"class {name} is defined under `if __name__ == \"__main__\":` in "
            f"{tmp_path / 'train.py'} (line {number})") in line
    assert "define it at module level of the script (above the guard)" in line


def test_a_class_at_module_level_of_the_script_is_sent(monkeypatch, tmp_path):
    """The ranks import the script again: what its module level defines is there."""
    main = _script_main(monkeypatch, tmp_path)
    Carried(plugins={"mine": PluginSpec(name="mine", factory=main.AtModuleLevel)}).check()


def test_accelopt_run_refuses_it_before_a_rank_starts(monkeypatch, tmp_path):
    """The run the user reported: it started three ranks that could not load the class."""
    mine = _interactive_main(monkeypatch)
    registry = accelopt.Registry.discover()
    registry.add(PluginSpec(name="mine", factory=mine))
    with pytest.raises(UserError, match="class Mine is defined in an interactive session"):
        accelopt.run([*TINY, "cluster.mode=ps", "+plugins=[mine]"],
                     run_dir=tmp_path / "out", registry=registry)
    assert not list(tmp_path.rglob("metrics.json"))


@pytest.mark.parametrize("stop", [Terminated])
def test_an_interrupted_run_says_where_its_outputs_are(stop, monkeypatch, tmp_path):
    """Stopped after its first checkpoint, with the default run directory (a notebook's
    user does not know its name): the exception carries the command's line. (SIGTERM's
    ``Terminated`` is a ``KeyboardInterrupt``: Ctrl-C takes the same path.)"""
    import accelopt.job.checkpoint as checkpoint

    real = checkpoint.Checkpointer.after_iteration

    def stop_after_a_checkpoint(self, job, result):  # type: ignore[no-untyped-def]
        real(self, job, result)
        if self.written:
            raise stop()

    monkeypatch.setattr(checkpoint.Checkpointer, "after_iteration", stop_after_a_checkpoint)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(stop) as info:
        accelopt.run([*TINY, "run.checkpoint_every=2"])
    (run_dir,) = [p.parent for p in tmp_path.glob("runs/*/*/config.yaml")]
    line = str(info.value)
    said = "terminated (SIGTERM)" if stop is Terminated else "interrupted (Ctrl-C)"
    assert line.startswith(f"{said}: what ran is kept in {run_dir.relative_to(tmp_path)} (")
    assert "run.resume=" in line and "\n" not in line
    assert (run_dir / "accelopt.log").read_text().rstrip().splitlines()[-1] == line
