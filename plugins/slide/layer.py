"""SLIDE layers as torch modules: the LSH-sampled wide output layer and the sparse-input layer.

Why buffers, not parameters: the weights of both layers are updated by this module's own
sparse Adam (only the rows a batch used), so they must be invisible to the job's dense
torch optimizer, which would otherwise touch every row each step (the pitfall of the
original code). As buffers they still count in the job's memory profile, travel with
``state_dict`` (checkpoint/resume) and follow ``deepcopy``. Gradients are not buffers: they
live only within a step, packed by row (:mod:`accelopt_plugins.slide.rowgrads`). A weight
tied to another module's Parameter (an input embedding) is that Parameter's storage, not a
copy (``tied_to``): the job's optimizer then updates the same rows from the input side.

Training forward of :class:`SlideLinear` returns a :class:`SlideLogits`: the active set needs
the true labels, which only the loss sees, so the logits are computed when the job calls
``loss_against(y)`` (the core's generic hook for outputs that compute their own loss). The
weight update happens inside backward, right after the input gradient is computed from the
pre-update weights, which is what a separate optimizer step would do.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any, ClassVar

import numba
import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from accelopt_plugins.slide import kernels
from accelopt_plugins.slide.config import SlideConfig
from accelopt_plugins.slide.hashing import FAMILIES, _keys_dense_par, make_family, pack_sign_keys
from accelopt_plugins.slide.rowgrads import RowGradients
from accelopt_plugins.slide.tables import INSERTIONS, RebuildSchedule, build_tables
from accelopt_plugins.slide.xcmodel import first_occurrences
from torch import nn

from accelopt.errors import UserError

SAMPLING_MODE = {"union": kernels.UNION, "threshold": kernels.THRESHOLD, "topk": kernels.TOPK,
                 "random": kernels.UNION}
"""``random`` is the ablation baseline: no table lookups, labels plus uniform random neurons."""
PHASES = ("hash", "forward", "backward", "optimizer", "rebuild")


def check_finite(t: torch.Tensor, what: str) -> None:
    """Reject NaN/inf early with the row that holds it (a NaN would silently poison Adam).
    numpy's isfinite on the tensor's memory: ~10x cheaper per step than torch's for these
    small batches (dispatch costs more than the check)."""
    a = t.detach().numpy()
    ok = np.isfinite(a)
    if not ok.all():
        row = int(np.flatnonzero(~ok.reshape(a.shape[0], -1).all(1))[0])
        raise ValueError(f"slide: {what} contains NaN or inf (batch row {row}); clean the data")


def as_hidden(h: torch.Tensor, features: int) -> torch.Tensor:
    """The output layer's input as float32 [..., features], or a one-line refusal. Why: the
    numba kernels read each row as exactly ``features`` float32 values of CPU memory, so a
    wrong width would be read out of bounds and an integer tensor reinterpreted; a float16,
    bfloat16 or float64 input (autocast, a double model) is converted, and autograd carries
    the gradient back to its own dtype."""
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"slide: the SLIDE output layer takes a tensor, got {type(h).__name__}")
    if not h.is_floating_point():
        raise ValueError(f"slide: the input of the SLIDE output layer must be floating point "
                         f"(hidden activations), got {h.dtype}")
    if h.dim() == 0 or h.shape[-1] != features:
        raise ValueError(f"slide: the input of the SLIDE output layer has shape "
                         f"{tuple(h.shape)}; its last dimension must be the replaced Linear's "
                         f"{features} in_features")
    if h.device.type != "cpu":
        raise ValueError(f"slide: the input of the SLIDE output layer is on {h.device}; "
                         "SLIDE's kernels run on the CPU (run.device=cpu)")
    return h if h.dtype == torch.float32 else h.float()


def check_label_dtype(y: torch.Tensor) -> None:
    """Targets are integer label ids: a float target (soft labels, or ids stored as floats)
    would be truncated silently by the int64 conversion the kernels need."""
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"slide: targets must be integer label ids, got {y.dtype}")


def align_targets(h: torch.Tensor, y: torch.Tensor, *, multi: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of hidden states [R, d] and their targets [R] (or [R, M] padded with -1), from
    h [..., d] and y [...] (or [..., M]): a sequence model's [B, T, d] states flatten with
    their [B, T] targets. Anything else is refused in one line, because the kernels read
    sample b's labels at row b of the targets: a shorter target would be read past its end
    (a crash), a longer one silently misassigned. ``multi``: a padded label matrix is
    allowed (``loss_against``; cross-entropy takes one class id per row)."""
    if not isinstance(y, torch.Tensor):
        y = torch.as_tensor(y)
    check_label_dtype(y)
    lead, d = tuple(h.shape[:-1]), h.shape[-1]
    if tuple(y.shape) == lead:
        return h.reshape(-1, d), y.reshape(-1)
    if multi and y.dim() == h.dim() and tuple(y.shape[:-1]) == lead:
        return h.reshape(-1, d), y.reshape(-1, y.shape[-1])
    dims = ", ".join(map(str, lead))
    shapes = f"[{dims}]" + (f" or a padded label matrix [{dims}, M]" if multi else "")
    raise ValueError(f"slide: targets of shape {list(y.shape)} do not line up with the "
                     f"output layer's input rows {list(h.shape)}: give one label id per "
                     f"row, {shapes}")


def unshareable(weight: torch.Tensor) -> str | None:
    """Why a tied weight cannot be SLIDE's own weight storage (``None``: it can). The
    kernels update rows in place through numpy, which needs contiguous float32 CPU memory."""
    if weight.dtype != torch.float32:
        return f"it is {str(weight.dtype).removeprefix('torch.')}, SLIDE keeps float32 rows"
    if weight.device.type != "cpu":
        return f"it is on {weight.device}, SLIDE's rows live in CPU memory"
    if not weight.is_contiguous():
        return "it is not contiguous, SLIDE updates rows of contiguous memory"
    return None


def auto_range_pow(n: int, code_bits: int) -> int:
    """About 16 neurons per bucket on average, at least 2**4 and at most the code's bits."""
    return int(max(4, min(code_bits, 20, round(math.log2(max(n / 16, 1))))))


def adam_global_t(cfg: SlideConfig, t: int) -> int:
    """The sparse Adam's ``global_t`` argument: the layer's step count (1-based) under global
    bias correction, 0 (each row's own count) under ``adam_correction=row``."""
    return t if cfg.adam_correction == "global" else 0


def set_threads(threads: int) -> None:
    if threads:
        numba.set_num_threads(min(int(threads), numba.config.NUMBA_NUM_THREADS))


class SampledLogitsError(UserError, TypeError):
    """An operation on sampled logits other than cross-entropy: a user error (its one line
    is the job's status, not blamed on the model's inputs) that is still a ``TypeError``."""


