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


class OwnLossDict(OwnLoss):
    """The same, returning a plain mapping (``{"loss": ..., "logits": ...}``)."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = super().forward(x, labels)
        return {"loss": out.loss, "logits": out.logits}


def own_loss_dict(*, input_shape, num_classes) -> nn.Module:
    return OwnLossDict(input_shape, num_classes)


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


class TokenClassification(Dataset):
    """HF-datasets style samples: dicts of ``input_ids``, ``attention_mask`` and ``labels``
    (a padded tail the mask hides; the label is whether token 1 occurs in the sequence)."""

    vocab_size = 32

    def __init__(self, n: int, length: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(2, self.vocab_size, (n, length), generator=g)
        self.lengths = torch.randint(length // 2, length + 1, (n,), generator=g)
        self.labels = torch.randint(2, (n,), generator=g)
        for j in range(n):
            if self.labels[j]:
                self.ids[j, int(torch.randint(int(self.lengths[j]), (1,), generator=g))] = 1

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, j: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(self.ids.shape[1]) < self.lengths[j]).long()
        return {"input_ids": self.ids[j] * mask, "attention_mask": mask,
                "labels": self.labels[j]}


def token_dicts(*, seed: int, n: int = 96, length: int = 12):
    return TokenClassification(n, length, seed), TokenClassification(n // 2, length, seed + 1)


class TwoInputs(nn.Module):
    """A model of two positional inputs: ``forward(features, extra)``."""

    def __init__(self, input_shape, num_classes) -> None:
        super().__init__()
        self.a = nn.Linear(input_shape[0], 16)
        self.b = nn.Linear(3, 16)
        self.out = nn.Linear(16, num_classes)

    def forward(self, features: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.a(features) + self.b(extra)))


def two_inputs(*, input_shape, num_classes) -> nn.Module:
    return TwoInputs(input_shape, num_classes)


def pairs_of_inputs(*, seed: int, n: int = 64):
    """Samples ``((features, extra), label)``: the model's two positional inputs."""
    g = torch.Generator().manual_seed(seed)
    x, e = torch.randn(n, 8, generator=g), torch.randn(n, 3, generator=g)
    y = (x[:, 0] + e[:, 0] > 0).long()
    return [((x[j], e[j]), y[j]) for j in range(n)]


def loader(*, seed: int, n: int = 80, batch_size: int = 16, drop_last: bool = False,
           shuffle: bool = False, generator_seed: int | None = None):
    """A ``DataLoader`` (an iterable of batches, no ``__getitem__``) over Gaussian blobs, with
    a held-out loader; its last batch is short unless ``drop_last``. ``shuffle``: a new order
    every pass (from a generator seeded with ``generator_seed``, if given)."""
    from torch.utils.data import DataLoader

    train, held_out = blobs(seed=seed, n=n, dim=16, classes=4)
    generator = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
    return (DataLoader(train, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                       generator=generator),
            DataLoader(held_out, batch_size=batch_size))


def one_pass(*, seed: int):
    """A one-pass generator: a job could not read its batches again."""
    return ((torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64)) for _ in range(3))


def doc_loop_model(*, input_shape, num_classes) -> nn.Module:
    """The model of docs/your-model.md's own-loop example."""
    return nn.Sequential(nn.Linear(input_shape[0], 256), nn.ReLU(), nn.Linear(256, num_classes))


class DocLoopData:
    """The data of docs/your-model.md's own-loop example, batch ``i`` = rows ``128 i ...``."""

    input_shape, num_classes, vocab_size, input_kind = (64,), 4096, None, "vector"

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        teacher = torch.randn(64, 4096, generator=g)
        self.x = torch.randn(2048, 64, generator=g)
        self.y = (self.x @ teacher).argmax(1)

    def batch(self, index: int, batch_size: int):
        lo = (index * batch_size) % len(self.y)
        return self.x[lo:lo + batch_size], self.y[lo:lo + batch_size]


def doc_loop_data(**_: object) -> DocLoopData:
    return DocLoopData()


