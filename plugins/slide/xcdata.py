"""Extreme-classification (XC) data: a seeded synthetic generator, the XC repository's text
format, and a dataset with the core's stateless ``batch(i, batch_size)`` interface.

Why synthetic: no XC dataset can be downloaded here, so the generator imitates their shape:
Zipf label frequencies, ~5 correlated labels per point (mostly from one label cluster),
per-label sparse word signatures drawn from a pool shared within the cluster, Zipf noise
words, and TF-IDF-like L2-normalised values. Users with Amazon-670K read it with
:func:`read_xc` (header ``N D L``, then ``l1,l2 f:v f:v`` per line, ids 0-based).

Batches are padded dense tensors because the core moves ``x``/``y`` with ``.to(device)`` and
profiles them by storage: ``x`` is float32 [B, 2, P] (row 0: feature ids, exact in float32
below 2**24; row 1: values; id -1 pads), ``y`` is int64 [B, M] label ids padded with -1.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from accelopt_plugins.slide.xcmodel import xc_softmax_loss
from numba import njit

MAX_FEATURES = 1 << 24  # feature ids travel as float32 in x
MAX_LABELS = 1 << 31  # label ids are stored as int32 (XCData.labels)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class XCData:
    """One split in CSR form: features (indptr/indices/data) and labels (label_ptr/labels)."""

    indptr: np.ndarray
    indices: np.ndarray
    data: np.ndarray
    label_ptr: np.ndarray
    labels: np.ndarray
    n_features: int
    n_labels: int

    @property
    def n(self) -> int:
        return len(self.indptr) - 1

    def label_sets(self) -> list[np.ndarray]:
        return [self.labels[self.label_ptr[i]:self.label_ptr[i + 1]] for i in range(self.n)]


@dataclass(frozen=True)
class XCSpec:
    """Size and shape of a synthetic XC problem (all fields enter the cache key)."""

    n_labels: int = 2000
    n_features: int = 5000
    n_train: int = 10000
    n_test: int = 2000
    labels_per_point: float = 5.0
    zipf: float = 0.9
    cluster_size: int = 40
    pool_per_cluster: int = 60
    signature: int = 12
    unique_words: int = 3
    keep: float = 0.6
    same_cluster: float = 0.8
    noise_words: float = 10.0
    seed: int = 0


SIZES: dict[str, XCSpec] = {
    "2k": XCSpec(),
    "20k": XCSpec(n_labels=20_000, n_features=40_000, n_train=50_000, n_test=5_000),
    "200k": XCSpec(n_labels=200_000, n_features=135_909, n_train=100_000, n_test=10_000),
    # 200k's data volume with 1.5x the labels: the widest output at which the (fair) dense
    # baseline still reaches its plateau within about an hour here (docs/benchmarks.md, "slide: time to quality on XC")
    "300k": XCSpec(n_labels=300_000, n_features=135_909, n_train=100_000, n_test=10_000),
    "670k": XCSpec(n_labels=670_091, n_features=135_909, n_train=200_000, n_test=10_000),
}


# ---------------------------------------------------------------------------- generator


def _zipf_cdf(n: int, a: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """CDF over ranks and a random rank->id map, so popular ids are spread over the range."""
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** a
    return np.cumsum(weights / weights.sum()), rng.permutation(n)


def _draw(cdf: np.ndarray, ids: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
    ranks = np.minimum(np.searchsorted(cdf, rng.random(size)), len(cdf) - 1)
    return ids[ranks]


def generate(spec: XCSpec) -> tuple[XCData, XCData]:
    """(train, test) for ``spec``; a pure function of it."""
    if spec.n_labels < 2 or spec.n_features < 2 or spec.n_features >= MAX_FEATURES:
        raise ValueError(f"need 2 <= labels and 2 <= features < {MAX_FEATURES}; got {spec}")
    rng = np.random.default_rng([spec.seed, 6])
    nl, nf = spec.n_labels, spec.n_features
    n_clusters = math.ceil(nl / spec.cluster_size)
    label_cdf, label_ids = _zipf_cdf(nl, spec.zipf, rng)
    word_cdf, word_ids = _zipf_cdf(nf, 1.1, rng)
    pools = rng.integers(0, nf, (n_clusters, spec.pool_per_cluster))
    cluster = np.arange(nl) // spec.cluster_size
    sig = pools[cluster[:, None], rng.integers(0, spec.pool_per_cluster, (nl, spec.signature))]
    sig[:, : spec.unique_words] = rng.integers(0, nf, (nl, spec.unique_words))

    def split(n: int, stream: int) -> tuple[np.ndarray, ...]:
        r = np.random.default_rng([spec.seed, 6, stream])
        k = np.clip(1 + r.poisson(spec.labels_per_point - 1, n), 1, int(3 * spec.labels_per_point))
        primary = _draw(label_cdf, label_ids, r, n)
        owner = np.repeat(np.arange(n), k - 1)
        base = cluster[primary[owner]] * spec.cluster_size
        near = np.minimum(base + r.integers(0, spec.cluster_size, len(owner)), nl - 1)
        far = _draw(label_cdf, label_ids, r, len(owner))
        extra = np.where(r.random(len(owner)) < spec.same_cluster, near, far)
        pairs = np.unique(np.concatenate([np.arange(n), owner]) * nl
                          + np.concatenate([primary, extra]))
        rows, labs = pairs // nl, pairs % nl
        mask = r.random((len(labs), spec.signature)) < spec.keep
        words = sig[labs][mask]
        word_rows = np.repeat(rows, mask.sum(1))
        n_noise = r.poisson(spec.noise_words, n)
        noise = _draw(word_cdf, word_ids, r, int(n_noise.sum()))
        cells, tf = np.unique(
            np.concatenate([word_rows, np.repeat(np.arange(n), n_noise)]) * nf
            + np.concatenate([words, noise]), return_counts=True)
        return rows, labs, cells // nf, cells % nf, tf

    parts = [split(spec.n_train, 1), split(spec.n_test, 2)]
    df = np.bincount(parts[0][3], minlength=nf)
    idf = np.log((spec.n_train + 1) / (df + 1)) + 1.0
    out = []
    for (rows, labs, frows, feats, tf), n in zip(parts, (spec.n_train, spec.n_test), strict=True):
        values = (1.0 + np.log(tf)) * idf[feats]
        norms = np.sqrt(np.bincount(frows, weights=values**2, minlength=n))
        values = values / norms[frows]
        out.append(XCData(
            indptr=_ptr(frows, n), indices=feats.astype(np.int32),
            data=values.astype(np.float32), label_ptr=_ptr(rows, n),
            labels=labs.astype(np.int32), n_features=nf, n_labels=nl,
        ))
    return out[0], out[1]


def _ptr(sorted_rows: np.ndarray, n: int) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.bincount(sorted_rows, minlength=n))]).astype(np.int64)


def cache_dir() -> Path:
    return Path(os.environ.get("ACCELOPT_CACHE", Path.home() / ".cache" / "accelopt")) / "xc"


def load_or_generate(spec: XCSpec) -> tuple[XCData, XCData]:
    """Generate once per spec and cache as .npz (written atomically)."""
    key = hashlib.sha256(repr(sorted(asdict(spec).items())).encode()).hexdigest()[:16]
    path = cache_dir() / f"xc-{spec.n_labels}-{key}.npz"
    if path.is_file():
        try:
            z = np.load(path)
            splits = []
            for s in ("train", "test"):
                splits.append(XCData(*(z[f"{s}_{f}"] for f in (
                    "indptr", "indices", "data", "label_ptr", "labels")),
                    n_features=spec.n_features, n_labels=spec.n_labels))
            return splits[0], splits[1]
        except (OSError, KeyError, ValueError):
            pass  # a damaged cache file is regenerated
    train, test = generate(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
    arrays = {f"{s}_{f}": getattr(d, f) for s, d in (("train", train), ("test", test))
              for f in ("indptr", "indices", "data", "label_ptr", "labels")}
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return train, test


# -------------------------------------------------------------------------- text format


def write_xc(path: str | Path, data: XCData) -> None:
    """Write the XC repository's format: ``N D L`` then ``l1,l2 f:v f:v`` per point."""
    with open(path, "w", encoding="ascii") as fh:
        fh.write(f"{data.n} {data.n_features} {data.n_labels}\n")
        for i in range(data.n):
            labs = ",".join(str(int(v)) for v in data.labels[data.label_ptr[i]:data.label_ptr[i + 1]])
            lo, hi = data.indptr[i], data.indptr[i + 1]
            feats = " ".join(f"{int(f)}:{float(v):.9g}"
                             for f, v in zip(data.indices[lo:hi], data.data[lo:hi], strict=True))
            fh.write(f"{labs} {feats}".rstrip() + "\n")


