"""The offload plugin's hooks: install the engine at model build time, report what it did."""

from __future__ import annotations

import re
from typing import Any

import torch
from accelopt_plugins.offload.config import OffloadConfig, validate
from accelopt_plugins.offload.engine import OffloadEngine, engine_on

from accelopt import LayerOffer, ReportRow, RunInfo, UserError, hookimpl
from accelopt.job.params import shard_rows
from accelopt.types import INERT, IterationContext, IterationResult

MiB = 2**20


def worker_share(run: RunInfo, job_id: str) -> tuple[str, dict[str, int]]:
    """Where this process is a worker of a cluster run: the words that say its figures are
    one worker's, and the metrics behind them; ``("", {})`` elsewhere.

    Why: each worker trains its own rows of the batch (contiguous, sizes differing by at most
    one), so its bytes are its share, not the job's (half
    of them in a run of two workers), and the core shows one worker's row unmarked when all
    workers' rows agree. The job's total is not known here: another worker's share may be a
    row larger, and its maps are in another process. The split is the cluster's own
    (:func:`~accelopt.job.params.shard_rows`)."""
    if run.role != "worker":
        return "", {}
    workers = max(1, run.cluster.workers)
    index = run.rank - run.cluster.servers if run.cluster.mode == "ps" else run.rank
    job = next((j for j in run.jobs if j.job_id == job_id), None)
    metrics = {"per_worker": 1, "workers": workers}
    if job is None or job.batch_size <= 0:
        return (f" figures per worker (one of {workers}, each training its share of the "
                "batch)", metrics)
    sizes = [stop - start for start, stop in shard_rows(job.batch_size, workers)]
    rows = sizes[index] if 0 <= index < workers else 0
    metrics |= {"worker_batch_rows": rows, "batch_rows": job.batch_size}
    if len(set(sizes)) == 1:
        who = f"each of the {workers} workers training {rows} of the batch's {job.batch_size} rows"
    else:
        who = (f"this worker training {rows} of the batch's {job.batch_size} rows, split over "
               f"{workers} workers")
    return f" figures per worker ({who})", metrics


