"""``accelopt tictac order ...``: print a transfer order and the predicted makespans.

The CLI hook gets no run config, so the overrides are composed here: ``plugins.tictac.KEY``
(or ``tictac.KEY``) set the plugin's config, ``model=NAME batch=N kind=infer|train a=X``
pick one of the paper's meta-device models, anything else (``workload=tiny``,
``cluster.network.bandwidth=...``) is a Hydra override of the run config.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from accelopt_plugins.tictac.config import EXECUTIONS, ORDERED_BY, TictacConfig
from accelopt_plugins.tictac.order import HEURISTICS

from accelopt import UserError
from accelopt.errors import did_you_mean, listed

USAGE = ("usage: accelopt tictac order [workload=NAME [job=NAME] | model=resnet50|resnet152|"
         "inception_v3|vgg16|alexnet batch=N kind=infer|train a=RATIO] "
         "[plugins.tictac.heuristic=tac] [plugins.tictac.execution=eager|dataflow] "
         "[other run overrides]")
META_KEYS = ("model", "batch", "kind", "a", "job")
KINDS = ("infer", "train")
A_RANGE = (1e-6, 1e6)
"""The ``a`` a meta-device model is planned at: beyond it the makespans overflow or E is
0/0 (Mc + Pc - max(Mc, Pc) lost to rounding), printed as inf and nan."""


def order_command(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] != "order":
        print(USAGE)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    config, meta, overrides = parse(argv[1:])
    plan = make_plan(config, meta, overrides)
    if plan is None:
        return 0  # nothing to order, said as a run says it
    print_plan(plan, config.heuristic, sys.stdout, source=use_order_file(plan, config))
    return 0


def use_order_file(plan: Any, config: TictacConfig) -> str:
    """``order_file``'s list as the plan's order, checked as a run checks it (a file that is
    not a list of this model's tensor names is refused here, where a run warns and rebuilds
    the order); the order's source for the header, '' when computed."""
    if not config.order_file:
        return ""
    from accelopt_plugins.tictac.plugin import TictacPlugin

    plugin = TictacPlugin(config)
    plugin.plan = plan
    try:
        plugin.use_order_file()
    except UserError as exc:
        raise UserError(f"tictac order: {str(exc).removeprefix('tictac: ')}; fix the file or "
                        "drop plugins.tictac.order_file") from None
    return plugin.order_source


