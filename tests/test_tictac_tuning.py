"""priority's measured credit window (plugins/tictac/tuning.py): the schedule, which
iterations are timed, the choice, and staying out when the default order measures fastest."""

from __future__ import annotations

import pytest
from accelopt_plugins.tictac.tuning import OFF, CreditTuner, candidates_from

pytestmark = pytest.mark.timeout(30)


def run(tuner: CreditTuner, seconds: dict, until: int) -> list:
    """Ask for each iteration's candidate, then report its time, as the hooks do."""
    chosen = []
    for i in range(until):
        c = tuner.candidate(i)
        chosen.append(c)
        tuner.record(i, seconds[c])
    return chosen


def test_each_candidate_in_turn_then_the_fastest():
    tuner = CreditTuner((OFF, 0, 65536), start=2, block=2, rounds=2)
    assert tuner.end == 2 + 3 * 2 * 2
    got = run(tuner, {OFF: 0.20, 0: 0.15, 65536: 0.16}, 18)
    assert got[:2] == [OFF, OFF]  # warm-up: nothing changed
    assert got[2:14] == [OFF, OFF, 0, 0, 65536, 65536] * 2  # interleaved rounds
    assert got[14:] == [0] * 4
    assert tuner.decided and tuner.chosen == 0
    # only a block's later iterations are timed: 2 per candidate (one per block, 2 rounds)
    assert {c: len(v) for c, v in tuner.timed().items()} == {OFF: 2, 0: 2, 65536: 2}
    assert "chose credit 0 B" in tuner.describe()


def test_a_blocks_first_iteration_is_not_timed():
    """The first iteration of a block carries its predecessor's mode: a huge time there
    must not decide anything."""
    tuner = CreditTuner((OFF, 0), start=0, block=2, rounds=1)
    tuner.record(0, 0.2)
    tuner.record(1, 0.2)
    tuner.record(2, 99.0)  # first of credit 0's block
    tuner.record(3, 0.1)
    assert tuner.candidate(4) == 0


def test_stays_out_when_the_default_order_is_fastest_or_tied():
    tuner = CreditTuner((OFF, 0), start=0, block=1, rounds=3)
    run(tuner, {OFF: 0.10, 0: 0.10}, 8)
    assert tuner.chosen is OFF  # a tie keeps the default
    assert "chose off" in tuner.describe()


def test_the_choice_waits_for_the_last_timed_iteration():
    """The server asks for iteration e's order before iteration e-1 has ended: until then
    it keeps the last block's candidate."""
    tuner = CreditTuner((OFF, 0), start=0, block=1, rounds=1)
    tuner.record(0, 0.3)
    assert tuner.candidate(1) == 0
    assert tuner.candidate(2) == 0 and not tuner.decided  # iteration 1 not in yet
    tuner.record(1, 0.1)
    assert tuner.candidate(3) == 0 and tuner.decided


def test_candidates_from_settings():
    assert candidates_from(4096, [0, 1], force=False) == (4096,)
    assert candidates_from(-1, [0, 65536], force=False) == (OFF, 0, 65536)
    assert candidates_from(-1, [0, 65536], force=True) == (0, 65536)
    one = CreditTuner((0,), start=2)
    assert one.candidate(0) == 0 and one.candidate(50) == 0  # a fixed window from the start