def read_xc(path: str | Path) -> XCData:
    """Read the XC repository's format; a malformed line raises ValueError naming its number.

    A point's labels are a set: a label listed twice in a line is kept once (every loss
    counts it once), and one log line says how many points had such repeats. A feature id
    of 2**24 or more is refused: ``x`` carries feature ids as float32, which holds integers
    exactly only up to there (16777217 arrived as 16777216, another feature's weights).
    A header label count ``L`` above 2**31 is refused too: label ids (below ``L``) are stored
    as int32, and a larger one failed later with numpy's OverflowError naming no file. A
    feature listed twice in a line is refused naming both values: unlike a repeated label
    (the same fact twice), a repeated feature has two values and no one reading of them
    (the dense layer summed them, a "last one wins" reader would not)."""
    indptr, indices, values, label_ptr, labels = [0], [], [], [0], []
    with_repeats = 0
    with open(path, encoding="ascii", errors="replace") as fh:
        header = fh.readline().split()
        if len(header) != 3 or not all(t.isdigit() for t in header):
            raise ValueError(f"{path}:1: expected header 'N D L' (three integers), got "
                             f"{' '.join(header)!r}")
        n, nf, nl = (int(t) for t in header)
        if nl > MAX_LABELS:
            raise ValueError(f"{path}:1: the header's label count {nl} is above the limit "
                             f"{MAX_LABELS} (2**31): label ids are stored as int32, so every "
                             f"id must be below it; renumber the labels to ids below "
                             f"{MAX_LABELS} and give their count in the header")
        count = 0
        for lineno, line in enumerate(fh, start=2):
            if not line.strip():
                continue
            count += 1
            tokens = line.split()
            if line[0].isspace() or ":" in tokens[0]:
                lab_tok, feat_toks = "", tokens
            else:
                lab_tok, feat_toks = tokens[0], tokens[1:]
            row: dict[int, None] = {}  # insertion-ordered: the first of a repeat stays
            toks = [t for t in lab_tok.split(",") if t]
            for t in toks:
                if not t.isdigit() or int(t) >= nl:
                    raise ValueError(f"{path}:{lineno}: expected label ids in [0, {nl}) separated "
                                     f"by commas, got {lab_tok!r}")
                row[int(t)] = None
            with_repeats += len(row) < len(toks)
            labels.extend(row)
            seen: dict[int, float] = {}
            for t in feat_toks:
                f, sep, v = t.partition(":")
                try:
                    fid, val = int(f), float(v)
                except ValueError:
                    fid, val = -1, 0.0
                if not sep or not 0 <= fid < nf or not math.isfinite(val):
                    raise ValueError(f"{path}:{lineno}: expected 'feature:value' with feature in "
                                     f"[0, {nf}) and a finite value, got {t!r}")
                if fid >= MAX_FEATURES:
                    raise ValueError(f"{path}:{lineno}: feature id {fid} is not below the limit "
                                     f"{MAX_FEATURES} (2**24): feature ids travel as float32, "
                                     f"exact only below it, so it would merge with another "
                                     f"feature; renumber the features to ids below {MAX_FEATURES}")
                if fid in seen:
                    raise ValueError(f"{path}:{lineno}: feature {fid} is listed twice in this "
                                     f"point (values {seen[fid]:g} and {val:g}); give each "
                                     f"feature once per line (the sum of its values, if that "
                                     f"is what was meant)")
                seen[fid] = val
                indices.append(fid)
                values.append(val)
            indptr.append(len(indices))
            label_ptr.append(len(labels))
    if count != n:
        raise ValueError(f"{path}: header says {n} points but the file has {count}")
    if with_repeats:
        log.warning("%s: %d of %d points list a label more than once; each repeat was dropped "
                    "(a point's labels are a set: every loss counts a label once)",
                    path, with_repeats, count)
    return XCData(
        indptr=np.asarray(indptr, np.int64), indices=np.asarray(indices, np.int32),
        data=np.asarray(values, np.float32), label_ptr=np.asarray(label_ptr, np.int64),
        labels=np.asarray(labels, np.int32), n_features=nf, n_labels=nl,
    )


