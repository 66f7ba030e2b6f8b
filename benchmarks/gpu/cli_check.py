"""GPU check of the documented commands (a few minutes on one CUDA GPU; skips without CUDA).

What only a GPU shows: the README's commands, each plugin's "try it" line and the hero
command, run as a user runs them on a machine whose ``run.device=auto`` means CUDA. Each
must exit 0 with every job done (none failed), and a one-process run must have trained on
the GPU. Prints one line per command with its wall time and what the run recorded.

    python benchmarks/gpu/cli_check.py [--cpu]     # --cpu: the same commands on this CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _cli
import _cli  # noqa: E402


@dataclass(frozen=True)
class Command:
    name: str
    args: list[str]
    refused: str | None = None
    """Words of the one-line refusal (exit 2) this command must get on a GPU machine."""

    @property
    def one_process_on_gpu(self) -> bool:
        """A one-process run left at ``run.device=auto``: it must have trained on CUDA."""
        return "cluster.mode=none" in self.args and "run.device=cpu" not in self.args


COMMANDS = [
    Command("default workload, one process", ["cluster.mode=none"]),
    Command("the hero command", ["+plugins=[salus,tictac]"]),
    Command("salus srtf, trace, one process", ["+plugins=[salus]", "plugins.salus.policy=srtf",
                                               "workload=trace", "cluster.mode=none"]),
    Command("gpu_kernels pruning, one process", ["+plugins=[gpu_kernels]",
                                                 "plugins.gpu_kernels.prune_amount=0.5",
                                                 "cluster.mode=none"]),
    Command("offload, one process", ["+plugins=[offload]", "cluster.mode=none"]),
    Command("slide, xc, on the CPU", ["+plugins=[slide]", "workload=xc", "cluster.mode=none",
                                      "run.device=cpu"]),
    Command("slide on the GPU: refused at configure", ["+plugins=[slide]", "workload=xc",
                                                       "cluster.mode=none"],
            refused="SLIDE's kernels run on the CPU"),
    Command("gradcomm, all-reduce, one rank", ["+plugins=[gradcomm]", "cluster.mode=allreduce",
                                               "workload=digits", "cluster.workers=1"]),
    Command("noop, one process", ["+plugins=[noop]", "cluster.mode=none"]),
    Command("a sweep on the salus launcher", ["-m", "workload.jobs.0.lr=0.01,0.1",
                                              "cluster.mode=none", "hydra/launcher=salus"]),
]


def run(args: list[str], where: Path, cpu: bool = False) -> tuple[int, float, str, list[dict]]:
    """``accelopt run <args>`` in a fresh directory: exit code, wall seconds, its output
    (whitespace collapsed: the console wraps long lines), and the metrics of every run
    directory it wrote. Also ``cluster_check.py``'s way to run the command."""
    where.mkdir(parents=True)
    extra = ["run.device=cpu"] if cpu and "run.device=cpu" not in args else []
    sweep = "-m" in args
    dirs = ([f"hydra.sweep.dir={where}/sweep"] if sweep else [f"hydra.run.dir={where}/run"])
    cmd = [sys.executable, "-m", "accelopt.cli.main", "run", *args, *extra, *dirs]
    start = time.perf_counter()
    # From the command's own directory: the installed accelopt, not a source tree in the cwd.
    # its own process group: stopped, ranks and all, on the timeout or when this check stops
    out = _cli.run_child(cmd, capture_output=True, text=True, timeout=240, cwd=where,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - start
    text = " ".join((out.stdout + out.stderr).split())
    metrics = [json.loads(p.read_text()) for p in sorted(where.rglob("metrics.json"))]
    return out.returncode, wall, text, metrics


def main() -> int:
    # before the CUDA check: --help shows what the check does, and a mistyped option is
    # refused here instead of starting the whole check on a GPU
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--cpu", action="store_true",
                    help="run the same commands on this machine's CPU (no GPU needed)")
    cpu = ap.parse_args().cpu
    import torch

    if not cpu and not torch.cuda.is_available():
        print("SKIP: no CUDA device (the CLI GPU check needs one; --cpu runs it here)")
        return 0
    failed = 0
    commands = [c for c in COMMANDS if not (cpu and c.refused)]
    with tempfile.TemporaryDirectory() as tmp:
        for k, command in enumerate(commands):
            rc, wall, text, metrics = run(command.args, Path(tmp, f"c{k}"), cpu)
            tail = text[-500:]
            if command.refused is not None:
                ok = rc == 2 and command.refused in tail and "Traceback" not in tail
                detail = f"rc {rc}, {wall:.1f} s: {tail[-300:]}"
            else:
                runs = [m.get("summary", {}) for m in metrics]
                done = sum(s.get("n_done", 0) for s in runs)
                bad = sum(s.get("n_failed", 0) for s in runs)
                devices = sorted({str(m.get("run", {}).get("device")) for m in metrics})
                backends = sorted({str(s["cluster_backend"]) for s in runs
                                   if "cluster_backend" in s})
                on_gpu = (cpu or not command.one_process_on_gpu
                          or all(d.startswith("cuda") for d in devices))
                ok = rc == 0 and bool(metrics) and done > 0 and bad == 0 and on_gpu
                detail = (f"rc {rc}, {wall:.1f} s, {len(metrics)} run(s), {done} job(s) done, "
                          f"{bad} failed, device {','.join(devices)}"
                          + (f", backend {','.join(backends)}" if backends else "")
                          + ("" if ok else f"; {tail}"))
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'}  {command.name}: {detail}", flush=True)
            print(f"      accelopt run {' '.join(command.args)}", flush=True)
    print(f"SUMMARY: {'PASS' if not failed else 'FAIL'} ({len(commands) - failed}/{len(commands)})")
    return 1 if failed else 0


if __name__ == "__main__":
    _cli.run(main)
