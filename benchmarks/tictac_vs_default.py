"""tictac against PyTorch's default transfer order (no plugin), training, on a shaped link.

TicTac's published gains are over TensorFlow's *random* order; PyTorch already sends
parameters in registration order, which is usually the order forward uses them. This
benchmark measures what tictac buys over that default, where a user would run it: a
parameter-server cluster (1 server + 2 workers) training the zoo's resnet, inception and
transformer and ``workload=lm``'s GPT-2, with the loopback shaped so that communication and
compute take about as long (a = Mc/Pc ~ 1, where ordering matters most).

For each model: one calibration run without the plugin at ``--bandwidth`` reads a; the link
is then set to ``bandwidth x a`` (a scales inversely with the rate), so the timed runs sit
near a = 1. Then ``--rounds`` paired rounds, each one run without the plugin and one with
``+plugins=[tictac]`` (its defaults, TAC, or what ``--set`` gives it, e.g.
``heuristic=priority``), back to back, the order alternating; the figure is the median over rounds of
the paired ratio of steady iterations per second of wall time (``wall_iterations_per_s``:
the iterations after the warm-up over their first start to last end; one over the median
iteration time is no throughput once an early update lets iterations overlap), tictac /
default, with its min-max. tictac's own row says what it enforced or why it stayed out.
Needs root (network namespace + tc).

The bound beside each model is physical: no schedule makes an iteration shorter than the
link's busy time (the iteration's bytes on the shared loopback over the shaped rate) or a
worker's compute time (Pc: forward + backward), measured in the default run and printed as
the default iteration's ratio to the larger. (Mc, the union of a worker's transfer
intervals, is no bound: a transfer's interval includes its wait behind the other worker's.)

    python benchmarks/tictac_vs_default.py [--models resnet,inception,transformer,lm] \
        [--rounds 3] [--iterations 20] [--extra off again] [--set heuristic=priority]

``--mode allreduce`` runs the same on 2 workers under PyTorch's DDP (the default side is
plain DDP; tictac has nothing to schedule there and says so). ``--workers 1`` gives the
server and its one worker a core each on a 2-core machine (with 2 workers, three processes
share two cores).

``--extra`` adds sides to every round: ``off`` (tictac loaded with ``heuristic=off``: no
planning, no transfer hook) and ``again`` (no plugin a second time, so the spread of two
identical sides, the A/A spread, is printed beside the comparison).

Its last line: ``tictac vs default order: X.XXx (median of N paired rounds)``, over every
round of every model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _cli  # noqa: E402
from accelopt_plugins.tictac.crossiter import (  # noqa: E402
    Schedule,
    calibrated,
    resimulate,
    simulate,
)
from accelopt_plugins.tictac.measured import Measured, measure  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from accelopt.config import AccelConfig, JobConfig  # noqa: E402
from accelopt.drivers.cluster import run_cluster  # noqa: E402
from accelopt.drivers.cluster.settings import parse_rate  # noqa: E402
from accelopt.workloads.models import MODEL_NAMES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ZOO = {"resnet": 48, "inception": 96, "transformer": 64}
"""Zoo models and the widths the tictac benchmarks train them at."""


def job_spec(model: str, iterations: int, batch: int) -> JobConfig:
    """The job: a zoo model at its benchmark width, or ``lm``: workload=lm's GPT-2 job."""
    if model == "lm":
        job = OmegaConf.load(REPO / "configs" / "workload" / "lm.yaml").jobs[0]
        fields = {k: v for k, v in OmegaConf.to_container(job).items()
                  if k in JobConfig.__dataclass_fields__}
        return JobConfig(**{**fields, "iterations": iterations, "warmup_iterations": 0,
                            "lr_schedule": "constant"})
    return JobConfig(name=model, model=model, width=ZOO.get(model, 32), batch_size=batch,
                     iterations=iterations, seed=0)


