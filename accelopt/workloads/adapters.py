"""Bring your own data: a map-style ``torch.utils.data.Dataset``, or an iterable of batches
(a ``DataLoader``), as a job's dataset.

A job reads its data as a pure function, ``batch(index, batch_size) -> (inputs, labels)``,
so that every process of a cluster run, a resumed job and a repeated run see the same rows
(``workloads/data.py``). Any map-style dataset of ``(input, label)`` pairs (``__len__`` and
``__getitem__``; a torchvision or HF dataset with a transform, a user's own) becomes one:
batch ``i`` is the rows the seeded per-epoch permutation puts there, fetched with
``dataset[j]`` and stacked. A factory may also return ``(train, held_out)``: the second is
the held-out set every run scores (``job/quality.py``), of either kind
(:func:`held_out_batches`). An iterable of ready-made batches
(a ``DataLoader``, no ``__getitem__``) is read in order instead (:class:`IterableBatches`).

A sample is ``(input, label)`` or a dict with a ``labels`` key (HF datasets); its input may
be a tensor, a tuple of tensors (the model's positional arguments) or a dict of tensors (its
keyword arguments: ``input_ids``, ``attention_mask``), see :mod:`accelopt.job.inputs`.

What the job needs to know is read from the data: ``input_shape`` from the first sample;
``num_classes`` from the dataset's ``num_classes`` or ``classes`` attribute, else one pass
over the labels; ``input_kind`` from the sample (float images ``[C, H, W]``, float vectors,
integer token sequences). Data a job cannot use (labels not row-aligned with inputs,
non-tensor samples, float labels, a label that is not a class index, a held-out set unlike
the training set) gets one line naming the problem and the fix.

Class labels (a dataset without a ``loss_fn`` of its own) are checked where they are in
memory when the dataset is built (:func:`check_labels`): a ``TensorDataset``'s label tensor,
or every label where one pass over them counts the classes; otherwise, and for an
iterable's batches, each batch's labels as it is read (one min and max). Integer labels of
another width (int32, uint8) become int64 as each sample is read: cross-entropy takes only
int64 (or uint8) targets, and a conversion loses nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from accelopt.job import inputs
from accelopt.workloads.data import batch_rows

BATCH_PROTOCOL = ("batch", "input_shape", "num_classes")
"""What the job's batch protocol needs; an object that has these is used as it is."""


def adapt_dataset(built: Any, *, name: str, seed: int) -> Any:
    """``built`` as the job's dataset: itself when it already speaks the batch protocol,
    else a :class:`MapStyleDataset` over it (or over ``(train, held_out)``)."""
    if all(hasattr(built, attr) for attr in BATCH_PROTOCOL):
        return built
    if _tensor_pair(built):  # a tensor is indexable, so (x, y) read as (train, held_out)
        x, y = built
        raise ValueError(
            f"dataset {name!r} returned a pair of tensors ({tuple(x.shape)}, "
            f"{tuple(y.shape)}), which reads as (train, held_out) datasets; wrap them: return "
            "torch.utils.data.TensorDataset(x, y), or (TensorDataset(x_train, y_train), "
            "TensorDataset(x_held_out, y_held_out))")
    held_out = None
    if (isinstance(built, tuple) and len(built) == 2
            and all(_map_style(b) or _iterable(b) for b in built)):
        built, held_out = built
    if _map_style(built):
        return MapStyleDataset(built, held_out, name=name, seed=seed)
    if _iterable(built):
        return IterableBatches(built, held_out, name=name, seed=seed)
    raise ValueError(
        f"dataset {name!r} returned {type(built).__name__}: neither the batch protocol "
        f"({', '.join(BATCH_PROTOCOL)}), a map-style torch Dataset (__len__, __getitem__) of "
        "(input, label) samples, nor an iterable of (inputs, labels) batches")


def _map_style(obj: Any) -> bool:
    """``__len__`` and ``__getitem__``, and not a torch ``IterableDataset``: torch's
    ``Dataset`` base class defines a ``__getitem__`` that raises ``NotImplementedError``, so
    an ``IterableDataset`` that defines ``__len__`` looked map-style and failed at item 0."""
    return (hasattr(obj, "__len__") and hasattr(obj, "__getitem__")
            and not isinstance(obj, torch.utils.data.IterableDataset))


def _tensor_pair(obj: Any) -> bool:
    """A tuple or list of two tensors: what a factory returning ``x, y`` gives."""
    return (isinstance(obj, (tuple, list)) and len(obj) == 2
            and all(isinstance(t, torch.Tensor) for t in obj))


