"""``collector_paused``: the cyclic collector off inside, restored as it was."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest

from accelopt.collector import collector_paused


def test_the_collector_is_off_inside_and_on_again_after_an_error():
    assert gc.isenabled()
    with pytest.raises(ValueError), collector_paused():
        assert not gc.isenabled()
        raise ValueError
    assert gc.isenabled()


def test_a_caller_that_turned_it_off_keeps_it_off():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def _in_a_fresh_interpreter(code: str) -> list[str]:
    """gc.freeze is process-wide: each case runs in its own interpreter."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=60, check=True)
    return out.stdout.split()


@pytest.mark.timeout(60)
def test_the_command_pauses_it_until_the_run_starts_then_freezes_what_exists():
    seen = _in_a_fresh_interpreter("""
        import gc
        from accelopt.collector import pause_until_run_starts, run_starts
        pause_until_run_starts()
        print(gc.isenabled(), gc.get_freeze_count() == 0)
        made = [[i] for i in range(1000)]  # what the imports would make
        run_starts()
        print(gc.isenabled(), gc.get_freeze_count() >= 1000)
        frozen = gc.get_freeze_count()
        run_starts()  # once only: a sweep's later runs freeze nothing more
        print(gc.get_freeze_count() == frozen)
    """)
    assert seen == ["False", "True", "True", "True", "True"]


@pytest.mark.timeout(60)
def test_a_run_without_the_command_leaves_the_collector_alone():
    seen = _in_a_fresh_interpreter("""
        import gc
        from accelopt.collector import pause_until_run_starts, run_starts
        run_starts()  # accelopt.run() from Python: not paused, nothing frozen
        print(gc.isenabled(), gc.get_freeze_count())
        gc.disable()  # a caller that turned it off itself keeps it off
        pause_until_run_starts()
        run_starts()
        print(gc.isenabled(), gc.get_freeze_count())
    """)
    assert seen == ["True", "0", "False", "0"]


def test_a_run_command_refused_before_its_run_turns_the_collector_on_again(tmp_path,
                                                                           monkeypatch):
    """``accelopt run`` pauses the collector until its run starts; a command that ended
    before (a refused setting, or ``execute`` replaced in a test) left it off for the rest of
    the process: a later test found ``gc.isenabled()`` false."""
    from accelopt.cli.main import dispatch

    monkeypatch.chdir(tmp_path)
    assert gc.isenabled()
    from accelopt.errors import PluginResolutionError

    with pytest.raises(PluginResolutionError):  # main() makes it one line, exit 2
        dispatch(["run", "workload=tiny", "+plugins=[no_such_plugin]"], False)
    assert gc.isenabled()