EXTRA = {"off": "tictac off", "again": "default again"}
"""The optional sides' labels (``--extra``)."""
VARIANTS: dict[str, dict[str, Any]] = {}
"""More tictac sides (``--variant NAME:KEY=VALUE,...``): label -> plugins.tictac settings."""


def settings(pairs: list[str], flag: str = "--set") -> dict[str, Any]:
    """``["heuristic=priority", "credit_bytes=0"]`` -> plugins.tictac settings; a pair
    without ``=``, a key tictac does not have, a key given twice or a value the plugin
    refuses (``heuristic=foo``) is a usage error, before any run."""
    from dataclasses import fields

    from accelopt_plugins.tictac.config import TictacConfig

    known = {f.name for f in fields(TictacConfig)}
    out: dict[str, Any] = {}
    for item in pairs:
        key, eq, value = item.partition("=")
        if not eq or key not in known:
            _cli.fail(f"{flag}: {item!r} is not KEY=VALUE with a plugins.tictac key "
                      f"({', '.join(sorted(known))})")
        if key in out:
            _cli.fail(f"{flag}: {key} is given twice; give each key once")
        out[key] = _value(value)
    tictac_config(out, flag)
    return out


def _value(text: str) -> Any:
    """A value as the command line gives it to a run: a number, a bool, a list
    (``[0,65536]``: tune_credits) or a string; a list read as a string met OmegaConf's
    "AnyNode is not a ListConfig"."""
    import yaml

    try:
        return yaml.safe_load(text) if text else text
    except yaml.YAMLError:
        return text


def _split_settings(items: str) -> list[str]:
    """``a=1,b=[2,3]`` -> ``["a=1", "b=[2,3]"]``: the commas between settings, not those
    inside a list (a variant's list setting was cut at its commas)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(items):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(items[start:i])
            start = i + 1
    return [*parts, items[start:]]


def tictac_config(values: dict[str, Any], flag: str) -> Any:
    """``values`` as a run reads them: OmegaConf against the plugin's config class, then
    the plugin's own checks (``accelopt_configure``); what a run would refuse after the
    calibration run is a usage error now."""
    from accelopt_plugins.tictac import PLUGIN
    from accelopt_plugins.tictac.plugin import TictacPlugin

    from accelopt.activation import plugin_config
    from accelopt.errors import UserError

    cfg = OmegaConf.create({"plugins": {"tictac": values}, "cluster": {"mode": MODE[0]}})
    try:
        config = plugin_config(PLUGIN, cfg)
        TictacPlugin(config).accelopt_configure(config, cfg)
    except UserError as exc:
        _cli.fail(f"{flag}: {exc}")
    return config


def tictac_sides(pairs: list[str], variants: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tictac side's settings (``--set``) and the variants' (``--variant
    NAME:KEY=VALUE,...``), checked before any run: a variant needs a name no other side has
    and at least one setting, and may not repeat another tictac side's settings (it would
    run as a copy of that side, reported under its own name)."""
    tictac = settings(pairs)
    configs = {"tictac": tictac_config(tictac, "--set")}
    out: dict[str, dict[str, Any]] = {}
    for text in variants:
        name, colon, items = text.partition(":")
        if not colon or not name or not items:
            _cli.fail(f"--variant {text!r} is not NAME:KEY=VALUE,...; give a name and its "
                      "settings, e.g. c256k:heuristic=priority,credit_bytes=262144")
        taken = ["default", "tictac", *(k for k in EXTRA if k not in VARIANTS), *out]
        if name in taken:
            _cli.fail(f"--variant {text!r}: a side is already named {name!r} (taken: "
                      f"{', '.join(taken)}); give it another name")
        out[name] = settings(_split_settings(items), f"--variant {name}")
        config = tictac_config(out[name], f"--variant {name}")
        same = [side for side, other in configs.items() if other == config]
        if same:
            _cli.fail(f"--variant {text!r}: the same settings as the {same[0]} side; change "
                      "a setting or drop it")
        configs[name] = config
    return tictac, out


