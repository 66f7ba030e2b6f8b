"""``collector_paused``: the cyclic collector off inside, restored as it was; ``imports_frozen``:
the same, then what exists frozen."""

from __future__ import annotations

import gc

import pytest

from accelopt.collector import collector_paused, imports_frozen


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


def test_a_command_line_start_up_freezes_what_it_imported_and_nothing_on_an_error():
    """``imports_frozen``: paused inside, then what exists frozen; an error freezes nothing;
    disabled (a library caller's process), nothing happens at all."""
    before = gc.get_freeze_count()
    try:
        with pytest.raises(ValueError), imports_frozen():
            assert not gc.isenabled()
            raise ValueError
        assert gc.isenabled() and gc.get_freeze_count() == before
        with imports_frozen(False):
            assert gc.isenabled()
        assert gc.get_freeze_count() == before
        kept = [[] for _ in range(1000)]  # containers made inside: frozen with the rest
        with imports_frozen():
            assert not gc.isenabled()
            kept += [[] for _ in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() >= before + 2000
    finally:
        gc.unfreeze()  # this test process goes on: give the objects back to the collector