class OffloadPlugin:
    """One engine per job. The engine is installed through ``accelopt_layer_build``: on the
    whole model (offered last, under path ``""``) or on the layers ``layers`` matches. The
    modules are kept (hooks are added to them), so parameter names do not change. The
    iteration hooks mark the engine's counting periods: the report's figures are per
    iteration however many forward passes one makes (gradient accumulation)."""

    def __init__(self, config: OffloadConfig) -> None:
        self.config = config
        self.engines: dict[str, OffloadEngine] = {}
        self._pattern: re.Pattern[str] | None = None
        self._taken: dict[str, list[str]] = {}

    @hookimpl
    def accelopt_configure(self, config: OffloadConfig, run_config: Any) -> None:
        validate(config)
        self.config = config
        self._pattern = re.compile(config.layers) if config.layers else None

    def _engine(self, job_id: str) -> OffloadEngine:
        if job_id not in self.engines:
            c = self.config
            self.engines[job_id] = OffloadEngine(
                policy=c.policy, min_bytes=int(c.min_kib * 1024),
                prefetch_layers=c.prefetch_layers, pin_memory=c.pin_memory,
            )
        return self.engines[job_id]

    @hookimpl
    def accelopt_layer_build(self, layer: LayerOffer) -> Any | None:
        if layer.job.kind != "train":
            return None  # inference saves nothing for backward
        engine = self._engine(layer.job.job_id)
        other = engine_on(layer.module)
        if other is not None and other is not engine:
            raise UserError(
                f"offload: job '{layer.job.name}': the model still carries the offloading "
                f"hooks of an earlier run (on {layer.path or 'its root'}: an accelopt.attach "
                "not closed?); close() that one first, so the two do not stack")
        taken = self._taken.setdefault(layer.job.job_id, [])
        if layer.path == "":
            engine.track(layer.module)
            if self._pattern is None:
                engine.install(layer.module, "")
            return None
        if self._pattern is not None and self._pattern.search(layer.path):
            if not any(layer.path.startswith(t + ".") for t in taken):
                engine.install(layer.module, layer.path)
                taken.append(layer.path)
        return None

    @hookimpl
    def accelopt_iteration_start(self, context: IterationContext) -> None:
        engine = self.engines.get(context.job.job_id)
        if engine is not None:
            engine.begin_iteration()

    @hookimpl
    def accelopt_iteration_end(self, context: IterationContext, result: IterationResult) -> None:
        engine = self.engines.get(context.job.job_id)
        if engine is not None:
            engine.end_iteration()

    @hookimpl
    def accelopt_run_end(self, run: RunInfo, metrics: dict[str, Any]) -> None:
        """Take the engines' hooks off the models (after the report rows were read): a
        loop's own model (``accelopt.attach``) outlives the run, and went on offloading,
        counted by nobody, after ``close()``."""
        for engine in self.engines.values():
            engine.remove()

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        c = self.config
        if not self.engines:
            return [ReportRow("offload", "nothing to do: no training job (inference saves no "
                              "feature maps for backward)", {INERT: 1})]
        rows = []
        cpu = not run.device.startswith("cuda")
        for job_id, engine in self.engines.items():
            engine.finish()
            t = engine.totals
            if t.passes == 0 or not engine.installed:
                where = ", ".join(engine.installed) or "no layer"
                rows.append(ReportRow("offload", f"{job_id}: nothing to do: no saved tensor "
                                      f"passed through the offloading hooks ({where} matched)",
                                      {"job": job_id, INERT: 1}))
                continue
            s, n = t.stats, t.passes
            off, res, par = s.offloaded_bytes / n, s.resident_bytes / n, s.param_bytes / n
            share = off / (off + res) if off + res else 0.0
            unpacks = s.prefetched + s.fetched_on_demand
            hit = s.prefetched / unpacks if unpacks else 0.0
            # without iteration boundaries (a loop of one's own outside ao.loop) the engine
            # counts per forward pass, and the row says so
            unit, key = (("iteration", "iteration") if engine.per_iteration
                         else ("forward pass", "forward_pass"))
            worker, worker_metrics = worker_share(run, job_id)
            if worker:
                unit += " per worker"
            scope = f" on the layers matching {c.layers!r}" if c.layers else ""
            text = (
                f"{job_id}:{worker}{':' if worker else ''} policy {c.policy}{scope}: "
                f"{off / MiB:.2f} MiB/{unit} of saved "
                f"feature maps offloaded to host ({share:.0%}), {res / MiB:.2f} MiB/{unit} "
                f"stayed resident{' (the other layers included)' if c.layers else ''}, "
                f"{par / MiB:.2f} MiB parameters never offloaded; prefetch served "
                f"{hit:.0%} of unpacks"
            )
            if not engine.per_iteration:
                text += "; counted per forward pass: no iteration boundary was marked"
            metrics: dict[str, float | int | str] = {
                "job": job_id, "forward_passes": s.forwards,
                f"offloaded_bytes_per_{key}": int(off), f"resident_bytes_per_{key}": int(res),
                f"param_bytes_per_{key}": int(par),
                "offloaded_fraction": round(share, 4), "prefetch_hit_rate": round(hit, 4),
                "fetched_on_demand": s.fetched_on_demand,
            }
            if engine.per_iteration:
                metrics["iterations"] = n
            metrics |= worker_metrics
            if s.kept_shared:
                # the policy picked them, but another save keeps their memory on the device
                # (a ReLU's output that a convolution saves too): not copied, counted resident
                metrics["saves_kept_shared"] = s.kept_shared
                text += (f"; {s.kept_shared / n:g} save(s)/{unit} the policy picked stayed on "
                         "the device, counted as resident: another save keeps the same memory "
                         "there (a ReLU's output that the next layer saves too), so copying "
                         "them out would free nothing")
            if s.left_to_caller:
                metrics["calls_left_to_checkpoint"] = s.left_to_caller
                text += (f"; {s.left_to_caller} call(s) of the offloaded layers ran under the "
                         "caller's torch.utils.checkpoint (or saved-tensor hooks of its own) "
                         "and were left to it: what they save is neither offloaded nor counted")
            if off == 0:  # its policy matched no saved tensor: it changed nothing here
                metrics[INERT] = 1
                text += "; nothing offloaded, so this job ran as without the plugin"
            elif cpu:
                text += ("; on cpu this is accounting only: a CPU has no device memory to "
                         "save (these bytes would leave GPU memory)")
            elif torch.cuda.is_available():
                peak = torch.cuda.max_memory_allocated()
                metrics["cuda_max_memory_allocated"] = int(peak)
                text += f"; cuda max_memory_allocated {peak / MiB:.1f} MiB"
            rows.append(ReportRow("offload", text, metrics))
        return rows
