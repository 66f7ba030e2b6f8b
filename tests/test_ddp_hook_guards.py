"""accelopt's DDP hook in a user's own DDP script (two gloo processes), where DDP or a resume
hands it what it once misread: DDP's ``static_graph=True`` (every bucket of its first
iteration has ``index() == 0``) and a saved hook state made with other options."""

from __future__ import annotations

import pytest
import torch
from gloo_pair import two_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class _Mixed(nn.Module):
    """Parameters of two dtypes (float32, float64, float32): DDP makes a bucket per dtype,
    so its static graph's first iteration hands over two buckets, both of index 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c = nn.Linear(16, 4)
        self.b = nn.Linear(16, 16).double()
        self.a = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)).double())).float())


def _static(rank: int, how: str) -> dict[str, torch.Tensor] | str:
    """Three steps of DDP(static_graph=True) with ``how``'s hook: the parameters, or the
    error's text."""
    from accelopt_plugins.gradcomm import comm_hook as gradcomm_hook

    from accelopt.ddp import comm_hook

    net = _Mixed()
    ddp = DistributedDataParallel(net, static_graph=True)
    state = None
    try:
        if how == "accelopt":
            state, hook = comm_hook(net, timeout_s=10)
        elif how == "gradcomm":
            state, hook = gradcomm_hook(net, timeout_s=10)
        if state is not None:
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            opt.zero_grad()
            ddp(torch.randn(4, 8, generator=gen)).sum().backward()
            opt.step()
    except Exception as exc:  # noqa: BLE001 - what the user sees
        return f"{type(exc).__name__}: {exc}"
    finally:
        if state is not None:
            state.close()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _resume_elsewhere(rank: int) -> dict[str, str]:
    """A top-k state (bucket_mb=25) loaded into hooks made with other options: each load's
    message."""
    from accelopt_plugins.gradcomm import comm_hook as gradcomm_hook
    from test_ddp_hook_misuse import stepped

    def mlp(hidden: int = 32) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))

    _net, _ddp, state, _gen = stepped(rank, 2, mlp(), sparsify="topk", density=0.1)
    saved = state.state_dict()
    state.close()
    out = {}
    for name, options in {"bucket": {"sparsify": "topk", "density": 0.1, "bucket_mb": 1e-4},
                          "codec": {"dtype": "fp16"},
                          "density": {"sparsify": "topk", "density": 0.2},
                          "model": {"sparsify": "topk", "density": 0.1},
                          "same": {"sparsify": "topk", "density": 0.1}}.items():
        other, _hook = gradcomm_hook(mlp(16 if name == "model" else 32), **options)
        try:
            other.load_state_dict(saved)
            out[name] = "accepted"
        except Exception as exc:  # noqa: BLE001 - what the user sees
            out[name] = str(exc)
        other.close()
    return out


def _compute(rank: int, what: str) -> dict:
    """Both checks in one pair of ranks (each makes its own DDP and hooks): two processes to
    start, not four."""
    return {"static": {how: _static(rank, how) for how in ("ddp", "accelopt", "gradcomm")},
            "resume": _resume_elsewhere(rank)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results, read by both tests below."""
    return two_ranks(tmp_path_factory.mktemp("guards"), "guards", _compute)


@pytest.mark.timeout(120)
def test_static_graph_with_two_dtypes_trains_as_ddp(ranks):
    """Each bucket of index 0 was read as a new iteration: the first iteration was finished
    with its second bucket still to come, and backward failed after the order timeout with
    "only 1 of 2 planned transfers ... were issued". gradcomm's hook also takes
    ``timeout_s`` now (it refused it as an unknown option)."""
    for rank in (r["static"] for r in ranks):
        ddp = rank["ddp"]
        for how in ("accelopt", "gradcomm"):
            assert isinstance(rank[how], dict), rank[how]
            for name, value in ddp.items():
                assert torch.equal(rank[how][name], value), (how, name)


@pytest.mark.timeout(120)
def test_a_state_saved_with_other_options_is_refused_at_load(ranks):
    """The codec's state was loaded unchecked: another bucket size failed at the first
    backward with torch's tensor size mismatch inside the encoder; a top-k state went into
    an fp16 codec silently."""
    for rank in (r["resume"] for r in ranks):
        assert rank["same"] == "accepted"
        assert rank["bucket"].startswith("gradcomm: the saved state was made with bucket_mb=25;"
                                         " this hook has bucket_mb=0.0001;"), rank["bucket"]
        assert "dtype='fp32', sparsify='topk', density=0.1" in rank["codec"], rank["codec"]
        assert "this hook has dtype='fp16', sparsify='none'" in rank["codec"]
        assert "made with density=0.1; this hook has density=0.2;" in rank["density"]
        assert rank["model"].startswith("gradcomm: the saved state's bucket0 holds 420 "
                                        "gradient elements, and this job's bucket0 has 212 "
                                        "elements"), rank["model"]
        for text in rank.values():
            assert "\n" not in text
