"""``workload=lm``: a small GPT-2 learning real text that needs no download.

The text is the source code of the running Python's own standard library (every machine
that runs accelopt has it), tokenised at the word level: identifiers, numbers and single
punctuation characters. The vocabulary is every token seen at least twice in the training
files, capped at ``vocab`` (tens of thousands by default, so the output layer is wide), plus
``<unk>``. Training and held-out text come from different files (sorted by path; the last
tenth is held out), so the held-out perplexity measures generalisation, not memory.

The model is ``transformers``' ``GPT2LMHeadModel`` from a small config with random weights
(no download); it computes its own loss from ``labels=`` (the job's ``loss: model``), the
labels being the inputs (it shifts them). ``transformers`` is a test extra
(``pip install -e '.[dev]'``); without it the workload says so in one line.

The corpus depends on the Python version (its standard library): the dataset's ``name``
records it, so two runs compare only when they name the same corpus.
"""

from __future__ import annotations

import math
import platform
import re
import sysconfig
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from accelopt.records import Quality
from accelopt.workloads.data import batch_rows

TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+|[^\sA-Za-z0-9_]")
UNK = 0
EVAL_BATCH = 32


def stdlib_files(max_files: int) -> list[Path]:
    """The standard library's own ``.py`` files (no tests, no site-packages), sorted."""
    return list(_stdlib_sources()[:max_files])


