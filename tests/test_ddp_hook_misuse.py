"""accelopt's DDP hook misused in a user's own DDP script (two gloo processes where a group
is needed): trained on after ``state.close()``, given something that is not its saved state,
or given options of the wrong kind. Each is refused in one line instead of hanging,
resuming wrongly or failing deep inside torch."""

from __future__ import annotations

import pytest
import torch
from gloo_pair import two_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accelopt.errors import ConfigError


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _step(ddp: nn.Module, gen: torch.Generator) -> None:
    ddp(torch.randn(4, 8, generator=gen)).sum().backward()


def stepped(rank: int, steps: int, net: nn.Module | None = None, **options: object):
    """``net`` (default :func:`_mlp`) in DDP with gradcomm's hook made with ``options``,
    after ``steps`` backward passes on this rank's data: (net, ddp, state, generator)."""
    from accelopt_plugins.gradcomm import comm_hook as gradcomm_hook

    net = net if net is not None else _mlp()
    ddp = DistributedDataParallel(net)
    state, hook = gradcomm_hook(net, **options)
    ddp.register_comm_hook(state, hook)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        _step(ddp, gen)
    return net, ddp, state, gen


def _after_close(rank: int) -> dict[str, str]:
    """One step, ``state.close()``, one more step: the second step's error."""
    _net, ddp, state, gen = stepped(rank, 1, dtype="fp16", timeout_s=5)
    state.close()
    try:
        _step(ddp, gen)
        return {"closed": "accepted"}
    except Exception as exc:  # noqa: BLE001 - what the user sees
        return {"closed": str(exc)}


def _loads(rank: int) -> dict[str, str]:
    """Top-k states (and what is not one) loaded into a top-k hook: each load's message."""
    from accelopt_plugins.gradcomm import comm_hook as gradcomm_hook

    net, _ddp, state, _gen = stepped(rank, 2, sparsify="topk", density=0.1)
    checkpoint = {"model": net.state_dict(), "opt": {}, "hook": state.state_dict(), "step": 2}
    state.close()
    out = {}
    for name, given in {"whole": checkpoint, "garbage": {"x": 1},
                        "no_gradcomm": {"iteration": 1, "plugins": {}},
                        "iteration": {"iteration": "1", "plugins": checkpoint["hook"]["plugins"]},
                        "list": [1], "right": checkpoint["hook"]}.items():
        other, _hook = gradcomm_hook(_mlp(), sparsify="topk", density=0.1)
        try:
            other.load_state_dict(given)
            out[name] = f"accepted at iteration {other.iteration}"
        except Exception as exc:  # noqa: BLE001 - what the user sees
            out[name] = str(exc)
        other.close()
    return out


def _compute(rank: int, what: str) -> dict[str, str]:
    """Both misuses in one pair of ranks (each starts its own DDP and hook; the loads first,
    the training after close() last): two processes to start, not four."""
    return {**_loads(rank), **_after_close(rank)}


@pytest.fixture(scope="module")
def misused(tmp_path_factory) -> list[dict[str, str]]:
    """Each rank's messages, read by both tests below."""
    return two_ranks(tmp_path_factory.mktemp("misuse"), "misuse", _compute)


@pytest.mark.timeout(60)
def test_training_after_close_is_refused_in_one_line(misused):
    """close() stopped the transport's completion thread and the hook went on posting
    buckets whose futures never completed: backward hung forever, even with timeout_s=5."""
    for rank in misused:
        text = rank["closed"]
        assert "this DDP communication hook was closed (state.close())" in text, text
        assert "do not train after close(); to train on, make a new (state, hook)" in text
        assert "Traceback" not in text and "\n" not in text


@pytest.mark.timeout(60)
def test_a_load_of_what_is_not_the_hooks_state_is_refused(misused):
    """load_state_dict read state.get("plugins") or {} and state.get("iteration", -1): the
    whole checkpoint (or {"x": 1}) loaded as nothing, the residuals dropped and the
    iteration count reset, and the resume diverged without an error."""
    for rank in misused:
        assert rank["right"] == "accepted at iteration 1"
        assert rank["whole"] == (
            "load_state_dict was given a dict with keys 'model', 'opt', 'hook', 'step', not a "
            "hook state (keys 'iteration' and 'plugins'); pass what state.state_dict() "
            "returned, e.g. load_state_dict(checkpoint['hook']) rather than the whole "
            "checkpoint")
        assert rank["garbage"].startswith("load_state_dict was given a dict with keys 'x', ")
        assert rank["list"].startswith("load_state_dict was given a list, not a hook state;")
        assert rank["iteration"].startswith(
            "load_state_dict: the hook state's iteration must be an int >= -1, got '1';")
        assert rank["no_gradcomm"].startswith(
            "the saved hook state holds no state of plugin 'gradcomm' (it holds none)"), \
            rank["no_gradcomm"]
        for name in ("right", "whole", "garbage", "list", "iteration", "no_gradcomm"):
            assert "\n" not in rank[name]


@pytest.mark.parametrize("options, message", [
    ({"dtype": "fp16", "process_group": "x"},
     "gradcomm.comm_hook: process_group='x' is not a process group; pass the one DDP uses "
     "(dist.new_group(...)), or None for the default"),
    ({"sparsify": "topk", "factor_masking": 1},
     "gradcomm.comm_hook: factor_masking is a switch: give True or False, got 1"),
    ({"sparsify": "topk", "error_feedback": "0"},
     "gradcomm.comm_hook: error_feedback is a switch: give True or False, got '0'"),
    ({"check_finite": 0.0},
     "gradcomm.comm_hook: check_finite is a switch: give True or False, got 0.0"),
])
def test_options_of_the_wrong_kind_are_one_line(options, message):
    """A process group given as a string failed inside torch ("'str' object has no attribute
    'size'"); a switch given 1 or "0" was read as true or false, though a number is refused
    (check_finite=2). Both are refused before any process group is needed."""
    from accelopt_plugins.gradcomm import comm_hook as gradcomm_hook

    with pytest.raises(ConfigError) as caught:
        gradcomm_hook(nn.Linear(2, 2), **options)
    assert str(caught.value) == message


def test_switch_words_are_still_taken():
    """The command line's words stay accepted (the hook then asks for a process group)."""
    from accelopt_plugins.gradcomm import comm_hook as gradcomm_hook

    from accelopt.errors import UserError

    with pytest.raises(UserError, match="comm_hook needs torch.distributed"):
        gradcomm_hook(nn.Linear(2, 2), sparsify="topk", error_feedback="no", overlap=False)
