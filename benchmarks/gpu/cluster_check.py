"""GPU check for the cluster modes on one CUDA GPU (about a minute; skips cleanly without CUDA).

What only a GPU shows: DDP over NCCL, and what a one-GPU machine does with several ranks.
Verifies:

1. NCCL's rule that the backend choice rests on: two ranks on one GPU in one communicator
   (printed: what NCCL did; if it ever accepts them, the choice is too cautious and says so);
2. the gradcomm DDP comm hook on CUDA tensors over NCCL (one rank): with no codec, the hook
   is DDP's own all-reduce bit for bit; each codec trains to a finite loss near it;
3. ``accelopt run cluster.mode=allreduce cluster.workers=1 +plugins=[gradcomm]``: one rank,
   so NCCL on the GPU, every job done;
4. the default ``accelopt run`` (PS: 1 server + 2 workers on one GPU): runs on CPU over gloo
   and says why in one line, every job done;
5. ``run.device=cuda`` with three ranks on one GPU: refused in one line, exit 2, nothing run.

    python benchmarks/gpu/cluster_check.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _cli
import _cli  # noqa: E402

CODECS = {"fp16": {"dtype": "fp16"}, "bf16": {"dtype": "bf16"},
          "topk": {"sparsify": "topk", "density": 0.05},
          "threshold": {"sparsify": "threshold", "threshold": 1e-3}}


def _shared_gpu_rank(rank: int, init: str, out: str) -> None:
    try:
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2,
                                device_id=torch.device("cuda", 0))
        t = torch.ones(4, device="cuda:0")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        Path(out, f"{rank}.txt").write_text(f"ok {t.tolist()}")
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, the point of the test
        Path(out, f"{rank}.txt").write_text(f"error {type(exc).__name__}: {exc}"[:400])


def nccl_on_one_gpu() -> tuple[bool, str]:
    """Two NCCL ranks on cuda:0: the outcome, as NCCL gives it (45 s at most)."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_shared_gpu_rank, args=(r, f"file://{tmp}/rdv", tmp))
                 for r in range(2)]
        with _cli.stopping(procs):  # no rank outlives SIGTERM (run_all.sh's timeout)
            for p in procs:
                p.start()
            deadline = time.monotonic() + 45
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
        said = {r: (Path(tmp, f"{r}.txt").read_text() if Path(tmp, f"{r}.txt").exists()
                    else "no answer") for r in range(2)}
    accepted = all(s.startswith("ok") for s in said.values())
    detail = ("hung 45 s; " if hung else "") + " | ".join(f"rank {r}: {s}"
                                                         for r, s in said.items())
    return accepted, detail


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10)).cuda()


def _train(options: dict | None, *, ours: bool) -> tuple[float, float, list[torch.Tensor]]:
    """First and final loss of 60 SGD steps, and the final parameters."""
    from accelopt_plugins.gradcomm import comm_hook as gradcomm_hook
    from torch.nn.parallel import DistributedDataParallel

    from accelopt.ddp import comm_hook as accelopt_hook

    net = _model()
    ddp = DistributedDataParallel(net, device_ids=[0])
    state = None
    if options is not None:
        state, hook = gradcomm_hook(net, bucket_mb=0.5, **options)
        ddp.register_comm_hook(state, hook)
    elif ours:
        state, hook = accelopt_hook(net, plugins=[])
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(60):
        x = torch.randn(64, 256, device="cuda", generator=gen)
        y = x[:, :10].argmax(dim=1)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    if state is not None:
        state.close()
    return float(losses[0]), float(losses[-1]), [p.detach().clone() for p in net.parameters()]