class SampledTargetError(UserError, ValueError):
    """Targets the sampled cross-entropy cannot take where dense cross-entropy would refuse
    them too (a class id out of range, a sequence's per-token logits): a user error (its one
    line is the job's status) that is still a ``ValueError``."""


SEQUENCE_LOGITS = ("a sequence model's per-token logits; let the model compute its loss "
                   "(loss=model, called with labels=) or give the dataset a loss_fn")
"""Why the default loss refuses [B, T, V] logits, in the dense job's words (the core's
``job_loss`` refuses a dense model's per-token logits with this reason)."""


def check_class_ids(y: torch.Tensor, n: int, ignore_index: int) -> None:
    """Refuse a class id outside ``[0, n)`` that is not ``ignore_index``, as dense
    ``F.cross_entropy`` does ("Target -1 is out of bounds"). Why: the label matrix of the
    multi-label loss reads -1 as padding, so a -1 class id became a row with no label,
    counted in the mean at loss 0, where a dense run refused it."""
    bad = (y != ignore_index) & ((y < 0) | (y >= n))
    if bool(bad.any()):
        raise SampledTargetError(
            f"slide: label ids must be in [0, {n}) for cross-entropy, got "
            f"{int(y[bad][0])} (dense cross-entropy refuses it too); give class ids, or "
            f"mark rows to skip with ignore_index={ignore_index}")


class SampledLogitsAttributeError(SampledLogitsError, AttributeError):
    """A tensor method asked of sampled logits (``out.argmax(-1)``): an ``AttributeError``
    too, so that ``getattr(out, name, default)`` and ``hasattr`` still answer."""


SAMPLED_ONLY_CE = ("in training it is sampled logits, of which only F.cross_entropy (or "
                   "nn.CrossEntropyLoss, without weight or label_smoothing) is defined")
"""What a refused operation on :class:`SlideLogits` is told, before its fixes."""

REFUSAL_FIXES = ("compute other metrics in eval mode (model.eval(): dense logits), or keep "
                 "this layer dense (plugins.slide.min_width above its width)")


def refused(what: str, error: type[SampledLogitsError] = SampledLogitsError
            ) -> SampledLogitsError:
    """The one-line refusal of ``what`` on the wide output layer's training output. Why one
    line and not a silent stand-in: a dataset's own loss (label smoothing, class weights,
    a softmax of its own) needs every logit, and the sampled cross-entropy in its place
    trained a different loss while the run reported success."""
    return error(f"slide: {what} on the wide output layer's training output: "
                 f"{SAMPLED_ONLY_CE}; {REFUSAL_FIXES}")


def _refuse_operator(name: str, symbol: str) -> Any:
    """A method for operator ``name`` that refuses it (see :data:`REFUSED_OPERATORS`)."""
    def op(self: SlideLogits, *_: Any) -> Any:
        raise refused(f"the operator {symbol}")
    op.__name__ = name
    return op


