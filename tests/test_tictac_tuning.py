"""priority's measured window and chunk size (plugins/tictac/tuning.py): the schedule, which
iterations are timed, the choice, and staying out when the default order measures fastest."""

from __future__ import annotations

import pytest
from accelopt_plugins.tictac.tuning import OFF, Window, WindowTuner, candidates_from

W0, W64 = Window(0), Window(65536)

pytestmark = pytest.mark.timeout(30)


def run(tuner: WindowTuner, seconds: dict, until: int) -> list:
    """Ask for each iteration's candidate, then report its time, as the hooks do."""
    chosen = []
    for i in range(until):
        c = tuner.candidate(i)
        chosen.append(c)
        tuner.record(i, seconds[c])
    return chosen


def test_each_candidate_in_turn_then_the_fastest():
    tuner = WindowTuner((OFF, W0, W64), start=2, block=2, rounds=2)
    assert tuner.end == 2 + 3 * 2 * 2
    got = run(tuner, {OFF: 0.20, W0: 0.15, W64: 0.16}, 18)
    assert got[:2] == [OFF, OFF]  # warm-up: nothing changed
    assert got[2:14] == [OFF, OFF, W0, W0, W64, W64] * 2  # interleaved rounds
    assert got[14:] == [W0] * 4
    assert tuner.decided and tuner.chosen == W0
    # only a block's later iterations are timed: 2 per candidate (one per block, 2 rounds)
    assert {c: len(v) for c, v in tuner.timed().items()} == {OFF: 2, W0: 2, W64: 2}
    assert "chose credit 0 B" in tuner.describe()


def test_a_blocks_first_iteration_is_not_timed():
    """The first iteration of a block carries its predecessor's mode: a huge time there
    must not decide anything."""
    tuner = WindowTuner((OFF, W0), start=0, block=2, rounds=1)
    tuner.record(0, 0.2)
    tuner.record(1, 0.2)
    tuner.record(2, 99.0)  # first of credit 0's block
    tuner.record(3, 0.1)
    assert tuner.candidate(4) == W0


def test_stays_out_when_the_default_order_is_fastest_or_tied():
    tuner = WindowTuner((OFF, W0), start=0, block=2, rounds=3)
    run(tuner, {OFF: 0.10, W0: 0.10}, 14)
    assert tuner.chosen is OFF  # a tie keeps the default
    assert "chose off" in tuner.describe()


def test_the_choice_waits_for_the_last_timed_iteration():
    """The server asks for iteration e's order before iteration e-1 has ended: until then
    it keeps the last block's candidate."""
    tuner = WindowTuner((OFF, W0), start=0, block=2, rounds=1)
    for i, seconds in enumerate((0.3, 0.3, 0.1)):
        tuner.record(i, seconds)
    assert tuner.candidate(3) == W0
    assert tuner.candidate(4) == W0 and not tuner.decided  # iteration 3 not in yet
    tuner.record(3, 0.1)
    assert tuner.candidate(5) == W0 and tuner.decided


def test_candidates_from_settings():
    assert candidates_from(4096, [0, 1], force=False) == (Window(4096),)
    assert candidates_from(-1, [0, 65536], force=False) == (OFF, W0, W64)
    assert candidates_from(-1, [0, 65536], force=True) == (W0, W64)
    one = WindowTuner((W0,), start=2)
    assert one.candidate(0) == W0 and one.candidate(50) == W0  # fixed from the start


def test_the_grid_of_windows_and_chunk_sizes_skips_chunks_without_a_window():
    """Without a window every chunk starts at once (nothing to preempt): not measured."""
    grid = candidates_from(-1, [0, 65536], False, -1, [0, 262144])
    assert grid == (OFF, W0, W64, Window(65536, 262144))
    assert candidates_from(65536, [], False, -1, [0, 4096]) == (
        OFF, W64, Window(65536, 4096))
    assert candidates_from(0, [], False, 4096) == (Window(0, 4096),)  # as configured
    assert Window(65536, 4096).key == "credit_65536_part_4096" and W0.key == "credit_0"