def _iterable(obj: Any) -> bool:
    return hasattr(obj, "__iter__") and not isinstance(obj, (str, bytes, torch.Tensor, Mapping))


LABEL_KEYS = ("labels", "label")
"""The label of a dict sample (HF datasets' convention); every other key is a model input."""


IGNORE_LABEL = -100
"""A label cross-entropy leaves out (PyTorch's ``ignore_index`` default; HF's padding)."""


def class_labels(y: torch.Tensor) -> torch.Tensor:
    """Integer labels as int64: cross-entropy refused int32 targets ("expected target dtype
    to be Long or Byte, but got Int") at the first step, though they are integers. Float,
    bool and complex labels are left as they are (refused with their own fix)."""
    if y.dtype in (torch.int64, torch.bool) or y.is_floating_point() or y.is_complex():
        return y
    return y.long()


def check_labels(y: torch.Tensor, num_classes: Any, where: str, first_row: int = 0,
                 rows: list[int] | None = None) -> None:
    """Refuse, in one line naming the first bad label's row and value and the fix, integer
    labels that are not class indices of ``num_classes`` classes: each must be in
    ``[0, num_classes)`` or -100 (ignored). A label -5, or 7 for a dataset that says it has 5
    classes, trained until a batch held it and then failed in torch's words ("Target -5 is
    out of bounds"), in a cluster run after its ranks started. One min and max when all is
    well. The row named is the set's: ``first_row`` is the row of ``y[0]``, or ``rows`` are
    the set's rows of ``y``'s (a shuffled batch).
    Float and bool labels are other checks' to refuse (or a ``loss_fn``'s to take)."""
    if y.numel() == 0 or y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        return
    top = num_classes if isinstance(num_classes, int) and not isinstance(num_classes, bool) \
        else None
    lo, hi = int(y.min()), int(y.max())
    if lo >= 0 and (top is None or hi < top):
        return
    bad = (y != IGNORE_LABEL) & ((y < 0) | (y >= top if top is not None else False))
    if not bool(bad.any()):
        return
    flat = int(bad.reshape(-1).nonzero()[0])
    value = int(y.reshape(-1)[flat])
    at = flat // max(1, y[0].numel()) if y.dim() else 0
    row = rows[at] if rows is not None else first_row + at
    if value < 0:
        fix = (f"class labels are indices 0..{top - 1}" if top is not None
               else "class labels are indices from 0") + " (or -100: a row left out of the loss)"
    else:
        # The largest label, not this one: a hint from the first bad label fails again on
        # the next larger one, once for each.
        fix = (f"the dataset has {top} classes: fix that label, or give the dataset "
               f"num_classes={hi + 1} (a model as wide)")
    raise ValueError(f"{where}: label {value} at row {row} is not a class index; {fix}")


def tensor_labels(data: Any) -> torch.Tensor | None:
    """The label tensor of a ``torch.utils.data.TensorDataset(x, y)`` whose items are its
    tensors' rows (its own ``__getitem__``): every label, in memory, without reading
    ``len(data)`` samples. ``None`` for any other dataset."""
    tensors = getattr(data, "tensors", None)
    if (isinstance(data, torch.utils.data.TensorDataset)
            and type(data).__getitem__ is torch.utils.data.TensorDataset.__getitem__
            and isinstance(tensors, tuple) and len(tensors) == 2):
        return tensors[1]
    return None


def split_sample(item: Any, where: str, float_labels: bool = False) -> tuple[Any, torch.Tensor]:
    """One sample as ``(inputs, label)``: an ``(input, label)`` pair (the input a tensor, a
    tuple of tensors or a dict of tensors), or a dict whose ``labels``/``label`` key is the
    label and whose other keys are the model's keyword inputs. ``float_labels``: the dataset
    has a loss of its own, so targets need not be class indices (regression, soft labels)."""
    if isinstance(item, Mapping):
        key = next((k for k in LABEL_KEYS if k in item), None)
        if key is None:
            raise ValueError(
                f"{where} is a dict without a label (keys {sorted(item)[:6]}); add a "
                "'labels' (or 'label') entry, or return (inputs, label) pairs")
        x: Any = {k: _tensor(v, where, f"field {k!r}") for k, v in item.items() if k != key}
        y = item[key]
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        x, y = item
        if isinstance(x, Mapping):
            x = {k: _tensor(v, where, f"field {k!r}") for k, v in x.items()}
        elif isinstance(x, (tuple, list)):
            x = tuple(_tensor(v, where, f"input {i}") for i, v in enumerate(x))
        else:
            x = _tensor(x, where, "input")
    else:
        wrap = (" (tensors x and y: wrap them in torch.utils.data.TensorDataset(x, y))"
                if isinstance(item, torch.Tensor) else "")
        raise ValueError(
            f"{where} is a {type(item).__name__}, not an (input, label) pair or a dict with "
            f"'labels'; return (tensor, label) or {{'input_ids': ..., 'labels': ...}}{wrap}")
    y = _tensor(y, where, "label")
    if y.is_floating_point() and not float_labels:
        raise ValueError(f"{where}: its label is {y.dtype}; class labels must be integers "
                         "(class indices), or give the dataset a loss_fn(out, y) for other "
                         "targets")
    return x, (y if float_labels else class_labels(y))


