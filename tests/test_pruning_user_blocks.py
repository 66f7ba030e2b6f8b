"""Node pruning on blocks users write themselves, and what the gpu_kernels row says when the
pruning cannot be trusted: a head layout pruning does not follow, a block passed as the
model itself, an amount that would empty a layer, a pruned model that cannot run, and an
inference ratio inside its noise."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from accelopt_plugins.gpu_kernels import plugin as gk
from accelopt_plugins.gpu_kernels.config import GpuKernelsConfig
from accelopt_plugins.gpu_kernels.pruning import PruneReport, node_prune
from torch import nn

pytestmark = pytest.mark.timeout(120)


class SelfAttention(nn.Module):
    """q/k/v/o projections and a ``head_dim``, but the head count is its own ``n_heads``
    (``merge="-1"``: merged by ``reshape(B, T, -1)``; ``"C"``: by ``reshape(B, T, C)``)."""

    def __init__(self, d: int = 32, n_heads: int = 4, merge: str = "-1") -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.merge = n_heads, d // n_heads, merge
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))

    def split(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, self.n_heads, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = (self.split(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        a = (torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v)
        a = a.transpose(1, 2)
        return self.o_proj(a.reshape(b, s, -1) if self.merge == "-1" else a.reshape(b, s, c))


class HeadDimAttention(SelfAttention):
    """The same projections, heads split by ``view(..., -1, head_dim)``: prunable."""

    def split(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, -1, self.head_dim).transpose(1, 2)


class Net(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.att, self.head = block, nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.att(x).mean(1))


@pytest.mark.parametrize(("merge", "needle"), [
    ("-1", "its kept heads compute something else"),
    ("C", "its forward fails with a head pruned"),
])
def test_a_block_with_its_own_head_count_stays_dense_and_says_why(merge: str,
                                                                   needle: str) -> None:
    """It was pruned to 2 of 4 heads while ``n_heads`` stayed 4: the 16 kept columns ran as
    4 heads of 4 (``"-1"``, silently different) or the job crashed (``"C"``)."""
    torch.manual_seed(0)
    model = Net(SelfAttention(merge=merge))
    dense, x = copy.deepcopy(model), torch.randn(2, 5, 32)
    report = node_prune(model, 0.5)
    assert report.pruned == {} and needle in report.refused["att"]
    assert model.att.q_proj.out_features == 32
    torch.testing.assert_close(model(x), dense(x))


def test_a_block_that_splits_heads_by_head_dim_is_pruned_exactly() -> None:
    """The pruned block equals the dense block with the removed heads' o_proj columns zero."""
    torch.manual_seed(0)
    model = Net(HeadDimAttention())
    masked, x = copy.deepcopy(model), torch.randn(2, 5, 32)
    report = node_prune(model, 0.5)
    assert report.pruned == {"att": (4, 2)} and model.att.q_proj.out_features == 16
    with torch.no_grad():
        for h in set(range(4)) - set(report.kept["att"].tolist()):
            masked.att.o_proj.weight[:, h * 8:(h + 1) * 8] = 0
    torch.testing.assert_close(model(x), masked(x))


def test_a_block_passed_as_the_model_itself_is_analysed() -> None:
    """Paths were built as f"{path}.q_proj" with path "": KeyError '.q_proj'."""
    torch.manual_seed(0)
    assert "compute something else" in node_prune(SelfAttention(), 0.5).refused[""]
    block = HeadDimAttention()
    assert node_prune(block, 0.5).pruned == {"": (4, 2)}
    assert block(torch.randn(2, 5, 32)).shape == (2, 5, 32)


def test_an_amount_just_under_one_keeps_one_unit_and_says_so() -> None:
    """0.99999999999 rounded to keep none: 0-wide layers, params 3466 -> 10, FLOPs 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32),
                          nn.ReLU(), nn.Linear(32, 10))
    report = node_prune(model, 0.99999999999)
    assert report.pruned == {"1": (32, 1), "3": (32, 1)}
    assert report.floored == {"1": 32, "3": 32}
    assert "one unit of each kept" in report.summary()
    assert model(torch.randn(3, 64)).shape == (3, 10)


class _Breaks(nn.Module):
    """Runs dense; its pruned copy's forward raises, as a model with a hard-coded width."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.broken = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.broken:
            raise RuntimeError("shape '[2, 8]' is invalid for input of size 4")
        return self.fc(x)


@pytest.mark.parametrize("keyword", [False, True])
def test_a_pruned_model_that_cannot_run_gets_a_row_not_a_key_error(keyword: bool) -> None:
    """The probe recorded the dense FLOPs, the pruned forward raised, and the row indexed
    ``flops_pruned``: ``KeyError`` in accelopt_report_rows, rc 1. Called with keyword inputs
    (``model(x=...)``, as HF models are), the check was skipped altogether."""
    dense, model = _Breaks(), _Breaks()
    model.broken = True
    record = gk._JobRecord(prune=PruneReport(pruned={"fc": (8, 4)}, params_before=36,
                                          params_after=20))
    gk._PruneProbe(model, dense, record)
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError):
        model(x=x) if keyword else model(x)
    plugin = gk.GpuKernelsPlugin(GpuKernelsConfig(prune_amount=0.5))
    plugin.jobs["j"] = record
    (row,) = plugin.accelopt_report_rows(run=None)
    assert "the pruned model failed its first forward: RuntimeError: shape" in row.summary
    assert "flops_dense" not in row.metrics and "FLOPs" not in row.summary


