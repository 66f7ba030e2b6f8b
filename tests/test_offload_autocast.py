"""offload under mixed precision: autocast's bf16 copies of the weights are weights (kept on
the device, counted with the parameters), not feature maps to copy to the host each step."""

from __future__ import annotations

import pytest
import torch
from accelopt_plugins.offload.engine import OffloadEngine, _Handle, install_on
from clirun import run_in_process
from test_offload import spy_pack
from torch import nn

pytestmark = pytest.mark.timeout(120)


def wide(*, input_shape, num_classes) -> nn.Module:
    """Weights much larger than the feature maps of a small batch: a weight offloaded as a
    feature map shows at once in the offloaded bytes."""
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 256), nn.ReLU(),
                         nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, num_classes))


def offload_row(tmp_path, precision: str):
    record = run_in_process(
        "workload=single", "workload.jobs.0.model=test_offload_autocast:wide",
        "workload.jobs.0.dataset=synthetic_vectors", "workload.jobs.0.batch_size=4",
        "workload.jobs.0.iterations=2", f"workload.jobs.0.precision={precision}",
        "+plugins=[offload]", "run.profile=false", "run.progress=false",
        run_dir=tmp_path / precision)
    (row,) = [r for r in record.plugin_rows if r.plugin == "offload"]
    return row


def test_a_bf16_job_keeps_the_weights_autocast_casts_on_the_device(tmp_path):
    fp32, bf16 = offload_row(tmp_path, "fp32"), offload_row(tmp_path, "bf16")
    off32 = fp32.metrics["offloaded_bytes_per_iteration"]
    off16 = bf16.metrics["offloaded_bytes_per_iteration"]
    weights = 256 * 256 * 2  # the middle layer's bf16 copy alone
    # the feature maps only (bf16 ones are at most as large as fp32 ones), never a weight
    assert 0 < off16 <= off32 < weights, (fp32.summary, bf16.summary)
    # the bf16 copies are counted with the parameters: half the fp32 weights' bytes
    assert bf16.metrics["param_bytes_per_iteration"] >= fp32.metrics[
        "param_bytes_per_iteration"] // 2 > weights, bf16.summary


def test_autocast_copies_of_parameters_are_never_offloaded_and_counted_once():
    """A loop of one's own under ``torch.autocast`` (as with ``accelopt.attach``): the
    copies (and ``addmm``'s transposed views of them) stay, each parameter counted once per
    forward pass at its copy's size; the input's cast (a leaf that is not a parameter) and
    the activations are offloaded; gradients equal those without the engine."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ref.load_state_dict(model.state_dict())
    x = torch.randn(8, 16, requires_grad=True)
    engine = OffloadEngine(policy="all")
    install_on(model, engine)
    saves = spy_pack(engine)
    for net, inp in ((model, x), (ref, x.detach().clone().requires_grad_())):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(inp)
        out.float().sum().backward()
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    copies = [(t, out) for t, out in saves if t.dim() == 2 and t.shape in
              {w.shape for w in weights} | {w.t().shape for w in weights}]
    assert copies and not any(isinstance(out, _Handle) for _, out in copies)
    assert engine.current.param_bytes == sum(w.numel() * 2 for w in weights)
    assert any(isinstance(out, _Handle) for _, out in saves)  # the feature maps still go
    # the bf16 input (8 x 16) and the ReLU's output (8 x 32, saved twice, copied once)
    assert engine.current.offloaded_bytes == (8 * 16 + 8 * 32) * 2
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
