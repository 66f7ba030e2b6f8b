"""``collector_paused``: the cyclic collector off inside, restored as it was."""

from __future__ import annotations

import gc

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
