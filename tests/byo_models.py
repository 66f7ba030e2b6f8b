"""Models and datasets as users bring them: factories with their own keywords, library-style
constructors, map-style torch datasets, tuple and ModelOutput outputs, model-computed losses."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset


def kw_mlp(*, input_shape, num_classes, hidden: int = 8, depth: int = 1) -> nn.Module:
    """Names two of the standard keywords, and takes two of its own."""
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(hidden, num_classes))


def library_style(**kwargs) -> nn.Module:
    """Like ``torchvision.models.resnet18(**kwargs)``: passes everything to its class, so it
    must get only what the user gave."""
    return LibraryNet(**kwargs)


class LibraryNet(nn.Module):
    def __init__(self, num_classes: int = 1000, in_features: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.fc(x.flatten(1))
        return logits, logits.detach().abs().mean()  # (logits, an auxiliary output)


@dataclass
class Output:
    """Shaped like an HF ``ModelOutput``: ``logits`` and, given labels, ``loss``."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class OwnLoss(nn.Module):
    """Computes its own (label-smoothed) loss when called with ``labels=``."""

    def __init__(self, input_shape, num_classes) -> None:
        super().__init__()
        self.fc = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        logits = self.fc(x.flatten(1))
        loss = None if labels is None else nn.functional.cross_entropy(
            logits, labels, label_smoothing=0.1)
        return Output(logits, loss)


def own_loss(*, input_shape, num_classes) -> nn.Module:
    return OwnLoss(input_shape, num_classes)


def blobs(*, seed: int, n: int = 256, dim: int = 16, classes: int = 4):
    """A map-style (train, held_out) pair of TensorDatasets: Gaussian blobs per class."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, dim, generator=g) * 2

    def draw(count: int) -> TensorDataset:
        y = torch.randint(classes, (count,), generator=g)
        return TensorDataset(means[y] + torch.randn(count, dim, generator=g), y)

    return draw(n), draw(n // 2)


class Misaligned(Dataset):
    """The batch protocol, with one label too few per batch."""

    input_shape, num_classes, vocab_size, input_kind, name = (4,), 2, None, "vector", "bad"

    def batch(self, index: int, batch_size: int):
        return torch.zeros(batch_size, 4), torch.zeros(batch_size - 1, dtype=torch.int64)


def misaligned(**_: object) -> Misaligned:
    return Misaligned()


class FloatLabels(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, j: int):
        return torch.zeros(4), torch.tensor(0.5)


def float_labels() -> FloatLabels:
    return FloatLabels()


def hf_bert(*, num_classes: int, vocab_size: int, input_shape) -> nn.Module:
    """A small BERT-style encoder from a transformers config (random weights, no download)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, num_labels=num_classes,
                        max_position_embeddings=max(64, input_shape[0]))
    return BertForSequenceClassification(config)


class IgnoresLabels(nn.Module):
    def __init__(self, input_shape, num_classes) -> None:
        super().__init__()
        self.fc = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc(x.flatten(1))


def ignores_labels(*, input_shape, num_classes) -> nn.Module:
    return IgnoresLabels(input_shape, num_classes)


def hf_vit(*, num_classes: int, input_shape) -> nn.Module:
    """A small ViT from a transformers config (random weights, no download)."""
    from transformers import ViTConfig, ViTForImageClassification

    channels, height, _ = input_shape
    config = ViTConfig(image_size=height, patch_size=4, num_channels=channels, hidden_size=32,
                       num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       num_labels=num_classes)
    return ViTForImageClassification(config)
