"""Benchmark scripts' figures that were not what they said: ``machine_scaling.py``'s compute
probe overflowed to inf and was dropped by the compiler (``compute 0.00x``) and it printed no
machine or settings; ``straggler.py --iterations 1`` timed its warm-up (a period below its own
wire bound); ``offload_compare.py`` printed ``-0%`` for the baseline's change against itself.
In-process, tiny sizes, no benchmark runs: behaviour only, never a speed."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import numba
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _cli  # noqa: E402
import machine_scaling  # noqa: E402
import offload_compare  # noqa: E402
import straggler  # noqa: E402

needs_two_threads = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2,
                                       reason="needs 2 numba threads")


@pytest.fixture
def sigterm_kept():
    """``_cli.run`` installs its SIGTERM handler; put pytest's back after."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def _reference(chains: int, iters: int) -> np.ndarray:
    """The compute probe's recurrence, step by step in numpy float32."""
    x = (np.arange(chains, dtype=np.float32)[:, None]
         + np.arange(4, dtype=np.float32)[None, :])
    for _ in range(iters):
        x = x * np.float32(0.9999) + np.float32(1e-4)
    return x.sum(axis=1)


@pytest.mark.timeout(120)
def test_compute_probe_stays_finite_and_its_result_is_every_step_of_the_recurrence() -> None:
    """At the script's 1e6 steps the old map (x * 1.0001) gave inf, and the compiler dropped
    the loop; the result now is finite, differs by start, and for each step count equals that
    many steps of the recurrence: the work done is the work stated."""
    out = np.zeros(4, np.float32)
    machine_scaling._compute(4, 1_000_000, out)
    assert np.isfinite(out).all()
    ends = {}
    for iters in (10, 1000):
        out = np.zeros(4, np.float32)
        machine_scaling._compute(4, iters, out)
        np.testing.assert_allclose(out, _reference(4, iters), rtol=1e-4)
        assert len(set(out.tolist())) == 4  # depends on each chain's start
        ends[iters] = out
    assert not np.allclose(ends[10], ends[1000], rtol=1e-3)  # and on the number of steps
    assert machine_scaling.compute_flops(64, 10_000) == 10 * machine_scaling.compute_flops(
        64, 1000)


@pytest.mark.timeout(120)
@needs_two_threads
def test_a_probe_faster_than_its_stated_work_allows_is_refused_not_printed(
        monkeypatch) -> None:
    """A compute kernel that does nothing (what the compiler made of the overflowing one):
    its figure is refused with the reason, the other probes still print."""
    monkeypatch.setattr(machine_scaling, "_compute", lambda chains, iters, out: None)
    numba.set_num_threads(1)
    try:
        got = machine_scaling.machine_scaling(pairs=3, n=500, updated=100, stream=4096,
                                              iters=1_000_000)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert not isinstance(got["compute"], float)
    assert "the work was not done" in str(got["compute"])
    assert all(isinstance(got[k], float) for k in ("random rows", "stream"))
    text = machine_scaling.describe(got)
    assert "compute not shown (1 thread took" in text and "compute 0.00x" not in text


@pytest.mark.timeout(30)
def test_a_probe_with_a_result_that_is_not_finite_is_refused() -> None:
    probe = machine_scaling.Probe(lambda: None, 1.0, "FLOP",
                                  lambda: np.array([1.0, np.inf], np.float32))
    refused = machine_scaling.speedup(probe, [(1.0, 0.5)])
    assert "not finite" in str(refused)
    fine = machine_scaling.Probe(lambda: None, 1e6, "FLOP", lambda: np.ones(2, np.float32))
    assert machine_scaling.speedup(fine, [(1.0, 0.5), (1.0, 0.6), (1.0, 0.4)]) == 2.0


@pytest.mark.timeout(60)
def test_machine_scaling_prints_the_machine_and_its_settings(monkeypatch, capsys) -> None:
    monkeypatch.setattr(machine_scaling, "machine_scaling",
                        lambda pairs: {"compute": 1.9, "random rows": 1.5, "stream": 1.2})
    monkeypatch.setattr(sys, "argv", ["machine_scaling.py", "--pairs", "3"])
    machine_scaling.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("machine: ") and "numba threads" in lines[0]
    assert "--pairs 3" in lines[1]
    assert "compute 1.90x" in lines[-1]


