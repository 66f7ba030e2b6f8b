"""Plugins used by tests/test_cluster*.py inside spawned cluster processes.

Children find them through ``ACCELOPT_PLUGINS=cluster_plugins:NAME`` (tests/ is put on
PYTHONPATH by the tests), exactly as a third-party plugin named there would be found.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from accelopt.hookspecs import hookimpl
from accelopt.plugin import PluginSpec
from accelopt.types import ReportRow


class _Reverse:
    @hookimpl
    def accelopt_transfer_order(self, transfers, destination):
        return [t.tensor for t in reversed(list(transfers))]

    @hookimpl
    def accelopt_report_rows(self, run):
        return [ReportRow("reverse_order", "sent every transfer in reverse layer order")]


class _Bogus:
    @hookimpl
    def accelopt_transfer_order(self, transfers, destination):
        return ["no.such.tensor", *[t.tensor for t in transfers]]


@dataclass
class PauseConfig:
    rank: int = -1
    iteration: int = 2
    pid_file: str = ""


class _Pause:
    """On ``rank`` at ``iteration``: write the pid to ``pid_file`` and sleep (to be killed)."""

    def __init__(self, config: PauseConfig) -> None:
        self.config = config

    @hookimpl
    def accelopt_iteration_start(self, context):
        if int(os.environ.get("RANK", -1)) == self.config.rank and \
                context.iteration == self.config.iteration:
            with open(self.config.pid_file + ".tmp", "w") as fh:
                fh.write(str(os.getpid()))
            os.replace(self.config.pid_file + ".tmp", self.config.pid_file)
            time.sleep(120)


class _Half:
    """Encode float32 payloads as a pickled dict holding float16; decode back."""

    @hookimpl
    def accelopt_transfer_encode(self, record, payload):
        if isinstance(payload, torch.Tensor) and payload.dtype == torch.float32:
            return {"half": payload.to(torch.float16)}
        return None

    @hookimpl
    def accelopt_transfer_decode(self, record, payload):
        if isinstance(payload, dict) and "half" in payload:
            return payload["half"].to(torch.float32)
        return None


class _Collapses:
    """A decoder with a bug: every parameter comes back as its sum (one element)."""

    @hookimpl
    def accelopt_transfer_decode(self, record, payload):
        return payload.sum() if record.kind == "param" else None


class _ShrinksWithoutDecoder:
    """An encoder whose payload nobody decodes: each gradient becomes its first element."""

    @hookimpl
    def accelopt_transfer_encode(self, record, payload):
        if record.kind == "grad" and isinstance(payload, torch.Tensor):
            return payload.reshape(-1)[:1].clone()
        return None


class _DropBias:
    """Filter: drop every bias gradient (the server then applies a zero gradient)."""

    @hookimpl
    def accelopt_transfer_filter(self, record):
        return not (record.kind == "grad" and record.tensor.endswith("bias"))


class _CountDone:
    """Observes accelopt_transfer_done on the receiving rank: counts transfers and bytes."""

    def __init__(self) -> None:
        self.count = 0
        self.nbytes = 0
        self.negative = 0

    @hookimpl
    def accelopt_transfer_done(self, record, start_s, end_s):
        self.count += 1
        self.nbytes += record.nbytes
        self.negative += end_s < start_s

    @hookimpl
    def accelopt_report_rows(self, run):
        rank = str(run.rank)  # the rank's record says where it runs
        return [ReportRow("count_done", f"rank {rank} received {self.count} transfers",
                          {"rank": rank, "done": self.count, "bytes": self.nbytes,
                           "negative": self.negative})]


class _HoldLast:
    """On a PS worker, holds the decode of each iteration's last parameter (the model's last
    tensor) until that iteration's forward has computed the model's first layer, or 10 s.
    With per-layer waits the first layer runs while the last parameter is held; with a wait
    for every parameter before forward it cannot, and each hold times out. The row says how
    many holds the first layer ended (``early``) out of how many (``held``)."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.forwards = 0
        self.first: torch.nn.Module | None = None
        self.last: str | None = None
        self.held = self.early = 0

    def _forwarded(self, module, args, output) -> None:
        if module is self.first:  # not a copy's (a profile's probe step)
            with self.changed:
                self.forwards += 1
                self.changed.notify_all()

    @hookimpl
    def accelopt_layer_build(self, layer):
        if layer.path == "":  # the whole model, offered last
            self.last = [name for name, _ in layer.module.named_parameters()][-1]
            self.first = next(m for m in layer.module.modules()
                              if any(True for _ in m.parameters(recurse=False)))
            self.first.register_forward_hook(self._forwarded)

    @hookimpl
    def accelopt_transfer_decode(self, record, payload):
        if record.kind == "param" and record.tensor == self.last:
            self.held += 1
            with self.changed:  # forward of this iteration has passed the first layer
                if self.changed.wait_for(lambda: self.forwards > record.iteration, timeout=10):
                    self.early += 1

    @hookimpl
    def accelopt_report_rows(self, run):
        return [ReportRow("hold_last", f"rank {run.rank}: {self.early} of {self.held}",
                          {"rank": str(run.rank), "held": self.held, "early": self.early})]


