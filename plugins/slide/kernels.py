"""The SLIDE training kernels (numba): active-set selection, sparse forward/backward, sparse Adam.

Parallelism is SLIDE's: the batch is split into ``n_chunks`` interleaved slices (one per
thread: sample b belongs to chunk b % n_chunks), every sample is processed by one thread,
and gradients are accumulated into the shared gradient rows without locks (HOGWILD). Each
chunk owns preallocated scratch rows (hit counters, candidate lists, key buffers) that are
cleared incrementally, so a step allocates nothing proportional to the layer width. With one
thread every step is bit-for-bit reproducible; with more, HOGWILD races make float sums
order-dependent (as in the paper).

Modes of active-set selection (``mode``): 0 = union of the L retrieved buckets, 1 = neurons
retrieved in more than ``threshold`` tables, 2 = the ``topk`` neurons by number of tables
that retrieved them. Training adds the true labels and then random neurons until
``min_active`` are active.
"""

from __future__ import annotations

import numpy as np
from accelopt_plugins.slide.hashing import table_keys_one
from accelopt_plugins.slide.tables import xorshift
from numba import njit, prange

UNION, THRESHOLD, TOPK = 0, 1, 2
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
"""Reassociation lets LLVM vectorise float32 reductions; no ``nnan``/``ninf``: the kernels
compare against -inf and inputs are checked for NaN/inf before they get here."""
_SELECTED = -1
_LABEL = -2


@njit(cache=True, inline="always")
def draw_distinct(mark, marker, out, count, target, n, state):
    """Append uniform draws among the neurons with ``mark[j] == 0`` to ``out[count:target]``,
    marking each with ``marker`` so that none is drawn twice; returns the new count. With
    more than half of all neurons wanted, walks them from a random start instead (rejection
    sampling would stall)."""
    if target * 2 > n:
        state, r = xorshift(state)
        start = np.int64(r % np.uint64(n))
        for o in range(n):
            if count >= target:
                break
            j = (start + o) % n
            if mark[j] == 0:
                out[count] = j
                mark[j] = marker
                count += 1
    else:
        while count < target:
            state, r = xorshift(state)
            j = np.int64(r % np.uint64(n))
            if mark[j] == 0:
                out[count] = j
                mark[j] = marker
                count += 1
    return count


