"""Pruning rules by module structure, for blocks whose forward is known and self-contained.

Why rules and not the graph: HF models are not torch.fx-traceable (dynamic shapes, caches,
``view(..., -1, head_dim)``), and attention splits a projection into heads with a reshape the
graph walk refuses. For the blocks below the forward is fixed by their class, and the pruned
units never leave the block, so slicing them is safe without a graph:

* feed-forward blocks: GPT-2's ``GPT2MLP`` (``c_fc`` -> act -> ``c_proj``, HF ``Conv1D``),
  BERT's ``BertLayer`` (``intermediate.dense`` -> act -> ``output.dense``), ViT's ``ViTMLP``
  (``fc1`` -> act -> ``fc2``) and ``nn.TransformerEncoderLayer`` (``linear1`` -> act ->
  ``linear2``): hidden units;
* attention heads: ``GPT2Attention`` (fused ``c_attn`` = [q | k | v], ``c_proj``) and
  ``BertAttention`` (``self.query/key/value``, ``output.dense``): whole heads, and the head
  count attributes the forward reads (``num_heads``/``split_size``;
  ``num_attention_heads``/``all_head_size``) are updated; attention with separate
  ``q_proj/k_proj/v_proj/o_proj`` and a ``head_dim`` (HF ViT, Llama-style) likewise. Both
  forwards infer the head count from the tensor (``view(..., -1, head_dim)``), which is what
  makes this safe. A q/k/v/o block is pruned only after a check on a copy: with a head
  pruned it must compute what the dense block computes with that head masked, on a probe
  input (a user's block that splits heads by a head count of its own fails it and stays
  dense, the reason in the report).

``nn.MultiheadAttention`` (fused ``in_proj`` with the head count baked into its C++ fast
path) and cross-attention are refused with the reason.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from accelopt_plugins.gpu_kernels.channel_graph import is_conv1d
from torch import nn


@dataclass
class RuleGroup:
    """``units`` prunable units (channels or heads). Unit u is output columns
    ``producers[p][u]`` of each producer and input columns ``consumers[c][u]`` of each
    consumer; ``after(kept)`` updates the block's attributes to the kept unit count."""

    key: str
    block: str
    units: int
    unit: str
    producers: dict[str, torch.Tensor] = field(default_factory=dict)
    consumers: dict[str, torch.Tensor] = field(default_factory=dict)
    after: Callable[[int], None] | None = None
    refused: str | None = None

    @property
    def members(self) -> list[str]:
        return [*self.producers, *self.consumers]


def _join(path: str, name: str) -> str:
    """``path.name``, or ``name`` for the root (a block passed as the model itself)."""
    return f"{path}.{name}" if path else name


def _blocks(units: int, width: int, offsets: tuple[int, ...] = (0,)) -> torch.Tensor:
    """Column indices of unit u: ``offset + u*width + [0, width)`` for each offset."""
    base = torch.arange(units)[:, None] * width + torch.arange(width)[None, :]
    return torch.cat([base + o for o in offsets], dim=1)


def _ffn(path: str, up: str, down: str, up_mod: nn.Module, down_mod: nn.Module) -> RuleGroup:
    n = int(up_mod.nf if is_conv1d(up_mod) else up_mod.out_features)
    n_in = int(down_mod.nx if is_conv1d(down_mod) else down_mod.in_features)
    group = RuleGroup(_join(path, up), path, n, "channel", {_join(path, up): _blocks(n, 1)},
                      {_join(path, down): _blocks(n, 1)})
    if n != n_in:
        group.refused = f"feed-forward block {path!r}: hidden sizes disagree ({n} vs {n_in})"
    return group


def _heads(group: RuleGroup, head_dim: int, producers: dict[str, tuple[int, ...]],
           consumer: str, after: Callable[[int], None]) -> RuleGroup:
    """One attention block's heads as a group: each producer's output columns of head u
    (``head_dim`` wide, at each of its offsets: GPT-2's fused [q | k | v] has three), the
    consumer's input columns of head u, and the head-count update the forward reads."""
    for name, offsets in producers.items():
        group.producers[name] = _blocks(group.units, head_dim, offsets)
    group.consumers[consumer] = _blocks(group.units, head_dim)
    group.after = after
    return group


