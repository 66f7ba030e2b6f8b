"""gradcomm in real all-reduce runs (2 gloo processes on 127.0.0.1): replicas stay bitwise
identical (checked every N iterations on every rank), fp16 halves the bytes the transport
moves, sparse buckets are gathered and still train, a diverging run stops naming the layer."""

from __future__ import annotations

import hashlib
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from accelopt.cluster import RankFailed, run_cluster
from accelopt.config import AccelConfig, JobConfig

pytestmark = pytest.mark.timeout(120)
CHECK_EVERY = 2


def make_cfg(iterations: int = 6, lr: float = 0.05, **gradcomm):
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name="tiny", model="mlp", width=32, batch_size=16, iterations=iterations, seed=0,
        lr=lr))]
    cfg.cluster.mode = "allreduce"
    cfg.cluster.workers = 2
    cfg.cluster.timeout_s = 20
    cfg.cluster.bucket_mb = 0.004  # ~4 KB: the mlp's layers fall in several buckets
    cfg.plugins = {"gradcomm": gradcomm}
    return cfg


def _replica_rank(rank: int, world: int, port: int, cfg_yaml: str, out_dir: str) -> None:
    """One rank of the all-reduce runtime, recording a digest of its parameters every
    CHECK_EVERY iterations (after the optimizer step) into ``out_dir``."""
    import torch.distributed as dist

    from accelopt.cluster import allreduce
    from accelopt.cluster.rank import RankRuntime
    from accelopt.cluster.settings import settings_from

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    cfg = OmegaConf.create(cfg_yaml)
    settings = settings_from(cfg.cluster)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    torch.manual_seed(int(cfg.run.seed))
    rt = RankRuntime(cfg, settings, rank, world, time.time(), torch.device("cpu"), "gloo",
                     out_dir, None)
    digests: list[str] = []
    end = rt.iteration_end

    def checked_end(ctx, start, loss, samples):
        end(ctx, start, loss, samples)
        if (ctx.iteration + 1) % CHECK_EVERY == 0:
            h = hashlib.sha256()
            for p in rt.job.model.parameters():
                h.update(p.detach().numpy().tobytes())
            digests.append(f"{ctx.iteration}:{h.hexdigest()}")

    rt.iteration_end = checked_end  # type: ignore[method-assign]
    allreduce.run_worker(rt)
    result = rt.finish()
    rows = [r.summary for r in result.plugin_rows if r.plugin == "gradcomm"]
    Path(out_dir, f"rank{rank}.txt").write_text("\n".join(digests + rows))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_replicas_stay_identical_every_n_iterations(tmp_path):
    cfg = make_cfg(iterations=6, sparsify="topk", density=0.05, dtype="fp16")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_replica_rank,
                         args=(r, 2, port, OmegaConf.to_yaml(cfg), str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=90)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    lines = [Path(tmp_path, f"rank{r}.txt").read_text().splitlines() for r in range(2)]
    digests = [[line for line in ls if line[0].isdigit()] for ls in lines]
    assert len(digests[0]) == 6 // CHECK_EVERY
    assert digests[0] == digests[1]
    # and the replicas really moved: the parameter digests change between checks
    assert len(set(digests[0])) == len(digests[0])
    assert all(any("error feedback" in line for line in ls) for ls in lines)
    # the job is SGD with momentum 0.9: DGC momentum correction is on by default
    assert all(any("momentum correction (m=0.9" in line for line in ls) for ls in lines)


def test_fp16_halves_the_bytes_and_sparse_buckets_train():
    plain = run_cluster(make_cfg(), run_dir=".")
    half = run_cluster(make_cfg(dtype="fp16", error_feedback=False), run_dir=".")
    sparse = run_cluster(make_cfg(sparsify="threshold", threshold=0.01), run_dir=".")
    payload = [sum(r.stats.payload_bytes for r in out.ranks) for out in (plain, half, sparse)]
    assert payload[1] * 2 == payload[0]
    # the few elements above the threshold as int32 index + fp32 value
    assert payload[2] < 0.5 * payload[0]
    losses = [out.results[0].losses for out in (plain, half, sparse)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)  # fp16 rounding only
    assert all(torch.isfinite(torch.tensor(ls)).all() for ls in losses)
    assert losses[2][-1] < losses[2][0]  # sparse still trains
    rows = [r.summary for r in sparse.plugin_rows if r.plugin == "gradcomm"]
    assert rows and "threshold 0.01" in rows[0]
    print(rows[0])


def test_a_diverging_run_stops_naming_the_layer_instead_of_spreading_nan():
    cfg = make_cfg(iterations=6, lr=1e30, dtype="bf16")  # weights explode, gradients go NaN
    with pytest.raises(RankFailed) as info:
        run_cluster(cfg, run_dir=".")
    message = str(info.value)
    assert "NonFiniteGradient" in message and "in layer 'net." in message
    assert "not sent" in message and "\n" not in message
    print(message)


def test_momentum_correction_at_density_one_is_plain_momentum_sgd():
    """Sending every element with momentum correction (no masking) must train exactly like
    the plain all-reduce with the job's SGD momentum: the velocity moves into the codec and
    the decoder cancels the optimizer's own momentum, in the real runtime, over several
    buckets."""
    plain = run_cluster(make_cfg(), run_dir=".")
    corrected = run_cluster(make_cfg(sparsify="topk", density=1.0, momentum_correction=True,
                                     factor_masking=False), run_dir=".")
    assert plain.state.keys() == corrected.state.keys()
    for name, value in plain.state.items():
        torch.testing.assert_close(corrected.state[name], value, atol=1e-5, rtol=1e-4)
    rows = [r for r in corrected.plugin_rows if r.plugin == "gradcomm"]
    assert rows and "without factor masking" in rows[0].summary
    assert rows[0].metrics["buckets"] > 1
    # and with masking the same density-1 run is different training (sent entries lose
    # their momentum): the check above can tell them apart
    masked = run_cluster(make_cfg(sparsify="topk", density=1.0), run_dir=".")
    assert any(not torch.allclose(masked.state[n], v, atol=1e-5, rtol=1e-4)
               for n, v in plain.state.items())