def own_loss(*sources: Any) -> Any:
    """The ``loss_fn(out, y)`` of the first source that has one (the dataset, or a
    ``DataLoader``'s dataset): the adapter must carry it, or the job's loss silently falls
    back to cross-entropy."""
    for data in sources:
        loss = getattr(data, "loss_fn", None)
        if callable(loss):
            return loss
    return None


def target_classes(y: torch.Tensor, per_sample: bool) -> int:
    """``num_classes`` for float targets (a loss of the dataset's own): the target's width,
    1 for one value per sample. (Integer labels count classes by their largest value.)"""
    dims = y.dim() - (0 if per_sample else 1)
    return int(y.shape[-1]) if dims >= 1 else 1


def _tensor(v: Any, where: str, field: str) -> torch.Tensor:
    """``v`` as a tensor, or one line naming the sample's ``field`` that is not numbers (an
    HF-datasets row's ``text`` column beside its ``input_ids``, a str label): torch's own
    error ("new(): invalid data type 'str'") named neither the field nor the fix."""
    if isinstance(v, torch.Tensor):
        return v
    try:
        return torch.as_tensor(v)
    except (TypeError, ValueError, RuntimeError):
        text = isinstance(v, str) or (isinstance(v, (list, tuple)) and any(
            isinstance(e, str) for e in v))
        what = f"text ({_short(v)})" if text else f"a {type(v).__name__} ({_short(v)})"
        if field == "label":
            raise ValueError(
                f"{where}: its label is {what}, not a number; labels must be numbers (integer "
                "class indices): map each to one (HF datasets: "
                "dataset.class_encode_column('label'))") from None
        key = field.removeprefix("field ")
        drop = (f"drop it (HF datasets: dataset.remove_columns([{key}]))"
                if field.startswith("field ") else "drop it")
        raise ValueError(f"{where}: its {field} is {what}, not numbers a model can take; "
                         f"{drop} or convert it to numbers (tokenize text)") from None


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def classes_attribute(*sources: Any) -> int | None:
    """``num_classes`` (an int) or ``classes`` (a sequence) of the first source that has one."""
    for data in sources:
        for attr in ("num_classes", "classes"):
            value = getattr(data, attr, None)
            if isinstance(value, int):
                return value
            if value is not None and hasattr(value, "__len__"):
                return len(value)
    return None


def sample_facts(first: torch.Tensor) -> tuple[tuple[int, ...], str]:
    """``(input_shape, input_kind)`` from one sample's first input tensor."""
    kind = ("sequence" if not first.is_floating_point()
            else "image" if first.dim() == 3 else "vector")
    return tuple(first.shape), kind


def held_out_batches(held_out: Any, name: str, float_labels: bool,
                     batch_size: int = 1024, num_classes: int | None = None) -> Any:
    """The held-out set's ``(inputs, labels)`` batches, of either kind whatever the training
    set's: a map-style one's samples stacked ``batch_size`` at a time, an iterable's batches
    as they come. What the scorer reads (``eval_batches``): an empty set yields none, and
    the job's note says it is empty (joining no samples raised ``IndexError``), and a
    ``DataLoader`` beside a map-style training set was indexed as one ("not
    subscriptable"). Each batch's class labels are checked against ``num_classes``
    (:func:`check_labels`): a label above the classes was scored silently."""
    if not _map_style(held_out):
        for j, item in enumerate(held_out):
            x, y = split_sample(item, f"dataset {name!r}: held-out batch {j}", float_labels)
            if not float_labels:
                check_labels(y, num_classes, f"dataset {name!r}: held-out batch {j}")
            yield x, y
        return
    n = len(held_out)
    for lo in range(0, n, batch_size):
        pairs = [split_sample(held_out[j], f"dataset {name!r}: held-out item {j}",
                              float_labels) for j in range(lo, min(n, lo + batch_size))]
        try:
            x, y = inputs.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"dataset {name!r}: held-out set: {exc}".splitlines()[0]) from None
        if not float_labels:
            check_labels(y, num_classes, f"dataset {name!r}: held-out set", first_row=lo)
        yield x, y