class Regression(TensorDataset):
    """A map-style dataset of float targets with a loss of its own (mean squared error):
    the loss must be the dataset's, its float targets welcome, and no argmax scores it.
    ``loss_calls`` counts the loss's calls, so a test sees it was the one used."""

    loss_calls = 0

    def loss_fn(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        type(self).loss_calls += 1
        return torch.nn.functional.mse_loss(out, y)


def regression(*, seed: int, n: int = 96, dim: int = 6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = x.sum(1, keepdim=True)
    return Regression(x[: n * 2 // 3], y[: n * 2 // 3]), Regression(x[n * 2 // 3:], y[n * 2 // 3:])


def regression_loader(*, seed: int, batch_size: int = 16):
    """The same data as a DataLoader: its dataset's loss_fn must still be the loss."""
    from torch.utils.data import DataLoader

    train, held_out = regression(seed=seed)
    return (DataLoader(train, batch_size=batch_size, drop_last=True),
            DataLoader(held_out, batch_size=batch_size))


class FrozenAndSpare(nn.Module):
    """A frozen first layer (fine-tuning), and a ``spare`` layer forward never calls (left
    over from a head swap): the two ways a trainable model has parameters without gradients."""

    def __init__(self, input_shape, num_classes: int, spare: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(math.prod(input_shape), 16)
        self.embed.requires_grad_(False)
        self.head = nn.Linear(16, num_classes)
        if spare:
            self.spare = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.embed(x.flatten(1))))


def batchnorm_mlp(*, input_shape, num_classes) -> nn.Module:
    """Trains on two rows or more: BatchNorm refuses one in training."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 16),
                         nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, num_classes))


def frozen(*, input_shape, num_classes) -> nn.Module:
    return FrozenAndSpare(input_shape, num_classes, spare=False)


def frozen_and_spare(*, input_shape, num_classes) -> nn.Module:
    return FrozenAndSpare(input_shape, num_classes, spare=True)


class TiedOutput(nn.Module):
    """An output layer sharing an embedding's weight (as language models tie ``lm_head`` to
    the token embedding), the embedding registered first but never called: the table lists
    the tied weight under ``emb``, whose forward never runs."""

    def __init__(self, input_shape, num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(num_classes, width)
        self.inp = nn.Linear(math.prod(input_shape), width)
        self.out = nn.Linear(width, num_classes, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x.flatten(1))))


def tied_output(*, input_shape, num_classes) -> nn.Module:
    return TiedOutput(input_shape, num_classes)


def typo_inside(*, input_shape, num_classes) -> nn.Module:
    """Takes its arguments, then calls a layer with a misspelled keyword (a TypeError)."""
    return nn.Linear(input_shape[0], num_classes, bais=False)  # type: ignore[call-arg]


def raises(**_: object) -> nn.Module:
    """A model factory whose own code fails."""
    raise RuntimeError("boom")


def sparse_embedding(*, vocab_size, num_classes, input_shape) -> nn.Module:
    """A bag of words with nn.Embedding(sparse=True): sparse gradients."""
    return nn.Sequential(nn.Embedding(vocab_size, 8, sparse=True), nn.Flatten(),
                         nn.Linear(8 * input_shape[0], num_classes))


class RaisesAfter(nn.Module):
    """A small MLP whose forward raises once it has run ``after`` times: its job fails
    part-way (in a cluster run, that stops the run)."""

    def __init__(self, input_shape, num_classes, after: int) -> None:
        super().__init__()
        self.net = kw_mlp(input_shape=input_shape, num_classes=num_classes)
        self.after, self.calls = after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError(f"boom at forward {self.calls}")
        return self.net(x)


def raises_after(*, input_shape, num_classes, after: int = 2) -> nn.Module:
    return RaisesAfter(input_shape, num_classes, after)


def too_wide(*, input_shape, num_classes) -> nn.Module:
    """A first layer for 999 features, whatever the dataset gives: a mis-fit the model only
    shows in forward."""
    return nn.Sequential(nn.Flatten(), nn.Linear(999, num_classes))



def with_a_nan(*, seed: int):
    """``blobs`` with one feature of one training point nan (a first loss of nan)."""
    train, held_out = blobs(seed=seed)
    x, y = train.tensors
    x = x.clone()
    x[:, 0] = float("nan")  # every batch holds one
    return TensorDataset(x, y), held_out