def _gpt2_attention(path: str, m: nn.Module) -> RuleGroup:
    heads, hd, split = int(m.num_heads), int(m.head_dim), int(m.split_size)
    group = RuleGroup(path, path, heads, "head")
    if getattr(m, "is_cross_attention", False) or not (
            is_conv1d(m.c_attn) and is_conv1d(m.c_proj) and m.c_attn.nf == 3 * split
            and split == heads * hd and m.c_proj.nx == split):
        group.refused = "attention heads: cross-attention or an unexpected c_attn layout"
        return group

    def after(kept: int) -> None:
        m.num_heads, m.split_size = kept, kept * hd
    return _heads(group, hd, {_join(path, "c_attn"): (0, split, 2 * split)},
                  _join(path, "c_proj"), after)


def _bert_attention(path: str, m: nn.Module) -> RuleGroup:
    s = m.self
    heads, hd = int(s.num_attention_heads), int(s.attention_head_size)
    group = RuleGroup(path, path, heads, "head")
    linears = [getattr(s, n, None) for n in ("query", "key", "value")]
    dense = getattr(getattr(m, "output", None), "dense", None)
    if not all(isinstance(x, nn.Linear) and x.out_features == heads * hd for x in linears) or (
            not isinstance(dense, nn.Linear) or dense.in_features != heads * hd):
        group.refused = "attention heads: q/k/v or output projection of an unexpected shape"
        return group
    if getattr(s, "position_embedding_type", "absolute") not in (None, "absolute"):
        group.refused = "attention heads: relative position embeddings are not pruned"
        return group

    def after(kept: int) -> None:
        s.num_attention_heads, s.all_head_size = kept, kept * hd
    return _heads(group, hd, {_join(path, f"self.{n}"): (0,) for n in ("query", "key", "value")},
                  _join(path, "output.dense"), after)


