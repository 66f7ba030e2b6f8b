"""Configuration of the slide plugin (``plugins.slide.<key>=<value>``) and its validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

from accelopt.errors import ConfigError

HASHES = ("dwta", "wta", "simhash")
SAMPLINGS = ("union", "threshold", "topk", "random")
INSERTIONS = ("fifo", "reservoir")
REBUILDS = ("fixed", "decay", "changed")
INFERENCES = ("dense", "lsh")
CORRECTIONS = ("global", "row")
TOPUPS = ("sample", "batch")
BACKWARDS = ("rows", "hogwild")


@dataclass
class SlideConfig:
    """Keys users set as ``plugins.slide.key=value``. Defaults: the paper's SimHash K=9, L=50
    (its Delicious setting; its Amazon setting, DWTA K=8, retrieved no better than random on
    our 128-wide ReLU hidden layer, see docs/benchmarks.md, section slide), buckets of 128 filled by
    reservoir sampling, the top 1000 neurons by table hits, rebuild every 50 batches. One
    default differs from the paper: ``logq`` (see there)."""

    min_width: int = 4096
    """Replace Linear layers with at least this many outputs."""
    sparse_input: bool = True
    """Also replace the XC network's sparse-input first layer (sparse Adam on used rows)."""
    hash: str = "simhash"
    k: int = 9
    l: int = 50  # noqa: E741 - the paper's name
    bin_size: int = 8
    simhash_density: float = 0.33
    range_pow: int = 0
    """log2 of buckets per table; 0: chosen from the width (about 16 neurons per bucket)."""
    bucket_size: int = 128
    insertion: str = "reservoir"
    sampling: str = "topk"
    threshold: int = 1
    """``sampling=threshold``: keep neurons retrieved in more than this many tables."""
    topk: int = 1000
    """``sampling=topk``: keep this many neurons, by number of tables that retrieved them."""
    min_active: int = 1000
    """Top up each sample's active set with random neurons to at least this many."""
    max_active: int = 0
    """Cap on a sample's active set; 0: L * bucket_size + min_active."""
    topup: str = "sample"
    """Where the top-up comes from: ``sample``, uniform draws per sample (the paper);
    ``batch``, one candidate list shared by the batch (its labels, then uniform draws up to
    ``min_active``) scored by every sample beside its own retrieved neurons. With ``batch``
    a few retrieved neurons per sample suffice: ``topup=batch l=16 topk=50`` is our fastest
    setting to a given P@1 (docs/benchmarks.md, "slide: time to quality on XC")."""
    logq: bool = True
    """Log-Q correction of the random top-up: each uniformly drawn neuron's logit gets
    log(neurons it stands for), so the active set's softmax estimates the full softmax's
    normaliser (retrieved neurons and labels count once, the drawn ones for the rest). The
    paper uses a plain softmax over the active set (``false``); the correction ended 2.8 P@1
    points higher at 200K labels and 1.9 at 20K (``benchmarks/slide_tta.py``, logq=false vs
    true)."""
    rebuild: str = "fixed"
    rebuild_period: int = 50
    rebuild_growth: float = 1.5
    rebuild_max_period: int = 2000
    change_threshold: float = 0.05
    inference: str = "dense"
    lr: Optional[float] = None
    """Learning rate of the sparse Adam; null: the job's own lr (its optimizer must be adam)."""
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    adam_correction: str = "global"
    """Sparse Adam's bias correction: ``global`` step count (torch SparseAdam, TF LazyAdam) or
    each row's own update count (``row``; learned less per step, see docs)."""
    backward: str = "rows"
    """How gradient rows are summed across the batch's samples. ``rows``: each row by one
    thread from the batch's entries of that row (a transposed index of the active sets; no
    races, the same row gradients for any thread count); ``hogwild``: the paper's, every
    sample adds into the shared rows from its own thread without locks. At 670K labels the
    backward took 15.6 instead of 22.3 ms/step on one thread and 9.6 instead of 12.9 on two:
    HOGWILD's scattered row updates miss cache (``benchmarks/slide_step.py``)."""
    threads: int = 0
    """numba threads (0: numba's default, one per core); 1 makes runs bit-for-bit reproducible."""
    seed: int = 0