def comm_hooks_on_nccl() -> list[tuple[str, bool, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/rdv", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        try:
            torch.use_deterministic_algorithms(True, warn_only=True)
            first, base_loss, base = _train(None, ours=False)
            _, ours_loss, ours = _train(None, ours=True)
            checks = [("accelopt's hook is DDP's all-reduce bit for bit (NCCL, CUDA)",
                       all(torch.equal(a, b) for a, b in zip(base, ours, strict=True)),
                       f"loss {first:.4f} -> {base_loss:.4f} vs {ours_loss:.4f}")]
            for name, options in CODECS.items():
                _, loss, _ = _train(options, ours=False)
                ok = first - loss > 0.5 * (first - base_loss)  # half of DDP's descent or more
                checks.append((f"gradcomm {name} on NCCL trains", ok,
                               f"loss {first:.4f} -> {loss:.4f} vs DDP's -> {base_loss:.4f}"))
        finally:
            dist.destroy_process_group()
    return checks


def accelopt(args: list[str], where: Path) -> tuple[int, str, dict]:
    """The command, as :mod:`cli_check` runs it: exit code, output, the run's metrics."""
    from cli_check import run

    rc, _wall, text, metrics = run(args, where)
    return rc, text, metrics[0] if metrics else {}


def cli_runs(tmp: Path) -> list[tuple[str, bool, str]]:
    checks = []
    rc, text, m = accelopt(["cluster.mode=allreduce", "cluster.workers=1", "+plugins=[gradcomm]",
                            "plugins.gradcomm.dtype=fp16"], tmp / "allreduce")
    s = m.get("summary", {})
    ok = rc == 0 and s.get("cluster_backend") == "nccl" and s.get("n_done") == s.get("n_jobs")
    checks.append(("all-reduce, one rank: DDP over NCCL, every job done", ok,
                   f"rc {rc}, backend {s.get('cluster_backend')}, "
                   f"{s.get('n_done')}/{s.get('n_jobs')} done, makespan "
                   f"{s.get('makespan_s', float('nan')):.2f} s" + ("" if ok else f"; {text[-600:]}")))
    rc, text, m = accelopt([], tmp / "ps")
    s = m.get("summary", {})
    said = "NCCL needs one device per rank" in text
    ok = rc == 0 and s.get("cluster_backend") == "gloo" and said and s.get("n_done") == s.get("n_jobs")
    checks.append(("default PS run on one GPU: CPU over gloo, said in one line", ok,
                   f"rc {rc}, backend {s.get('cluster_backend')}, note printed {said}, "
                   f"{s.get('n_done')}/{s.get('n_jobs')} done" + ("" if ok else f"; {text[-600:]}")))
    rc, text, _ = accelopt(["run.device=cuda"], tmp / "refused")
    ok = rc == 2 and "one device per rank" in text and "Traceback" not in text
    checks.append(("run.device=cuda with 3 ranks on one GPU: refused, exit 2", ok,
                   f"rc {rc}: {text[-300:]}"))
    return checks


def main() -> int:
    # before the CUDA check: --help shows what the check does, and a mistyped option is
    # refused here instead of starting the whole check on a GPU
    argparse.ArgumentParser(description=_cli.summary(__doc__)).parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device (cluster GPU check needs one)")
        return 0
    print(f"{torch.cuda.device_count()} CUDA device(s): {torch.cuda.get_device_name()}; "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    accepted, detail = nccl_on_one_gpu()
    print(f"NCCL, two ranks on one GPU: {'accepted' if accepted else 'refused'}: {detail}",
          flush=True)
    checks = [("NCCL refuses two ranks on one GPU (why auto picks gloo there)", not accepted,
               "refused" if not accepted else "NCCL accepted them: the gloo fallback is "
               "more cautious than needed")]
    checks += comm_hooks_on_nccl()
    with tempfile.TemporaryDirectory() as tmp:
        checks += cli_runs(Path(tmp))
    failed = 0
    for name, ok, detail in checks:
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    print(f"SUMMARY: {'PASS' if not failed else 'FAIL'} ({len(checks) - failed}/{len(checks)})")
    return 1 if failed else 0


if __name__ == "__main__":
    _cli.run(main)