@lru_cache(maxsize=1)
def _stdlib_sources() -> tuple[Path, ...]:
    """Every one of them, found once per process: walking the standard library takes
    seconds, and each corpus size (``max_files``, ``seq_len``) walked it again."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return tuple(sorted(p for p in root.rglob("*.py")
                        if not {"test", "tests", "site-packages", "idle_test"} & set(p.parts)))


@lru_cache(maxsize=4)
def _corpus(max_files: int, vocab: int,
            seq_len: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(training chunks ``[N, seq_len]``, held-out chunks, vocabulary size, training tokens),
    memoised per process (a pure function of its arguments and the Python version). The
    training tokens are the longest ``seq_len`` that still makes one training chunk."""
    files = stdlib_files(max_files)
    if len(files) < 10:
        raise ValueError(f"workload=lm: found only {len(files)} standard-library files under "
                         f"{sysconfig.get_paths()['stdlib']}; a Python installation with its "
                         "standard library sources is needed")
    cut = len(files) - max(1, len(files) // 10)
    streams = []
    for part in (files[:cut], files[cut:]):
        words: list[str] = []
        for path in part:
            words += TOKEN.findall(path.read_text(encoding="utf-8", errors="replace"))
        streams.append(words)
    counts = Counter(streams[0])
    common = [w for w, c in counts.most_common(vocab - 1) if c >= 2]
    index = {w: i + 1 for i, w in enumerate(common)}

    def chunks(words: list[str]) -> torch.Tensor:
        ids = torch.tensor([index.get(w, UNK) for w in words], dtype=torch.int64)
        n = len(ids) // seq_len
        return ids[: n * seq_len].view(n, seq_len)

    return chunks(streams[0]), chunks(streams[1]), len(common) + 1, len(streams[0])


class StdlibText:
    """The batch protocol over the corpus: batch ``i`` is the chunks the seeded per-epoch
    permutation puts there; labels are the inputs (the model shifts them)."""

    input_kind = "sequence"
    num_classes = 0  # a language model's classes are its vocabulary

    def __init__(self, *, seed: int, max_files: int, vocab: int, seq_len: int,
                 eval_chunks: int) -> None:
        self.seed = seed
        self._train, self._held_out, self.vocab_size, fits = _corpus(max_files, vocab,
                                                                     seq_len)
        if len(self._train) == 0:  # batch 0 divided by zero rows (a ZeroDivisionError)
            raise ValueError(f"stdlib_text: seq_len={seq_len} is longer than the training text "
                             f"of {max_files} files ({fits} tokens): no training sequence; "
                             f"set seq_len={fits} or less (or raise max_files)")
        self._held_out = self._held_out[:eval_chunks]
        self.num_classes = self.vocab_size
        self.n_train = len(self._train)
        self.input_shape = (seq_len,)
        self.name = (f"stdlib_text(python {platform.python_version()}, {max_files} files, "
                     f"vocab {self.vocab_size}, {self.n_train} x {seq_len} tokens)")

    def __repr__(self) -> str:
        return self.name

    def batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self._train[batch_rows(self.seed, self.n_train, index, batch_size)]
        return x, x.clone()

    def evaluate_model(self, model: torch.nn.Module) -> Quality:
        """Held-out perplexity: exp of the mean next-token cross-entropy over the held-out
        chunks (``model(x, labels=x).loss`` per batch, weighted by its predicted tokens). A
        held-out text shorter than one ``seq_len`` has no chunk: not scored, with the note of
        any empty held-out set (it divided by zero tokens, "cannot score")."""
        # late: accelopt.job imports the workloads
        from accelopt.job.quality import EMPTY_HELD_OUT, EmptyHeldOut

        if len(self._held_out) == 0:
            raise EmptyHeldOut(EMPTY_HELD_OUT)
        total, tokens = 0.0, 0
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for lo in range(0, len(self._held_out), EVAL_BATCH):
                    x = self._held_out[lo:lo + EVAL_BATCH]
                    n = x.numel() - len(x)  # each row predicts all but its first token
                    total += float(model(x, labels=x).loss) * n
                    tokens += n
        finally:
            model.train(was_training)
        return Quality(metric="perplexity", value=math.exp(total / tokens),
                       samples=len(self._held_out))


def stdlib_text(*, seed: int, max_files: int = 600, vocab: int = 30000, seq_len: int = 64,
                eval_chunks: int = 256) -> StdlibText:
    """Factory for ``dataset: accelopt.workloads.lm:stdlib_text``."""
    for key, value, low in (("max_files", max_files, 10), ("vocab", vocab, 16),
                            ("seq_len", seq_len, 2), ("eval_chunks", eval_chunks, 1)):
        if int(value) < low:
            raise ValueError(f"stdlib_text: {key} must be >= {low}, got {value}")
    return StdlibText(seed=seed, max_files=int(max_files), vocab=int(vocab),
                      seq_len=int(seq_len), eval_chunks=int(eval_chunks))


def gpt2(*, vocab_size: int | None, input_shape: tuple[int, ...], n_embd: int = 64,
         n_layer: int = 2, n_head: int = 2, dropout: float = 0.0) -> Any:
    """Factory for ``model: accelopt.workloads.lm:gpt2``: ``GPT2LMHeadModel`` from a small
    config, random weights, positions for the dataset's sequence length."""
    if vocab_size is None:  # token data without one: transformers said only "Validation
        # error for field 'vocab_size':", its reason on a line of its own
        raise ValueError("gpt2 embeds token ids and needs the vocabulary size, got None: give "
                         "the dataset a vocab_size attribute (its largest token id + 1), or "
                         "the model vocab_size=N in the job's model_kwargs")
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise ValueError("workload=lm needs HF transformers: pip install transformers (or "
                         "pip install -e '.[dev]')") from None
    # no special tokens (GPT-2's 50256 is outside this vocabulary); the causal-LM loss
    config = GPT2Config(vocab_size=vocab_size, n_positions=max(input_shape[0], 8),
                        n_embd=n_embd, n_layer=n_layer, n_head=n_head, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=None,
                        eos_token_id=None, loss_type="ForCausalLM")
    model = GPT2LMHeadModel(config)
    # transformers 5 picks the loss from the class name, not the config; "GPT2LMHeadModel"
    # names none, so every run's first forward warned "loss_type=None ... unrecognized"
    # before falling back to this same loss: name it on the model itself.
    model.loss_type = "ForCausalLM"
    return model