def check_held_out(data: Any, held_out: Any) -> None:
    """Refuse, when the dataset is built, a held-out set its job cannot score: inputs of
    another shape or kind than the training set's (30 features beside 20), labels of another
    kind (float beside class indices), or labels that are not class indices of the training
    set's classes (all of them where they are in memory, a ``TensorDataset``'s; else each
    batch as it is scored). It was found after training, or never: a run trained fully and
    then said "not scored ... mat1 and mat2 shapes cannot be multiplied", and labels above
    the classes were scored. ``data``: the adapted training set (its ``input_shape``,
    ``input_kind``, ``num_classes``, ``_float_labels``); its first sample's facts are read
    from the held-out set's first item (a map-style set) or batch (an iterable), whose
    label :func:`split_sample` refuses if it is float where class indices are needed."""
    name, float_labels = data.name, data._float_labels
    where = f"dataset {name!r}: held-out set"
    if _map_style(held_out):
        if not len(held_out):
            return  # scored as empty (its note says so)
        x, _ = split_sample(held_out[0], f"{where}: item 0", float_labels)
    else:
        first = next(iter(held_out), None)
        if first is None:
            return
        x, _ = split_sample(first, f"{where}: batch 0", float_labels)
        x = inputs.tensors(x)[0][0] if inputs.tensors(x) else x  # its first sample
    found = inputs.tensors(x)
    if found:
        shape, kind = sample_facts(found[0])
        same = shape == tuple(data.input_shape) or (
            kind == "sequence" == data.input_kind and len(shape) == len(data.input_shape))
        if not same or (kind == "sequence") != (data.input_kind == "sequence"):
            raise ValueError(
                f"{where}: its inputs are {shape} {found[0].dtype} per sample but the training "
                f"set's are {tuple(data.input_shape)} ({data.input_kind}); give the held-out "
                "set the training set's input shape and dtype (the model takes those)")
    labels = tensor_labels(held_out)
    if labels is not None and not float_labels:
        check_labels(labels, data.num_classes, where)


class MapStyleDataset:
    """The batch protocol over a map-style dataset of samples (:func:`split_sample`)."""

    def __init__(self, train: Any, held_out: Any | None, *, name: str, seed: int) -> None:
        self.name, self.seed = name, seed
        self._train, self._held_out = train, held_out
        self.n_train = len(train)
        if self.n_train == 0:
            raise ValueError(f"dataset {name!r}: its training set is empty (len 0); return a "
                             "dataset with at least one batch of samples")
        loss = own_loss(train)
        if loss is not None:
            self.loss_fn = loss
        self._float_labels = loss is not None
        x, y = self._sample(train, 0)
        self.input_shape, self.input_kind = sample_facts(inputs.tensors(x)[0])
        self.vocab_size = getattr(train, "vocab_size", None)
        self.num_classes = classes_attribute(train) or (
            target_classes(y, per_sample=True) if y.is_floating_point()
            else self._max_label(train) + 1)
        self._checked = False
        """Every training label was checked when the dataset was built (else each batch's
        are, as it is read)."""
        labels = tensor_labels(train)
        if labels is not None and not self._float_labels:
            check_labels(labels, self.num_classes, f"dataset {name!r}: training set")
            self._checked = True
        if held_out is not None:  # only then has it a held-out set: runs score it
            check_held_out(self, held_out)
            self.eval_batches = self._eval_batches
            if _map_style(held_out) and len(held_out):
                self.eval_set = self._eval_set

    def __repr__(self) -> str:
        return (f"MapStyleDataset(name={self.name!r}, n_train={self.n_train}, input_shape="
                f"{self.input_shape}, num_classes={self.num_classes})")

    def _sample(self, data: Any, j: int) -> tuple[Any, torch.Tensor]:
        return split_sample(data[j], f"dataset {self.name!r}: item {j}", self._float_labels)

    def _max_label(self, data: Any) -> int:
        """The largest label, over every sample (each checked: no negative but -100)."""
        top = 0
        for j in range(len(data)):
            y = self._sample(data, j)[1]
            low, high = int(y.min()), int(y.max())
            if low < 0:  # y[None]: one sample's labels are one row
                check_labels(y[None], None, f"dataset {self.name!r}: training set", first_row=j)
            top = max(top, high)
        self._checked = True
        return top

    def _stack(self, data: Any, rows: list[int]) -> tuple[Any, torch.Tensor]:
        pairs = [self._sample(data, j) for j in rows]
        try:
            return inputs.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"dataset {self.name!r}: {exc}".splitlines()[0]) from None

    def batch(self, index: int, batch_size: int) -> tuple[Any, torch.Tensor]:
        """The ``index``-th training batch: a pure function of (seed, index, batch_size)."""
        rows = batch_rows(self.seed, self.n_train, index, batch_size).tolist()
        x, y = self._stack(self._train, rows)
        if not (self._checked or self._float_labels):
            check_labels(y, self.num_classes, f"dataset {self.name!r}: training set",
                         rows=rows)
        return x, y

    def _eval_set(self) -> tuple[Any, torch.Tensor]:
        x, y = self._stack(self._held_out, list(range(len(self._held_out))))
        if not self._float_labels:
            check_labels(y, self.num_classes, f"dataset {self.name!r}: held-out set")
        return x, y

    def _eval_batches(self, batch_size: int = 1024) -> Any:
        return held_out_batches(self._held_out, self.name, self._float_labels, batch_size,
                                self.num_classes)



