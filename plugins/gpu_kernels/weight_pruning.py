"""Weight (unstructured) pruning executed as sparse matrix multiplication: the baseline that
the seed says does not pay on dense hardware.

Magnitude pruning zeroes the smallest |w| of a layer (Han et al. 2015). To *execute* the
sparsity instead of multiplying zeros, the weight is stored as a ``torch.sparse_csr_tensor``
and the layer computes ``W_csr @ x^T``; a conv is lowered (im2col) to the same sparse
matmul. Training keeps the dense weight plus a fixed mask (zeroed weights stay zero), which
is how pruned networks are fine-tuned; ``to_sparse()`` freezes the result into CSR for
inference. Scalpel (Yu et al. ISCA 2017) measured this kind of execution at 0.41x (GPU) and
1.06x (CPU) of dense speed.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _csr(dense: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # "sparse CSR support is in beta": known, not news
        warnings.simplefilter("ignore", UserWarning)
        return dense.detach().to_sparse_csr()


def magnitude_mask(weight: torch.Tensor, amount: float) -> torch.Tensor:
    """Boolean mask keeping the largest-magnitude ``1 - amount`` of ``weight``'s entries."""
    if not 0.0 <= amount < 1.0:
        raise ValueError(f"weight pruning amount {amount} is outside [0, 1)")
    n = weight.numel()
    k = int(round(amount * n))
    if k == 0:
        return torch.ones_like(weight, dtype=torch.bool)
    threshold = weight.detach().abs().flatten().kthvalue(k).values
    mask = weight.detach().abs() > threshold
    # ties at the threshold: keep exactly n - k entries
    deficit = (n - k) - int(mask.sum())
    if deficit > 0:
        ties = ((weight.detach().abs() == threshold) & ~mask).flatten().nonzero().flatten()
        mask.view(-1)[ties[:deficit]] = True
    return mask


def _masked_copy(new: nn.Module, layer: nn.Module, amount: float) -> Any:
    """Load ``layer``'s weights into ``new``, attach the magnitude mask and zero the pruned
    weights (shared by the masked Linear and Conv2d)."""
    new.load_state_dict(layer.state_dict())
    new.register_buffer("mask", magnitude_mask(layer.weight, amount))
    with torch.no_grad():
        new.weight.mul_(new.mask)
    return new


class MaskedLinear(nn.Linear):
    """A Linear whose pruned weights stay zero during fine-tuning (mask applied in forward)."""

    mask: torch.Tensor

    @classmethod
    def from_dense(cls, layer: nn.Linear, amount: float) -> MaskedLinear:
        new = cls(layer.in_features, layer.out_features, bias=layer.bias is not None)
        return _masked_copy(new, layer, amount)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.mask, self.bias)


class MaskedConv2d(nn.Conv2d):
    """A Conv2d whose pruned weights stay zero during fine-tuning."""

    mask: torch.Tensor

    @classmethod
    def from_dense(cls, layer: nn.Conv2d, amount: float) -> MaskedConv2d:
        new = cls(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride,
                  layer.padding, layer.dilation, layer.groups, bias=layer.bias is not None)
        return _masked_copy(new, layer, amount)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight * self.mask, self.bias)


class CSRLinear(nn.Module):
    """Inference Linear with its weight in CSR: ``y = (W_csr @ x^T)^T + b``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.weight = _csr(weight)
        self.bias = None if bias is None else bias.detach().clone()

    @property
    def density(self) -> float:
        return self.weight.values().numel() / (self.in_features * self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = (self.weight @ flat.t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class CSRConv2d(nn.Module):
    """Inference Conv2d (groups=1) lowered to im2col + CSR sparse matmul."""

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        if conv.groups != 1 or not isinstance(conv.padding, tuple):
            raise ValueError("CSRConv2d supports groups=1 with numeric padding")
        self.out_channels = conv.out_channels
        self.kernel_size, self.stride = conv.kernel_size, conv.stride
        self.padding, self.dilation = conv.padding, conv.dilation
        self.weight = _csr(conv.weight.flatten(1))
        self.bias = None if conv.bias is None else conv.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        kh, kw = self.kernel_size
        oh = (h + 2 * self.padding[0] - self.dilation[0] * (kh - 1) - 1) // self.stride[0] + 1
        ow = (w + 2 * self.padding[1] - self.dilation[1] * (kw - 1) - 1) // self.stride[1] + 1
        cols = F.unfold(x, self.kernel_size, self.dilation, self.padding, self.stride)
        # (C*k*k, N*L) dense right-hand side; one sparse matmul for the whole batch
        rhs = cols.transpose(0, 1).reshape(cols.shape[1], -1)
        y = (self.weight @ rhs).reshape(self.out_channels, n, oh * ow).transpose(0, 1)
        if self.bias is not None:
            y = y + self.bias[None, :, None]
        return y.reshape(n, self.out_channels, oh, ow)


def weight_prune(model: nn.Module, amount: float, *, skip: tuple[str, ...] = ()) -> int:
    """Replace every Linear/Conv2d (except paths in ``skip``) by its masked version with
    ``amount`` of its weights zeroed by magnitude; returns how many layers were replaced."""
    count = 0
    for path, module in list(model.named_modules()):
        if path in skip or isinstance(module, (MaskedLinear, MaskedConv2d)):
            continue
        new: nn.Module | None = None
        if type(module) is nn.Linear:
            new = MaskedLinear.from_dense(module, amount)
        elif type(module) is nn.Conv2d and module.groups == 1:
            new = MaskedConv2d.from_dense(module, amount)
        if new is not None:
            _replace(model, path, new)
            count += 1
    return count


def to_sparse(model: nn.Module) -> nn.Module:
    """Freeze masked layers into CSR-executed inference layers (in place; returns model)."""
    for path, module in list(model.named_modules()):
        if isinstance(module, MaskedLinear):
            _replace(model, path, CSRLinear(module.weight * module.mask, module.bias))
        elif isinstance(module, MaskedConv2d):
            dense = nn.Conv2d(module.in_channels, module.out_channels, module.kernel_size,
                              module.stride, module.padding, module.dilation,
                              bias=module.bias is not None)
            with torch.no_grad():
                dense.weight.copy_(module.weight * module.mask)
                if module.bias is not None:
                    dense.bias.copy_(module.bias)
            _replace(model, path, CSRConv2d(dense))
    return model


def _replace(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, new)
