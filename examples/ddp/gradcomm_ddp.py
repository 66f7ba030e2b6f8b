"""gradcomm's codecs in a plain PyTorch DDP script (no accelopt run): two gloo processes on
this machine train the same MLP with DDP's own all-reduce and with gradcomm's hook.

    python examples/ddp/gradcomm_ddp.py [--codec fp16|bf16|topk|threshold ...] [--iterations 50]

Each process prints nothing; rank 0 prints the final loss of DDP's run and of each codec's,
and gradcomm's row for each.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from accelopt_plugins.gradcomm import comm_hook
from torch import nn
from torch.nn.parallel import DistributedDataParallel

CODECS = {
    "fp16": {"dtype": "fp16"},
    "bf16": {"dtype": "bf16"},
    "topk": {"sparsify": "topk", "density": 0.05},
    "threshold": {"sparsify": "threshold", "threshold": 1e-2},
}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 4))


def train(rank: int, world: int, options: dict | None, iterations: int) -> tuple[float, list]:
    """One DDP run; ``options``: gradcomm's settings (``None``: DDP's own all-reduce)."""
    net = model()
    ddp = DistributedDataParallel(net)
    state = None
    if options is not None:
        state, hook = comm_hook(net, bucket_mb=0.01, **options)
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of data
    loss = torch.tensor(0.0)
    for _ in range(iterations):
        x = torch.randn(16, 32, generator=data)
        y = (x[:, :4].argmax(dim=1))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
    rows = []
    if state is not None:
        rows = state.report()
        state.close()  # before the process group goes
    return float(loss.detach()), rows


def worker(rank: int, world: int, init: str, codecs: list[str], iterations: int) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    plain, _ = train(rank, world, None, iterations)
    if rank == 0:
        print(f"DDP all-reduce: final loss {plain:.4f}")
    for codec in codecs:
        coded, rows = train(rank, world, CODECS[codec], iterations)
        if rank == 0:
            print(f"gradcomm {codec}: final loss {coded:.4f}")
            for row in rows:
                print(f"  {row.plugin}: {row.summary}")
    # The DDP wrappers above are garbage in reference cycles; left to the interpreter's
    # exit, their process group's gloo threads may free a finished work's tensors while
    # Python shuts down, which aborts the process (plain DDP does it too, ~5% of exits
    # here; pytorch/pytorch#190489). Collect them while the process is whole.
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec", choices=sorted(CODECS), nargs="+", default=["fp16"],
                        help="one or more codecs, each trained beside DDP's own all-reduce")
    parser.add_argument("--iterations", type=int, default=50)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.spawn(worker, args=(2, init, opts.codec, opts.iterations), nprocs=2)


if __name__ == "__main__":
    main()