class IterableBatches:
    """The batch protocol over an iterable of ready-made batches (a ``DataLoader``; a list
    counts as a map-style dataset of samples, not as batches):
    batch ``i`` is the iterable's ``i``-th batch, counting on into the next pass when one
    ends, so it must yield the same batches in the same order every pass (a ``DataLoader``
    with ``shuffle=False``; a shuffling one is refused). A pass is read
    again from its start only when a batch before the last one read is asked for (a resumed
    or restarted job); the last few batches are kept, so the step's and a probe's reads of
    one batch cost one read. A batch with fewer rows than the job's ``batch_size`` (a
    ``DataLoader``'s last, without ``drop_last``) ends the pass and is not trained on."""

    KEEP = 4
    """Batches kept for repeated reads."""

    def __init__(self, train: Any, held_out: Any | None, *, name: str, seed: int) -> None:
        if iter(train) is train:
            raise ValueError(
                f"dataset {name!r} returned a one-pass iterator ({type(train).__name__}); a "
                "job reads its batches again on resume and on every rank: return a "
                "re-iterable (a DataLoader, or an object whose __iter__ starts a new pass)")
        self.name, self.seed = name, seed
        self._train, self._held_out = train, held_out
        loss = own_loss(train, getattr(train, "dataset", None))
        if loss is not None:
            self.loss_fn = loss
        self._float_labels = loss is not None
        self._iter: Any = None
        self._next = 0  # index of the batch self._iter yields next
        self._pass_length: int | None = None
        self._kept: dict[int, tuple[Any, torch.Tensor]] = {}
        try:
            first = self._read(0)
        except IndexError:
            raise ValueError(
                f"dataset {name!r}: its training iterable yields no batch (an empty "
                "DataLoader?); give it at least one batch of samples") from None
        x, y = first
        if y.dim() == 0:  # a label per item: the iterable yields samples, not batches
            raise ValueError(
                f"dataset {name!r} is an iterable (read as batches) but yields single "
                f"samples (item 0: input {inputs.describe(x)}, a 0-d label); an iterable must "
                "yield batches: wrap it in torch.utils.data.DataLoader(dataset, batch_size=...)")
        self._check_same_order(first)
        self.batch_rows = len(y)
        self.input_shape, self.input_kind = sample_facts(inputs.tensors(x)[0][0])
        self.vocab_size = getattr(train, "vocab_size", None)
        dataset = getattr(train, "dataset", None)
        self.num_classes = classes_attribute(train, dataset) or (
            target_classes(y, per_sample=False) if y.is_floating_point()
            else self._max_label() + 1)
        if held_out is not None:
            check_held_out(self, held_out)
            self.eval_batches = self._eval_batches
            if not _map_style(held_out):
                self.eval_set = self._eval_set

    def __repr__(self) -> str:
        return (f"IterableBatches(name={self.name!r}, batch_rows={self.batch_rows}, "
                f"input_shape={self.input_shape}, num_classes={self.num_classes})")

    def _check_same_order(self, first: tuple[Any, torch.Tensor]) -> None:
        """Refuse an iterable whose passes come in different orders (``shuffle=True``, with or
        without a seeded generator: each pass draws a new permutation). Batch ``i`` of a
        later pass would be read from whichever pass a rank, a resumed job or the batches
        kept for repeated reads happen to hold, so one pass could train some samples twice
        and others never. The labels of two passes' first batches tell: per-sample randomness
        (augmentation) leaves them alone."""
        again = self._pair(next(iter(self._train)), 0)
        if again[1].shape != first[1].shape or not torch.equal(again[1], first[1]):
            raise ValueError(
                f"dataset {self.name!r} yields its batches in a different order on each pass "
                "(a DataLoader with shuffle=True?), and every rank and a resumed job read "
                "them again; give it shuffle=False, or return its dataset (map-style), which "
                "accelopt shuffles every epoch with the job's seed")

    def _pair(self, item: Any, index: int) -> tuple[Any, torch.Tensor]:
        return split_sample(item, f"dataset {self.name!r}: batch {index}", self._float_labels)

    def _restart(self) -> None:
        self._iter, self._next = iter(self._train), 0

    def _read(self, index: int) -> tuple[Any, torch.Tensor]:
        """Batch ``index`` of one pass (``index`` < the pass length)."""
        if index in self._kept:
            return self._kept[index]
        if self._iter is None or index < self._next:
            self._restart()
        while True:
            try:
                item = next(self._iter)
            except StopIteration:
                self._pass_length = self._next
                if index >= self._next:
                    raise IndexError(index) from None
                self._restart()
                continue
            at = self._next
            self._next += 1
            if at == index:
                pair = self._pair(item, at)
                self._kept[at] = pair
                if len(self._kept) > self.KEEP:
                    del self._kept[min(self._kept)]
                return pair

    def _max_label(self) -> int:
        """The largest label over one pass, which also counts the pass's full batches (so
        :meth:`_length` need not walk it again)."""
        top, full, short_seen = 0, 0, False
        for j, item in enumerate(self._train):
            y = self._pair(item, j)[1]
            if not self._float_labels:
                check_labels(y, None, f"dataset {self.name!r}: batch {j}")
            top = max(top, int(y.max()))
            short_seen = short_seen or len(y) < self.batch_rows
            full += 0 if short_seen else 1
        if self._pass_length is None:
            self._pass_length = full
        return top

    def _length(self, batch_size: int) -> int:
        """Full batches per pass (the first short batch ends a pass)."""
        if self._pass_length is None:
            n = 0
            for item in self._train:
                if len(self._pair(item, n)[1]) < batch_size:
                    break
                n += 1
            self._pass_length = n
        if self._pass_length == 0:
            raise ValueError(
                f"dataset {self.name!r}: no batch of {batch_size} rows (its batches have "
                f"{self.batch_rows}); set the job's batch_size to {self.batch_rows}")
        return self._pass_length

    def batch(self, index: int, batch_size: int) -> tuple[Any, torch.Tensor]:
        """Batch ``index`` (wrapping into further passes); its rows must be ``batch_size``."""
        if batch_size != self.batch_rows:
            raise ValueError(
                f"dataset {self.name!r} yields batches of {self.batch_rows} rows but the job's "
                f"batch_size is {batch_size}; set batch_size={self.batch_rows} (the iterable "
                "decides the batch size)")
        at = index % self._length(batch_size)
        x, y = self._read(at)
        if not self._float_labels:  # one min and max: its labels cannot be read up front
            check_labels(y, self.num_classes, f"dataset {self.name!r}: batch {at}")
        return x, y

    def _eval_set(self) -> tuple[Any, torch.Tensor]:
        pairs = [self._pair(item, j) for j, item in enumerate(self._held_out)]
        if not pairs:
            raise ValueError(f"dataset {self.name!r}: the held-out iterable yields no batch")
        y = torch.cat([y for _, y in pairs])
        if not self._float_labels:
            check_labels(y, self.num_classes, f"dataset {self.name!r}: held-out set")
        return inputs.concat([x for x, _ in pairs]), y

    def _eval_batches(self, batch_size: int = 1024) -> Any:
        return held_out_batches(self._held_out, self.name, self._float_labels, batch_size,
                                self.num_classes)
