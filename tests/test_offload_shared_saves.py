"""offload: a storage saved by two ops, one keeping it on the device and one offloading it, is
counted once, as resident, and not copied out (the copy would free nothing).

Why: a ReLU saves its output and the convolution after it saves the same tensor as its input.
Under ``policy=conv`` the ReLU's save stayed resident and the convolution's was offloaded and
counted as offloaded too: the row claimed the maps twice and said they left the device, while
the ReLU's save kept them there."""

from __future__ import annotations

import copy

import pytest
import torch
from accelopt_plugins.offload.engine import OffloadEngine, _Handle, install_on
from torch import nn

pytestmark = pytest.mark.timeout(60)


def conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out))


class ResBlockNet(nn.Module):
    """Stem conv-BN-ReLU, a residual block (conv-BN-ReLU, conv-BN, + shortcut, ReLU), a second
    conv-BN, mean pool, linear head: three ReLU outputs each feed a convolution."""

    def __init__(self, input_shape: tuple[int, ...] = (3, 8, 8), num_classes: int = 4) -> None:
        super().__init__()
        c = 16
        self.stem = conv_bn(input_shape[0], c)
        self.a = conv_bn(c, c)
        self.b = conv_bn(c, c)
        self.second = conv_bn(c, c)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        h = torch.relu(h + self.b(torch.relu(self.a(h))))
        h = self.second(h)
        return self.head(h.mean((2, 3)))


class ConvThenMul(nn.Module):
    """The other order: the convolution saves its input first, then a later ``mul`` (outside
    any convolution) saves the same tensor and keeps it on the device."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * 2.0  # a map of the model's own (mul by a number saves nothing)
        return (self.conv(a) * a).sum((1, 2, 3))


def saved_storages(model: nn.Module, x: torch.Tensor) -> dict[int, int]:
    """Independent count: the distinct non-parameter storages one forward saves, by address."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return seen


def run_with(engine: OffloadEngine, model: nn.Module, x: torch.Tensor):
    """One forward and backward under the engine; what each save packed to, and the grads."""
    install_on(model, engine)
    packed: list[tuple[torch.Tensor, object]] = []
    pack = engine.pack

    def spy(t: torch.Tensor) -> object:
        out = pack(t)
        packed.append((t, out))
        return out

    engine.pack = spy  # type: ignore[method-assign]
    model(x).sum().backward()
    return packed, [p.grad.clone() for p in model.parameters()]


def offloaded_as_plain(model: nn.Module, x: torch.Tensor
                       ) -> tuple[OffloadEngine, list, dict]:
    """``model`` run under ``policy=conv`` (the engine, what it packed) and the saved
    storages of a plain run (their sizes), the gradients of the two checked bitwise equal."""
    plain = copy.deepcopy(model)
    want = saved_storages(copy.deepcopy(model), x)
    engine = OffloadEngine(policy="conv")
    packed, got = run_with(engine, model, x)
    plain(x).sum().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(got, plain.parameters(), strict=True))
    return engine, packed, want


def test_relu_output_fed_to_a_convolution_is_resident_and_counted_once():
    torch.manual_seed(0)
    x = torch.randn(32, 3, 8, 8)
    engine, packed, want = offloaded_as_plain(ResBlockNet(), x)
    s = engine.current
    # only the network input leaves the device: every other conv input is a ReLU output the
    # ReLU keeps resident
    assert s.offloaded_tensors == 1 and s.offloaded_bytes == x.numel() * 4
    assert s.kept_shared == 3
    assert s.offloaded_bytes + s.resident_bytes == sum(want.values())
    offloaded = {t.untyped_storage().data_ptr() for t, out in packed if isinstance(out, _Handle)}
    assert offloaded == {x.untyped_storage().data_ptr()}


def test_an_offloaded_map_a_later_save_keeps_resident_is_taken_back():
    torch.manual_seed(0)
    engine, packed, want = offloaded_as_plain(ConvThenMul(), torch.randn(8, 4, 6, 6))
    s = engine.current
    assert s.offloaded_bytes == 0 and s.offloaded_tensors == 0 and s.kept_shared == 1
    assert s.resident_bytes == sum(want.values())
    (handle,) = [out for _, out in packed if isinstance(out, _Handle)]
    # backward read the device tensor itself; the host copy was dropped
    assert handle.kept and handle.host.device.type == "meta" and s.prefetched == 0


@pytest.mark.timeout(180)  # a whole run, its report and drawing included
def test_the_row_counts_each_storage_once_and_says_what_was_left(run_tiny):
    """The plugin's row on the finding's model: offloaded + resident is the unique saved maps
    (it read 1.66 MiB against 1.28 MiB), and the row says why the ReLU outputs stayed."""
    from accelopt_plugins.offload import PLUGIN

    record = run_tiny(PLUGIN, overrides=[
        "plugins.offload.policy=conv", "run.device=cpu", "run.profile=false",
        "workload.jobs=[{name:res,model:'test_offload_shared_saves:ResBlockNet',"
        "dataset:synthetic_images,iterations:2,batch_size:32}]"], workload="single")
    (row,) = [r for r in record.plugin_rows if r.plugin == "offload"]
    torch.manual_seed(0)
    model = ResBlockNet((3, 16, 16), 10)  # synthetic_images: 3x16x16, 10 classes
    want = sum(saved_storages(model, torch.randn(32, 3, 16, 16)).values())
    m = row.metrics
    assert m["offloaded_bytes_per_iteration"] + m["resident_bytes_per_iteration"] == want, row
    assert m["saves_kept_shared"] == 3 * 2, row.summary
    assert "another save keeps" in row.summary, row.summary