TOPOLOGY = ["shared"]
"""``--topology``: shared (one shaped loopback, every byte on one bus) or hosts (a link per
rank, each direction shaped on its own, as machines with their own NICs)."""
WORKERS = [2]
"""``--workers``: data-parallel workers (2; 1 leaves a core to each of two ranks)."""
MODE = ["ps"]
"""``--mode``: ps (1 server + 2 workers) or allreduce (2 workers, PyTorch DDP: the default
side is plain DDP)."""
TICTAC: dict[str, Any] = {}
"""The tictac side's ``plugins.tictac`` settings (``--set``; empty: its defaults)."""
KEEP: list[Path] = []
"""``--keep``: a directory each run's directory is copied into (empty: none kept)."""


def make_cfg(spec: JobConfig, bandwidth: str, side: str) -> Any:
    """``side``: default or again (no plugin), tictac (its defaults) or off (tictac loaded
    with ``heuristic=off``: it plans nothing and implements no transfer hook, so it isolates
    what loading the plugin costs from what its planning and ordering do)."""
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(spec)]
    cfg.cluster.mode = MODE[0]
    cfg.cluster.workers = WORKERS[0]
    cfg.cluster.servers = 1 if MODE[0] == "ps" else 0
    cfg.cluster.timeout_s = 120
    cfg.cluster.network.bandwidth = bandwidth
    cfg.cluster.network.topology = TOPOLOGY[0]
    if side == "tictac":
        cfg.plugins = {"tictac": dict(TICTAC)}
    elif side in VARIANTS:
        cfg.plugins = {"tictac": dict(VARIANTS[side])}
    elif side == "off":
        cfg.plugins = {"tictac": {"heuristic": "off"}}
    return cfg


def one_run(spec: JobConfig, bandwidth: str, side: str, label: str = "") -> dict[str, Any]:
    """One run; with ``--keep``, its directory (the plugin's plans) is copied to
    ``<keep>/<label>`` with the ranks' timelines, per-iteration figures and metrics
    (``timeline.json``), so the run can be studied afterwards."""
    with tempfile.TemporaryDirectory() as run_dir:
        out = run_cluster(make_cfg(spec, bandwidth, side), run_dir=run_dir)
        plan = Path(run_dir) / "tictac" / "plan-rank0.json"  # the server's
        saved = json.loads(plan.read_text()).get("cross_iteration") if plan.exists() else None
        if KEEP and label:
            kept = KEEP[0] / label
            shutil.copytree(run_dir, kept)
            (kept / "timeline.json").write_text(json.dumps({
                "spans": [dataclasses.asdict(s) for s in out.spans],
                "per_iteration": out.per_iteration, "metrics": out.metrics}, default=str))
    m = out.metrics
    # the calibration comes from the run without the plugin (an early update has none)
    facts = (measure(out.spans, parse_rate(bandwidth) / 8, int(m.get("warmup_iterations") or 0))
             if side == "default" else None)
    rows = [r for r in out.plugin_rows if r.plugin == "tictac"]
    predicted = [r.metrics for r in rows if "predicted_ms" in r.metrics]  # the server's
    return {"it_s": m.get("wall_iterations_per_s"), "a": m.get("ratio_a"),
            "predicted": predicted[0] if predicted else {}, "saved": saved,
            "e": m.get("efficiency_e"), "mc": m.get("mc_s"), "pc": m.get("pc_s"),
            "wire": m.get("wire_bytes_per_iteration"),
            "iteration": m.get("iteration_s"), "measured": facts,
            "row": rows[0].summary.split(";")[0] if rows else ""}  # what it did, no paths


KINDS = {"oracle": "the oracle's compute",
         "calibrated": "every op scaled to the default run's compute (Pc)",
         "measured": "the default run's measured forward, backward, per-transfer cost and "
                     "server turnaround"}
"""How the simulator's inputs are taken (``simulated``), and what each kind means."""


