"""Bring your own data: a map-style ``torch.utils.data.Dataset`` as a job's dataset.

A job reads its data as a pure function, ``batch(index, batch_size) -> (inputs, labels)``,
so that every process of a cluster run, a resumed job and a repeated run see the same rows
(``workloads/data.py``). Any map-style dataset of ``(input, label)`` pairs (``__len__`` and
``__getitem__``; a torchvision or HF dataset with a transform, a user's own) becomes one:
batch ``i`` is the rows the seeded per-epoch permutation puts there, fetched with
``dataset[j]`` and stacked. A factory may also return ``(train, held_out)``: the second is
the held-out set every run scores (``job/quality.py``).

What the job needs to know is read from the data: ``input_shape`` from the first sample;
``num_classes`` from the dataset's ``num_classes`` or ``classes`` attribute, else one pass
over the labels; ``input_kind`` from the sample (float images ``[C, H, W]``, float vectors,
integer token sequences). Data a job cannot use (labels not row-aligned with inputs,
non-tensor samples, float labels) gets one line naming the problem and the fix.
"""

from __future__ import annotations

from typing import Any

import torch

from accelopt.workloads.data import batch_rows

BATCH_PROTOCOL = ("batch", "input_shape", "num_classes")
"""What the job's batch protocol needs; an object that has these is used as it is."""


def adapt_dataset(built: Any, *, name: str, seed: int) -> Any:
    """``built`` as the job's dataset: itself when it already speaks the batch protocol,
    else a :class:`MapStyleDataset` over it (or over ``(train, held_out)``)."""
    if all(hasattr(built, attr) for attr in BATCH_PROTOCOL):
        return built
    held_out = None
    if isinstance(built, tuple) and len(built) == 2 and all(_map_style(b) for b in built):
        built, held_out = built
    if not _map_style(built):
        raise ValueError(
            f"dataset {name!r} returned {type(built).__name__}: neither the batch protocol "
            f"({', '.join(BATCH_PROTOCOL)}) nor a map-style torch Dataset (__len__, "
            "__getitem__) of (input, label) pairs")
    return MapStyleDataset(built, held_out, name=name, seed=seed)


def _map_style(obj: Any) -> bool:
    return hasattr(obj, "__len__") and hasattr(obj, "__getitem__")


class MapStyleDataset:
    """The batch protocol over a map-style dataset of ``(input, label)`` pairs."""

    def __init__(self, train: Any, held_out: Any | None, *, name: str, seed: int) -> None:
        self.name, self.seed = name, seed
        self._train, self._held_out = train, held_out
        self.n_train = len(train)
        if self.n_train == 0:
            raise ValueError(f"dataset {name!r} is empty")
        x, y = self._sample(train, 0)
        self.input_shape: tuple[int, ...] = tuple(x.shape)
        self.input_kind = ("sequence" if not x.is_floating_point()
                           else "image" if x.dim() == 3 else "vector")
        self.vocab_size = getattr(train, "vocab_size", None)
        self.num_classes = self._classes(train)
        if held_out is not None:  # only then has it an eval_set: runs score it
            self.eval_set = self._eval_set

    def __repr__(self) -> str:
        return (f"MapStyleDataset(name={self.name!r}, n_train={self.n_train}, input_shape="
                f"{self.input_shape}, num_classes={self.num_classes})")

    def _sample(self, data: Any, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        item = data[j]
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(
                f"dataset {self.name!r}: item {j} is a {type(item).__name__}, not an (input, "
                "label) pair; return (tensor, label) from __getitem__")
        x, y = item
        x = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
        y = torch.as_tensor(y)
        if y.is_floating_point():
            raise ValueError(
                f"dataset {self.name!r}: label of item {j} is {y.dtype}; class labels must be "
                "integers (class indices)")
        return x, y

    def _classes(self, data: Any) -> int:
        for attr in ("num_classes", "classes"):
            value = getattr(data, attr, None)
            if isinstance(value, int):
                return value
            if value is not None and hasattr(value, "__len__"):
                return len(value)
        top = max(int(self._sample(data, j)[1].max()) for j in range(len(data)))
        return top + 1

    def _stack(self, data: Any, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self._sample(data, j) for j in rows]
        shapes = {tuple(x.shape) for x, _ in pairs}
        if len(shapes) > 1:
            raise ValueError(
                f"dataset {self.name!r}: inputs of different shapes in one batch "
                f"({', '.join(map(str, sorted(shapes)[:3]))}); pad or resize them to one shape")
        return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])

    def batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``index``-th training batch: a pure function of (seed, index, batch_size)."""
        rows = batch_rows(self.seed, self.n_train, index, batch_size).tolist()
        return self._stack(self._train, rows)

    def _eval_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._stack(self._held_out, list(range(len(self._held_out))))