class SlideLogits:
    """The training output of :class:`SlideLinear`: hidden activations waiting for targets.

    It stands where the logits would, so the code between a model's output layer and its
    loss keeps working: ``float()``, ``view``/``reshape`` to ``[-1, out_features]`` (a
    sequence model's ``[batch, time, d]`` activations become rows) and ``F.cross_entropy``
    with ``ignore_index`` (HF transformers' causal-LM loss: padded positions are dropped
    before sampling) and ``reduction`` mean or sum. Anything that needs the full rows of
    scores is refused, naming eval mode, where the layer returns dense logits."""

    def __init__(self, layer: SlideLinear, h: torch.Tensor) -> None:
        self.layer = layer
        self.h = h
        self.shape = (*h.shape[:-1], layer.out_features)

    @property
    def device(self) -> torch.device:
        return self.h.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # the layer's arithmetic

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        return torch.Size(self.shape) if dim is None else self.shape[dim]

    def float(self) -> SlideLogits:
        return self  # the activations are float32 already; the layer computes in float32

    def contiguous(self) -> SlideLogits:
        return self

    def view(self, *shape: Any) -> SlideLogits:
        """Rows of activations: only a reshape that keeps the class dimension last."""
        dims = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) \
            else shape
        if not dims or dims[-1] not in (-1, self.layer.out_features):
            raise TypeError(
                f"slide: view{dims} of the sampled output layer's training output: only "
                f"shapes ending in its {self.layer.out_features} classes are defined")
        return SlideLogits(self.layer, self.h.reshape(*dims[:-1], self.h.shape[-1]))

    reshape = view

    def __getitem__(self, index: Any) -> Any:
        """Refused like every other operation but cross-entropy: indexing went to Python's
        ``'SlideLogits' object is not subscriptable``, which the run blamed on the model's
        inputs."""
        raise refused(f"indexing [{index!r}]")

    def __getattr__(self, name: str) -> Any:
        """Only called for attributes the class lacks: a tensor method (``out.argmax``,
        ``out.log_softmax``) is refused in one line, not Python's "'SlideLogits' object has
        no attribute". Protocol probes (dunder names) get a plain ``AttributeError``."""
        if name.startswith("__"):
            raise AttributeError(name)
        raise refused(f".{name}", SampledLogitsAttributeError)

    _CE_DEFAULTS = {"weight": None, "size_average": None, "ignore_index": -100,
                    "reduce": None, "reduction": "mean", "label_smoothing": 0.0}

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        """``F.cross_entropy(out, y)`` (and ``nn.CrossEntropyLoss``) on this output is
        :meth:`loss_against` over the rows whose target is not ``ignore_index``, so a
        training loop or a model written for a dense output layer runs unchanged. Nothing
        else is defined on sampled logits: the full row of scores is never computed in
        training."""
        kwargs = dict(kwargs or {})
        if func is F.cross_entropy:
            out, rest = args[0], list(args[1:])
            target = rest.pop(0) if rest else kwargs.pop("target")
            ignore = kwargs.pop("ignore_index", -100)
            reduction = kwargs.pop("reduction", "mean")
            changed = {k: v for k, v in kwargs.items()
                       if k in cls._CE_DEFAULTS and v != cls._CE_DEFAULTS[k]}
            if rest or changed or set(kwargs) - set(cls._CE_DEFAULTS) or reduction not in (
                    "mean", "sum"):
                raise SampledLogitsError(
                    f"slide: cross-entropy on the sampled output layer takes ignore_index "
                    f"and reduction mean|sum only (got {sorted(changed) or 'other arguments'}"
                    "): the sampled softmax cannot weight or smooth over the classes it did "
                    "not score; drop them, or keep this layer dense (plugins.slide.min_width "
                    "above its width)")
            return out._cross_entropy(target, int(ignore), reduction)
        raise refused(getattr(func, "__name__", str(func)))

    def _cross_entropy(self, target: torch.Tensor, ignore_index: int,
                       reduction: str) -> torch.Tensor:
        """``F.cross_entropy`` with dense semantics: logits [rows, classes] (a [B, T, V]
        output is refused, as torch reads its dimension 1 as the classes), rows whose target
        is ``ignore_index`` dropped, any other id outside the classes refused."""
        if self.h.dim() > 2:
            v = self.layer.out_features
            raise SampledTargetError(
                f"slide: cross-entropy of logits {tuple(self.shape)} against targets "
                f"{tuple(getattr(target, 'shape', ()))}: F.cross_entropy takes the classes "
                f"in dimension 1, so dense logits of this shape are refused too; flatten "
                f"both first: F.cross_entropy(out.view(-1, {v}), y.view(-1))")
        h, y = align_targets(self.h, target, multi=False)
        return self._rows_cross_entropy(h, y, ignore_index, reduction)

    def _rows_cross_entropy(self, h: torch.Tensor, y: torch.Tensor, ignore_index: int,
                            reduction: str) -> torch.Tensor:
        """The sampled cross-entropy of rows ``h`` [R, d] with one class id each."""
        check_class_ids(y, self.layer.out_features, ignore_index)
        keep = y != ignore_index
        if not bool(keep.all()):
            h, y = h[keep], y[keep]
        if len(y) == 0:
            return h.sum() * 0.0  # nothing to learn from: a zero loss with a graph
        loss = self._sampled(h, y)
        return loss * len(y) if reduction == "sum" else loss

    def loss_against(self, y: torch.Tensor) -> torch.Tensor:
        """Softmax over the active set with 1/|y| targets; y is [B] class ids (dense
        cross-entropy's: -100 skips a row, any other id outside the classes is refused) or
        [B, M] label sets padded with -1. A sequence model's [B, T, V] output is refused as
        the default loss refuses dense per-token logits (:data:`SEQUENCE_LOGITS`)."""
        if self.h.dim() > 2:
            shape = tuple(getattr(y, "shape", ()))
            raise SampledTargetError(
                f"slide: cross-entropy of logits {tuple(self.shape)} against labels {shape}: "
                f"{SEQUENCE_LOGITS}")
        h, y = align_targets(self.h, y)
        if y.dim() == 1:
            return self._rows_cross_entropy(h, y, -100, "mean")
        return self._sampled(h, y)

    def _sampled(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The sampled softmax loss of rows ``h`` [R, d] against ``y`` [R] or [R, M]."""
        if torch.is_grad_enabled() and not h.requires_grad:
            h = h.detach().requires_grad_(True)  # the layer trains in backward: make it run
        loss = _BatchTopupLoss if self.layer.cfg.topup == "batch" else _SlideLoss
        return loss.apply(h, y, self.layer)


REFUSED_OPERATORS = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//",
                     "pow": "**", "matmul": "@"}
"""Python operators on :class:`SlideLogits` (``out / 2.0``, a temperature), each refused
in one line (both operand orders): Python's own "unsupported operand type(s)" named
neither cause nor fix."""
for _name, _symbol in REFUSED_OPERATORS.items():
    for _dunder in (f"__{_name}__", f"__r{_name}__"):
        setattr(SlideLogits, _dunder, _refuse_operator(_dunder, _symbol))
for _dunder, _symbol in (("__neg__", "-"), ("__lt__", "<"), ("__le__", "<="),
                         ("__gt__", ">"), ("__ge__", ">=")):
    setattr(SlideLogits, _dunder, _refuse_operator(_dunder, _symbol))


class SlideLinear(nn.Module):
    """A wide Linear(in_features -> out_features) trained the SLIDE way (see module doc)."""

    trains_itself: ClassVar[str] = "slide"
    """Its weights update in backward (sparse Adam), outside the job's optimizer: a job
    whose only trainable layer this is still trains (``accelopt.job.job.TRAINS_ITSELF``). The
    value names the plugin, so that ``accelopt.attach`` can name it when it refuses what
    such a layer cannot honour (a ``GradScaler``, accumulation over several backwards)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        cfg: SlideConfig,
        *,
        lr: float,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        tied_to: str | None = None,
    ) -> None:
        """``tied_to``: the name of another module's Parameter that ``weight`` is (a tied
        input embedding); the layer then keeps that tensor's storage as its weight instead
        of a copy, so its sparse row updates and the job optimizer's updates of the
        embedding act on one tensor (see :meth:`_rows_to_rehash` for the tables)."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.cfg, self.lr = cfg, float(lr)
        self.lr_scale = 1.0
        """The job's learning-rate schedule at this step (warm-up, decay), which the plugin
        sets before each iteration: the sparse Adam steps at ``lr * lr_scale``."""
        n, d = out_features, in_features
        if weight is None:
            bound = 1.0 / math.sqrt(d)
            weight = torch.empty(n, d).uniform_(-bound, bound)
            bias = torch.empty(n).uniform_(-bound, bound)
        self.has_bias = bias is not None
        """Whether the layer has a bias to train. The replaced Linear's ``bias=False`` (a
        GPT-2 head) keeps a zero bias (the kernels add one) that is never updated: a
        trained one would be a parameter the user's model does not have, and its held-out
        score one that the model's architecture cannot reproduce."""
        bias = torch.zeros(n) if bias is None else bias
        f32 = dict(dtype=torch.float32)
        self.tied_to = tied_to
        self._tie = None if tied_to is None else (weight,)
        """The tied Parameter itself (a tuple: not registered here), for ``deepcopy``."""
        if tied_to is not None:
            why = unshareable(weight)
            if why:
                raise ValueError(f"slide: cannot share {tied_to}'s storage: {why}")
            self.register_buffer("weight", weight.detach())  # the same storage, no copy
        else:
            self.register_buffer("weight", weight.detach().to(**f32).clone().contiguous())
        self.register_buffer("bias", bias.detach().to(**f32).clone().contiguous())
        # zero_() writes every page now: calloc'd pages would otherwise fault in one by one
        # during the first epochs and be billed to the training steps
        for name in ("m_w", "v_w"):
            self.register_buffer(name, torch.empty(n, d, **f32).zero_())
        for name in ("m_b", "v_b"):
            self.register_buffer(name, torch.empty(n, **f32).zero_())
        self.grads = RowGradients(n, d, with_bias=True, by_rows=cfg.backward == "rows")
        self.register_buffer("steps", torch.zeros(n, dtype=torch.int64))
        self.register_buffer("dirty", torch.zeros(n, dtype=torch.uint8))
        bits = 1 if cfg.hash == "simhash" else cfg.bin_size.bit_length() - 1
        rp = cfg.range_pow or auto_range_pow(n, cfg.k * bits)
        family = make_family(
            cfg.hash, d, cfg.k, cfg.l, seed=cfg.seed, bin_size=cfg.bin_size,
            density=cfg.simhash_density, range_pow=rp,
        )
        self.family_args = (FAMILIES[cfg.hash], cfg.k, cfg.l, family.bits, family.range_pow)
        self.register_buffer("hash_idx", torch.from_numpy(family.idx))
        self.register_buffer("hash_sgn", torch.from_numpy(family.sgn))
        self.register_buffer(
            "tables", torch.empty(cfg.l, 1 << rp, cfg.bucket_size, dtype=torch.int32).zero_())
        self.register_buffer("counts", torch.zeros(cfg.l, 1 << rp, dtype=torch.int32))
        # column-major (a transposed [L, n] tensor): filling table t reads one contiguous column
        self.register_buffer("keys", torch.zeros(cfg.l, n, dtype=torch.int32).t())
        # step, next rebuild/check at, rebuilds done, tables built (0/1)
        self.register_buffer("sched", torch.zeros(4, dtype=torch.int64))
        self.max_active = min(n, cfg.max_active or cfg.l * cfg.bucket_size + cfg.min_active)
        self.schedule = RebuildSchedule(
            cfg.rebuild, cfg.rebuild_period, cfg.rebuild_growth, cfg.rebuild_max_period,
            cfg.change_threshold,
        )
        self._scratch: dict[str, np.ndarray] = {}
        self._built_at: int | None = None
        """The step count (``sched[0]``) at the last (re)build in this process."""
        self.stats: dict[str, float] = {}
        self.reset_stats()

    def __deepcopy__(self, memo: dict) -> SlideLinear:
        """A copy of a tied layer shares the copy of its tied Parameter (the model's copy of
        the embedding, through ``memo``), so the copy stays tied as the original is (the
        job's memory profile steps a deep copy); an untied layer copies as any module."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        state = dict(self.__dict__)
        if self._tie is not None:
            state["_buffers"] = {k: v for k, v in self._buffers.items() if k != "weight"}
        for key, value in state.items():
            object.__setattr__(new, key, copy.deepcopy(value, memo))
        if new._tie is not None:
            new._buffers = {"weight": new._tie[0].detach(), **new._buffers}
        return new

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"in_features={self.in_features}, out_features={self.out_features}, hash={c.hash}, "
                f"K={c.k}, L={c.l}, buckets=2^{self.family_args[4]}x{c.bucket_size}, "
                f"sampling={c.sampling}, rebuild={c.rebuild}")

    @classmethod
    def from_linear(cls, linear: nn.Linear, cfg: SlideConfig, *, lr: float,
                    tied_to: str | None = None) -> SlideLinear:
        return cls(linear.in_features, linear.out_features, cfg, lr=lr,
                   weight=linear.weight, bias=linear.bias, tied_to=tied_to)

    # -- statistics -------------------------------------------------------------------

    def reset_stats(self) -> None:
        self.stats = {f"t_{p}": 0.0 for p in PHASES}
        self.stats.update(steps=0, samples=0, active=0, union=0, retrieved=0, rebuilds=0,
                          checks=0, rehashed=0, inferred=0, label_only=0)

    def summary(self) -> dict[str, float]:
        """Per-step means: active fraction, union of active rows, share of time rebuilding."""
        s = self.stats
        steps, samples = max(s["steps"], 1), max(s["samples"], 1)
        total = sum(s[f"t_{p}"] for p in PHASES)
        return {
            "active_fraction": s["active"] / samples / self.out_features,
            "active_per_sample": s["active"] / samples,
            "retrieved_per_sample": s["retrieved"] / samples,
            "label_only_fraction": s["label_only"] / samples,
            "union_rows_per_batch": s["union"] / steps,
            # the first build's time included; the rows rehashed count rebuilds only
            "rebuild_time_share": s["t_rebuild"] / total if total else 0.0,
            "rebuilds": s["rebuilds"],
            "rehashed_per_rebuild": s["rehashed"] / s["rebuilds"] if s["rebuilds"] else 0.0,
            **{f"ms_{p}": 1e3 * s[f"t_{p}"] / steps for p in PHASES},
        }

    # -- tables -----------------------------------------------------------------------

    def family(self) -> tuple:
        kind, k, l, bits, rp = self.family_args  # noqa: E741
        return (kind, self.hash_idx.numpy(), self.hash_sgn.numpy(), k, l, bits, rp)

    def _neuron_keys(self, rows: np.ndarray | None = None, out: np.ndarray | None = None,
                     scatter: bool = False) -> np.ndarray:
        """Table keys (int32 [., L]) of all neurons or of ``rows``, written to ``out``: row i
        of it for the i-th neuron asked, or row ``rows[i]`` with ``scatter`` (the layer's
        own key array, updated in place)."""
        count = self.out_features if rows is None else len(rows)
        if out is None:
            out = np.empty((count, self.cfg.l), dtype=np.int32)
        if self.cfg.hash == "simhash":
            self._simhash_keys_blas(rows, out, scatter)
            return out
        w = self.weight.numpy() if rows is None else self.weight.numpy()[rows]
        new = out if not scatter else np.empty((count, self.cfg.l), dtype=np.int32)
        _keys_dense_par(np.ascontiguousarray(w), *self.family(), new)
        if scatter:
            out[rows] = new
        return out

    def _simhash_keys_blas(self, rows: np.ndarray | None, out: np.ndarray, scatter: bool,
                           chunk: int = 16384) -> None:
        """SimHash keys of many rows as one matmul with the (sparse +-1) projections written
        densely: rehashing 670K neurons is a GEMM, ~10x faster than the per-row kernel, and
        the bits are packed into keys by a parallel kernel. The same keys as the query path,
        except that a dot product within rounding of 0 may take the other sign (the sum
        order differs), which LSH tolerates. Works in chunks of rows (gathered by torch's
        parallel ``index_select``), so that no copy of all the rows' weights or projections
        is made and every part runs on all threads."""
        kind, k, l, bits, rp = self.family_args  # noqa: E741
        idx, sgn = self.hash_idx.numpy(), self.hash_sgn.numpy()
        if "proj" not in self._scratch:
            proj = np.zeros((idx.shape[0], self.in_features), np.float32)
            np.add.at(proj, (np.arange(idx.shape[0])[:, None], idx), sgn)
            self._scratch["proj"] = proj
        proj_t = torch.from_numpy(self._scratch["proj"]).T
        count = self.out_features if rows is None else len(rows)
        picked = None if rows is None else torch.from_numpy(rows.astype(np.int64, copy=False))
        dest = rows.astype(np.int64, copy=False) if scatter and rows is not None else \
            np.zeros(0, np.int64)
        size = min(chunk, count)
        gathered = torch.empty(size if picked is not None else 0, self.in_features)
        projected = torch.empty(size, proj_t.shape[1])  # reused: no page faults per chunk
        for lo in range(0, count, chunk):
            hi = min(count, lo + chunk)
            block = (self.weight[lo:hi] if picked is None else
                     torch.index_select(self.weight, 0, picked[lo:hi], out=gathered[:hi - lo]))
            p = torch.mm(block, proj_t, out=projected[:hi - lo])
            pack_sign_keys(p.numpy(), k, l, rp, out, dest, lo)

    def rebuild(self, rows: np.ndarray | None = None, new: np.ndarray | None = None) -> None:
        """Rehash the neurons whose weights changed since the last build (all of them the
        first time) and refill the tables (one writer per table).

        Why only the changed ones: a neuron's key depends only on its own weight row, and
        the sparse Adam flags every row it moves (``dirty``), so the keys of clean rows are
        still exact; this skips the rows no batch touched since the last build. ``rows`` and
        ``new`` pass keys the change-triggered check already computed."""
        keys = self.keys.numpy()  # column-major [n, L]: a table's keys are contiguous
        if not int(self.sched[3]):
            self._neuron_keys(out=keys)
        else:
            if rows is None:
                rows = self._rows_to_rehash()
                self._neuron_keys(rows, out=keys, scatter=True)
            elif new is not None:
                keys[rows] = new
        if int(self.sched[3]):  # a rebuild (the first build is no rebuild: not counted)
            self.stats["rehashed"] += len(rows)
        build_tables(keys, self.tables.numpy(), self.counts.numpy(),
                     INSERTIONS[self.cfg.insertion], self.cfg.seed + int(self.sched[2]))
        self.dirty.zero_()
        self.sched[3] = 1
        self._built_at = int(self.sched[0])

    def _rows_to_rehash(self) -> np.ndarray:
        """Rows whose weights may have changed since the last build: those the sparse Adam
        flagged (``dirty``), or every row when the weight is tied to a Parameter. Why all:
        the job's optimizer updates the tied embedding outside this layer, and its Adam
        moments and weight decay move every row it ever saw at every step, so no row can be
        assumed unchanged (the rehash is one GEMM over all rows, as in the first build)."""
        if self.tied_to is not None:
            return np.arange(self.out_features)
        return np.flatnonzero(self.dirty.numpy())

    def tables_stale(self) -> bool:
        """The tables miss changes of the weights (inference rebuilds them first): never
        built, rows updated since the last build, or, tied, any training step since."""
        if not int(self.sched[3]):
            return True
        if self.tied_to is not None:
            return self._built_at != int(self.sched[0])
        return bool(self.dirty.numpy().any())

    def _maybe_rebuild(self) -> None:
        if self.cfg.sampling == "random":
            return
        start = time.perf_counter()
        step = int(self.sched[0])
        self.schedule.next_at, self.schedule.rebuilds = int(self.sched[1]), int(self.sched[2])
        if not int(self.sched[3]):
            self.rebuild()
            self.schedule.done(step, rebuilt=False)
        elif self.schedule.due(step):
            rebuilt = True
            rows = new = None
            if self.cfg.rebuild == "changed":
                self.stats["checks"] += 1
                rows, new, changed = self._changed()
                rebuilt = changed / self.out_features > self.cfg.change_threshold
            if rebuilt:
                self.rebuild(rows, new)
                self.stats["rebuilds"] += 1
            self.schedule.done(step, rebuilt)
        else:
            return
        self.sched[1], self.sched[2] = self.schedule.next_at, self.schedule.rebuilds
        self.stats["t_rebuild"] += time.perf_counter() - start

    def _changed(self) -> tuple[np.ndarray, np.ndarray | None, int]:
        """Rows updated since the last build, their new keys, and how many keys changed."""
        rows = self._rows_to_rehash()
        if not len(rows):
            return rows, None, 0
        new = self._neuron_keys(rows)
        return rows, new, int((new != self.keys.numpy()[rows]).any(axis=1).sum())

    # -- scratch ----------------------------------------------------------------------

    def scratch(self, batch: int) -> dict[str, np.ndarray]:
        """Per-chunk and per-batch buffers, reallocated only when the shapes change."""
        chunks = numba.get_num_threads()
        n, c = self.out_features, self.cfg
        key = (chunks, batch)
        if self._scratch.get("key") != key:
            a = self.max_active
            self._scratch = {
                "key": key,  # type: ignore[dict-item]
                "hits": np.zeros((chunks, n), hit_counter_dtype(c.l)),
                "cand": np.zeros((chunks, c.l * c.bucket_size), np.int32),
                "keys": np.zeros((chunks, c.l), np.int32),
                "hist": np.zeros((chunks, c.l + 1), np.int64),
                "ids": np.zeros((batch, a), np.int32),
                "n_active": np.zeros(batch, np.int32),
                "is_label": np.zeros((batch, a), np.int32),
                "retrieved": np.zeros(batch, np.int32),
                "n_fixed": np.zeros(batch, np.int32),
                "offset": np.zeros(batch, np.float32),
                "logits": np.zeros((batch, a), np.float32),
                "dz": np.zeros((batch, a), np.float32),
                "loss": np.zeros(batch, np.float32),
                "flag": np.zeros(n, np.uint8),
            }
        return self._scratch

    def begin_step(self, h: torch.Tensor, y: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """What every training loss does first: threads, a due table rebuild, and the
        batch as numpy (hidden activations float32, labels int64 [B, M])."""
        set_threads(self.cfg.threads)
        hn = self.hidden_rows(h)
        labels = as_label_matrix(y, self.out_features)
        if labels.shape[0] != hn.shape[0]:
            raise ValueError(f"slide: {labels.shape[0]} target rows for {hn.shape[0]} rows of "
                             "hidden states; give one target row per input row")
        self._maybe_rebuild()
        return hn, labels

    def hidden_rows(self, h: torch.Tensor) -> np.ndarray:
        """Hidden states as the kernels read them: C-contiguous float32 [rows, in_features]
        (checked here, the last step before any kernel, whoever called)."""
        hn = np.ascontiguousarray(h.detach().numpy(), dtype=np.float32)
        if hn.ndim != 2 or hn.shape[1] != self.in_features:
            raise ValueError(f"slide: hidden states of shape {tuple(hn.shape)}; the kernels "
                             f"take [rows, {self.in_features}]")
        return hn

    def count_forward(self, t0: float, t1: float, t2: float, samples: int, active: int,
                      retrieved: int, label_only: int = 0) -> None:
        """Statistics of a training forward: selection from t0 to t1, logits to t2.
        ``retrieved``: the retrieved neurons scored (after threshold or top-k, labels not
        counted); ``label_only``: samples whose active set was only their labels (no
        negative: a zero loss, nothing learned from them)."""
        st = self.stats
        st["label_only"] += label_only
        st["t_hash"] += t1 - t0
        st["t_forward"] += t2 - t1
        st["samples"] += samples
        st["active"] += active
        st["retrieved"] += retrieved

    def update(self, start: float) -> None:
        """Sparse Adam on the rows with pending gradients (``self.grads``), then count the
        step: the tail of every training step, whichever loss computed the gradients.
        ``start``: when the optimizer phase began (for the time breakdown)."""
        bias = (self.bias.numpy(), self.m_b.numpy(), self.v_b.numpy()) if self.has_bias else None
        g = self.grads
        moved = rows_with_gradient(g.w[:g.count], g.b[:g.count] if self.has_bias else None)
        if not self.has_bias:  # the kernels accumulate a bias gradient regardless: drop it
            self.grads.b[:self.grads.count] = 0.0
        n_rows = self.grads.adam_step(
            self.weight.numpy(), self.m_w.numpy(), self.v_w.numpy(), bias, self.steps.numpy(),
            self.dirty.numpy(), self.lr * self.lr_scale, self.cfg,
            adam_global_t(self.cfg, int(self.sched[0]) + 1),
        )
        st = self.stats
        st["t_optimizer"] += time.perf_counter() - start
        st["union"] += min(moved, n_rows)
        st["steps"] += 1
        self.sched[0] += 1

    def own_rows_backward(self, hn: np.ndarray, s: dict[str, np.ndarray], scale: np.float32
                          ) -> np.ndarray:
        """Gradients of the rows in the active lists ``s["ids"]`` (indexed by
        ``self.grads.assign``) into the packed block, from ``s["dz"] * scale``; returns the
        input gradient, from the weights before the update (``cfg.backward`` says how)."""
        g = self.grads
        if g.by_rows:
            return g.accumulate(s["dz"], scale, hn, self.weight.numpy())
        dh = np.zeros_like(hn)
        kernels.backward_active(hn, self.weight.numpy(), s["ids"], s["n_active"], s["dz"],
                                scale, dh, g.slot, g.w, g.b, numba.get_num_threads())
        return dh

    # -- forward ----------------------------------------------------------------------

    def select(self, h: np.ndarray, labels: np.ndarray, min_active: int) -> dict[str, np.ndarray]:
        """Active sets of a batch (hash + table lookups + labels + random top-up)."""
        s = self.scratch(h.shape[0])
        c = self.cfg
        if labels.shape[1] > s["ids"].shape[1]:  # the kernel writes every label: room for them
            most = int((labels >= 0).sum(axis=1).max()) if labels.size else 0
            if most > s["ids"].shape[1]:
                raise ValueError(
                    f"plugins.slide.max_active={c.max_active} holds fewer neurons than a "
                    f"sample's {most} labels (labels are always active); raise it, or set 0 "
                    "(automatic)")
        kernels.select_active(
            h, labels, self.step_seed(), *self.family(),
            self.tables.numpy(), self._counts(), SAMPLING_MODE[c.sampling], c.threshold,
            c.topk, min_active, c.logq, s["hits"], s["cand"], s["keys"], s["hist"], s["ids"],
            s["n_active"], s["is_label"], s["retrieved"], s["n_fixed"], s["offset"],
        )
        return s

    def step_seed(self) -> int:
        return self.cfg.seed * 1_000_003 + int(self.sched[0])

    def shared_candidates(self, labels: np.ndarray, min_active: int) -> tuple[np.ndarray, int]:
        """``topup=batch``: the batch's distinct labels (sorted), then distinct uniform draws
        that are not labels, ``min_active`` candidates in all (capped at the width; only the
        labels if they are more); every sample scores them beside its own retrieved neurons.
        Why: the other samples' labels are negatives drawn in proportion to label frequency,
        the wrong labels a softmax most needs to push down, and shared rows are updated once
        per batch, so the union of active rows (what the sparse Adam pays for) stays near the
        retrieved part. Returns (candidates as int64, number of labels at their head)."""
        s = self.scratch(labels.shape[0])
        out = np.empty(max(labels.size, min(min_active, self.out_features)), np.int64)
        count, n_lab = kernels.shared_list(labels, self.out_features, min_active,
                                           self.step_seed(), s["flag"], out)
        return out[:count], n_lab

    def _counts(self) -> np.ndarray:
        """Bucket sizes for lookups; all zero in ``random`` mode (nothing is retrieved)."""
        if self.cfg.sampling == "random":
            if "zero_counts" not in self._scratch:
                self._scratch["zero_counts"] = np.zeros_like(self.counts.numpy())
            return self._scratch["zero_counts"]
        return self.counts.numpy()

    def forward(self, h: torch.Tensor) -> Any:
        if self.training:
            h = as_hidden(h, self.in_features)
            check_finite(h, "the input of the SLIDE output layer")
            return SlideLogits(self, h)
        if self.cfg.inference == "lsh":
            out = self.sparse_logits(h)  # checks its input in retrieve()
        else:
            h = as_hidden(h, self.in_features)
            check_finite(h, "the input of the SLIDE output layer")
            out = F.linear(h, self.weight, self.bias)
        self.stats["inferred"] += out.numel() // self.out_features  # rows scored (eval mode)
        return out

    def retrieve(self, h: torch.Tensor) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """LSH inference's part before the output: the rows of ``h`` [..., d] as the kernels
        take them, and each row's retrieved neurons (``ids[b, :n_active[b]]``) with their
        logits (``logits[b, :n_active[b]]``). Stale tables are rebuilt first (the rows
        trained since the last build), so the neurons retrieved are those of the weights
        being scored."""
        h = as_hidden(h, self.in_features)
        check_finite(h, "the input of the SLIDE output layer")
        set_threads(self.cfg.threads)
        if self.tables_stale():
            self.rebuild()
        hn = self.hidden_rows(h.reshape(-1, self.in_features))
        s = self.select(hn, np.zeros((hn.shape[0], 0), np.int64), 0)
        kernels.forward_active(hn, self.weight.numpy(), self.bias.numpy(), s["ids"],
                               s["n_active"], s["is_label"], s["n_fixed"], s["offset"],
                               s["logits"], s["dz"], s["loss"])
        return hn, s

    def sparse_logits(self, h: torch.Tensor) -> torch.Tensor:
        """LSH inference: logits of the retrieved neurons, -inf elsewhere, shaped like
        ``F.linear``'s output. One scatter of the active entries (not a loop over rows):
        the [rows, N] fill of -inf is then the only part that grows with the width, which
        is why :meth:`sparse_topk` exists."""
        hn, s = self.retrieve(h)
        rows = hn.shape[0]
        mask = np.arange(s["ids"].shape[1])[None, :] < s["n_active"][:, None]
        which, _ = np.nonzero(mask)
        out = torch.full((rows, self.out_features), -math.inf)
        out[torch.from_numpy(which), torch.from_numpy(s["ids"][mask].astype(np.int64))] = \
            torch.from_numpy(s["logits"][mask])
        return out.reshape(*h.shape[:-1], self.out_features)

    def sparse_topk(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """LSH inference's top ``k`` neurons per row without the [rows, N] logits: (values,
        ids), each [..., k], best first; a row that retrieved fewer than ``k`` neurons is
        padded with -inf and id -1. The same neurons and values as ``sparse_logits(h)
        .topk(k)`` (up to the order of equal logits), from one kernel over each row's
        retrieved logits: work proportional to the active set, not to the width."""
        if k < 1:
            raise ValueError(f"slide: sparse_topk needs k >= 1, got {k}")
        hn, s = self.retrieve(h)
        values = np.empty((hn.shape[0], k), np.float32)
        ids = np.empty((hn.shape[0], k), np.int64)
        kernels.topk_active(s["ids"], s["n_active"], s["logits"], k, values, ids)
        lead = tuple(h.shape[:-1])
        return (torch.from_numpy(values).reshape(*lead, k),
                torch.from_numpy(ids).reshape(*lead, k))


def rows_with_gradient(w: np.ndarray, b: np.ndarray | None) -> int:
    """How many packed gradient rows are not all zero (weights, or bias when given). Why
    not the rows the active sets named: a sample whose active set is only its labels has a
    zero gradient, and its rows were reported as updated. Only rows with a zero bias
    gradient are scanned in full (rarely more than those label-only rows)."""
    if b is None:
        return int(np.count_nonzero(np.any(w != 0, axis=1)))
    zero = np.flatnonzero(b == 0)
    return len(b) - len(zero) + int(np.count_nonzero(np.any(w[zero] != 0, axis=1)))


def label_only_samples(n_active: np.ndarray, labels: np.ndarray, extra: int = 0) -> int:
    """Samples whose active set (``n_active[b]`` own neurons plus ``extra`` shared ones)
    holds no more neurons than their labels: no negative to push down."""
    n_lab = (labels >= 0).sum(axis=1) if labels.size else np.zeros(len(n_active), np.int64)
    return int(np.count_nonzero(n_active + extra <= n_lab))


def retrieved_scored(s: dict[str, np.ndarray], batch: int) -> int:
    """Retrieved neurons that entered the active sets (after threshold or top-k; labels
    not counted): the fixed part of each set, less its labels. Why not the kernel's
    ``retrieved``: that counts the tables' candidates before the filter (755 per sample
    reported while 1 was active)."""
    width = s["ids"].shape[1]
    fixed = np.arange(width)[None, :] < s["n_fixed"][:batch, None]
    return int(np.count_nonzero(fixed & (s["is_label"][:batch] == 0)))


def hit_counter_dtype(tables: int) -> type:
    """The narrowest signed integer that counts hits from ``tables`` tables and holds the
    negative markers of :func:`kernels.select_active`: int8 for up to 126 tables. Why: the
    per-thread counters span the whole width and are hit at random, so a quarter of the
    bytes keeps more of them in cache (hashing + lookups 14% faster at 200K labels)."""
    return np.int8 if tables < 127 else np.int16 if tables < 32767 else np.int32


def as_label_matrix(y: torch.Tensor, n: int) -> np.ndarray:
    """Targets as int64 [B, M] padded with -1 (a 1-D class-index target becomes M = 1)."""
    check_label_dtype(y)
    lab = y.detach().to(torch.int64)
    if lab.dim() == 1:
        lab = lab[:, None]
    if lab.dim() != 2:
        raise ValueError(f"slide: targets must be [B] or [B, M] label ids, got shape {tuple(y.shape)}")
    if lab.numel() and (int(lab.max()) >= n or int(lab.min()) < -1):
        raise ValueError(f"slide: label ids must be in [0, {n}) (or -1 padding)")
    # a repeat within a row is padding: a point's labels are a set, as the dense loss
    # counts them (topup=sample's kernel collapsed a repeat, topup=batch weighed it twice)
    return np.ascontiguousarray(torch.where(first_occurrences(lab), lab, -1).numpy())


class _SlideLoss(torch.autograd.Function):
    """Mean over the batch of the sampled softmax loss; backward updates the layer in place."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, y: torch.Tensor, layer: SlideLinear) -> torch.Tensor:
        hn, labels = layer.begin_step(h, y)
        t0 = time.perf_counter()
        s = layer.select(hn, labels, layer.cfg.min_active)
        t1 = time.perf_counter()
        kernels.forward_active(hn, layer.weight.numpy(), layer.bias.numpy(), s["ids"],
                               s["n_active"], s["is_label"], s["n_fixed"], s["offset"],
                               s["logits"], s["dz"], s["loss"])
        batch = hn.shape[0]
        layer.count_forward(t0, t1, time.perf_counter(), batch, int(s["n_active"].sum()),
                            retrieved_scored(s, batch),
                            label_only_samples(s["n_active"][:batch], labels))
        ctx.layer, ctx.h = layer, hn
        return torch.tensor(float(s["loss"].mean(dtype=np.float64)), dtype=h.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, None, None]:
        layer: SlideLinear = ctx.layer
        hn = ctx.h
        s = layer.scratch(hn.shape[0])
        t0 = time.perf_counter()
        layer.grads.assign(s["ids"], s["n_active"])
        dh = layer.own_rows_backward(hn, s, np.float32(float(grad_out) / hn.shape[0]))
        t1 = time.perf_counter()
        layer.stats["t_backward"] += t1 - t0
        layer.update(t1)
        return torch.from_numpy(dh), None, None


