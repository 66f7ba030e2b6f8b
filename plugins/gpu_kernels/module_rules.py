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
  ``q_proj/k_proj/v_proj/o_proj`` and a ``head_dim`` (HF ViT) likewise. Both forwards infer the head count
  from the tensor (``view(..., -1, head_dim)``), which is what makes this safe.

``nn.MultiheadAttention`` (fused ``in_proj`` with the head count baked into its C++ fast
path) and cross-attention are refused with the reason.
"""

from __future__ import annotations

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


def _blocks(units: int, width: int, offsets: tuple[int, ...] = (0,)) -> torch.Tensor:
    """Column indices of unit u: ``offset + u*width + [0, width)`` for each offset."""
    base = torch.arange(units)[:, None] * width + torch.arange(width)[None, :]
    return torch.cat([base + o for o in offsets], dim=1)


def _ffn(path: str, up: str, down: str, up_mod: nn.Module, down_mod: nn.Module) -> RuleGroup:
    n = int(up_mod.nf if is_conv1d(up_mod) else up_mod.out_features)
    n_in = int(down_mod.nx if is_conv1d(down_mod) else down_mod.in_features)
    group = RuleGroup(f"{path}.{up}" if path else up, path, n, "channel",
                      {f"{path}.{up}".lstrip("."): _blocks(n, 1)},
                      {f"{path}.{down}".lstrip("."): _blocks(n, 1)})
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
    return _heads(group, hd, {f"{path}.c_attn": (0, split, 2 * split)}, f"{path}.c_proj",
                  after)


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
    return _heads(group, hd, {f"{path}.self.{n}": (0,) for n in ("query", "key", "value")},
                  f"{path}.output.dense", after)


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

    def after(kept: int) -> None:
        for attr in ("num_attention_heads", "num_heads"):
            if isinstance(getattr(m, attr, None), int):
                setattr(m, attr, kept)
    return _heads(group, hd, {f"{path}.{n}": (0,) for n in ("q_proj", "k_proj", "v_proj")},
                  f"{path}.o_proj", after)


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
