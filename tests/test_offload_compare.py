"""``benchmarks/offload_compare.py``: each row's gradients and bytes describe the work its
timed steps do. The ``save_on_cpu`` row took its gradients and byte count from a pass under
the script's own copy hook while its steps ran torch's ``save_on_cpu`` (which, unpinned, copies
nothing on a CPU), so it printed ``differ`` for a variant whose steps were bitwise the
baseline's. Tiny network: a few milliseconds a step."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import offload_compare  # noqa: E402


def _variant(name: str) -> offload_compare.Variant:
    torch.manual_seed(0)
    reference = offload_compare.VGG(8, 32)
    x = torch.randn(2, 3, 32, 32)
    y = torch.randint(0, 10, (2,))
    args = argparse.Namespace(policy="all", prefetch=1)
    return offload_compare.Variant(name, copy.deepcopy(reference), x, y, args)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", offload_compare.NAMES)
def test_the_counted_pass_has_the_gradients_of_the_timed_step(name: str) -> None:
    variant = _variant(name)
    counted = variant.measure()["grads"]
    variant.timed_step()  # no optimizer step between: the same weights
    timed = [p.grad for p in variant.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(counted, timed, strict=True))


@pytest.mark.timeout(30)
def test_save_on_cpu_copies_on_a_cpu_and_its_bytes_are_what_it_copied() -> None:
    """Unpinned, torch's pack is ``tensor.cpu()``: the tensor itself on a CPU, no copy, while
    the row printed the bytes of the script's own copies."""
    variant = _variant("save_on_cpu")
    own = variant._own_hooks()
    t = torch.randn(4, 4)
    assert own.pack_hook(t)[1].untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = variant.model(variant.x)
    del out
    row = variant.measure()
    assert row["copied"] == sum(saved) > 0  # every saved tensor, each time it is saved
    assert row["resident"] == 0


@pytest.mark.timeout(10)
def test_a_counter_without_a_pack_hook_keeps_tensors_on_the_device() -> None:
    weight = torch.randn(3, 3)
    counter = offload_compare.Counter({weight.untyped_storage().data_ptr()})
    act = torch.randn(2, 5)
    assert counter.pack(act) is act and counter.pack(act) is act and counter.pack(weight) is weight
    assert (counter.activation_bytes, counter.resident_activation_bytes) == (40, 40)
    assert (counter.param_bytes, counter.copied_bytes) == (36, 0)


@pytest.mark.timeout(10)
def test_grads_verdict_says_by_how_much_gradients_differ() -> None:
    a = [torch.zeros(3), torch.ones(2)]
    assert offload_compare.grads_verdict(a, [t.clone() for t in a]) == "bitwise equal"
    b = [torch.zeros(3), torch.tensor([1.0, 1.5])]
    assert offload_compare.grads_verdict(a, b) == "differ (max |diff| 5.0e-01)"