def _meta_values(meta: dict[str, str]) -> tuple[int, str, float]:
    """``batch``, ``kind`` and ``a`` of a meta-device model, checked: a batch of -4 was
    torch's error, ``a=0`` a division by zero, ``a=-1`` a negative link rate and a NaN
    efficiency printed with exit 0, ``kind=bogus`` planned as inference, ``a=1e308`` and
    ``a=1e-300`` inf makespans and E = nan (:data:`A_RANGE`)."""
    try:
        batch = int(meta.get("batch", 32))
    except ValueError:
        batch = 0
    if batch < 1:
        raise UserError(f"tictac order: batch must be a whole number >= 1, got "
                        f"{meta.get('batch')!r}")
    kind = meta.get("kind", "infer")
    if kind not in KINDS:
        raise UserError(f"tictac order: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    try:
        a = float(meta.get("a", 1.0))
    except ValueError:
        a = float("nan")
    if not A_RANGE[0] <= a <= A_RANGE[1]:
        raise UserError(f"tictac order: a (Mc/Pc, communication over computation) must be a "
                        f"number in [{A_RANGE[0]:g}, {A_RANGE[1]:g}], got {meta.get('a')!r}")
    return batch, kind, a


def parse(args: list[str]) -> tuple[TictacConfig, dict[str, str], list[str]]:
    fields = {f.name: f for f in dataclasses.fields(TictacConfig)}
    config = TictacConfig()
    meta: dict[str, str] = {}
    overrides: list[str] = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise UserError(f"tictac order: '{arg}' is not KEY=VALUE; {USAGE}")
        short = key.removeprefix("+").removeprefix("plugins.").removeprefix("tictac.")
        if key.startswith(("plugins.tictac.", "tictac.")):
            if short not in fields:
                raise UserError(f"tictac order: unknown key '{key}' (keys: "
                                f"{', '.join(fields)})")
            setattr(config, short, _convert(short, value, key))
        elif key in META_KEYS:
            meta[key] = value
        else:
            overrides.append(arg)
    if ORDERED_BY.get(config.heuristic, config.heuristic) not in HEURISTICS:
        raise UserError(f"tictac order: heuristic={config.heuristic} has no order to print; "
                        f"pick {', '.join(HEURISTICS)} or priority")
    if config.execution not in EXECUTIONS:
        raise UserError(f"tictac order: execution must be one of {', '.join(EXECUTIONS)}, got "
                        f"{config.execution!r}")
    return config, meta, overrides


KINDS_OF_VALUE = {"bool": "bool (true or false)", "int": "whole number", "float": "number",
                  "str": "string", "list": "list of whole numbers, e.g. [0,65536]"}


def _convert(short: str, value: str, key: str) -> Any:
    """``value`` as a run reads ``plugins.tictac.KEY``: parsed by Hydra's override grammar,
    then checked by OmegaConf against :class:`TictacConfig` (``tune_credits=[1,2]`` is a
    list, ``heuristic=off`` a string, ``force=maybe`` is refused); a value that does not fit
    the key is refused in one line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        parsed = OverridesParser.create().parse_override(f"{short}={value}").value()
        node = OmegaConf.merge(OmegaConf.structured(TictacConfig), {short: parsed})
        return OmegaConf.to_container(node)[short]
    except (HydraException, OmegaConfBaseException, ValueError):
        kind = type(getattr(TictacConfig(), short)).__name__
        raise UserError(f"tictac order: {key}={value!r} is not a "
                        f"{KINDS_OF_VALUE.get(kind, kind)}") from None


def make_plan(config: TictacConfig, meta: dict[str, str], overrides: list[str]) -> Any:
    """The plan of a meta-device model or of a workload's job; ``None`` (after printing the
    run's own line) where a run of these overrides would order nothing: in all-reduce mode
    a run stays out, and an order printed with predicted makespans would be one it never
    enforces. ``cluster.mode=none`` (the default) is planned as one worker of a PS run."""
    from accelopt_plugins.tictac.plan import plan_meta

    if "model" in meta:
        if overrides:
            raise UserError(f"tictac order: model={meta['model']} is a meta-device model; "
                            f"drop the run overrides {overrides}")
        if "job" in meta:
            raise UserError("tictac order: job= picks a job of a workload; a meta-device "
                            "model is one already")
        batch, kind, a = _meta_values(meta)
        from accelopt_plugins.tictac.plugin import TictacPlugin

        TictacPlugin(config).accelopt_configure(config, None)  # its keys refused as in a run
        try:
            return plan_meta(meta["model"], batch=batch, kind=kind, a=a,
                             execution=config.execution)  # type: ignore[arg-type]
        except KeyError as exc:
            raise UserError(f"tictac order: {exc.args[0]}") from None
    given = [key for key in ("batch", "kind", "a") if key in meta]
    if given:  # ignored in silence: the workload's job has its own
        raise UserError(f"tictac order: {', '.join(given)} {'go' if len(given) > 1 else 'goes'}"
                        " with model=NAME (a meta-device model); a workload's job has its own "
                        "(set workload.jobs.N.KEY)")
    from accelopt_plugins.tictac.plugin import (
        TictacPlugin,
        job_labels,
        nothing_to_order,
        oracle_loss,
    )

    from accelopt.cli.hydra_run import compose_checked
    from accelopt.config import register_schema

    register_schema()
    cfg = compose_checked(overrides)
    if not cfg.workload.jobs:
        raise UserError("tictac order: the workload has no jobs; pass workload=NAME")
    import torch

    from accelopt.job import Job, job_specs
    from accelopt.job import inputs as job_inputs
    from accelopt.job.params import shard_rows
    from accelopt.types import ClusterInfo

    plugin = TictacPlugin(config)
    plugin.accelopt_configure(config, cfg)
    mode = str(cfg.cluster.mode)
    if mode not in ("none", "ps"):
        print(f"# tictac: {nothing_to_order(mode)}")
        return None
    # a command line tool, not a run: it builds one job of the workload itself (job=NAME,
    # else the first, saying so), as a worker of the configured cluster would see it (its
    # rows of the first batch)
    specs = job_specs(cfg)
    names = [s.name for s in specs]
    if "job" in meta and meta["job"] not in names:
        raise UserError(f"tictac order: the workload has no job {meta['job']!r}"
                        f"{did_you_mean(meta['job'], names)} (jobs: {listed(names, 8)})")
    spec = specs[names.index(meta.get("job", names[0]))]
    if len(specs) > 1 and "job" not in meta:
        print(f"# the workload has {len(specs)} jobs; this is the first, {spec.name} (pick "
              f"another with job=NAME: {listed(names[1:], 4)})")
    job = Job(spec, job_id=spec.name, device=torch.device("cpu"))
    workers = int(cfg.cluster.workers) if mode == "ps" else 1
    row0, row1 = shard_rows(spec.batch_size, workers)[0]
    x, y = job.dataset.batch(0, spec.batch_size)
    x, y = job_inputs.slice_rows(x, row0, row1), y[row0:row1]  # a tuple's, a mapping's too
    bandwidth = (cfg.cluster.get("network") or {}).get("bandwidth")
    if bandwidth:
        from accelopt.drivers.cluster.settings import parse_rate

        plugin.cluster = ClusterInfo(bandwidth_bps=parse_rate(str(bandwidth)))
    message, bw = plugin._link()
    from accelopt_plugins.tictac.plan import plan_measured

    # named as a run's plan names it (model-job): "-w{width}" printed "wNone" for a job
    # that sets no width (most models have none)
    return plan_measured(job.model, x, name=f"{spec.model}-{job.info.job_id}", kind=spec.kind,
                         bytes_per_s=bw, message_s=message,
                         execution=config.execution,  # type: ignore[arg-type]
                         runs=config.oracle_runs, loss=oracle_loss(job.loss_fn, y),
                         threads=int(cfg.run.threads) or 1, labels=job_labels(job.loss_fn, y))


def print_plan(plan: Any, heuristic: str, out: Any, source: str = "") -> None:
    """The order (``source``: where it came from, if not computed) and every heuristic's
    predicted makespan (the heuristic's own from ``source``'s order)."""
    import random

    ordered = ORDERED_BY.get(heuristic, heuristic)  # priority ranks by TAC's order
    order = plan.order_for(ordered, random.Random(0))
    dag = plan.dag
    print(f"# {dag.model}: {len(dag.recvs)} parameter tensors, {len(dag.program)} compute ops, "
          f"{plan.execution} execution, link {plan.bytes_per_s / 1e6:.3f} MB/s, "
          f"a = Mc/Pc = {plan.ratio_a:.2f}", file=out)
    how = heuristic if ordered == heuristic else f"{heuristic}: ranked by {ordered}"
    how += f", from {source}" if source else ""
    print(f"# order ({how}): priority, tensor, bytes", file=out)
    for p, r in enumerate(order):
        print(f"{p:5d}  {dag.recv_names[r]}  {dag.nbytes[dag.recvs[r]]}", file=out)
    pred = plan.predict()
    print("# predicted makespan per heuristic (random: mean / p95 over 1000 orders)", file=out)
    for h, v in pred.items():
        mark = ("  <-" + (f" ({source})" if source else "")) if h == ordered else ""
        extra = f" / p95 {v['p95_s'] * 1e3:.3f} ms" if h == "random" else ""
        e = round(v["E"], 3) + 0.0  # a rounding error below zero printed as -0.000
        print(f"{h:>8}: {v['makespan_s'] * 1e3:.3f} ms{extra}  E = {e:.3f}{mark}", file=out)
