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
