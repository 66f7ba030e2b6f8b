"""Tests for accelopt.telemetry: the process fallback for real, NVML through a fake module."""

from __future__ import annotations

import sys
import time
import types
from types import SimpleNamespace

import pytest

from accelopt.telemetry import TelemetrySampler

pytestmark = pytest.mark.timeout(20)


def _nvml_available() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_nvml_available(), reason="this machine has an NVIDIA GPU")
def test_falls_back_to_process_sampling_without_gpu() -> None:
    t0 = time.perf_counter()
    sampler = TelemetrySampler(interval_s=0.01)
    sampler.start(t0)
    try:
        assert sampler.wait_for_samples(2, timeout=5.0)
    finally:
        samples = sampler.stop()
    assert sampler.note.startswith("no NVIDIA GPU found (NVML: ")
    assert "\n" not in sampler.note
    assert len(samples) >= 2
    assert all(s.source == "process" and s.memory_bytes > 0 for s in samples)
    assert all(s.t_s > 0 for s in samples)
    assert [s.t_s for s in samples] == sorted(s.t_s for s in samples)
    # the first CPU share has no previous reading: not measured (it read 0.0, an idle process)
    assert samples[0].utilization_pct is None
    assert all(isinstance(s.utilization_pct, float) for s in samples[1:])


def test_stop_is_prompt_and_idempotent() -> None:
    sampler = TelemetrySampler(interval_s=60.0)  # stop must not wait out the interval
    begin = time.perf_counter()
    with sampler:
        pass
    assert time.perf_counter() - begin < 5.0
    once = sampler.stop()
    assert len(once) == 2 and sampler.stop() == once  # its start and its stop, once
    assert sampler._thread is not None and not sampler._thread.is_alive()


def test_rejects_bad_interval_and_double_start() -> None:
    with pytest.raises(ValueError):
        TelemetrySampler(interval_s=0)
    with TelemetrySampler(interval_s=60.0) as sampler, pytest.raises(RuntimeError):
        sampler.start()


def _fake_pynvml(calls: list[str]) -> types.ModuleType:
    mod = types.ModuleType("pynvml")
    mod.nvmlInit = lambda: calls.append("init")  # type: ignore[attr-defined]
    mod.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)  # type: ignore[attr-defined]
    mod.nvmlDeviceGetName = lambda h: b"Fake H100"  # type: ignore[attr-defined]
    mod.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=42)  # type: ignore[attr-defined]
    mod.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(used=123)  # type: ignore[attr-defined]
    return mod


def test_nvml_path_with_fake_module(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(calls))
    with TelemetrySampler(interval_s=0.01) as sampler:
        assert sampler.wait_for_samples(2, timeout=5.0)
    assert sampler.note == "GPU 0 Fake H100: sampling utilization and memory via NVML every 0.01 s"
    assert all(s.source == "nvml" and s.utilization_pct == 42.0 for s in sampler.samples)
    assert sampler.samples[0].memory_bytes == 123
    assert calls == ["init", "shutdown"]


def test_nvml_init_error_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    mod = _fake_pynvml(calls)

    def fail() -> None:
        raise RuntimeError("Driver Not Loaded\nsecond line")

    mod.nvmlInit = fail  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    with TelemetrySampler(interval_s=60.0) as sampler:
        pass
    assert sampler.note == (
        "no NVIDIA GPU found (NVML: Driver Not Loaded): sampling this process's CPU and RSS instead"
    )
    assert calls == []  # never initialised, so nothing to shut down


def test_a_run_shorter_than_one_interval_has_its_start_and_end_sampled() -> None:
    """The first sample came one interval after the start: a run shorter than that had
    `samples: []` under a note saying it was sampling."""
    t0 = time.perf_counter()
    sampler = TelemetrySampler(interval_s=60.0)
    sampler.start(t0)
    assert sampler.wait_for_samples(1, timeout=5.0)  # the start's, without an interval
    samples = sampler.stop()
    assert len(samples) == 2
    assert 0 <= samples[0].t_s <= samples[1].t_s
    assert all(s.memory_bytes > 0 for s in samples)


def test_the_backend_is_probed_when_made_not_when_started(monkeypatch) -> None:
    """start() probed NVML (and set up psutil) after the run's clock had started: 5-26 ms
    in the queueing delay of every job arriving at 0."""
    probes: list[str] = []
    real = TelemetrySampler._init_nvml

    def probe(self: TelemetrySampler) -> str | None:
        probes.append("probe")
        return real(self)

    monkeypatch.setattr(TelemetrySampler, "_init_nvml", probe)
    sampler = TelemetrySampler(interval_s=60.0)
    assert probes == ["probe"] and sampler.note != "telemetry not started"
    with sampler:
        pass
    assert probes == ["probe"]  # starting it probed nothing more