def validate(cfg: SlideConfig) -> None:
    """Raise ConfigError (one line: the key and the fix) on the first bad value."""
    choices = {
        "hash": HASHES, "sampling": SAMPLINGS, "insertion": INSERTIONS, "rebuild": REBUILDS,
        "inference": INFERENCES, "adam_correction": CORRECTIONS, "topup": TOPUPS,
        "backward": BACKWARDS,
    }
    for key, allowed in choices.items():
        if getattr(cfg, key) not in allowed:
            raise ConfigError(
                f"plugins.slide.{key}={getattr(cfg, key)!r}: choose one of {', '.join(allowed)}"
            )
    positive = ("min_width", "k", "l", "bucket_size", "rebuild_period", "rebuild_max_period",
                "topk")
    for key in positive:
        if int(getattr(cfg, key)) < 1:
            raise ConfigError(f"plugins.slide.{key} must be >= 1, got {getattr(cfg, key)}")
    non_negative = ("min_active", "max_active", "threshold", "threads", "range_pow", "seed")
    for key in non_negative:
        if int(getattr(cfg, key)) < 0:
            raise ConfigError(f"plugins.slide.{key} must be >= 0, got {getattr(cfg, key)}")
    if cfg.bin_size < 2 or cfg.bin_size & (cfg.bin_size - 1):
        raise ConfigError(f"plugins.slide.bin_size must be a power of two >= 2, got {cfg.bin_size}")
    if cfg.range_pow > 30:
        raise ConfigError(f"plugins.slide.range_pow must be <= 30, got {cfg.range_pow}")
    bits = 1 if cfg.hash == "simhash" else cfg.bin_size.bit_length() - 1
    if cfg.k * bits > KEY_BITS:  # the key's shifts would drop the first hashes' bits
        raise ConfigError(
            f"plugins.slide.k={cfg.k}: a table key holds {KEY_BITS} bits of hash code and "
            f"hash={cfg.hash} gives {bits} per hash (bin_size={cfg.bin_size}), so k must be "
            f"<= {KEY_BITS // bits}")
    if cfg.range_pow:
        _refuse_tables_beyond_memory(cfg)
    if not 0.0 < cfg.simhash_density <= 1.0:
        raise ConfigError("plugins.slide.simhash_density must be in (0, 1]")
    if not 0.0 <= cfg.change_threshold <= 1.0:
        raise ConfigError("plugins.slide.change_threshold must be in [0, 1]")
    if not (math.isfinite(cfg.rebuild_growth) and cfg.rebuild_growth >= 1.0):  # nan: not >=
        raise ConfigError(f"plugins.slide.rebuild_growth must be a finite number >= 1 (gaps "
                          f"grow over time), got {cfg.rebuild_growth}; e.g. 1.5")
    if cfg.seed >= SEED_LIMIT:  # numpy's generators and the kernels' int64 step seeds
        raise ConfigError(f"plugins.slide.seed must be < 2**32, got {cfg.seed}")
    if cfg.lr is not None and not (math.isfinite(cfg.lr) and cfg.lr > 0):  # nan: not > 0
        raise ConfigError(f"plugins.slide.lr must be a finite number > 0, got {cfg.lr}")
    for key in ("beta1", "beta2"):  # Adam's moment decays: 1 or more never forgets
        if not 0.0 <= float(getattr(cfg, key)) < 1.0:
            raise ConfigError(f"plugins.slide.{key} must be in [0, 1), got {getattr(cfg, key)}")
    if not (math.isfinite(cfg.eps) and cfg.eps > 0):  # 0 divides by a zero second moment
        raise ConfigError(f"plugins.slide.eps must be a finite number > 0, got {cfg.eps}")
    if cfg.topup == "sample" and 0 < cfg.max_active < cfg.min_active:
        # each sample's active set is capped at max_active, so min_active was never reached
        raise ConfigError(
            f"plugins.slide.max_active={cfg.max_active} is below plugins.slide.min_active="
            f"{cfg.min_active}, so no active set could reach min_active; raise max_active "
            "(0: automatic) or lower min_active")
    if cfg.rebuild == "decay" and cfg.rebuild_max_period < cfg.rebuild_period:
        # the cap would make every gap max_period: more rebuilds than fixed, none decaying
        raise ConfigError(
            f"plugins.slide.rebuild_max_period={cfg.rebuild_max_period} is below "
            f"plugins.slide.rebuild_period={cfg.rebuild_period}, so rebuild=decay would "
            "rebuild more often than rebuild=fixed; raise rebuild_max_period to at least "
            "rebuild_period")
    if cfg.sampling == "random" and cfg.topup == "sample" and cfg.min_active < 2:
        # nothing is retrieved and the top-up stops at min_active: the labels alone
        raise ConfigError(
            f"plugins.slide.min_active={cfg.min_active} with sampling=random leaves each "
            "sample only its labels active (no negative: the loss is 0 and nothing trains); "
            "set min_active above a sample's label count (e.g. 1000)")
    if cfg.threshold >= cfg.l and cfg.sampling == "threshold":
        raise ConfigError(f"plugins.slide.threshold must be < l ({cfg.l}) or nothing is retrieved")


SEED_LIMIT = 2**32
"""Seeds from 0 to 2**32 - 1: times 1,000,003 plus a step count, they stay within int64."""

KEY_BITS = 64
"""Bits of hash code a table key is built from (a uint64, ``hashing.table_keys_one``)."""


def _refuse_tables_beyond_memory(cfg: SlideConfig) -> None:
    """``range_pow`` set by hand sizes each layer's tables (``l x 2**range_pow`` buckets of
    ``bucket_size`` int32 ids, and a count each): more than the machine's memory failed in
    the first layer's build with an allocator's message of terabytes."""
    import psutil

    need = cfg.l * (1 << cfg.range_pow) * (cfg.bucket_size + 1) * 4
    have = int(psutil.virtual_memory().total)
    if need > have:
        raise ConfigError(
            f"plugins.slide.range_pow={cfg.range_pow}: each layer's hash tables (l={cfg.l} x "
            f"2^{cfg.range_pow} buckets x bucket_size={cfg.bucket_size}) need "
            f"{need / 2**30:,.0f} GiB, more than this machine's {have / 2**30:,.0f} GiB; "
            "lower range_pow (0 sizes it from the layer's width)")


def as_config(obj: object) -> SlideConfig:
    """Copy any object with SlideConfig's attributes (an OmegaConf node) into a SlideConfig."""
    if isinstance(obj, SlideConfig):
        return obj
    return SlideConfig(**{f.name: getattr(obj, f.name) for f in fields(SlideConfig)
                          if hasattr(obj, f.name)})