def simulated(default: dict[str, Any], tictac: dict[str, Any],
              errors: dict[str, dict[str, list[float]]]) -> str:
    """The cross-iteration simulator beside the measured wall iteration of each side: as the
    tictac side's server predicted it (``oracle``: compute from its oracle), again with
    every op scaled to the compute the default run's workers measured (``calibrated``), and
    again with what the default run measured (``measured``: forward and backward apart, the
    per-transfer cost and the server's turnaround, ``accelopt_plugins.tictac.measured``).
    Both calibrations come from the default run alone and serve both sides, so what they
    predict for the tictac side is predicted, not fitted."""
    predicted, saved = tictac["predicted"], tictac["saved"]
    if "predicted_ms" not in predicted or not default["it_s"] or not tictac["it_s"]:
        return ""
    ran = predicted["predicted_schedule"]
    facts = default["measured"]
    parts = []
    for side, key, run in (("default", "off", default), ("tictac", ran, tictac)):
        measured = 1e3 / run["it_s"]
        oracle_ms = predicted["predicted_off_ms" if key == "off" else "predicted_ms"]
        errors["oracle"][side].append(oracle_ms / measured - 1)
        text = f"{side} {measured:.1f} ms: oracle {oracle_ms:.1f}"
        if saved and default["pc"]:
            calibrated = 1e3 * resimulate(saved, key, default["pc"]).iteration_s
            errors["calibrated"][side].append(calibrated / measured - 1)
            text += f", calibrated {calibrated:.1f}"
        if saved and isinstance(facts, Measured):
            again = 1e3 * resimulate(saved, key, measured=facts).iteration_s
            errors["measured"][side].append(again / measured - 1)
            text += f", measured {again:.1f}"
        parts.append(text)
    assumed = (f" (the oracle's compute {predicted.get('simulated_compute_ms', 0):.1f} ms, "
               f"a worker's measured {1e3 * (default['pc'] or 0):.1f} ms")
    if isinstance(facts, Measured):
        assumed += (f": forward {1e3 * facts.forward_s:.1f} + backward "
                    f"{1e3 * facts.backward_s:.1f} ms; per transfer {1e3 * facts.message_s:.3f}"
                    f" ms, server turnaround {1e3 * facts.server_s:.2f} ms)")
    else:
        assumed += f"; no measured calibration: {facts})"
    return "; measured vs simulated: " + "; ".join(parts) + assumed


WHAT_IF = {"early update": Schedule(early_update=True),
           "+ a window (by priority)": Schedule(early_update=True, by_priority=True),
           "+ 256 KiB chunks": Schedule(early_update=True, by_priority=True,
                                        partition_bytes=262144)}
"""tictac's schedules, each simulated on both topologies from the default run's measured
calibration (``what_if``)."""


def what_if(default: dict[str, Any], tictac: dict[str, Any]) -> dict[str, float]:
    """Each of tictac's schedules' simulated speed-up over the default order, on one bus
    and on per-rank links at the same rate, from the default run's measured calibration:
    what the simulator, calibrated where it is checked, says each schedule could gain here
    (empty when the round has no calibration)."""
    facts, saved = default["measured"], tictac["saved"]
    if not saved or not isinstance(facts, Measured):
        return {}
    work, link = calibrated(saved, facts)
    gains = {}
    for topology, shared in (("shared", True), ("hosts", False)):
        on = dataclasses.replace(link, shared=shared)
        base = simulate(work, on).iteration_s
        for name, schedule in WHAT_IF.items():
            gains[f"{topology}: {name}"] = base / simulate(work, on, schedule).iteration_s
    return gains


def rate_text(bits: float) -> str:
    return f"{max(1, round(bits / 1e6))}mbit"


