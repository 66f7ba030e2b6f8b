"""What a job learned: its trained model scored on its dataset's held-out set.

A speed-up that costs quality is not a gain, so every run reports, per training job, the
top-1 precision of the final model on the held-out set (``Dataset.eval_set()``, or the
dataset's own ``eval_batches``): accuracy for single-label data, precision@1 (P@1) for
multi-label data (labels ``[B, M]`` padded with -1, the extreme-classification convention).
A dataset with a metric of its own scores the model itself (``evaluate_model(model)``:
``workload=lm``'s held-out perplexity). A model that computes its own loss (``loss: model``)
is called as its job calls it, ``model(x, labels=y)``, and scored from its output's logits;
one whose logits are per token (``[batch, positions, vocabulary]``: a causal LM, an
encoder-decoder such as T5 or BART, which makes its decoder's inputs from the labels) is
scored by its own held-out loss instead, as held-out perplexity (``exp`` of the mean loss):
top-1 over ``[batch, classes]`` does not apply to it.
Scored after the job's last iteration, in eval mode without gradients, outside its timed
work (JCT, makespan and iteration times do not include it). A ``-inf`` score is a class not
scored (a sampled output layer's LSH inference leaves its unretrieved classes so); nan and
``+inf`` are refused. A point without a label (-100, PyTorch cross-entropy's
``ignore_index``, where one class id is given; no id >= 0 in a label set) is not scored nor
counted, as training skips it; a held-out set with no labelled point is not scored (a note).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from accelopt.errors import error_text
from accelopt.job import inputs
from accelopt.job.job import logits_of, loss_convention, loss_positions, own_loss
from accelopt.records import CANNOT_SCORE, JobResult, Quality

EVAL_BATCH = 1024
EMPTY_HELD_OUT = "its held-out set is empty"
IGNORE_INDEX = -100
"""A single-label held-out point labelled so has nothing to predict (as in training)."""
NONE_LABELLED = ("not scored: no point of its held-out set is labelled (every label is "
                 f"{IGNORE_INDEX}, or every label set holds no class id >= 0)")


class EmptyHeldOut(ValueError):
    """The dataset has a held-out set with no points: nothing to score, as with no held-out
    set at all (a note, not a failure). Scoring none gave ``nan`` over 0 points, or an
    adapter's ``IndexError`` read as "cannot score"."""


class NoneLabelled(EmptyHeldOut):
    """The held-out set has points but none with a label: nothing to score either (a note
    saying so). Scored, every point was a miss: an accuracy of 0.000 over points that
    have no answer."""


def labelled(labels: torch.Tensor) -> torch.Tensor:
    """Per point: whether it has a label to score against. One class id per point
    (``[B]``): not :data:`IGNORE_INDEX`, the label training's cross-entropy skips. A label
    set (``[B, M]``, padded with -1): some id >= 0. Why: such points counted as misses, so
    a held-out set with half its points unlabelled scored half its accuracy."""
    if labels.dim() <= 1:
        return labels != IGNORE_INDEX
    return (labels.reshape(len(labels), -1) >= 0).any(dim=1)


def hits_at_1(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per point: 1.0 if the arg-max class is among its labels (``[B]`` class ids, or ``[B, M]``
    label sets padded with -1), else 0.0. A ``-inf`` score is no prediction (a row of them
    all scores 0.0, whatever argmax picks)."""
    best = logits.max(dim=1)
    labels = labels.reshape(len(labels), -1)
    hit = (labels == best.indices[:, None]).any(dim=1) & (best.values > -torch.inf)
    return hit.to(torch.float64)


def hits_at_5(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per point: the share of its five best-scored classes that are among its labels
    (``[B, M]`` label sets padded with -1; fewer than five classes: all of them)."""
    k = min(5, logits.shape[1])
    top = logits.topk(k, dim=1)
    labels = labels.reshape(len(labels), -1)
    hit = (top.indices[:, :, None] == labels[:, None, :]).any(dim=2) & (top.values > -torch.inf)
    return hit.to(torch.float64).sum(1) / k


def eval_batches(dataset: object, batch_size: int = EVAL_BATCH
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]] | None:
    """The dataset's held-out set in batches (its own ``eval_batches`` when it has one);
    None when it has no held-out set."""
    own = getattr(dataset, "eval_batches", None)
    if callable(own):
        return iter(own(batch_size))
    held_out = getattr(dataset, "eval_set", None)
    if not callable(held_out):
        return None
    x, y = held_out()

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for lo in range(0, len(y), batch_size):
            yield inputs.slice_rows(x, lo, lo + batch_size), y[lo:lo + batch_size]

    return batches()