class _WaitsForTheWatchdog:
    """Blocks in its first ``accelopt_iteration_end`` until this process's hook watchdog has
    named it (at most 60 s): a blocking hook, with no sleep to guess how long is enough."""

    def __init__(self) -> None:
        self.named = threading.Event()
        self.waited = False

    @hookimpl
    def accelopt_iteration_end(self, context, result):
        if self.waited:
            return
        self.waited = True
        named = self.named

        class Seen(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "has been in accelopt_iteration_end" in record.getMessage():
                    named.set()

        seen = Seen()
        logging.getLogger("accelopt.watchdog").addHandler(seen)
        try:
            named.wait(60)
        finally:
            logging.getLogger("accelopt.watchdog").removeHandler(seen)


class _RankSays:
    """A run-level plugin (no transfer hook) whose report differs by rank, as a build-time
    plugin's measurement does."""

    @hookimpl
    def accelopt_report_rows(self, run):
        rank = os.environ.get("RANK", "?")
        return [ReportRow("rank_says", f"measured on rank {rank}", {"rank": rank})]


class _Digest:
    """Every ``every`` steps, a digest of the job's parameters after the optimizer step, on
    every rank that steps (what a replica check needs: accelopt_after_step)."""

    every = 2

    def __init__(self) -> None:
        self.model = None
        self.digests: list[str] = []

    @hookimpl
    def accelopt_job_built(self, run, job):
        self.model = job.model  # a test plugin: it may keep the model for the run

    @hookimpl
    def accelopt_after_step(self, context, stepped):
        if (context.iteration + 1) % self.every == 0:
            import hashlib

            h = hashlib.sha256()
            for p in self.model.parameters():
                h.update(p.detach().cpu().numpy().tobytes())
            self.digests.append(f"{context.iteration}:{h.hexdigest()}")

    @hookimpl
    def accelopt_report_rows(self, run):
        self.model = None
        return [ReportRow("digest", f"rank {run.rank}: {len(self.digests)} digests",
                          {"rank": run.rank, "digests": ";".join(self.digests)})]


REVERSE = PluginSpec(name="reverse_order", factory=lambda c: _Reverse())
BOGUS = PluginSpec(name="bogus_order", factory=lambda c: _Bogus())
PAUSE = PluginSpec(name="pause_rank", factory=_Pause, config=PauseConfig)
HALF = PluginSpec(name="half_codec", factory=lambda c: _Half())
DROP_BIAS = PluginSpec(name="drop_bias", factory=lambda c: _DropBias())
COLLAPSES = PluginSpec(name="collapses", factory=lambda c: _Collapses())
SHRINKS = PluginSpec(name="shrinks", factory=lambda c: _ShrinksWithoutDecoder())
COUNT_DONE = PluginSpec(name="count_done", factory=lambda c: _CountDone(), scope="job")
RANK_SAYS = PluginSpec(name="rank_says", factory=lambda c: _RankSays())
WAITS_FOR_WATCHDOG = PluginSpec(name="waits_for_watchdog",
                                factory=lambda c: _WaitsForTheWatchdog())
HOLD_LAST = PluginSpec(name="hold_last", factory=lambda c: _HoldLast(), scope="job")
DIGEST = PluginSpec(name="digest", factory=lambda c: _Digest(), scope="job")
