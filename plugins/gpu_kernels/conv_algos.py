"""Four ways to compute the same convolution (same weights, bias and semantics as
``torch.nn.Conv2d``, i.e. cross-correlation with zero padding):

* ``direct``: ``torch.nn.functional.conv2d`` (the library's own kernel: the baseline);
* ``im2col``: lowering: unfold input patches into columns, one GEMM (Chellapilla et al.);
* ``fft``: pointwise products in the frequency domain (Mathieu et al. 2014) - wins for
  large kernels because its cost does not grow with k*k;
* ``winograd``: F(2x2, 3x3) minimal filtering (Lavin & Gray 2016): 16 multiplies per 2x2
  output tile and input/output channel pair instead of 36 (2.25x), 3x3 stride 1 only.

Each algorithm declares what it supports (``supports``) so the autotuner only times valid
ones. All are written with differentiable torch ops, so they train as well as infer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Pair = tuple[int, int]
ALGORITHMS: tuple[str, ...] = ("direct", "im2col", "fft", "winograd")

# Winograd F(2x2, 3x3) transforms (Lavin & Gray 2016, eq. 7): Y = A^T [(G g G^T) . (B^T d B)] A
WINOGRAD_BT = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
WINOGRAD_G = [[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]]
WINOGRAD_AT = [[1, 1, 1, 0], [0, 1, -1, -1]]


def _pair(v: Any) -> Pair:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def conv_params(conv: nn.Conv2d) -> dict[str, Any]:
    """The hyper-parameters that decide which algorithms are valid."""
    return {
        "kernel": _pair(conv.kernel_size),
        "stride": _pair(conv.stride),
        "padding": conv.padding if isinstance(conv.padding, str) else _pair(conv.padding),
        "dilation": _pair(conv.dilation),
        "groups": int(conv.groups),
        "padding_mode": conv.padding_mode,
    }


def supports(algorithm: str, conv: nn.Conv2d) -> bool:
    """Whether ``algorithm`` computes exactly what ``conv`` computes."""
    p = conv_params(conv)
    if algorithm == "direct":
        return True
    if p["padding_mode"] != "zeros" or isinstance(p["padding"], str):
        return False  # string ('same') and non-zero padding modes: direct only
    if algorithm in ("im2col", "fft"):
        return True  # any stride, dilation and groups
    if algorithm == "winograd":
        return (p["kernel"] == (3, 3) and p["stride"] == (1, 1) and p["dilation"] == (1, 1)
                and p["groups"] == 1)
    raise ValueError(f"unknown convolution algorithm {algorithm!r}; known: {ALGORITHMS}")


def valid_algorithms(conv: nn.Conv2d) -> list[str]:
    return [a for a in ALGORITHMS if supports(a, conv)]


# --------------------------------------------------------------------------------------------
# The algorithms as functions of (x, weight, bias): the autotuner times them on detached
# copies of the parameters, so measuring never touches the real gradients.


def conv2d_direct(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: Pair,
                  padding: Any, dilation: Pair, groups: int) -> torch.Tensor:
    return F.conv2d(x, w, b, stride, padding, dilation, groups)


def _out_size(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def conv2d_im2col(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: Pair,
                  padding: Pair, dilation: Pair, groups: int) -> torch.Tensor:
    """Lowering: columns of patches (N, C*kh*kw, L), then one (grouped) GEMM."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    oh = _out_size(h, kh, stride[0], padding[0], dilation[0])
    ow = _out_size(wd, kw, stride[1], padding[1], dilation[1])
    cols = F.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)
    cols = cols.reshape(n, groups, cg * kh * kw, oh * ow)
    y = torch.matmul(w.reshape(groups, o // groups, cg * kh * kw), cols)  # (N, G, O/G, L)
    y = y.reshape(n, o, oh, ow)
    return y if b is None else y + b.view(1, o, 1, 1)


def conv2d_fft(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: Pair,
               padding: Pair, dilation: Pair, groups: int) -> torch.Tensor:
    """Correlation theorem: corr(x, w) = irfft(rfft(x) * conj(rfft(w))); the first
    ``H - kh + 1`` outputs of the circular correlation have no wrap-around."""
    n, c, _, _ = x.shape
    o, cg, kh, kw = w.shape
    if dilation != (1, 1):  # a dilated kernel is the kernel with zeros between its taps
        dk = w.new_zeros(o, cg, (kh - 1) * dilation[0] + 1, (kw - 1) * dilation[1] + 1)
        dk[:, :, :: dilation[0], :: dilation[1]] = w
        w, kh, kw = dk, dk.shape[2], dk.shape[3]
    xp = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    hp, wp = xp.shape[2], xp.shape[3]
    xf = torch.fft.rfft2(xp, s=(hp, wp)).reshape(n, groups, cg, hp, -1)
    wf = torch.fft.rfft2(w, s=(hp, wp)).reshape(groups, o // groups, cg, hp, -1).conj()
    yf = torch.einsum("ngchw,gochw->ngohw", xf, wf).reshape(n, o, hp, -1)
    y = torch.fft.irfft2(yf, s=(hp, wp))[:, :, : hp - kh + 1 : stride[0], : wp - kw + 1 : stride[1]]
    y = y.contiguous()
    return y if b is None else y + b.view(1, o, 1, 1)


def _mat(rows: Sequence[Sequence[float]], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=like.dtype, device=like.device)


def conv2d_winograd(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: Pair,
                    padding: Pair, dilation: Pair, groups: int) -> torch.Tensor:
    """F(2x2, 3x3): 4x4 input tiles with stride 2; 16 batched (O x C) @ (C x tiles) GEMMs
    in the transformed domain replace the 36-multiply direct sum per 2x2 output tile."""
    if stride != (1, 1) or dilation != (1, 1) or groups != 1 or tuple(w.shape[2:]) != (3, 3):
        raise ValueError("winograd F(2x2,3x3) needs a 3x3 kernel, stride 1, dilation 1, groups 1")
    n, c, h, wd = x.shape
    o = w.shape[0]
    oh, ow = h + 2 * padding[0] - 2, wd + 2 * padding[1] - 2
    th, tw = -(-oh // 2), -(-ow // 2)
    # pad so that th x tw tiles of 4x4 (stride 2) cover the (padded) input exactly
    xp = F.pad(x, (padding[1], padding[1] + 2 * tw - ow, padding[0], padding[0] + 2 * th - oh))
    tiles = xp.unfold(2, 4, 2).unfold(3, 4, 2)  # (N, C, th, tw, 4, 4)
    bt, g, at = _mat(WINOGRAD_BT, x), _mat(WINOGRAD_G, x), _mat(WINOGRAD_AT, x)
    v = bt @ tiles @ bt.t()  # input transform, (N, C, th, tw, 4, 4)
    u = g @ w @ g.t()  # filter transform, (O, C, 4, 4)
    v = v.permute(4, 5, 1, 0, 2, 3).reshape(16, c, n * th * tw)
    u = u.permute(2, 3, 0, 1).reshape(16, o, c)
    m = torch.bmm(u, v)  # (16, O, tiles): the only multiplies that scale with C*O
    m = m.reshape(4, 4, o, n, th, tw).permute(3, 2, 4, 5, 0, 1)  # (N, O, th, tw, 4, 4)
    y = at @ m @ at.t()  # output transform, (N, O, th, tw, 2, 2)
    y = y.permute(0, 1, 2, 4, 3, 5).reshape(n, o, 2 * th, 2 * tw)[:, :, :oh, :ow].contiguous()
    return y if b is None else y + b.view(1, o, 1, 1)


CONV_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "direct": conv2d_direct,
    "im2col": conv2d_im2col,
    "fft": conv2d_fft,
    "winograd": conv2d_winograd,
}


def run_algorithm(algorithm: str, conv: nn.Conv2d, x: torch.Tensor,
                  weight: torch.Tensor | None = None,
                  bias: torch.Tensor | None | str = "same") -> torch.Tensor:
    """Compute ``conv`` on ``x`` with ``algorithm`` (optionally with substitute parameters).
    An unbatched ``(C, H, W)`` input, which ``nn.Conv2d`` takes, runs as a batch of one: the
    algorithms unpack ``(N, C, H, W)`` and raised on it."""
    if x.dim() == 3:
        return run_algorithm(algorithm, conv, x.unsqueeze(0), weight, bias).squeeze(0)
    w = conv.weight if weight is None else weight
    b = conv.bias if isinstance(bias, str) else bias
    p = conv_params(conv)
    return CONV_FUNCTIONS[algorithm](x, w, b, p["stride"], p["padding"], p["dilation"], p["groups"])


class AlgoConv2d(nn.Conv2d):
    """A Conv2d that computes with a chosen algorithm; parameters and state_dict keys are
    those of the Conv2d it was made from (the *same* Parameter objects, so an optimizer
    built earlier keeps working)."""

    algorithm: str | None

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, algorithm: str | None = "direct") -> AlgoConv2d:
        new = cls.__new__(cls)
        state = dict(vars(conv))
        for key in ("_parameters", "_buffers", "_modules"):
            state[key] = dict(state[key])  # same tensors, own containers
        new.__dict__.update(state)
        new.algorithm = algorithm
        if algorithm is not None and not supports(algorithm, conv):
            raise ValueError(f"algorithm {algorithm!r} does not support {conv}")
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.algorithm in (None, "direct"):  # exactly nn.Conv2d's own path
            return self._conv_forward(x, self.weight, self.bias)
        return run_algorithm(self.algorithm, self, x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, algorithm={self.algorithm}"


# --------------------------------------------------------------------------------------------
# Multiply counting: the per-tile algorithm written out scalar by scalar, so a test can
# count the multiplications with an instrumented number type.


def _transform(mat: Sequence[Sequence[float]], vec: Sequence[Any]) -> list[Any]:
    """``mat @ vec`` where entries 0 and +-1 cost no multiply (as in a real kernel)."""
    out = []
    for row in mat:
        acc: Any = None
        for coef, value in zip(row, vec, strict=False):
            if coef == 0:
                continue
            term = value if coef == 1 else (-value if coef == -1 else value * coef)
            acc = term if acc is None else acc + term
        out.append(acc if acc is not None else vec[0] * 0)
    return out


def _transform_2d(mat: Sequence[Sequence[float]], tile: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """``mat @ tile @ mat^T`` with the free-coefficient rule above."""
    cols = list(zip(*tile, strict=False))
    left = [_transform(mat, list(col)) for col in cols]  # each column transformed
    left_t = [list(r) for r in zip(*left, strict=False)]  # rows of mat @ tile
    return [_transform(mat, row) for row in left_t]


def winograd_filter_transform(g: Sequence[Sequence[float]]) -> list[list[float]]:
    """U = G g G^T (done once per filter and amortised over all tiles)."""
    return _transform_2d(WINOGRAD_G, g)


def winograd_tile(d: Sequence[Sequence[Any]], u: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """One 2x2 output tile from a 4x4 input tile ``d`` and a transformed filter ``u``:
    input transform (additions only), 16 elementwise multiplies, output transform
    (additions only)."""
    v = _transform_2d(WINOGRAD_BT, d)
    m = [[u[i][j] * v[i][j] for j in range(4)] for i in range(4)]
    return _transform_2d(WINOGRAD_AT, m)


def direct_tile(d: Sequence[Sequence[Any]], g: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """The same 2x2 output tile by the direct sum: 9 multiplies per output, 36 in all."""
    out = []
    for y in range(2):
        row = []
        for x in range(2):
            acc: Any = None
            for i in range(3):
                for j in range(3):
                    term = d[y + i][x + j] * g[i][j]
                    acc = term if acc is None else acc + term
            row.append(acc)
        out.append(row)
    return out