def score(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
          device: torch.device | None = None,
          with_labels: bool = False) -> tuple[float, int, bool, float, int]:
    """(top-1 precision, points scored, multi-label, precision@5, scores per point) of
    ``model`` over ``batches`` (eval mode, no gradients; the model's train/eval mode is
    restored afterwards). Points without a label (:func:`labelled`) are left out;
    :class:`NoneLabelled` if the batches hold points but none with a label.
    ``with_labels``: the model is called with ``labels=y`` (``loss: model``, as its job's
    step calls it); the labels reach the score only through the logits the model makes."""
    was_training = model.training
    model.eval()
    hits, hits5, n, multi, width = 0.0, 0.0, 0, False, 0
    seen = 0
    try:
        with torch.no_grad():
            for x, y in batches:
                if device is not None:
                    x, y = inputs.to_device(x, device), y.to(device)
                logits = logits_of(inputs.call(model, x, **({"labels": y} if with_labels
                                                             else {})))
                if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
                    raise ValueError(
                        f"the model's output is {_shape(logits)}, not [batch, classes] "
                        "logits; top-1 needs one score per class")
                if y.is_floating_point():
                    raise ValueError(
                        f"its held-out labels are {y.dtype} (regression or soft targets), not "
                        "class ids; give the dataset an evaluate_model(model) for a metric of "
                        "its own")
                _check_scores(logits)
                multi = multi or y.dim() > 1
                width = int(logits.shape[1])
                seen += len(y)
                keep = labelled(y)
                if not bool(keep.all()):
                    if not bool(keep.any()):
                        continue
                    logits, y = logits[keep], y[keep]
                hits += float(hits_at_1(logits, y).sum())
                if multi:
                    hits5 += float(hits_at_5(logits, y).sum())
                n += len(y)
    finally:
        model.train(was_training)
    if seen and not n:
        raise NoneLabelled(NONE_LABELLED)
    nan = float("nan")
    return (hits / n if n else nan), n, multi, (hits5 / n if n else nan), width


def evaluate(model: torch.nn.Module, dataset: object, device: torch.device | None = None,
             with_labels: bool = False) -> Quality | None:
    """The model's held-out top-1 on ``dataset``; None if the dataset has no held-out set,
    :class:`EmptyHeldOut` if it has an empty one (:class:`NoneLabelled`: no point
    labelled). A model or dataset this cannot score raises ``ValueError`` in one line.
    ``with_labels``: the model computes its own loss and is called with ``labels=``, as its
    job's step calls it (:func:`score`)."""
    own = getattr(dataset, "evaluate_model", None)
    if callable(own):  # a dataset with a metric of its own (a language model's perplexity)
        return own(model)  # type: ignore[no-any-return]
    batches = eval_batches(dataset)
    if batches is None:
        return None
    if with_labels:
        first = next(batches, None)
        batches = itertools.chain([] if first is None else [first], batches)
        if first is not None and _scores_tokens(model, first, device):
            return own_loss_perplexity(model, batches, device)
    value, n, multi, p5, width = score(model, batches, device, with_labels)
    if n == 0:
        raise EmptyHeldOut(EMPTY_HELD_OUT)
    classes = getattr(dataset, "num_classes", None)
    note = ""
    if isinstance(classes, int) and classes > 0 and width and width != classes:
        # trains without an error (cross-entropy takes a wider head; a narrower one fails):
        # the usual cause is a library model left at its default, 1,000 classes for 10
        note = (f"the model gives {width} scores per point for the dataset's {classes} "
                f"classes: its output layer does not match the labels (num_classes of its "
                f"factory?); scored as it is")
    return Quality(metric="p_at_1" if multi else "accuracy", value=value, samples=n,
                   p_at_5=p5 if multi else None, note=note)


def _scores_tokens(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                   device: torch.device | None) -> bool:
    """Whether a ``loss: model`` model is a sequence model that computes its own loss: its
    logits per token (three or more dimensions) beside a loss tensor. Such a model is scored
    by that loss (:func:`own_loss_perplexity`); it was reported "cannot score" before, for
    logits that are not ``[batch, classes]``."""
    x, y = batch
    if device is not None:
        x, y = inputs.to_device(x, device), y.to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = inputs.call(model, x, labels=y)
    finally:
        model.train(was_training)
    logits = logits_of(out)
    return (isinstance(logits, torch.Tensor) and logits.dim() > 2
            and own_loss(out) is not None)


