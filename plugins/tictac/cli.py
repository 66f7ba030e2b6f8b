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

from accelopt_plugins.tictac.config import TictacConfig

from accelopt import UserError

USAGE = ("usage: accelopt tictac order [workload=NAME | model=resnet50|resnet152|inception_v3|"
         "vgg16|alexnet batch=N kind=infer|train a=RATIO] [plugins.tictac.heuristic=tac] "
         "[plugins.tictac.execution=eager|dataflow] [other run overrides]")
META_KEYS = ("model", "batch", "kind", "a")


def order_command(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] != "order":
        print(USAGE)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    config, meta, overrides = parse(argv[1:])
    plan = make_plan(config, meta, overrides)
    print_plan(plan, config.heuristic, sys.stdout)
    return 0


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
            setattr(config, short, _convert(getattr(config, short), value, key))
        elif key in META_KEYS:
            meta[key] = value
        else:
            overrides.append(arg)
    if config.heuristic == "off":
        raise UserError("tictac order: heuristic=off has no order to print; pick tac, tic, "
                        "random, reverse or named")
    return config, meta, overrides


def _convert(default: Any, value: str, key: str) -> Any:
    try:
        if isinstance(default, bool):
            return value.lower() in ("1", "true", "yes")
        return type(default)(value)
    except ValueError:
        raise UserError(f"tictac order: {key}={value!r} is not a {type(default).__name__}") \
            from None


def make_plan(config: TictacConfig, meta: dict[str, str], overrides: list[str]) -> Any:
    from accelopt_plugins.tictac.plan import plan_meta

    if "model" in meta:
        if overrides:
            raise UserError(f"tictac order: model={meta['model']} is a meta-device model; "
                            f"drop the run overrides {overrides}")
        try:
            return plan_meta(meta["model"], batch=int(meta.get("batch", 32)),
                             kind=meta.get("kind", "infer"), a=float(meta.get("a", 1.0)),
                             execution=config.execution)  # type: ignore[arg-type]
        except KeyError as exc:
            raise UserError(f"tictac order: {exc.args[0]}") from None
    from accelopt_plugins.tictac.plugin import TictacPlugin

    from accelopt.cli.hydra_run import compose_checked
    from accelopt.config import register_schema

    register_schema()
    cfg = compose_checked(overrides)
    if not cfg.workload.jobs:
        raise UserError("tictac order: the workload has no jobs; pass workload=NAME")
    import torch

    from accelopt.job import Job, job_specs
    from accelopt.job.params import shard_rows
    from accelopt.types import ClusterInfo

    plugin = TictacPlugin(config)
    plugin.accelopt_configure(config, cfg)
    # a command line tool, not a run: it builds the workload's first job itself, as a
    # worker of the configured cluster would see it (its rows of the first batch)
    spec = job_specs(cfg)[0]
    job = Job(spec, job_id=spec.name, device=torch.device("cpu"))
    mode = str(cfg.cluster.mode)
    workers = int(cfg.cluster.workers) if mode == "ps" else 1
    row0, row1 = shard_rows(spec.batch_size, workers)[0]
    x, y = job.dataset.batch(0, spec.batch_size)
    x, y = x[row0:row1], y[row0:row1]
    bandwidth = (cfg.cluster.get("network") or {}).get("bandwidth")
    if bandwidth:
        from accelopt.drivers.cluster.settings import parse_rate

        plugin.cluster = ClusterInfo(bandwidth_bps=parse_rate(str(bandwidth)))
    message, bw = plugin._link()
    from accelopt_plugins.tictac.plan import plan_measured

    return plan_measured(job.model, x, name=f"{spec.model}-w{spec.width}", kind=spec.kind,
                         bytes_per_s=bw, message_s=message,
                         execution=config.execution,  # type: ignore[arg-type]
                         runs=config.oracle_runs, loss=lambda out: job.loss_fn(out, y),
                         threads=int(cfg.run.threads) or 1)


def print_plan(plan: Any, heuristic: str, out: Any) -> None:
    import random

    order = plan.order_for(heuristic, random.Random(0))
    dag = plan.dag
    print(f"# {dag.model}: {len(dag.recvs)} parameter tensors, {len(dag.program)} compute ops, "
          f"{plan.execution} execution, link {plan.bytes_per_s / 1e6:.3f} MB/s, "
          f"a = Mc/Pc = {plan.ratio_a:.2f}", file=out)
    print(f"# order ({heuristic}): priority, tensor, bytes", file=out)
    for p, r in enumerate(order):
        print(f"{p:5d}  {dag.recv_names[r]}  {dag.nbytes[dag.recvs[r]]}", file=out)
    pred = plan.predict()
    print("# predicted makespan per heuristic (random: mean / p95 over 1000 orders)", file=out)
    for h, v in pred.items():
        mark = "  <-" if h == heuristic else ""
        extra = f" / p95 {v['p95_s'] * 1e3:.3f} ms" if h == "random" else ""
        print(f"{h:>8}: {v['makespan_s'] * 1e3:.3f} ms{extra}  E = {v['E']:.3f}{mark}", file=out)
