"""offload and the caller's own saved-tensor hooks: a ``torch.utils.checkpoint`` around a layer
the engine is installed on keeps checkpointing (the engine's hooks, entered inside it, would be
innermost and win); and a cluster worker's row says its figures are one worker's."""

from __future__ import annotations

import copy

import pytest
import torch
from accelopt_plugins.offload.config import OffloadConfig
from accelopt_plugins.offload.engine import OffloadEngine, install_on
from accelopt_plugins.offload.plugin import OffloadPlugin
from torch import nn
from torch.utils.checkpoint import checkpoint

from accelopt.types import ClusterInfo, JobInfo, RunInfo

pytestmark = pytest.mark.timeout(60)


class CkNet(nn.Module):
    """A block with BatchNorm run under ``checkpoint``: its running statistics say whether
    the forward was recomputed (each recomputation updates them again)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                   nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant))


def train(model: nn.Module, call=None, steps: int = 3) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        out = call(model, x) if call else model(x)
        nn.functional.cross_entropy(out, y).backward()
        opt.step()


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    """Weights and buffers (BatchNorm's statistics and num_batches_tracked), bitwise."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("paths", [["block"], ["block.0", "block.1"], None])
def test_a_checkpointed_layer_stays_checkpointed_under_offload(reentrant, paths):
    """Offload on ``block`` (or layers inside it, or the whole model) with ``checkpoint(block)``
    in the model's forward: the non-reentrant checkpoint never recomputed (BatchNorm's
    num_batches_tracked 3 against 6, running statistics apart) and its maps were offloaded;
    the reentrant one's recomputation in backward was offloaded and counted."""
    torch.manual_seed(0)
    model = CkNet(reentrant)
    plain = copy.deepcopy(model)
    engine = OffloadEngine(policy="all")
    install_on(model, engine, paths=paths)
    train(plain)
    train(model)
    engine.finish()
    assert int(plain.block[1].num_batches_tracked) == 6  # 3 forwards + 3 recomputations
    assert_same_state(model, plain)
    s = engine.totals.stats
    if paths is not None:  # only layers inside the checkpoint: nothing left for the engine
        assert s.offloaded_tensors == 0, s
        assert s.left_to_caller == 3 * len(paths), s
    else:  # the whole model: inp and head still offloaded, block left to the checkpoint
        assert s.offloaded_tensors > 0 and s.left_to_caller == 0, s
    assert s.forwards == 3  # a recomputation is not a forward pass


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("paths", [None, ["1", "3"]])
def test_a_checkpoint_around_the_whole_offloaded_model_is_left_to_it(reentrant, paths):
    """``checkpoint(model, x)`` (a loop of one's own under accelopt.attach): the engine's
    hooks on the root would win over checkpoint's, and where only layers are offloaded its
    counting hook for the other layers would do the same."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    plain = copy.deepcopy(model)
    engine = OffloadEngine(policy="all")
    install_on(model, engine, paths=paths)

    def call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if reentrant:  # its output requires grad only where an input does
            x = x.detach().requires_grad_()
        return checkpoint(m, x, use_reentrant=reentrant)

    train(plain, call)
    train(model, call)
    engine.finish()
    assert int(plain[1].num_batches_tracked) == 6
    assert_same_state(model, plain)
    s = engine.totals.stats
    assert s.offloaded_tensors == 0 and s.resident_tensors == 0, s
    assert s.left_to_caller == 3 * len(paths or [""]), s


def test_a_checkpoint_inside_an_offloaded_layer_still_works():
    """Checkpoint's hooks are inner there and win: unchanged, and nothing counted as left."""

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU())
            self.out = nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(checkpoint(self.body, x, use_reentrant=False))

    torch.manual_seed(0)
    model = nn.Sequential(Inner())
    plain = copy.deepcopy(model)
    engine = OffloadEngine(policy="all")
    install_on(model, engine)
    train(plain)
    train(model)
    engine.finish()
    assert_same_state(model, plain)
    s = engine.totals.stats
    assert s.offloaded_tensors > 0 and s.left_to_caller == 0, s


def run_info(role: str, rank: int, mode: str, workers: int, servers: int = 0,
             batch: int = 8) -> RunInfo:
    job = JobInfo(job_id="01-tiny-cnn", name="tiny-cnn", model="cnn", kind="train",
                  arrival_s=0.0, iterations=2, batch_size=batch)
    cluster = ClusterInfo(mode=mode, workers=workers, servers=servers)  # type: ignore[arg-type]
    return RunInfo(run_dir="run", device="cpu", plugins=("offload",), jobs=(job,), seed=0,
                   rank=rank, role=role, world_size=cluster.world_size,  # type: ignore[arg-type]
                   leader=rank == 0, cluster=cluster)


def plugin_row(run: RunInfo, layers: str = "", reentrant: bool = False):
    """The plugin's row for two iterations of a CkNet (``layers``: ``^block$`` or the whole
    model), built by the plugin's report hook from the ``run`` given."""
    plugin = OffloadPlugin(OffloadConfig(layers=layers))
    engine = plugin._engine("01-tiny-cnn")
    torch.manual_seed(0)
    model = CkNet(reentrant)
    install_on(model, engine, paths=["block"] if layers else None)
    for _ in range(2):
        engine.begin_iteration()
        model(torch.randn(8, 16)).sum().backward()
        engine.end_iteration()
    (row,) = plugin.accelopt_report_rows(run)
    return row


@pytest.mark.parametrize("mode, servers, rank", [("allreduce", 0, 1), ("ps", 1, 2)])
def test_a_workers_row_says_its_figures_are_one_workers(mode, servers, rank):
    """In ps/allreduce each worker trains its rows of the batch: its bytes (half the job's
    with two workers) were shown with no label, as the job's."""
    row = plugin_row(run_info("worker", rank, mode, workers=2, servers=servers))
    assert "figures per worker (each of the 2 workers training 4 of the batch's 8 rows)" \
        in row.summary, row.summary
    assert "MiB/iteration per worker of saved feature maps" in row.summary
    assert row.metrics["per_worker"] == 1 and row.metrics["workers"] == 2
    assert row.metrics["worker_batch_rows"] == 4 and row.metrics["batch_rows"] == 8


def test_an_uneven_split_names_this_workers_rows():
    first = plugin_row(run_info("worker", 0, "allreduce", workers=3))
    last = plugin_row(run_info("worker", 2, "allreduce", workers=3))
    assert "this worker training 3 of the batch's 8 rows, split over 3 workers" in first.summary
    assert "this worker training 2 of the batch's 8 rows" in last.summary
    single = plugin_row(run_info("single", 0, "none", workers=1))
    assert "per worker" not in single.summary and "per_worker" not in single.metrics


def test_the_row_counts_calls_left_to_the_callers_checkpoint():
    row = plugin_row(run_info("single", 0, "none", workers=1), layers="^block$")
    assert row.metrics["calls_left_to_checkpoint"] == 2
    assert "2 call(s) of the offloaded layers ran under the caller's torch.utils.checkpoint" \
        in row.summary
    assert row.metrics["offloaded_bytes_per_iteration"] == 0
    assert row.metrics.get("inert") == 1  # it changed nothing: checkpoint had those maps