def own_loss_perplexity(model: torch.nn.Module,
                        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                        device: torch.device | None = None) -> Quality:
    """Held-out perplexity of a sequence model that computes its own loss: ``exp`` of its
    loss (``model(x, labels=y).loss``, as its job's step calls it) over the held-out
    batches, each batch's mean loss weighted by the positions it is a mean over (labels
    other than :data:`IGNORE_INDEX`, shifted by one for a causal LM: ``loss_convention``;
    by rows where the convention is not known). One batch (up to :data:`EVAL_BATCH` rows)
    is the model's loss exactly. A nan or inf loss is refused (no perplexity)."""
    convention = loss_convention(model)
    was_training = model.training
    model.eval()
    total, positions, rows, batches_scored = 0.0, 0, 0, 0
    try:
        with torch.no_grad():
            for x, y in batches:
                if device is not None:
                    x, y = inputs.to_device(x, device), y.to(device)
                count = int(loss_positions(y, convention).sum())
                rows += len(y)
                if count == 0:
                    continue
                loss = own_loss(inputs.call(model, x, labels=y))
                if loss is None or loss.numel() != 1:
                    raise ValueError("the model's output has no scalar loss for its held-out "
                                     "batch; a per-token model is scored by its own loss")
                value = float(loss)
                if not math.isfinite(value):
                    raise ValueError(f"the model's held-out loss is {value}: no perplexity")
                total += value * count
                positions += count
                batches_scored += 1
    finally:
        model.train(was_training)
    if rows and not positions:
        raise NoneLabelled(NONE_LABELLED)
    if not positions:
        raise EmptyHeldOut(EMPTY_HELD_OUT)
    note = "a sequence model (per-token logits): scored by its own held-out loss, as perplexity"
    if convention is None and batches_scored > 1:
        note += (f" (its {batches_scored} batches weighted by their labelled positions: the "
                 "model names no loss convention, so a loss over shifted labels is weighted "
                 "as over its labels; a transformers loss_type, e.g. 'ForCausalLM', tells it)")
    return Quality(metric="perplexity", value=math.exp(total / positions), samples=rows,
                   note=note)


def _check_scores(logits: torch.Tensor) -> None:
    """Refuse nan and +inf scores (an argmax over them is no prediction). ``-inf`` is a
    class not scored, as a sampled output layer's LSH inference marks the neurons it did
    not retrieve; held-out scoring refused those models ("not finite") before."""
    if bool(torch.isnan(logits).any()) or bool((logits == torch.inf).any()):
        raise ValueError("the model's outputs are not finite (nan or +inf): an argmax over "
                         "them is no prediction")


def _shape(out: Any) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    return f"a {type(out).__name__}"


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether ``model``'s trained weights are finite: every parameter finite, and no buffer
    (batch norm's running statistics) nan. A job whose weights are not has diverged,
    whatever its last losses said (a nan gradient in its last step left a finite loss).
    A buffer may hold ``-inf`` by design (an attention mask added to the scores), so only
    nan counts there."""
    def floating(t: torch.Tensor) -> bool:
        return t.is_floating_point() or t.is_complex()

    return (all(bool(torch.isfinite(p).all()) for p in model.parameters() if floating(p))
            and not any(bool(torch.isnan(b).any()) for b in model.buffers() if floating(b)))


def score_result(result: JobResult, spec: Any, model: torch.nn.Module | None, dataset: object,
                 device: torch.device | None = None) -> None:
    """Set ``result.quality`` (or ``result.quality_note``, saying why not) for a job that
    ran: scored only when it trained to the end, asks for it (``evaluate``), and its data
    has a held-out set. Never raises: a model this cannot score gets a one-line note. A
    ``loss: model`` job's model is called with the labels, as its step calls it.

    A finished training job's weights are checked first (``result.weights_finite``), with or
    without ``evaluate``: they decide whether it diverged (``JobResult.diverged_at``), so a
    job whose losses were not finite for a step and then finite again (a skipped step, a
    batch with no labelled point) is scored, with a note saying so, and one left with nan
    weights by its last step is not reported done well."""
    if result.status == "done" and spec.kind == "train" and model is not None:
        try:
            result.weights_finite = weights_finite(model)
        except Exception:  # noqa: BLE001 - a state this cannot read: not known, as before
            result.weights_finite = None
    _score(result, spec, model, dataset, device)
    note = result.nonfinite_note if result.status == "done" else ""
    if note:
        result.quality_note = "; ".join(filter(None, (result.quality_note, note)))


def _score(result: JobResult, spec: Any, model: torch.nn.Module | None, dataset: object,
           device: torch.device | None) -> None:
    if not getattr(spec, "evaluate", True):
        result.quality_note = "evaluate: false"
    elif spec.kind != "train":
        result.quality_note = "an inference job (nothing trained)"
    elif result.status != "done":
        result.quality_note = f"the job did not finish ({result.status})"
    elif result.diverged_at is not None:  # before the weights' absence: the reason that counts
        what = "loss" if result.diverged_at < len(result.losses) else "job"
        result.quality_note = f"not scored: the {what} diverged ({result.diverged_where})"
    elif model is None:
        result.quality_note = "its trained weights are not in this process"
    else:
        try:
            result.quality = evaluate(model, dataset, device,
                                      with_labels=getattr(spec, "loss", "auto") == "model")
        except EmptyHeldOut as exc:
            result.quality_note = str(exc) or EMPTY_HELD_OUT
            return
        except Exception as exc:  # noqa: BLE001 - a plugin's model may not score: say so
            result.quality_note = f"{CANNOT_SCORE}: {error_text(exc)}"[:300]
            return
        if result.quality is None:
            result.quality_note = "its dataset has no held-out set"
        else:
            result.quality_note = result.quality.note