@njit(parallel=True, cache=True)
def select_active(
    h, labels, step_seed, kind, idx, sgn, k, l, bits, range_pow,  # noqa: E741
    tables, counts, mode, threshold, topk, min_active, logq,
    hits, cand, keys, hist, ids, n_active, is_label, retrieved, n_fixed, offset,
):
    """Fill ids[b, :n_active[b]] with sample b's active neurons; mark labels in is_label.

    The first ``n_fixed[b]`` active neurons are the retrieved ones and the labels; the rest
    are the uniform random top-up. With ``logq`` true, ``offset[b]`` = log(the number of
    neurons not in the fixed part / the number drawn from them): each drawn neuron stands for
    that many, so the softmax over the active set estimates the full softmax's normaliser
    (the log-Q correction of sampled softmax, Jean et al. 2015, applied to the part that was
    sampled uniformly); otherwise 0 (the paper's plain softmax over the active set).

    ``labels`` is int64 [B, M] padded with -1 (M may be 0: inference, no labels added).
    ``retrieved[b]`` receives how many distinct neurons the tables returned (for recall
    statistics). ``hits``/``cand``/``keys``/``hist`` are per-chunk scratch buffers.
    """
    batch = h.shape[0]
    n = hits.shape[1]
    cap_active = ids.shape[1]
    n_chunks = hits.shape[0]
    cap = tables.shape[2]
    for c in prange(n_chunks):
        hit = hits[c]
        cl = cand[c]
        key = keys[c]
        hs = hist[c]
        for b in range(c, batch, n_chunks):
            table_keys_one(h[b], kind, idx, sgn, k, l, bits, range_pow, key)
            n_cand = 0
            for t in range(l):
                bucket = key[t]
                size = min(counts[t, bucket], cap)
                for s in range(size):
                    j = tables[t, bucket, s]
                    if hit[j] == 0:
                        cl[n_cand] = j
                        n_cand += 1
                    hit[j] += 1
            retrieved[b] = n_cand
            n_lab = 0
            for q in range(labels.shape[1]):
                if labels[b, q] >= 0:
                    n_lab += 1
            room = cap_active - n_lab
            na = 0
            if mode == UNION:
                for i in range(n_cand):
                    if na >= room:
                        break
                    ids[b, na] = cl[i]
                    na += 1
            elif mode == THRESHOLD:
                for i in range(n_cand):
                    if na >= room:
                        break
                    if hit[cl[i]] > threshold:
                        ids[b, na] = cl[i]
                        na += 1
            else:
                want = min(topk, room)
                hs[:] = 0
                for i in range(n_cand):
                    hs[hit[cl[i]]] += 1
                cut = l
                above = 0
                while cut > 0 and above + hs[cut] < want:
                    above += hs[cut]
                    cut -= 1
                take_at_cut = want - above
                for i in range(n_cand):
                    j = cl[i]
                    if hit[j] > cut or (hit[j] == cut and take_at_cut > 0 and cut > 0):
                        if hit[j] == cut:
                            take_at_cut -= 1
                        ids[b, na] = j
                        na += 1
            for i in range(n_cand):
                hit[cl[i]] = 0
            for i in range(na):
                hit[ids[b, i]] = _SELECTED
            for q in range(labels.shape[1]):
                j = labels[b, q]
                if j < 0:
                    continue
                if hit[j] != _SELECTED and hit[j] != _LABEL:
                    ids[b, na] = j
                    na += 1
                hit[j] = _LABEL
            target = min(min_active, n, cap_active)
            n_fixed[b] = na
            if na < target:
                state = np.uint64(step_seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(b + 1)
                na = draw_distinct(hit, _SELECTED, ids[b], na, target, n, state)
            for i in range(na):
                j = ids[b, i]
                is_label[b, i] = 1 if hit[j] == _LABEL else 0
                hit[j] = 0
            n_active[b] = na
            drawn = na - n_fixed[b]
            offset[b] = np.log((n - n_fixed[b]) / drawn) if logq and drawn > 0 else 0.0


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def forward_active(h, w, bias, ids, n_active, is_label, n_fixed, offset, logits, dz, loss):
    """Logits of the active neurons, softmax over them, loss with 1/|y| targets per label.

    Logits of the random top-up (positions from ``n_fixed[b]`` on) get ``offset[b]`` added
    (0 unless log-Q correction is on, see :func:`select_active`); the offset is a constant,
    so d loss / d logit is unchanged in form and backward needs no change.

    ``dz`` receives d loss_b / d logit (softmax - target); a sample without labels gets loss
    0 and zero gradient (inference passes no labels and ignores dz and loss). The dot
    products may be reassociated (``FASTMATH``) so that they vectorise: 2-3x faster at 670K
    labels; the sum order is fixed by the code, so a thread count still gives the same bits.
    """
    batch, dim = h.shape
    for b in prange(batch):
        na = n_active[b]
        hb = h[b]
        zmax = -np.inf
        for i in range(na):
            j = ids[b, i]
            wj = w[j]
            acc = np.float32(0.0)
            for d in range(dim):
                acc += wj[d] * hb[d]
            acc += bias[j]
            if i >= n_fixed[b]:
                acc += offset[b]
            logits[b, i] = acc
            if acc > zmax:
                zmax = acc
        total = 0.0
        n_lab = 0
        for i in range(na):
            total += np.exp(logits[b, i] - zmax)
            n_lab += is_label[b, i]
        log_total = np.log(total)
        lb = 0.0
        for i in range(na):
            logp = logits[b, i] - zmax - log_total
            if n_lab > 0:
                target = is_label[b, i] / n_lab
                lb -= target * logp
                dz[b, i] = np.exp(logp) - target
            else:
                dz[b, i] = 0.0
        loss[b] = lb


@njit(parallel=True, cache=True)
def topk_active(ids, n_active, logits, k, top_logits, top_ids):
    """Each row's ``k`` largest logits among its active entries (``logits[b, :n_active[b]]``
    of neurons ``ids[b, :n_active[b]]``), best first, into ``top_logits``/``top_ids`` [B, k];
    a row with fewer than ``k`` active neurons is padded with -inf and id -1. Insertion into
    a sorted buffer of ``k``: O(active x k) per row, no [B, N] scores (LSH inference's
    top-k path); an equal logit keeps the earlier entry first."""
    for b in prange(top_ids.shape[0]):
        vals = top_logits[b]
        out = top_ids[b]
        vals[:] = -np.inf
        out[:] = -1
        for i in range(n_active[b]):
            z = logits[b, i]
            if z <= vals[k - 1]:
                continue
            pos = k - 1
            while pos > 0 and vals[pos - 1] < z:
                vals[pos] = vals[pos - 1]
                out[pos] = out[pos - 1]
                pos -= 1
            vals[pos] = z
            out[pos] = ids[b, i]


@njit(cache=True)
def shared_list(labels, n, want, seed, flag, out):
    """``topup=batch``: the batch's distinct labels, sorted, then distinct uniform draws
    among the other neurons, ``min(want, n)`` candidates in all (or just the labels if they
    are more). Writes ``out[:count]`` and returns (count, number of labels at its head);
    ``flag`` (one byte per neuron, zero on entry) is left cleared."""
    n_lab = touched_features(labels, flag, out)  # the distinct ids of a padded id matrix
    out[:n_lab].sort()
    for i in range(n_lab):
        flag[out[i]] = 1  # labels are not drawn
    target = max(n_lab, min(want, n))
    count = n_lab
    state = np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(1)
    count = draw_distinct(flag, 1, out, count, target, n, state)
    for i in range(count):
        flag[out[i]] = 0
    return count, n_lab


@njit(parallel=True, cache=True)
def drop_shared(ids, n_active, in_shared):
    """``topup=batch``: remove from each sample's active list (in place, order kept) the
    neurons of the shared list (``in_shared[j]`` = 1), which every sample scores anyway;
    ``n_active`` becomes the number of the sample's own neurons."""
    for b in prange(ids.shape[0]):
        k = 0
        for i in range(n_active[b]):
            j = ids[b, i]
            if in_shared[j] == 0:
                ids[b, k] = j
                k += 1
        n_active[b] = k


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def forward_batch_topup(h, w, bias, own, n_own, z_sh, n_lab_sh, logq, n, lab_pos, z_own, loss):
    """``topup=batch``: the softmax of each sample over its own neurons ``own[b, :n_own[b]]``
    and the shared list, whose logits ``z_sh`` [B, S] (h W_S^T + b_S, one GEMM) come in.

    The shared list is the batch's ``n_lab_sh`` labels, then uniform draws; with ``logq`` the
    drawn part gets log((n - own - labels) / drawn) added (each stands for that many
    neurons). ``lab_pos[b, q]`` is the column of sample b's q-th label in the list (-1:
    padding); every label weighs 1/(the sample's label count). On return ``z_own`` and
    ``z_sh`` hold d loss_b / d logit (softmax - target) and ``loss[b]`` the sample's loss; a
    sample without labels gets loss 0 and zero gradients."""
    batch, dim = h.shape
    width = z_sh.shape[1]
    drawn = width - n_lab_sh
    for b in prange(batch):
        no = n_own[b]
        hb = h[b]
        off = np.float32(0.0)
        if logq and drawn > 0:
            off = np.float32(np.log((n - no - n_lab_sh) / drawn))
        zmax = -np.inf
        for i in range(no):
            wj = w[own[b, i]]
            acc = np.float32(0.0)
            for d in range(dim):
                acc += wj[d] * hb[d]
            acc += bias[own[b, i]]
            z_own[b, i] = acc
            zmax = max(zmax, acc)
        for s in range(n_lab_sh, width):
            z_sh[b, s] += off
        for s in range(width):
            zmax = max(zmax, z_sh[b, s])
        n_lab = 0
        for q in range(lab_pos.shape[1]):
            if lab_pos[b, q] >= 0:
                n_lab += 1
        if n_lab == 0:
            z_own[b, :no] = 0.0
            z_sh[b, :] = 0.0
            loss[b] = 0.0
            continue
        lb = 0.0
        for q in range(lab_pos.shape[1]):
            if lab_pos[b, q] >= 0:
                lb -= (z_sh[b, lab_pos[b, q]] - zmax) / n_lab
        # one exp per logit: keep exp(z - zmax), then divide by the sum (the softmax)
        total = 0.0
        for i in range(no):
            e = np.exp(z_own[b, i] - zmax)
            z_own[b, i] = e
            total += e
        for s in range(width):
            e = np.exp(z_sh[b, s] - zmax)
            z_sh[b, s] = e
            total += e
        lb += np.log(total)
        inv = np.float32(1.0 / total)
        for i in range(no):
            z_own[b, i] *= inv
        for s in range(width):
            z_sh[b, s] *= inv
        for q in range(lab_pos.shape[1]):
            if lab_pos[b, q] >= 0:
                z_sh[b, lab_pos[b, q]] -= np.float32(1.0 / n_lab)
        loss[b] = lb


@njit(parallel=True, cache=True)
def backward_active(h, w, ids, n_active, dz, scale, dh, slot, grad_w, grad_b, n_chunks):
    """dh = sum_i dz_i w[j_i] (from the weights before the update); the gradient of row j
    accumulates dz_i * h into the packed row ``grad_w[slot[j]]`` without locks (HOGWILD)."""
    batch, dim = h.shape
    n_chunks = min(batch, max(1, n_chunks))
    for c in prange(n_chunks):
        for b in range(c, batch, n_chunks):
            for d in range(dim):
                dh[b, d] = 0.0
            for i in range(n_active[b]):
                j = ids[b, i]
                g = dz[b, i] * scale
                if g == 0.0:
                    continue
                gj = grad_w[slot[j]]
                for d in range(dim):
                    dh[b, d] += g * w[j, d]
                    gj[d] += g * h[b, d]
                grad_b[slot[j]] += g


RADIX_BITS = 11
"""At most this many key bits per radix pass: 2,048 counters per part stay in L1."""


def radix_passes(n: int) -> tuple[int, int]:
    """(passes, bits per pass) for sorting keys in [0, n): the fewest passes of at most
    :data:`RADIX_BITS` bits, the bits spread evenly (670K rows: 2 passes of 10 bits)."""
    bits = max(1, (max(n, 2) - 1).bit_length())
    passes = -(-bits // RADIX_BITS)
    return passes, -(-bits // passes)


def entry_shift(width: int) -> int:
    """Bits of the position within a sample in a packed entry ``b << shift | i``: a power of
    two, so that decoding is a shift and a mask, not a division per entry."""
    return max(1, (max(width, 2) - 1).bit_length())


@njit(cache=True, inline="always")
def _split(total, c, parts):
    """Part c's slice [lo, hi) of ``total`` items split into ``parts`` near-equal ones."""
    return total * c // parts, total * (c + 1) // parts


@njit(parallel=True, cache=True)
def index_rows(ids, counts, parts, shift, passes, bits, key_a, ent_a, key_b, ent_b, slot, rows,
               start, with_slots):
    """Index a batch's active lists by row (a CSR transpose of ``ids``): the distinct ids
    >= 0 of ``ids[b, :counts[b]]`` sorted in ``rows[:k]`` (returns k), ``start[r]`` = how
    many entries the rows before r have, and row r's entries, packed ``b << shift | i``
    (see :func:`entry_shift`), in (b, i) order in ``ent[start[r]:start[r + 1]]``, where
    ``ent`` is ``ent_a`` after an even number of ``passes`` and ``ent_b`` after an odd one
    (:meth:`RowGradients.assign` picks it). With ``with_slots``, also ``slot[j]`` = j's
    position in ``rows`` (the HOGWILD kernels add into ``grad_w[slot[j]]``; the caller
    resets it, see :func:`release_slots`).

    Why a transpose: with it every gradient row is summed by one thread from its own
    entries (:func:`accumulate_rows`), instead of every sample adding into shared rows
    (HOGWILD), which at 670K labels missed cache on each of 128K scattered row updates.

    How: a stable least-significant-digit radix sort of the (row, entry) pairs, ``passes``
    passes of ``bits`` bits (:func:`radix_passes`), each split over the threads: a part
    counts its contiguous slice's digits, one short serial prefix over (digit, part) gives
    every part its write positions, and each part scatters its slice there. Stable, so a
    row's entries keep their (b, i) order whatever the thread count. Why not counters per
    id: they are as wide as the layer, and clearing or scanning them (670K ids, once per
    thread) cost more than sorting the ~128K entries and scaled worse on two threads.
    ``parts``: slices (one per thread); ``key_*`` and ``ent_*`` (int32) must hold
    ``ids.size`` entries."""
    batch = ids.shape[0]
    # 1. the valid entries of each block of samples, then copied out in (b, i) order
    per_block = np.zeros(parts + 1, np.int64)
    for q in prange(parts):
        lo, hi = _split(batch, q, parts)
        m = 0
        for b in range(lo, hi):
            for i in range(counts[b]):
                if ids[b, i] >= 0:
                    m += 1
        per_block[q + 1] = m
    for q in range(parts):
        per_block[q + 1] += per_block[q]
    total = per_block[parts]
    for q in prange(parts):
        lo, hi = _split(batch, q, parts)
        e = per_block[q]
        for b in range(lo, hi):
            for i in range(counts[b]):
                j = ids[b, i]
                if j >= 0:
                    key_a[e] = j
                    ent_a[e] = (b << shift) | i
                    e += 1
    # 2. radix passes, a <-> b
    radix = 1 << bits
    mask = radix - 1
    hist = np.zeros((parts, radix), np.int64)
    for p in range(passes):
        src_k, src_e = (key_a, ent_a) if p % 2 == 0 else (key_b, ent_b)
        dst_k, dst_e = (key_b, ent_b) if p % 2 == 0 else (key_a, ent_a)
        sh = p * bits
        for c in prange(parts):
            lo, hi = _split(total, c, parts)
            hc = hist[c]
            hc[:] = 0
            for e in range(lo, hi):
                hc[(src_k[e] >> sh) & mask] += 1
        pos = 0
        for d in range(radix):
            for c in range(parts):
                here = hist[c, d]
                hist[c, d] = pos
                pos += here
        for c in prange(parts):
            lo, hi = _split(total, c, parts)
            hc = hist[c]
            for e in range(lo, hi):
                key = src_k[e]
                d = (key >> sh) & mask
                at = hc[d]
                hc[d] = at + 1
                dst_k[at] = key
                dst_e[at] = src_e[e]
    key = key_a if passes % 2 == 0 else key_b
    # 3. rows: where the sorted keys change
    heads = np.zeros(parts + 1, np.int64)
    for c in prange(parts):
        lo, hi = _split(total, c, parts)
        m = 0
        for e in range(lo, hi):
            if e == 0 or key[e] != key[e - 1]:
                m += 1
        heads[c + 1] = m
    for c in range(parts):
        heads[c + 1] += heads[c]
    for c in prange(parts):
        lo, hi = _split(total, c, parts)
        r = heads[c]
        for e in range(lo, hi):
            if e == 0 or key[e] != key[e - 1]:
                j = key[e]
                rows[r] = j
                start[r] = e
                if with_slots:
                    slot[j] = r
                r += 1
    k = heads[parts]
    start[k] = total
    return k


@njit(cache=True, inline="always")
def _row_range(start, n_rows, c, parts):
    """Part c's contiguous range [lo, hi) of the ``n_rows`` indexed rows, the ranges holding
    about equal numbers of entries (``start``: entries before each row)."""
    total = start[n_rows]
    lo = np.searchsorted(start[:n_rows], total * c // parts)
    hi = n_rows if c == parts - 1 else np.searchsorted(start[:n_rows], total * (c + 1) // parts)
    return lo, hi


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def accumulate_rows(rows, n_rows, start, ent, shift, coef, scale, x, w, dh_parts, grad_w,
                    grad_b):
    """Row-parallel gradients from the index of :func:`index_rows`: for packed row r (layer
    row j = ``rows[r]``) and each entry (b, i) of it, with g = coef[b, i] * scale,
    ``grad_w[r] += g * x[b]`` and ``grad_b[r] += g`` (when ``grad_b`` is not empty); when
    ``dh_parts`` [T, B, D] is not empty, also ``dh_parts[c, b] += g * w[j]`` (the input
    gradient from the weights before the update), one part per thread, summed by the caller.

    Threads take contiguous ranges of rows holding about equal numbers of entries. Each row
    is summed by one thread in (b, i) order, so the row gradients are the same bits for any
    thread count; the input gradient's parts split by thread count. Zero coefficients are
    skipped, as in :func:`backward_active`."""
    dim = x.shape[1]
    low = (1 << shift) - 1
    t_chunks = dh_parts.shape[0]
    with_dh = dh_parts.shape[1] > 0
    for c in prange(t_chunks):
        lo, hi = _row_range(start, n_rows, c, t_chunks)
        if with_dh:
            dh_parts[c, :, :] = 0.0
        for r in range(lo, hi):
            j = rows[r]
            gr = grad_w[r]
            gb = np.float32(0.0)
            for e in range(start[r], start[r + 1]):
                b = ent[e] >> shift
                g = coef[b, ent[e] & low] * scale
                if g == 0.0:
                    continue
                gb += g
                xb = x[b]
                if with_dh:
                    db = dh_parts[c, b]
                    wj = w[j]
                    for d in range(dim):
                        gr[d] += g * xb[d]
                        db[d] += g * wj[d]
                else:
                    for d in range(dim):
                        gr[d] += g * xb[d]
            if grad_b.shape[0] > 0:
                grad_b[r] += gb


@njit(cache=True)
def release_slots(rows, n_rows, slot):
    """Reset ``slot`` to -1 for ``rows[:n_rows]`` (what :func:`index_rows` expects)."""
    for r in range(n_rows):
        slot[rows[r]] = -1


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def sparse_adam(rows, n_rows, w, grad_w, m_w, v_w, bias, grad_b, m_b, v_b, steps, dirty,
                lr, beta1, beta2, eps, global_t):
    """Adam on the given rows only (lazy Adam: untouched rows keep their moments and weights).

    Gradients come packed: ``grad_w[r]`` / ``grad_b[r]`` belong to row ``rows[r]`` (see
    :func:`index_rows`). Why packed: the gradient block of one batch stays in cache while
    it accumulates, and the update reads and clears it there instead of a scattered
    [n, d] array: ~40% less time for 6,000 rows of 128 at 200K labels
    (``benchmarks/slide_profile.py``).

    Bias correction: with ``global_t`` > 0 every row uses the global step count ``global_t``
    (torch's SparseAdam and TF's LazyAdam do this); with ``global_t`` = 0 each row uses its
    own update count ``steps[j]``. Why global is the default: a row's moments are not decayed
    while the row is idle, so a rarely used row sees its few gradients at up to ~3-6x the
    step size under global correction, which is what lets rare rows (feature embeddings,
    rarely sampled labels) catch up; the per-row count divides that away and made SLIDE learn
    less per step than the dense baseline (``benchmarks/slide_diag.py``, adam_correction=row). Gradients of the
    updated rows are zeroed; rows are flagged dirty for rehashing. The per-element update
    runs in float32 (as torch's Adam does), the per-row corrections in float64."""
    dim = w.shape[1]
    b1, b2, e = np.float32(beta1), np.float32(beta2), np.float32(eps)
    ob1, ob2 = np.float32(1.0) - b1, np.float32(1.0) - b2
    for r in prange(n_rows):
        j = rows[r]
        steps[j] += 1
        t = global_t if global_t > 0 else steps[j]
        step_size = np.float32(lr / (1.0 - beta1**t))
        inv_c2 = np.float32(1.0 / np.sqrt(1.0 - beta2**t))
        wj, gj, mj, vj = w[j], grad_w[r], m_w[j], v_w[j]
        for d in range(dim):
            g = gj[d]
            m = b1 * mj[d] + ob1 * g
            v = b2 * vj[d] + ob2 * g * g
            mj[d] = m
            vj[d] = v
            wj[d] -= step_size * m / (np.sqrt(v) * inv_c2 + e)
            gj[d] = 0.0
        if bias.shape[0] > 0:
            g = grad_b[r]
            m = b1 * m_b[j] + ob1 * g
            v = b2 * v_b[j] + ob2 * g * g
            m_b[j] = m
            v_b[j] = v
            bias[j] -= step_size * m / (np.sqrt(v) * inv_c2 + e)
            grad_b[r] = 0.0
        dirty[j] = 1


# ------------------------------------------------------------------ sparse input layer


@njit(parallel=True, cache=True)
def sparse_input_forward(feat, vals, w, bias, out):
    """out[b] = bias + sum_p vals[b, p] * w[feat[b, p]] over the non-padding (>= 0) ids."""
    batch, width = feat.shape
    dim = w.shape[1]
    for b in prange(batch):
        for d in range(dim):
            out[b, d] = bias[d]
        for p in range(width):
            f = feat[b, p]
            if f < 0:
                continue
            v = vals[b, p]
            for d in range(dim):
                out[b, d] += v * w[f, d]


@njit(parallel=True, cache=True)
def sparse_input_backward(feat, vals, grad_out, slot, grad_w, n_chunks):
    """grad_w[slot[f]] += vals * grad_out[b] for every feature of every sample (HOGWILD; the
    gradient rows are packed, see :func:`index_rows`)."""
    batch, width = feat.shape
    dim = grad_w.shape[1]
    n_chunks = min(batch, max(1, n_chunks))
    for c in prange(n_chunks):
        for b in range(c, batch, n_chunks):
            for p in range(width):
                f = feat[b, p]
                if f < 0:
                    continue
                v = vals[b, p]
                gf = grad_w[slot[f]]
                for d in range(dim):
                    gf[d] += v * grad_out[b, d]


@njit(cache=True)
def touched_features(feat, flag, out):
    """The distinct ids >= 0 of a padded id matrix, in first-seen order (flag is left
    cleared)."""
    n = 0
    for b in range(feat.shape[0]):
        for p in range(feat.shape[1]):
            f = feat[b, p]
            if f >= 0 and flag[f] == 0:
                flag[f] = 1
                out[n] = f
                n += 1
    for r in range(n):
        flag[out[r]] = 0
    return n