class _BatchTopupLoss(torch.autograd.Function):
    """``topup=batch``: each sample's softmax runs over its own retrieved neurons and one
    candidate list shared by the batch (:meth:`SlideLinear.shared_candidates`). Why two
    kinds of work: the shared part is the same for every sample, so its logits and
    gradients are three GEMMs on one gathered block of rows ([B, D] x [D, S] and back),
    while the retrieved part (tens to hundreds of rows per sample) is the per-sample numba
    kernels' job (dot products, then HOGWILD gradient rows). Both hand their rows to the
    same sparse Adam as the default path.

    Why torch and not numpy for the GEMMs: numpy's OpenBLAS keeps its worker threads
    spinning after each call, and on a machine with as many cores as numba threads they
    took the cores from the numba kernels that follow (40 ms/step instead of 12 at 200K
    labels, L=16, topk=50, ``benchmarks/slide_profile.py``).

    Log-Q (``logq``): the drawn part of the list stands for the neurons outside the sample's
    fixed part (its own retrieved neurons and the batch's labels), as in the default path; a
    retrieved neuron that was also drawn is scored once, in the shared list."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, y: torch.Tensor, layer: SlideLinear) -> torch.Tensor:
        hn, labels = layer.begin_step(h, y)
        t0 = time.perf_counter()
        s = layer.select(hn, labels, 0)  # retrieved + own labels, no per-sample top-up
        shared, n_lab = layer.shared_candidates(labels, layer.cfg.min_active)
        flag = s["flag"]
        flag[shared] = 1
        kernels.drop_shared(s["ids"], s["n_active"], flag)  # own labels are in the list
        flag[shared] = 0
        t1 = time.perf_counter()
        sh = torch.from_numpy(shared)
        w_sh = layer.weight[sh]  # a copy: the rows before this step's update, for backward
        z_sh = torch.addmm(layer.bias[sh], torch.from_numpy(hn), w_sh.T).numpy()
        lab_pos = np.where(labels >= 0, np.searchsorted(shared[:n_lab], labels), -1)
        kernels.forward_batch_topup(
            hn, layer.weight.numpy(), layer.bias.numpy(), s["ids"], s["n_active"], z_sh, n_lab,
            layer.cfg.logq, layer.out_features, lab_pos, s["dz"], s["loss"])
        batch = hn.shape[0]
        layer.count_forward(t0, t1, time.perf_counter(), batch,
                            int(s["n_active"].sum()) + batch * len(shared),
                            int(s["n_active"].sum()),  # own list: retrieved, not shared
                            label_only_samples(s["n_active"][:batch], labels, len(shared)))
        ctx.layer, ctx.h, ctx.shared, ctx.w_sh, ctx.dz_sh = layer, hn, sh, w_sh, z_sh
        return torch.tensor(float(s["loss"].mean(dtype=np.float64)), dtype=h.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, None, None]:
        layer: SlideLinear = ctx.layer
        hn, sh = ctx.h, ctx.shared
        s = layer.scratch(hn.shape[0])
        t0 = time.perf_counter()
        scale = np.float32(float(grad_out) / hn.shape[0])
        g = layer.grads  # the own rows first (sorted), then the shared list (disjoint)
        n_own = g.assign(s["ids"], s["n_active"], extra=len(sh))
        end = n_own + len(sh)
        g.rows[n_own:end] = sh.numpy()
        dh = layer.own_rows_backward(hn, s, scale)  # each sample's own (retrieved) rows
        dz_sh = torch.from_numpy(ctx.dz_sh * scale)
        dh += (dz_sh @ ctx.w_sh).numpy()
        torch.mm(dz_sh.T, torch.from_numpy(hn), out=torch.from_numpy(g.w[n_own:end]))
        torch.sum(dz_sh, 0, out=torch.from_numpy(g.b[n_own:end]))
        t1 = time.perf_counter()
        layer.stats["t_backward"] += t1 - t0
        layer.update(t1)
        ctx.w_sh = ctx.dz_sh = None
        return torch.from_numpy(dh), None, None


class SlideSparseInput(nn.Module):
    """First layer on padded sparse input x [B, 2, P] (ids, values; id -1 = padding):
    out = bias + sum_p v_p W[f_p]. Weight rows get sparse Adam on the batch's features only;
    the (narrow) bias stays an ordinary parameter for the job's optimizer."""

    trains_itself: ClassVar[str] = "slide"
    """Its weight rows update in backward (``accelopt.job.job.TRAINS_ITSELF``; the value
    names the plugin for ``accelopt.attach``'s refusals, as :class:`SlideLinear`'s)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, cfg: SlideConfig, *,
                 lr: float) -> None:
        super().__init__()
        self.in_features, self.out_features = int(weight.shape[0]), int(weight.shape[1])
        self.cfg, self.lr = cfg, float(lr)
        self.lr_scale = 1.0
        """As :attr:`SlideLinear.lr_scale`: the job's schedule at this step."""
        d = self.in_features
        self.register_buffer("weight", weight.detach().float().clone().contiguous())
        for name in ("m_w", "v_w"):  # zero_(): fault pages in now, not mid-training
            self.register_buffer(name, torch.empty_like(self.weight).zero_())
        self.register_buffer("steps", torch.zeros(d, dtype=torch.int64))
        self.register_buffer("dirty", torch.zeros(d, dtype=torch.uint8))
        self.register_buffer("step_count", torch.zeros(1, dtype=torch.int64))
        self.bias = nn.Parameter(bias.detach().float().clone())
        self.grads = RowGradients(d, self.out_features, with_bias=False,
                                  by_rows=cfg.backward == "rows")
        self.t_forward = self.t_backward = self.t_optimizer = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] != 2:
            raise ValueError(f"slide: the sparse input must be [batch, 2, slots] (feature ids, "
                             f"values), got {list(getattr(x, 'shape', [type(x).__name__]))}")
        if x.device.type != "cpu":
            raise ValueError(f"slide: the sparse input is on {x.device}; SLIDE's kernels run "
                             "on the CPU (run.device=cpu)")
        check_finite(x, "the sparse input")
        return _SparseInput.apply(self.bias, x, self)


