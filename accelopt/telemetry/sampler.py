"""Background sampling of the accelerator (or, without one, of this process).

A run's timeline is easier to read next to utilisation: idle gaps between iterations show
up as dips. NVML is tried first; on a machine without an NVIDIA driver the sampler falls
back to this process's CPU and RSS and says so in one line (:attr:`TelemetrySampler.note`),
so a CPU-only run never looks like it measured a GPU.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any

import psutil

from accelopt.errors import first_line
from accelopt.records import TelemetrySample

MIN_INTERVAL_S = 0.05
"""The shortest ``run.telemetry_interval_s`` a run accepts: the operating system counts a
process's CPU time in ticks of about 10 ms, so over a shorter interval psutil's CPU share
reads 0% or thousands of percent (1e-6 s gave 0% and 9427%); over 50 ms a tick is at most
20 points of a core."""


def _short(exc: BaseException) -> str:
    """First line of an error, capped: the note must stay one line."""
    text = first_line(exc) or type(exc).__name__
    return text if len(text) <= 80 else text[:77] + "..."


class TelemetrySampler:
    """Sample at ``start``, every ``interval_s`` seconds on a daemon thread, and at ``stop``.

    The backend is picked (NVML probed, else psutil set up: milliseconds) when the sampler
    is made, by :meth:`prepare`: a run makes it before its clock starts, so that starting it
    at the clock's origin costs the first jobs nothing measurable."""

    def __init__(self, interval_s: float = 0.5, device_index: int = 0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.device_index = device_index
        self._stop_event = threading.Event()
        self._cond = threading.Condition()
        self._samples: list[TelemetrySample] = []
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._note = "telemetry not started"
        self._nvml: Any = None
        self._handle: Any = None
        self._process: psutil.Process | None = None
        self._cpu_primed = False
        """psutil's CPU share is over the time since its previous call: the first has none."""
        self._prepared = False
        self._stopped = False
        self.errors = 0
        """Samples skipped because the backend raised (e.g. GPU lost mid-run)."""
        self.prepare()

    @property
    def note(self) -> str:
        """One line saying what is sampled and how (or why not the GPU)."""
        return self._note

    @property
    def source(self) -> str:
        return "nvml" if self._handle is not None else "process"

    # -- lifecycle ---------------------------------------------------------------------

    def prepare(self) -> None:
        """Pick the backend (the costly part: NVML's initialisation, or psutil's process
        handle) and write the note; done once, by the constructor."""
        if self._prepared:
            return
        self._prepared = True
        reason = self._init_nvml()
        if reason is None:
            self._note = (
                f"GPU {self.device_index} {self._gpu_name()}: sampling utilization and memory "
                f"via NVML every {self.interval_s:g} s"
            )
        else:
            self._process = psutil.Process()
            self._note = (
                f"no NVIDIA GPU found (NVML: {reason}): sampling this process's CPU and RSS instead"
            )

    def start(self, t0: float | None = None) -> None:
        """Start the thread, which samples at once and then every interval; ``t0``
        (``time.perf_counter()`` units) is the run's start, so sample times line up with the
        spans. Defaults to now. The backend was picked beforehand (:meth:`prepare`)."""
        if self._thread is not None:
            raise RuntimeError("TelemetrySampler.start() called twice")
        self._t0 = time.perf_counter() if t0 is None else t0
        self.prepare()  # a no-op unless stopped and started anew (refused above)
        self._thread = threading.Thread(target=self._run, name="accelopt-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> list[TelemetrySample]:
        """Stop the thread (bounded wait), take the closing sample (a run shorter than one
        interval still has its start and its end), release NVML, and return the samples.
        A second call returns the same samples."""
        self._stop_event.set()
        thread = self._thread
        if thread is not None and not self._stopped:
            thread.join(timeout=max(2.0, 2 * self.interval_s))
            self._sample()
        self._stopped = True
        self._shutdown_nvml()
        return self.samples

    def __enter__(self) -> TelemetrySampler:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- reading -----------------------------------------------------------------------

    @property
    def samples(self) -> list[TelemetrySample]:
        """A copy: the thread keeps appending to the original."""
        with self._cond:
            return list(self._samples)

    def wait_for_samples(self, n: int, timeout: float) -> bool:
        """Block until at least ``n`` samples exist or ``timeout`` passes; True if reached.

        Lets callers (and tests) synchronise on the sampler's progress instead of sleeping.
        """
        with self._cond:
            return self._cond.wait_for(lambda: len(self._samples) >= n, timeout=timeout)

    # -- backends ----------------------------------------------------------------------

    def _init_nvml(self) -> str | None:
        """Try NVML; return None on success, else a short reason for the note."""
        try:
            import pynvml
        except ImportError as exc:
            return f"pynvml not importable ({_short(exc)})"
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError subclasses, or OSError from a broken install
            return _short(exc)
        try:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except Exception as exc:
            self._safe_shutdown(pynvml)
            return _short(exc)
        self._nvml = pynvml
        return None

    def _gpu_name(self) -> str:
        try:
            name = self._nvml.nvmlDeviceGetName(self._handle)
        except Exception:
            return "(name unavailable)"
        return name.decode() if isinstance(name, bytes) else str(name)

    @staticmethod
    def _safe_shutdown(pynvml: Any) -> None:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass

    def _shutdown_nvml(self) -> None:
        if self._nvml is not None:
            self._safe_shutdown(self._nvml)
            self._nvml = None
            self._handle = None

    def _read(self) -> TelemetrySample:
        t_s = time.perf_counter() - self._t0
        if self._handle is not None:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used
            return TelemetrySample(t_s, "nvml", float(util), int(used))
        assert self._process is not None
        # CPU % since the previous sample; psutil's first call (the start's sample) only
        # sets the reference point and reads 0.0, which is no measurement: None (null in
        # the files, as every figure not measured is; it read as an idle process)
        cpu: float | None = float(self._process.cpu_percent(None))
        if not self._cpu_primed:
            self._cpu_primed, cpu = True, None
        rss = self._process.memory_info().rss
        return TelemetrySample(t_s, "process", cpu, int(rss))

    def _sample(self) -> None:
        """Take one sample (a backend error is counted, not raised)."""
        try:
            sample = self._read()
        except Exception:
            self.errors += 1
            return
        with self._cond:
            self._samples.append(sample)
            self._cond.notify_all()

    def _run(self) -> None:
        self._sample()  # at the start: a run shorter than one interval has samples too
        # Event.wait doubles as the sleep and the stop signal: stop() wakes us at once.
        while not self._stop_event.wait(self.interval_s):
            self._sample()
