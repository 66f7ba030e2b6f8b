"""The model zoo: small, representative networks that jobs train.

Each family stands for a workload shape that accelerator techniques treat differently: a plain
MLP (dense matmuls), CNNs (convolutions + BatchNorm), a ResNet (residual adds), an
Inception-style net (parallel branches, which a communication scheduler can overlap), an LSTM
(sequential recurrence) and a Transformer (attention). Models are deliberately tiny so that a
forward+backward at batch 32 costs milliseconds on a CPU and many jobs can run at once.

Rules every model follows, because the runtime and plugins rely on them:

* no dropout anywhere: a training step is then a pure function of parameters and batch, so
  concurrently running (or resumed) jobs stay bit-for-bit reproducible;
* traceable by ``torch.fx.symbolic_trace`` (no data-dependent Python control flow), so plugins
  can inspect and rewrite the graph;
* parameters are initialised from torch's global RNG, exactly like ``torch.nn`` modules; seed
  it (``torch.manual_seed``) before ``build_model`` to get reproducible weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn

from accelopt.workloads.refs import call_factory, is_ref

InputKind = Literal["vector", "image", "sequence"]

MODEL_NAMES: tuple[str, ...] = ("mlp", "cnn", "resnet", "inception", "lstm", "transformer")

_INPUT_KIND: dict[str, InputKind] = {
    "mlp": "vector",
    "cnn": "image",
    "resnet": "image",
    "inception": "image",
    "lstm": "sequence",
    "transformer": "sequence",
}

_DEFAULT_WIDTH: dict[str, int] = {
    "mlp": 256,
    "cnn": 16,
    "resnet": 16,
    "inception": 16,
    "lstm": 64,
    "transformer": 64,
}


def _check_known(name: str) -> None:
    """Fail early, in one line that lists the valid choices, on a misspelt model name."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}")


def model_input_kind(name: str) -> InputKind:
    """The kind of input a model family expects.

    ``"vector"`` for the MLP means "anything dense": it flattens its input, so it also accepts
    images (see ``accelopt.workloads.data.check_compatible``).
    """
    _check_known(name)
    return _INPUT_KIND[name]


# --------------------------------------------------------------------------------------------
# Building blocks