class _SparseInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, bias: torch.Tensor, x: torch.Tensor, layer: SlideSparseInput) -> Any:
        set_threads(layer.cfg.threads)
        t0 = time.perf_counter()
        feat = np.ascontiguousarray(x[:, 0, :].numpy()).astype(np.int64)
        vals = np.ascontiguousarray(x[:, 1, :].numpy(), dtype=np.float32)
        if feat.size and feat.max() >= layer.in_features:
            raise ValueError(f"slide: feature id {feat.max()} >= {layer.in_features} features")
        if feat.size and feat.min() < -1:  # a negative id would wrap to another row
            raise ValueError(f"slide: feature id {feat.min()} < 0 (only -1 marks padding)")
        out = np.empty((feat.shape[0], layer.out_features), np.float32)
        kernels.sparse_input_forward(feat, vals, layer.weight.numpy(),
                                     bias.detach().numpy(), out)
        ctx.layer, ctx.feat, ctx.vals = layer, feat, vals
        layer.t_forward += time.perf_counter() - t0
        return torch.from_numpy(out)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, None, None]:
        layer: SlideSparseInput = ctx.layer
        t0 = time.perf_counter()
        g = np.ascontiguousarray(grad_out.numpy(), dtype=np.float32)
        grads = layer.grads
        feat = ctx.feat
        grads.assign(feat, np.full(feat.shape[0], feat.shape[1], np.int32))
        if grads.by_rows:
            grads.accumulate(ctx.vals, 1.0, g)
        else:
            kernels.sparse_input_backward(feat, ctx.vals, g, grads.slot, grads.w,
                                          numba.get_num_threads())
        t1 = time.perf_counter()
        grads.adam_step(
            layer.weight.numpy(), layer.m_w.numpy(), layer.v_w.numpy(), None,
            layer.steps.numpy(), layer.dirty.numpy(), layer.lr * layer.lr_scale, layer.cfg,
            adam_global_t(layer.cfg, int(layer.step_count[0]) + 1),
        )
        layer.step_count += 1
        layer.t_backward += t1 - t0
        layer.t_optimizer += time.perf_counter() - t1
        return grad_out.sum(0), None, None
