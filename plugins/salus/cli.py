"""``accelopt serve | submit | status | cancel``: the SALUS execution service from the shell.

Kept free of torch imports until a command runs, because ``accelopt --help`` lists every
plugin's commands.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from accelopt import CliCommand, UserError
from accelopt.errors import first_line


def commands() -> list[CliCommand]:
    return [
        CliCommand("serve", "salus: run the execution service on a local socket", serve_cmd),
        CliCommand("submit", "salus: submit a job to `accelopt serve`", submit_cmd),
        CliCommand("status", "salus: lanes, jobs, progress and memory of the service",
                   status_cmd),
        CliCommand("cancel", "salus: cancel a job of the service", cancel_cmd),
    ]


def _socket_arg(parser: argparse.ArgumentParser) -> None:
    from accelopt_plugins.salus.service import default_socket

    parser.add_argument("--socket", type=Path, default=None,
                        help=f"Unix socket of the service (default {default_socket()}, or "
                             "$ACCELOPT_SALUS_SOCKET)")


def _path(opts: argparse.Namespace) -> Path:
    from accelopt_plugins.salus.service import default_socket

    return opts.socket or default_socket()


def _ask(opts: argparse.Namespace, message: dict[str, Any]) -> dict[str, Any]:
    from accelopt_plugins.salus.service import SUBMIT_TIMEOUT_S, request

    # a submit is answered once its jobs are profiled, which takes longer under load
    timeout = SUBMIT_TIMEOUT_S if message.get("op") == "submit" else 30.0
    reply = request(_path(opts), message, timeout)
    if not reply.get("ok"):
        raise UserError(str(reply.get("error", "the service refused the request")))
    return reply


def serve_cmd(args: list[str]) -> int:
    """Run the execution service in the foreground until `accelopt serve --stop`."""
    parser = argparse.ArgumentParser(prog="accelopt serve", description=serve_cmd.__doc__)
    _socket_arg(parser)
    parser.add_argument("--root", type=Path, default=Path("runs/serve"),
                        help="where each job's run directory goes (<root>/jobs/<id>/)")
    parser.add_argument("--policy", default="pack",
                        help="pack (default), srtf, fair, fifo, rr, las, dlas, gittins, a "
                             "policy an installed package registers, or module:Class")
    parser.add_argument("--capacity", default="", help="memory shared by the lanes, e.g. 2GiB")
    parser.add_argument("--max-lanes", type=int, default=-1)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads per lane")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--stop", action="store_true",
                        help="ask the running service to stop (its jobs finish first)")
    opts = parser.parse_args(args)
    if opts.stop:
        print(_ask(opts, {"op": "shutdown"})["message"])
        return 0
    from accelopt_plugins.salus.policies import make_policy
    from accelopt_plugins.salus.service import ServeOptions, serve

    options = ServeOptions(socket=_path(opts), root=opts.root, policy=opts.policy,
                           capacity=opts.capacity, max_lanes=opts.max_lanes,
                           threads=opts.threads, device=opts.device)
    try:
        make_policy(opts.policy)  # one-line error before anything starts
        return serve(options, ready=lambda line: print(line, flush=True))
    except UserError as exc:
        raise _named_by_flags(exc) from None


_FLAGS = {"plugins.salus.policy": "--policy", "plugins.salus.capacity": "--capacity",
          "plugins.salus.threads": "--threads", "plugins.salus.max_lanes": "--max-lanes",
          "run.device": "--device"}
"""The settings ``accelopt serve`` passes on from its flags, by the names the checks use."""


def _named_by_flags(exc: UserError) -> UserError:
    """A refused setting named as the user gave it: ``--capacity``, not
    ``plugins.salus.capacity`` (the service checks its flags as salus's settings)."""
    text = str(exc)
    for key, flag in _FLAGS.items():
        text = text.replace(key, flag)
    exc.args = (text,)
    return exc


def _key_values(items: list[str]) -> dict[str, Any]:
    """``key=value`` pairs, each value read as ``accelopt run`` reads an override's
    (:func:`_value`)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"expected key=value, got {item!r} (e.g. model=cnn iterations=100)")
        out[key] = _value(key, value)
    return out


def _value(key: str, value: str) -> Any:
    """``value`` as a run reads ``key=value``: Hydra's override grammar, so
    ``model_kwargs={num_classes:10}`` is a mapping, ``[1,2]`` a list, ``0.1`` a number,
    ``true`` a boolean and ``cnn`` a string; JSON (``{"num_classes": 10}``) is read as JSON.
    A value neither reads (a sweep, ``a=b``) is refused in one line with the fix."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Sweep
    from hydra.errors import HydraException

    with contextlib.suppress(json.JSONDecodeError):
        return json.loads(value)
    try:
        parsed = OverridesParser.create().parse_override(f"value={value}").value()
    except HydraException as exc:
        raise UserError(f"submit: cannot read {key}={value!r} ({first_line(exc)}); write "
                        "values as `accelopt run` takes them: a mapping {num_classes:10}, a "
                        f"list [1,2], or a string in quotes, {key}='\"{value}\"'") from None
    if isinstance(parsed, Sweep):
        raise UserError(f"submit: {key}={value!r} is a sweep; a submit is one job: submit one "
                        f"per value, or quote a string with a comma: {key}='\"{value}\"'")
    return parsed


def _one_source(opts: argparse.Namespace) -> None:
    """Refuse a submit whose parts would not all be used: ``--workload`` submits the
    workload's own jobs, so key=value pairs or a ``--factory`` beside it were dropped without
    a word (the jobs ran with the workload's values, the factory was never imported)."""
    if opts.workload and opts.factory:
        raise UserError(f"submit: --workload {opts.workload} and --factory {opts.factory} are two "
                        "submits; give one of them")
    if opts.workload and opts.overrides:
        keys = ", ".join(item.partition("=")[0] for item in opts.overrides)
        raise UserError(f"submit: --workload submits the workload's own jobs: key=value "
                        f"overrides ({keys}) are not applied to them; drop them, or submit one "
                        "job with model=... and those keys")


def submit_cmd(args: list[str]) -> int:
    """Submit a job: `accelopt submit model=cnn iterations=200 batch_size=32 [name=x]`,
    `accelopt submit --workload tiny`, or `accelopt submit --factory mod:fn key=value`."""
    parser = argparse.ArgumentParser(prog="accelopt submit", description=submit_cmd.__doc__)
    _socket_arg(parser)
    parser.add_argument("--workload", help="submit every job of a built-in workload")
    parser.add_argument("--factory", help="module:function returning a JobConfig/dict/Job")
    parser.add_argument("overrides", nargs="*", help="job config key=value pairs")
    opts = parser.parse_args(args)
    _one_source(opts)
    fields = _key_values(opts.overrides)
    if opts.workload:
        message: dict[str, Any] = {"op": "submit", "workload": opts.workload}
    elif opts.factory:
        message = {"op": "submit", "factory": opts.factory, "args": fields}
    else:
        message = {"op": "submit", "job": fields}
    for job_id in _ask(opts, message)["submitted"]:
        print(job_id)
    return 0


def status_cmd(args: list[str]) -> int:
    """Show the service's lanes, jobs, progress and memory."""
    parser = argparse.ArgumentParser(prog="accelopt status", description=status_cmd.__doc__)
    _socket_arg(parser)
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args(args)
    reply = _ask(opts, {"op": "status"})
    if opts.json:
        print(json.dumps(reply, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    from accelopt.report.summary import quality_text
    from accelopt.units import format_bytes

    def size(value: Any) -> str:
        return "-" if value is None else format_bytes(value)

    console = Console() if sys.stdout.isatty() else Console(width=120)
    console.print(f"policy {reply['policy']} on {reply['device']} (pid {reply['pid']}): "
                  f"{size(reply['used'])} of {size(reply['capacity'])} in lanes; "
                  f"[italic]{reply['note']}[/italic]")
    lanes = Table(title="lanes")
    for column in ("lane", "size", "needed", "jobs", "running"):
        lanes.add_column(column)
    for lane in reply["lanes"]:
        lanes.add_row(lane["id"], size(lane["size"]), size(lane["used"]),
                      ", ".join(lane["jobs"]), lane["busy"] or "-")
    console.print(lanes)
    jobs = Table(title="jobs")
    for column in ("id", "model", "state", "lane", "progress", "JCT s", "pers", "eph",
                   "quality", "error / note"):
        jobs.add_column(column, overflow="fold")
    for job in reply["jobs"]:
        jct = "-" if job["jct_s"] is None else f"{job['jct_s']:.2f}"
        # a job done on a loss of nan read as one done well ("done", quality "–", no error)
        diverged = job.get("diverged") and job["state"] == "done"
        note = job.get("quality_note", "") if diverged else ""
        done = "?" if job["done"] is None else job["done"]  # a killed service kept no count
        jobs.add_row(job["id"], job["model"], "diverged" if diverged else job["state"],
                     job["lane"] or "-", f"{done}/{job['iterations']}", jct,
                     size(job["persistent"]), size(job["ephemeral"]), quality_text(job),
                     job["error"] or note)
    console.print(jobs)
    return 0


def cancel_cmd(args: list[str]) -> int:
    """Cancel a job by id (from `accelopt status` or `accelopt submit`)."""
    parser = argparse.ArgumentParser(prog="accelopt cancel", description=cancel_cmd.__doc__)
    _socket_arg(parser)
    parser.add_argument("job_id")
    opts = parser.parse_args(args)
    print(_ask(opts, {"op": "cancel", "id": opts.job_id})["message"])
    return 0