def _no_cluster(*_args, **_kwargs):
    raise AssertionError("a cluster run was started")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("iterations", ["1", "2"])
def test_straggler_refuses_a_run_with_no_steady_window(iterations, monkeypatch, capsys,
                                                       sigterm_kept) -> None:
    monkeypatch.setattr(straggler, "run_cluster", _no_cluster)
    monkeypatch.setattr(sys, "argv", ["straggler.py", "--iterations", iterations])
    with pytest.raises(SystemExit) as info:
        _cli.run(straggler.main)
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines() == [
        f"straggler.py: error: --iterations {iterations} leaves no steady iterations after the "
        "2 warm-up ones, so no steady-state period; give at least 3"]


@pytest.mark.timeout(60)
def test_straggler_marks_a_period_below_its_wire_bound(monkeypatch, capsys) -> None:
    """1 MB of parameters at 100 Mbit/s: a PS worker's link needs 160 ms an iteration. A
    1 us period is not printed as a result; a 1 s one is."""
    periods = iter([1e-6, 1e-6, 1.0, 1.0])  # ps equal, straggler; allreduce equal, straggler

    def fake_run(cfg, run_dir):
        return SimpleNamespace(metrics={"wall_iterations_per_s": 1 / next(periods),
                                        "param_bytes": 1_000_000})

    monkeypatch.setattr(straggler, "run_cluster", fake_run)
    monkeypatch.setattr(sys, "argv", ["straggler.py", "--iterations", "3", "--repeats", "1"])
    straggler.main()
    out = capsys.readouterr().out
    rows = {ln.split()[0] + " " + ln.split()[1]: ln for ln in out.splitlines()
            if ln.startswith(("ps ", "allreduce "))}
    for key in ("ps equal", "ps straggler"):
        assert rows[key].endswith("below the wire bound: not a steady-state measurement")
        assert rows[key].split()[2] == "-"  # no median period printed as the result
    for key in ("allreduce equal", "allreduce straggler"):
        assert "below the wire bound" not in rows[key] and rows[key].split()[2] == "1000.0"
    progress = [ln for ln in out.splitlines() if "repeat 1:" in ln]
    assert sum("below the wire bound" in ln for ln in progress) == 2


def _result(name: str, resident: int, step_s: float) -> dict:
    return {"name": name, "resident": resident, "copied": 0, "peak": None,
            "step_s": step_s, "spread": (step_s, step_s), "grads": [torch.zeros(2)]}


@pytest.mark.timeout(60)
def test_offload_compare_never_prints_minus_zero_percent(monkeypatch, capsys) -> None:
    """The baseline's change against itself is -0.0, a change under half a percent rounds to
    zero: both print +0%, not -0%."""
    mib = offload_compare.MiB
    results = [_result("baseline", 10 * mib, 0.1),
               _result("offload (vDNN)", int(9.99 * mib), 0.1),  # -0.1%
               _result("save_on_cpu", 10 * mib, 0.0999),  # -0.1%
               _result("checkpoint", 5 * mib, 0.13)]
    monkeypatch.setattr(offload_compare, "compare", lambda *a, **k: results)
    monkeypatch.setattr(offload_compare, "copy_bandwidth", lambda device: 1e9)
    monkeypatch.setattr(sys, "argv", ["offload_compare.py", "--device", "cpu"])
    offload_compare.main()
    out = capsys.readouterr().out
    assert "-0%" not in out
    rows = {ln[:16].strip(): ln for ln in out.splitlines()
            if ln.startswith(("baseline", "offload", "save_on_cpu", "checkpoint"))}
    assert rows["baseline"].split().count("+0%") == 2
    assert rows["offload (vDNN)"].split()[3] == "+0%"
    assert rows["save_on_cpu"].split()[6] == "+0%"
    assert "-50%" in rows["checkpoint"] and "+30%" in rows["checkpoint"]
    assert offload_compare.change(-0.3) == "-30%"
    assert offload_compare.change(-0.001, signed=False) == "0%"
