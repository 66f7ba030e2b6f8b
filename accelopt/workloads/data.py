"""Datasets for zoo models, with stateless, index-addressable batches.

A job may be paused, preempted, migrated or resumed at any iteration. If fetching batch ``i``
depended on a data loader's internal state, every checkpoint would have to carry that state
and resumed runs could silently diverge. Here ``Dataset.batch(i, batch_size)`` is a pure
function of (seed, i, batch_size): the training set is materialised once from a private
``torch.Generator`` (the global RNG is never touched, so concurrent jobs cannot perturb each
other), and batch ``i`` reads positions ``i*batch_size ... (i+1)*batch_size - 1`` of an
infinite stream made of per-epoch permutations, each seeded by (seed, epoch).

All datasets are small and generated or shipped locally: nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from accelopt.workloads.models import InputKind, model_input_kind
from accelopt.workloads.refs import call_factory, is_ref

DATASET_NAMES: tuple[str, ...] = (
    "synthetic_vectors",
    "synthetic_images",
    "synthetic_sequences",
    "digits",
)

_DEFAULT_FOR_KIND: dict[InputKind, str] = {
    "vector": "synthetic_vectors",
    "image": "synthetic_images",
    "sequence": "synthetic_sequences",
}
_PLURAL: dict[InputKind, str] = {"vector": "vectors", "image": "images", "sequence": "sequences"}

_DEFAULT_N_TRAIN = 2048
_N_EVAL = 512
_DIGITS_TRAIN_FRACTION = 0.8
_DIGITS_SPLIT_SEED = 0  # the train/test split of digits is fixed, independent of job seeds


def _derive_seed(*parts: int) -> int:
    """Mix integers into one 63-bit seed (numpy SeedSequence hashes well; adjacent inputs give
    unrelated streams, unlike ``seed + epoch``)."""
    state = np.random.SeedSequence([p & 0xFFFFFFFFFFFFFFFF for p in parts]).generate_state(2)
    return int((int(state[0]) << 32 | int(state[1])) & 0x7FFFFFFFFFFFFFFF)


def _generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(_derive_seed(*parts))


@lru_cache(maxsize=8)
def _epoch_permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    """Order of training samples in ``epoch``. Cached because consecutive batches share an
    epoch; the cache is a memo of a pure function, not loader state. Never mutate the result."""
    return torch.randperm(n, generator=_generator(seed, epoch, 1))


def batch_rows(seed: int, n_train: int, index: int, batch_size: int) -> torch.Tensor:
    """Training-set rows of batch ``index`` of a dataset of ``n_train`` rows: positions of the
    per-epoch permutation stream (a pure function of its arguments). Each position picks its
    own epoch, so a batch that straddles an epoch boundary (or is larger than the training
    set) is still well defined."""
    if index < 0:
        raise ValueError(f"batch index must be >= 0; got {index}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    positions = torch.arange(index * batch_size, (index + 1) * batch_size)
    epochs = positions // n_train
    offsets = positions % n_train
    out = torch.empty(batch_size, dtype=torch.int64)
    for epoch in torch.unique(epochs).tolist():
        mask = epochs == epoch
        out[mask] = _epoch_permutation(seed, int(epoch), n_train)[offsets[mask]]
    return out


class Dataset:
    """An in-memory labelled dataset with deterministic, stateless batching.

    ``input_shape`` is per sample (no batch dimension). Image and vector inputs are float32;
    sequence inputs are int64 tokens in ``[0, vocab_size)``. Labels are int64.
    """

    def __init__(
        self,
        *,
        name: str,
        seed: int,
        input_kind: InputKind,
        num_classes: int,
        train: tuple[torch.Tensor, torch.Tensor],
        held_out: tuple[torch.Tensor, torch.Tensor],
        vocab_size: int | None = None,
    ) -> None:
        x_train, y_train = train
        if len(x_train) != len(y_train) or len(x_train) == 0:
            raise ValueError(f"dataset {name!r}: train inputs and labels must be equal, non-empty")
        self.name = name
        self.seed = seed
        self.input_kind: InputKind = input_kind
        self.num_classes = num_classes
        self.vocab_size = vocab_size
        self.input_shape: tuple[int, ...] = tuple(x_train.shape[1:])
        self.n_train = len(x_train)
        self._x_train, self._y_train = x_train.contiguous(), y_train.contiguous()
        self._x_eval, self._y_eval = held_out[0].contiguous(), held_out[1].contiguous()

    def __repr__(self) -> str:
        return (
            f"Dataset(name={self.name!r}, seed={self.seed}, input_shape={self.input_shape}, "
            f"num_classes={self.num_classes}, n_train={self.n_train})"
        )

    def indices(self, index: int, batch_size: int) -> torch.Tensor:
        """Training-set rows of batch ``index``: positions of the per-epoch permutation stream.

        Each position picks its own epoch, so a batch that straddles an epoch boundary (or is
        larger than the training set) is still well defined.
        """
        return batch_rows(self.seed, self.n_train, index, batch_size)

    def batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``index``-th training batch (inputs, labels): a pure function of (seed, index,
        batch_size). Advanced indexing copies, so callers may mutate the result freely."""
        rows = self.indices(index, batch_size)
        return self._x_train[rows].contiguous(), self._y_train[rows].contiguous()

    def eval_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held-out set (inputs, labels), as copies so evaluation cannot corrupt it."""
        return self._x_eval.clone(), self._y_eval.clone()


# --------------------------------------------------------------------------------------------
# Generators. Each draws class structure first, then train and eval samples from the same
# distribution with independent streams, so changing n_train does not change the eval set.


def _labels(n: int, num_classes: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(num_classes, (n,), generator=gen)


def _synthetic_vectors(seed: int, n_train: int, dim: int = 64, num_classes: int = 10) -> Dataset:
    """Gaussian blobs: class means ~ N(0, 0.5^2 I), unit noise. Linearly separable enough to
    learn in a few steps, noisy enough that accuracy is not trivially 100%."""
    means = torch.randn(num_classes, dim, generator=_generator(seed, 10)) * 0.5

    def sample(n: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = _generator(seed, stream)
        y = _labels(n, num_classes, gen)
        return means[y] + torch.randn(n, dim, generator=gen), y

    return Dataset(
        name="synthetic_vectors",
        seed=seed,
        input_kind="vector",
        num_classes=num_classes,
        train=sample(n_train, 11),
        held_out=sample(_N_EVAL, 12),
    )


def _synthetic_images(
    seed: int, n_train: int, shape: tuple[int, int, int] = (3, 16, 16), num_classes: int = 10
) -> Dataset:
    """Per-class smooth patterns (a random 4x4 grid upsampled to full size) plus pixel noise:
    spatially structured, so convolutions have something to find."""
    c, h, w = shape
    coarse = torch.randn(num_classes, c, 4, 4, generator=_generator(seed, 20))
    patterns = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear")

    def sample(n: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = _generator(seed, stream)
        y = _labels(n, num_classes, gen)
        return patterns[y] + torch.randn(n, c, h, w, generator=gen), y

    return Dataset(
        name="synthetic_images",
        seed=seed,
        input_kind="image",
        num_classes=num_classes,
        train=sample(n_train, 21),
        held_out=sample(_N_EVAL, 22),
    )


def _synthetic_sequences(
    seed: int, n_train: int, vocab_size: int = 64, seq_len: int = 16, num_classes: int = 4
) -> Dataset:
    """Class = which vocabulary band tokens favour: each token comes from the class's band
    (vocab split into ``num_classes`` bands) with probability 0.5, else uniformly. A model must
    count token statistics over the sequence, not just look at one position."""
    band = vocab_size // num_classes

    def sample(n: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = _generator(seed, stream)
        y = _labels(n, num_classes, gen)
        uniform = torch.randint(vocab_size, (n, seq_len), generator=gen)
        in_band = y[:, None] * band + torch.randint(band, (n, seq_len), generator=gen)
        use_band = torch.rand(n, seq_len, generator=gen) < 0.5
        return torch.where(use_band, in_band, uniform), y

    return Dataset(
        name="synthetic_sequences",
        seed=seed,
        input_kind="sequence",
        num_classes=num_classes,
        vocab_size=vocab_size,
        train=sample(n_train, 31),
        held_out=sample(_N_EVAL, 32),
    )


@lru_cache(maxsize=1)
def _digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits (1797 8x8 images, pixel values 0..16), scaled to [0, 1]
    and split 80/20 with a fixed seed. The data file ships inside scikit-learn (a dependency),
    so loading never touches the network."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.as_tensor(bunch.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=_generator(_DIGITS_SPLIT_SEED, 40))
    n_train = int(round(len(x) * _DIGITS_TRAIN_FRACTION))
    tr, te = order[:n_train], order[n_train:]
    return x[tr], y[tr], x[te], y[te]


def _digits(seed: int, n_train: int | None) -> Dataset:
    """Real data with a fixed split; ``seed`` only changes the batch order. ``n_train`` may
    take a prefix of the training split (never touching the test split)."""
    x_tr, y_tr, x_te, y_te = _digits_split()
    if n_train is not None:
        if n_train > len(x_tr):
            raise ValueError(f"digits has {len(x_tr)} training samples; got n_train={n_train}")
        x_tr, y_tr = x_tr[:n_train], y_tr[:n_train]
    return Dataset(
        name="digits",
        seed=seed,
        input_kind="image",
        num_classes=10,
        train=(x_tr.clone(), y_tr.clone()),
        held_out=(x_te.clone(), y_te.clone()),
    )


def build_dataset(name: str, *, seed: int, n_train: int | None = None,
                  kwargs: Mapping[str, Any] | None = None) -> Dataset:
    """Build dataset ``name``; ``seed`` fixes both its content (synthetic ones) and batch order.

    ``n_train`` defaults to 2048 for synthetic datasets and the full 80% split for digits.
    ``name`` may be a ``"module:factory"`` reference, called with ``kwargs`` (the job's
    ``dataset_kwargs``) and whichever of ``seed=``, ``n_train=`` its signature names; it
    returns any object with ``Dataset``'s interface (``batch``, ``input_shape``,
    ``num_classes``; ``vocab_size`` and ``input_kind`` optional), may add ``loss_fn(out, y)`` and
    ``eval_set()``, or a map-style ``torch.utils.data.Dataset`` of ``(input, label)`` pairs,
    which is adapted (``workloads/adapters.py``).
    """
    if is_ref(name):
        from accelopt.workloads.adapters import adapt_dataset

        built = call_factory(name, "dataset", {"seed": seed, "n_train": n_train}, kwargs)
        return adapt_dataset(built, name=name, seed=seed)  # type: ignore[return-value]
    if kwargs:
        raise ValueError(f"dataset_kwargs {dict(kwargs)} given for the zoo dataset {name!r}; "
                         "dataset_kwargs are for 'module:factory' datasets")
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASET_NAMES)}")
    if n_train is not None and n_train < 1:
        raise ValueError(f"n_train must be >= 1; got {n_train}")
    if name == "digits":
        return _digits(seed, n_train)
    n = _DEFAULT_N_TRAIN if n_train is None else n_train
    if name == "synthetic_vectors":
        return _synthetic_vectors(seed, n)
    if name == "synthetic_images":
        return _synthetic_images(seed, n)
    return _synthetic_sequences(seed, n)


def default_dataset_for(model: str) -> str:
    """The synthetic dataset that matches a model family's input kind."""
    if is_ref(model):
        raise ValueError(f"model {model!r} is a reference: set the job's dataset explicitly")
    return _DEFAULT_FOR_KIND[model_input_kind(model)]


def check_compatible(model: str, dataset: Dataset) -> None:
    """Reject a model/dataset pair before any compute is spent (one line, names the fix).

    The MLP flattens, so it takes vectors or images; every other family needs its own kind.
    A referenced model (``module:factory``) or a dataset of a kind the zoo does not know
    (e.g. sparse inputs from a referenced factory, or a batch-protocol object without an
    ``input_kind``) is its author's to match: not checked.
    """
    kind = getattr(dataset, "input_kind", None)  # optional in the batch protocol
    if is_ref(model) or kind not in _PLURAL:
        return
    needed = model_input_kind(model)
    accepted: tuple[InputKind, ...] = ("vector", "image") if model == "mlp" else (needed,)
    if kind in accepted:
        return
    needs = " or ".join(accepted)
    raise ValueError(
        f"model {model!r} needs {needs} data; dataset {getattr(dataset, 'name', '?')!r} gives "
        f"{_PLURAL[kind]}: choose dataset={_DEFAULT_FOR_KIND[needed]}"
    )