# ------------------------------------------------------------------------------ dataset


@njit(cache=True)
def _pack(indptr, indices, data, label_ptr, labels, rows, x, y):
    for b in range(len(rows)):
        i = rows[b]
        lo, hi = indptr[i], indptr[i + 1]
        for p in range(x.shape[2]):
            if p < hi - lo:
                x[b, 0, p] = indices[lo + p]
                x[b, 1, p] = data[lo + p]
            else:
                x[b, 0, p] = -1.0
                x[b, 1, p] = 0.0
        lo, hi = label_ptr[i], label_ptr[i + 1]
        for q in range(y.shape[1]):
            y[b, q] = labels[lo + q] if q < hi - lo else -1


def pack(data: XCData, rows: np.ndarray, width: int, label_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded (x [B, 2, width], y [B, label_width]) tensors for the given rows."""
    x = np.empty((len(rows), 2, width), np.float32)
    y = np.empty((len(rows), label_width), np.int64)
    _pack(data.indptr, data.indices, data.data, data.label_ptr, data.labels,
          np.asarray(rows, np.int64), x, y)
    return torch.from_numpy(x), torch.from_numpy(y)


def _max_len(ptr: np.ndarray) -> int:
    return int(np.diff(ptr).max()) if len(ptr) > 1 else 0


class XCDataset:
    """Duck-typed ``accelopt.workloads.Dataset`` over sparse multi-label data.

    ``vocab_size`` is the number of features (the model's input width); ``loss_fn`` is the
    softmax loss with 1/|y| targets, which the core's job uses instead of cross-entropy.
    """

    input_kind = "sparse"

    def __init__(self, name: str, seed: int, train: XCData, test: XCData) -> None:
        self.name, self.seed = name, seed
        self.train, self.test = train, test
        self.num_classes, self.vocab_size = train.n_labels, train.n_features
        self.n_train = train.n
        self.width = max(1, _max_len(train.indptr), _max_len(test.indptr))
        self.label_width = max(1, _max_len(train.label_ptr), _max_len(test.label_ptr))
        self.input_shape = (2, self.width)
        self.loss_fn = xc_softmax_loss

    def __repr__(self) -> str:
        return (f"XCDataset(name={self.name!r}, labels={self.num_classes}, "
                f"features={self.vocab_size}, n_train={self.n_train}, n_test={self.test.n})")

    def indices(self, index: int, batch_size: int) -> np.ndarray:
        """Rows of batch ``index``: positions in a stream of seeded per-epoch permutations."""
        if index < 0 or batch_size < 1:
            raise ValueError(f"need index >= 0 and batch_size >= 1; got {index}, {batch_size}")
        pos = np.arange(index * batch_size, (index + 1) * batch_size)
        epochs, offsets = pos // self.n_train, pos % self.n_train
        out = np.empty(batch_size, np.int64)
        for e in np.unique(epochs):
            m = epochs == e
            out[m] = _permutation(self.seed, int(e), self.n_train)[offsets[m]]
        return out

    def batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return pack(self.train, self.indices(index, batch_size), self.width, self.label_width)

    def eval_batches(self, batch_size: int = 1024, limit: int | None = None):
        """Held-out set in padded batches: (x, label sets)."""
        n = self.test.n if limit is None else min(limit, self.test.n)
        for lo in range(0, n, batch_size):
            rows = np.arange(lo, min(n, lo + batch_size))
            x, y = pack(self.test, rows, self.width, self.label_width)
            yield x, y

    def eval_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        return pack(self.test, np.arange(self.test.n), self.width, self.label_width)


@lru_cache(maxsize=8)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 61]).permutation(n)


def synthetic(size: str, seed: int = 0, n_train: int | None = None) -> XCDataset:
    """The synthetic problem of a named size (``2k``, ``20k``, ``200k``, ``300k``, ``670k``)."""
    from dataclasses import replace

    spec = SIZES[size]
    if n_train is not None:
        spec = replace(spec, n_train=int(n_train))
    train, test = load_or_generate(spec)
    return XCDataset(f"xc_{size}", seed, train, test)


# Factories for ``dataset: "accelopt_plugins.slide.xcdata:xc_20k"`` in a workload (the
# core calls them as factory(seed=, n_train=)); the data content is fixed by XCSpec.seed,
# the job's seed only orders batches, like the zoo's digits.
def xc_2k(seed: int = 0, n_train: int | None = None) -> XCDataset:
    return synthetic("2k", seed, n_train)


def xc_20k(seed: int = 0, n_train: int | None = None) -> XCDataset:
    return synthetic("20k", seed, n_train)


def xc_200k(seed: int = 0, n_train: int | None = None) -> XCDataset:
    return synthetic("200k", seed, n_train)


def xc_300k(seed: int = 0, n_train: int | None = None) -> XCDataset:
    return synthetic("300k", seed, n_train)


def xc_670k(seed: int = 0, n_train: int | None = None) -> XCDataset:
    return synthetic("670k", seed, n_train)


XC_LINE = "'l1,l2 f:v f:v' (comma-separated label ids, then feature:value pairs)"
"""A point's line in the XC repository's format, as a refusal names it."""


def from_files(train_path: str | Path, test_path: str | Path, seed: int = 0) -> XCDataset:
    """A dataset from XC-format files (e.g. Amazon-670K's train.txt / test.txt).

    A training file whose points have no label at all is refused: every point's loss is 0
    (a point without labels adds nothing), so it "trained" to losses of 0.0 on nothing. Its
    held-out points without labels are kept; held-out scoring leaves them out
    (``accelopt.job.quality.labelled``), and says so where none has a label."""
    train, test = read_xc(train_path), read_xc(test_path)
    if not len(train.labels):
        what = f"none of its {train.n} points has a label" if train.n else "it holds no point"
        raise ValueError(f"{train_path}: {what}, so there is nothing to train on; each point's "
                         f"line is {XC_LINE}")
    if (train.n_features, train.n_labels) != (test.n_features, test.n_labels):
        raise ValueError("train and test headers disagree on the number of features or labels")
    return XCDataset(Path(train_path).stem, seed, train, test)