class _KeywordInput(nn.Module):
    """Takes its input by keyword only, as HF models take ``input_ids=...``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, *, input_ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(input_ids))) * scale


def test_the_probe_measures_a_model_called_with_keyword_inputs() -> None:
    """The probe read ``args[0]`` and returned silently for ``model(input_ids=...)`` (HF
    GPT-2/BERT with loss=model): the row had params only, no FLOPs, latency or reason."""
    torch.manual_seed(0)
    model = _KeywordInput()
    dense = copy.deepcopy(model)
    record = gk._JobRecord(prune=node_prune(model, 0.5))
    assert record.prune.pruned == {"fc1": (16, 8)}
    gk._PruneProbe(model, dense, record)
    model(input_ids=torch.randn(3, 8), scale=2.0)
    probe = record.probe
    assert 0 < probe["flops_pruned"] < probe["flops_dense"]
    assert probe["latency_dense_ms"] > 0 and probe["latency_pruned_ms"] > 0
    assert record.notes == []


class _CountInput(nn.Module):
    """Its forward takes a count, not a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, n: int) -> torch.Tensor:
        return self.fc(torch.ones(1, 2) * n)


def test_the_probe_says_why_it_measured_nothing() -> None:
    """A first forward without any tensor argument: the row says nothing was measured
    (it said nothing at all)."""
    model = _CountInput()
    record = gk._JobRecord()
    gk._PruneProbe(model, copy.deepcopy(model), record)
    model(3)
    assert record.probe == {}
    assert record.notes == ["pruning probe: the first forward got no tensor argument, so "
                            "FLOPs and latency dense -> pruned were not measured"]


def test_the_row_counts_what_it_lists() -> None:
    """'refused 4:' listed three layers with no sign of the fourth, and 'autotuned 3 convs:
    direct x6' counted decisions (one per conv, input shape and mode) as if convs."""
    refused = {f"l{i}": "why" for i in range(5)}
    record = gk._JobRecord(prune=PruneReport(pruned={"a": (8, 4)}, refused=refused,
                                          params_before=10, params_after=5))
    shapes = {((2, 3, 8, 8), torch.float32, True): "direct",
              ((1, 3, 8, 8), torch.float32, False): "direct"}
    record.convs = [SimpleNamespace(_chosen=dict(shapes)) for _ in range(3)]  # type: ignore[misc]
    plugin = gk.GpuKernelsPlugin(GpuKernelsConfig(prune_amount=0.5, conv_autotune=True))
    plugin.jobs["j"] = record
    (row,) = plugin.accelopt_report_rows(run=None)
    assert "refused 5: l0: why; l1: why; l2: why; ... and 2 more" in row.summary
    assert ("autotuned 3 convs (6 decisions, one per conv, input shape and train/eval mode): "
            "direct x6") in row.summary
    record.prune.refused = dict(list(refused.items())[:3])  # type: ignore[union-attr]
    (row,) = plugin.accelopt_report_rows(run=None)
    assert "refused 3: l0: why; l1: why; l2: why" in row.summary and "more" not in row.summary


@pytest.mark.parametrize(("low", "high", "dense_ms", "needle"), [
    (0.16, 11.88, 1.04, "noise: the spread holds 1x"),
    (2.1, 2.6, 2.4, "above the FLOP bound 1.67x: noise"),
    (1.2, 1.5, 1.4, "1.20-1.50x over 7 interleaved rounds)"),
])
def test_the_inference_ratio_is_shown_with_its_spread(low: float, high: float,
                                                      dense_ms: float, needle: str) -> None:
    """Identical runs printed 11.88x, 0.16x and 1.04x (FLOP ratio 1.67x) as speed-ups."""
    probe = {"flops_dense": 5.0, "flops_pruned": 3.0, "latency_dense_ms": dense_ms,
             "latency_pruned_ms": 1.0, "speedup_low": low, "speedup_high": high}
    metrics: dict[str, float | int | str] = {}
    (flops, line) = gk._probe_parts(probe, metrics)
    assert flops == "FLOPs 5->3" and needle in line
    assert metrics["prune_speedup"] == dense_ms and metrics["speedup_low"] == low
    if needle.endswith("rounds)"):
        assert "noise" not in line


def test_a_pruned_weights_file_loads_into_a_model_pruned_to_the_same_amount(tmp_path) -> None:
    """The README's recipe: the saved state dict has pruned shapes; a freshly built model
    pruned at the same amount (other weights, other rounds) has the same shapes and loads it."""
    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(),
                             nn.Linear(24, 5))

    trained = build(0)
    node_prune(trained, 0.5, rounds=2)
    torch.save(trained.state_dict(), tmp_path / "w.pt")
    fresh = build(1)
    node_prune(fresh, 0.5)
    fresh.load_state_dict(torch.load(tmp_path / "w.pt"))
    x = torch.randn(3, 16)
    torch.testing.assert_close(fresh(x), trained(x))