def _qkvo_attention(path: str, m: nn.Module) -> RuleGroup:
    """Attention with separate ``q_proj/k_proj/v_proj`` and ``o_proj`` (HF ViT in
    transformers 5, Llama-style blocks): its forward splits heads by
    ``view(..., -1, head_dim)`` and merges them by ``reshape(..., -1)``, so whole heads can
    go; grouped key/value heads (k/v narrower than q) are refused."""
    hd = int(m.head_dim)
    q, k, v, o = (getattr(m, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    width = q.out_features if isinstance(q, nn.Linear) else 0
    heads = width // hd if hd else 0
    group = RuleGroup(path, path, heads, "head")
    if not (all(isinstance(x, nn.Linear) for x in (q, k, v, o)) and heads * hd == width
            and k.out_features == v.out_features == width and o.in_features == width):
        group.refused = ("attention heads: grouped key/value heads or q/k/v/o projections "
                         "of an unexpected shape")
        return group

    group.refused = _heads_follow_pruning(m, hd, heads)
    return _heads(group, hd, {_join(path, n): (0,) for n in ("q_proj", "k_proj", "v_proj")},
                  _join(path, "o_proj"), lambda kept: _set_head_count(m, kept))


def _set_head_count(m: nn.Module, kept: int) -> None:
    """The head-count attributes HF attention forwards read."""
    for attr in ("num_attention_heads", "num_heads"):
        if isinstance(getattr(m, attr, None), int):
            setattr(m, attr, kept)


PROBE_SHAPE = (2, 3)
"""Batch and sequence length of the probe input a q/k/v/o attention block is checked on."""


def _heads_follow_pruning(m: nn.Module, hd: int, heads: int) -> str | None:
    """Why pruning heads of this q/k/v/o block would change what its kept heads compute, or
    None. Why a check and not the class name alone: a user's ``SelfAttention`` with the same
    attribute names that splits heads by a head count of its own (``view(B, T, self.n_heads,
    -1)``) ran the kept columns as more, narrower heads after pruning, silently. On a copy,
    head 0 is pruned and the block must equal the dense block with head 0's ``o_proj``
    columns zeroed, on a seeded probe input [2, 3, d] (the job's random stream untouched).
    A block whose forward needs more than the hidden states is trusted only if it is HF
    ``transformers``' own (its forwards infer the head count from ``view(..., -1,
    head_dim)``); any other is refused."""
    if heads < 2:
        return None
    dense, pruned = copy.deepcopy(m).eval(), copy.deepcopy(m).eval()
    cols = _blocks(heads, hd)[1:].flatten().to(m.q_proj.weight.device)
    with torch.no_grad():
        dense.o_proj.weight[:, :hd] = 0
        for name in ("q_proj", "k_proj", "v_proj"):
            _keep_outputs(getattr(pruned, name), cols)
        pruned.o_proj.weight = nn.Parameter(pruned.o_proj.weight[:, cols])
        pruned.o_proj.in_features = int(cols.numel())
        _set_head_count(pruned, heads - 1)
        w = m.q_proj.weight
        x = torch.randn(*PROBE_SHAPE, m.q_proj.in_features, generator=torch.Generator()
                        .manual_seed(0), dtype=w.dtype).to(w.device)
        try:
            want = _first_tensor(dense(x))
        except Exception as exc:  # a forward that needs more than hidden states
            if type(m).__module__.startswith("transformers."):
                return None
            return (f"attention heads of {type(m).__name__}: its forward could not be checked "
                    f"on a probe input (it raised {type(exc).__name__} on hidden states "
                    f"{list(x.shape)}), so its heads stay dense")
        try:
            got = _first_tensor(pruned(x))
        except Exception as exc:
            return (f"attention heads of {type(m).__name__}: its forward fails with a head "
                    f"pruned ({type(exc).__name__}: {str(exc)[:120]}); it must split heads by "
                    "view(..., -1, head_dim) and merge them by reshape(..., -1)")
    if got.shape != want.shape or not torch.allclose(
            got, want, rtol=1e-4, atol=1e-5 * max(1.0, float(want.abs().max()))):
        return (f"attention heads of {type(m).__name__}: with a head pruned its kept heads "
                "compute something else (its forward reads a head count pruning does not "
                "update); split heads by view(..., -1, head_dim) to have them pruned")
    return None


def _keep_outputs(linear: nn.Linear, cols: torch.Tensor) -> None:
    """Keep output columns ``cols`` of a Linear copy (no new module: no random init)."""
    linear.weight = nn.Parameter(linear.weight[cols])
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[cols])
    linear.out_features = int(cols.numel())


def _first_tensor(out: object) -> torch.Tensor:
    """A block's output tensor (HF attention returns ``(output, weights)``)."""
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the block returned a {type(out).__name__}, not a tensor")
    return out


def _rule_for(path: str, m: nn.Module) -> RuleGroup | None:
    name = type(m).__name__
    if name.endswith("GPT2MLP") and is_conv1d(getattr(m, "c_fc", None) or nn.Module()) \
            and is_conv1d(getattr(m, "c_proj", None) or nn.Module()):
        return _ffn(path, "c_fc", "c_proj", m.c_fc, m.c_proj)
    if name in ("BertLayer", "RobertaLayer") and isinstance(
            getattr(getattr(m, "intermediate", None), "dense", None), nn.Linear) and isinstance(
            getattr(getattr(m, "output", None), "dense", None), nn.Linear):
        return _ffn(path, "intermediate.dense", "output.dense", m.intermediate.dense,
                    m.output.dense)
    if isinstance(m, nn.TransformerEncoderLayer):
        return _ffn(path, "linear1", "linear2", m.linear1, m.linear2)
    if name in ("ViTMLP", "ViTIntermediateMLP", "CLIPMLP") and isinstance(
            getattr(m, "fc1", None), nn.Linear) and isinstance(getattr(m, "fc2", None),
                                                              nn.Linear):
        return _ffn(path, "fc1", "fc2", m.fc1, m.fc2)
    if name.endswith("Attention") and isinstance(getattr(m, "head_dim", None), int) and all(
            hasattr(m, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return _qkvo_attention(path, m)
    if name.endswith("GPT2Attention") and hasattr(m, "c_attn"):
        return _gpt2_attention(path, m)
    if name in ("BertAttention", "RobertaAttention") and hasattr(m, "self"):
        return _bert_attention(path, m)
    return None


def module_rules(model: nn.Module) -> tuple[list[RuleGroup], dict[str, str]]:
    """Rule groups of ``model`` and refusals of attention modules no rule covers."""
    groups: list[RuleGroup] = []
    refused: dict[str, str] = {}
    for path, m in model.named_modules():
        rule = _rule_for(path, m)
        if rule is not None:
            groups.append(rule)
        elif isinstance(m, (nn.LSTM, nn.GRU, nn.RNN)):
            refused[path] = (f"{type(m).__name__} gates interleave hidden units in fused "
                             "weights; recurrent layers are not pruned")
        elif isinstance(m, nn.MultiheadAttention):
            refused[path] = ("attention heads are not pruned in nn.MultiheadAttention (fused "
                             "in_proj, head count fixed in its fast path); only the "
                             "feed-forward block is")
    return groups, refused