def _conv_bn_relu(c_in: int, c_out: int, kernel: int = 3, stride: int = 1) -> nn.Sequential:
    """Conv + BatchNorm + ReLU, the unit all CNN families share (bias is redundant before BN)."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class MLP(nn.Module):
    """Flatten -> [Linear -> ReLU] x 2 -> Linear."""

    def __init__(self, in_features: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Three conv-BN-ReLU layers with two 2x poolings, global average pool, linear head."""

    def __init__(self, in_channels: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _conv_bn_relu(in_channels, width),
            nn.MaxPool2d(2),
            _conv_bn_relu(width, 2 * width),
            nn.MaxPool2d(2),
            _conv_bn_relu(2 * width, 2 * width),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class BasicBlock(nn.Module):
    """ResNet basic block: conv-bn-relu-conv-bn plus a shortcut, then ReLU.

    The shortcut is the identity when shapes match and a strided 1x1 conv + BN otherwise, as in
    He et al. (2016), option B.
    """

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem + three stages of one BasicBlock each (channels w, 2w, 4w; strides 1, 2, 2)."""

    def __init__(self, in_channels: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.stem = _conv_bn_relu(in_channels, width)
        self.stages = nn.Sequential(
            BasicBlock(width, width, stride=1),
            BasicBlock(width, 2 * width, stride=2),
            BasicBlock(2 * width, 4 * width, stride=2),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(self.pool(x), 1))


class InceptionBlock(nn.Module):
    """Four parallel branches concatenated on channels (Szegedy et al., 2015).

    The branches share only their input, so they are independent paths in the fx graph; a
    communication scheduler can start one branch's gradient transfer while another computes.
    The 5x5 branch is factorised into two 3x3 convs (Inception-v2), which is cheaper.
    """

    def __init__(self, c_in: int, width: int) -> None:
        super().__init__()
        half, quarter = max(1, width // 2), max(1, width // 4)
        self.branch1x1 = _conv_bn_relu(c_in, width, kernel=1)
        self.branch3x3 = nn.Sequential(
            _conv_bn_relu(c_in, half, kernel=1), _conv_bn_relu(half, width)
        )
        self.branch5x5 = nn.Sequential(
            _conv_bn_relu(c_in, quarter, kernel=1),
            _conv_bn_relu(quarter, half),
            _conv_bn_relu(half, half),
        )
        self.branch_pool = nn.Sequential(
            nn.MaxPool2d(3, stride=1, padding=1), _conv_bn_relu(c_in, half, kernel=1)
        )
        self.out_channels = 2 * width + 2 * half

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [self.branch1x1(x), self.branch3x3(x), self.branch5x5(x), self.branch_pool(x)],
            dim=1,
        )


class InceptionNet(nn.Module):
    """Stem conv, then two Inception blocks, each after a 2x pool, global pool, linear head.

    Pooling before the first block keeps the many small branch convs cheap (the block runs at
    half resolution), which matters more on a CPU than the lost spatial detail.
    """

    def __init__(self, in_channels: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.stem = _conv_bn_relu(in_channels, width)
        self.block1 = InceptionBlock(width, width)
        self.pool = nn.MaxPool2d(2)
        self.block2 = InceptionBlock(self.block1.out_channels, width)
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(self.block2.out_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.pool(self.block1(self.pool(self.stem(x)))))
        return self.head(torch.flatten(self.global_pool(x), 1))


class LSTMClassifier(nn.Module):
    """Embedding -> one-layer LSTM -> Linear on the last time step."""

    def __init__(self, vocab_size: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.lstm = nn.LSTM(width, width, num_layers=1, batch_first=True)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out[:, -1])


class TransformerClassifier(nn.Module):
    """Token + learned positional embedding, two encoder layers, mean pool, linear head.

    The positional table is sized for the sequence length the model is built for, so forward
    has no shape-dependent slicing and stays fx-traceable.
    """

    def __init__(self, vocab_size: int, seq_len: int, num_classes: int, width: int) -> None:
        super().__init__()
        nhead = 4 if width % 4 == 0 else 1
        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Parameter(torch.randn(1, seq_len, width) * 0.02)
        self.layers = nn.Sequential(
            *(
                nn.TransformerEncoderLayer(
                    width, nhead, dim_feedforward=2 * width, dropout=0.0, batch_first=True
                )
                for _ in range(2)
            )
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.embed(tokens) + self.pos)
        return self.head(x.mean(dim=1))


# --------------------------------------------------------------------------------------------
# Factory


def _require_image_shape(name: str, input_shape: tuple[int, ...]) -> int:
    if len(input_shape) != 3:
        raise ValueError(
            f"model {name!r} needs image input_shape (C, H, W); got {input_shape}: "
            "use an image dataset such as synthetic_images or digits"
        )
    return input_shape[0]


def _require_sequence(
    name: str, input_shape: tuple[int, ...], vocab_size: int | None
) -> tuple[int, int]:
    if len(input_shape) != 1:
        raise ValueError(
            f"model {name!r} needs sequence input_shape (seq_len,); got {input_shape}: "
            "use a sequence dataset such as synthetic_sequences"
        )
    if vocab_size is None or vocab_size < 1:
        raise ValueError(f"model {name!r} embeds token ids and needs the dataset's "
                         f"vocab_size (>= 1), got {vocab_size}: give the dataset a vocab_size "
                         "attribute (the number of distinct token ids)")
    return input_shape[0], vocab_size


def build_model(
    name: str,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    vocab_size: int | None = None,
    width: int | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Build a zoo model for inputs of ``input_shape`` (per sample, no batch dimension).

    ``name`` may also be a ``"module:factory"`` reference (see ``workloads/refs.py``): the
    factory is called with ``kwargs`` (the job's ``model_kwargs``) and the standard keywords
    above that its signature names, and returns the module.

    Images are (C, H, W) float tensors; sequences are (seq_len,) integer tokens and need
    ``vocab_size``. ``width`` is the hidden size (MLP, LSTM, Transformer) or the base channel
    count (CNN families); ``None`` picks a small default that keeps a step in milliseconds.
    """
    if is_ref(name):
        model = call_factory(name, "model", {
            "input_shape": tuple(input_shape), "num_classes": num_classes,
            "vocab_size": vocab_size, "width": width}, kwargs)
        if not isinstance(model, nn.Module):
            raise ValueError(f"model {name!r} returned {type(model).__name__}, not a "
                             "torch.nn.Module")
        return model
    if kwargs:
        raise ValueError(f"model_kwargs {dict(kwargs)} given for the zoo model {name!r}, which "
                         "takes width only; model_kwargs are for 'module:factory' models")
    _check_known(name)
    input_shape = tuple(int(d) for d in input_shape)
    if not input_shape or any(d < 1 for d in input_shape):
        raise ValueError(f"input_shape must be non-empty positive sizes; got {input_shape}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1; got {num_classes}")
    w = _DEFAULT_WIDTH[name] if width is None else int(width)
    if w < 1:
        raise ValueError(f"width must be >= 1; got {width}")
    try:
        return _zoo_model(name, input_shape, num_classes, vocab_size, w)
    except (RuntimeError, MemoryError, OverflowError) as exc:
        # a width too large for memory (torch's allocator raises RuntimeError): one line
        # naming the width, as a factory's own error is, not a traceback from deep in torch
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"the zoo model {name!r} with width={w} cannot be built ({first}); "
                         "lower width") from None


def _zoo_model(name: str, input_shape: tuple[int, ...], num_classes: int,
               vocab_size: int | None, w: int) -> nn.Module:
    if name == "mlp":
        return MLP(math.prod(input_shape), num_classes, w)
    if name in ("cnn", "resnet", "inception"):
        channels = _require_image_shape(name, input_shape)
        cls = {"cnn": SmallCNN, "resnet": ResNet, "inception": InceptionNet}[name]
        return cls(channels, num_classes, w)
    seq_len, vocab = _require_sequence(name, input_shape, vocab_size)
    if name == "lstm":
        return LSTMClassifier(vocab, num_classes, w)
    return TransformerClassifier(vocab, seq_len, num_classes, w)