def main() -> int:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--models", type=_cli.names([*MODEL_NAMES, "lm"]), default="resnet,inception,transformer,lm")
    ap.add_argument("--bandwidth", type=_cli.rate, default="200mbit", help="the calibration run's link")
    ap.add_argument("--rounds", type=_cli.positive_int, default=3)
    ap.add_argument("--iterations", type=_cli.positive_int, default=20)
    ap.add_argument("--batch", type=_cli.positive_int, default=64)
    ap.add_argument("--extra", nargs="*", default=[], choices=["off", "again"],
                    help="more sides: off (tictac loaded with heuristic=off: no planning, no "
                         "transfer hooks), again (no plugin a second time: the A/A spread)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="plugins.tictac settings of the tictac side, e.g. heuristic=priority")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="one more tictac side per use, e.g. c256k:heuristic=priority,"
                         "credit_bytes=262144")
    ap.add_argument("--topology", default="shared", choices=["shared", "hosts"],
                    help="shared: one shaped loopback for all ranks (a bus); hosts: a shaped "
                         "full-duplex link per rank")
    ap.add_argument("--mode", default="ps", choices=["ps", "allreduce"],
                    help="ps: 1 server + 2 workers; allreduce: 2 workers under PyTorch DDP "
                         "(the default side is plain DDP)")
    ap.add_argument("--workers", type=_cli.positive_int, default=2,
                    help="data-parallel workers (1 leaves the server and the worker a core "
                         "each on a 2-core machine)")
    ap.add_argument("--keep", type=Path, default=None, metavar="DIR",
                    help="copy every run's directory to DIR/<model>/<round>-<side> (a new "
                         "directory: an existing one is refused, never written into)")
    args = ap.parse_args()
    if args.keep is not None:
        if args.keep.exists():
            ap.error(f"--keep {args.keep} exists; name a new directory")
        _cli.refuse_not_a_directory(args.keep, "--keep")
        KEEP.append(args.keep)
    TOPOLOGY[0] = args.topology
    MODE[0] = args.mode
    WORKERS[0] = args.workers
    tictac, variants = tictac_sides(args.set, args.variant)
    TICTAC.update(tictac)
    for name, values in variants.items():
        VARIANTS[name] = values
        EXTRA[name] = f"tictac {name}"
    args.extra = [*args.extra, *VARIANTS]
    described = ", ".join(args.set) if args.set else "its defaults (TAC, self-limited)"
    started = time.time()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, python "
          f"{platform.python_version()}; load average {os.getloadavg()[0]:.2f}")
    workers = f"{args.workers} worker{'s' if args.workers > 1 else ''}"
    ranks = f"1 server + {workers}" if args.mode == "ps" else f"{workers} (DDP)"
    print(f"{args.mode} cluster, {ranks}, {args.iterations} iterations per run, "
          f"{args.rounds} paired rounds per model (order alternating); tictac = {described}",
          flush=True)
    all_ratios: list[float] = []
    all_errors: dict[str, dict[str, list[float]]] = {
        kind: {"default": [], "tictac": []} for kind in KINDS}
    lines = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        spec = job_spec(model, args.iterations, args.batch)
        probe = one_run(spec, args.bandwidth, "default")
        a = probe["a"] or 1.0
        link = rate_text(parse_rate(args.bandwidth) * a)
        print(f"{model}: a = {a:.2f} at {args.bandwidth} -> timed at {link}", flush=True)
        ratios, base, mine, rows, bounds = [], [], [], set(), []
        errors: dict[str, dict[str, list[float]]] = {
            kind: {"default": [], "tictac": []} for kind in KINDS}
        extra: dict[str, list[float]] = {side: [] for side in args.extra}
        gains: dict[str, list[float]] = {}
        sides = ["default", "tictac", *args.extra]
        for r in range(args.rounds):
            order = sides[r % len(sides):] + sides[:r % len(sides)]  # rotating
            got = {side: one_run(spec, link, side, f"{model}/{r + 1}-{side}")
                   for side in order}
            d, t = got["default"], got["tictac"]
            for side in args.extra:
                if d["it_s"] and got[side]["it_s"]:
                    extra[side].append(got[side]["it_s"] / d["it_s"])
            if d["it_s"] and t["it_s"]:
                ratios.append(t["it_s"] / d["it_s"])
                base.append(d["it_s"])
                mine.append(t["it_s"])
            rows.add(t["row"])
            if d["wire"] and d["pc"] and d["iteration"]:
                # the busiest link's busy time: shared, every byte on one bus; hosts, the
                # server's link, full duplex, carries half the bytes in each direction
                bus = d["wire"] if TOPOLOGY[0] == "shared" else d["wire"] / 2
                link_s = 8 * bus / parse_rate(link)
                bounds.append(d["iteration"] / max(link_s, d["pc"]))
            more = "".join(f", {EXTRA[side]} {got[side]['it_s']:.3f} it/s"
                           for side in args.extra)
            more += simulated(d, t, errors)
            for name, gain in what_if(d, t).items():
                gains.setdefault(name, []).append(gain)
            print(f"  round {r + 1}: default {d['it_s']:.3f} it/s (a {d['a']:.2f}, E "
                  f"{d['e']:.2f}), tictac {t['it_s']:.3f} it/s (E {t['e']:.2f}){more}",
                  flush=True)
        for side, got_ratios in extra.items():
            if got_ratios:
                print(f"  {EXTRA[side]} / default: {statistics.median(got_ratios):.3f}x "
                      f"({min(got_ratios):.3f}-{max(got_ratios):.3f})", flush=True)
        if gains:
            print("  simulated, the default run's measured calibration, speed-up over the "
                  f"default order (median of {len(next(iter(gains.values())))} rounds): "
                  + ", ".join(f"{name} {statistics.median(g):.2f}x"
                              for name, g in gains.items()), flush=True)
        all_ratios += ratios
        for kind, by_side in errors.items():
            for side, errs in by_side.items():
                all_errors[kind][side] += errs
        med = statistics.median(ratios) if ratios else float("nan")
        bound = statistics.median(bounds) if bounds else float("nan")
        sim = " / ".join(f"{100 * statistics.median(e):+.0f}%" if e else "-"
                         for e in errors["measured"].values())
        lines.append(f"| {model} | {link} | {statistics.median(base):.3f} | "
                     f"{statistics.median(mine):.3f} | {med:.3f}x ({min(ratios):.3f}-"
                     f"{max(ratios):.3f}) | {bound:.2f}x | {sim} | {'; '.join(sorted(rows))} |")
    print("\n| model | link | default it/s | tictac it/s | tictac / default (min-max) "
          "| bound | simulator error, measured calibration (default / tictac) | tictac's row |")
    print("|---|---|---:|---:|---|---:|---|---|")
    print("\n".join(lines))
    print("bound: the default run's iteration over max(link, Pc): the busiest link's busy "
          "time (shared: the iteration's bytes on the one loopback over its shaped rate; "
          "hosts: the server's link, half of them each way) or the compute's (a worker's "
          "forward + backward) alone; no schedule goes below either")
    print("paper (TicTac, over TensorFlow's random order): +19.2% training; ByteScheduler "
          "(cross-iteration priorities, partitioning, credits): up to +196%")
    for kind, by_side in all_errors.items():
        errs = by_side["default"] + by_side["tictac"]
        if errs:
            within = sum(abs(e) <= 0.15 for e in errs)
            sides = ", ".join(f"{side} {sum(abs(e) <= 0.15 for e in e_side)} of {len(e_side)}"
                              for side, e_side in by_side.items())
            print(f"cross-iteration simulator, {KINDS[kind]}: predicted iteration within 15% "
                  f"of the measured one in {within} of {len(errs)} runs ({sides}; median "
                  f"error {100 * statistics.median(errs):+.1f}%, median |error| "
                  f"{100 * statistics.median(abs(e) for e in errs):.1f}%)")
    print(f"wall {time.time() - started:.0f} s")
    n = len(all_ratios)
    print(f"tictac vs default order: {statistics.median(all_ratios):.2f}x (median of {n} "
          "paired rounds)")
    return 0


if __name__ == "__main__":
    _cli.run(main)
