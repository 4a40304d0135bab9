"""Exact dynamic programs of the design (numba).

Both programs split a sequence of **atoms** into K contiguous runs, minimising the sum over runs of

    cost(j, i) = (F2[i] - F2[j]) - (FW[i] - FW[j])**2 / (W[i] - W[j])

where W, FW, F2 are prefix sums (length n + 1, starting at 0) of each atom's mass, first moment and second moment.
The cost of a run is its weighted squared error around its optimal level y = (FW[i] - FW[j]) / (W[i] - W[j]).

* **intervals mode** (the paper's eq. 7): atoms are the cells of a grid in x, in x order; runs are the intervals of
  the approximation. :func:`intervals_dp` scans j leftwards from i - 1: cost(j, i) only grows and D(k-1, j) >= 0,
  so it stops as soon as cost(j, i) >= the best value so far (exact pruning). Two more exact bounds make flat
  regions cheap: the argmin of i - 1 is tried first, and a block of 32 candidates is skipped when the block's
  minimum of D(k-1, .) plus cost(j, i) at its right end cannot beat the best. Rows i run in 64 chunks in parallel.
* **level-sets mode**: atoms are sorted by their mean value f' (cells of the grid, or samples); runs are the
  clusters of an exact weighted 1-D k-means. On sorted values the cost is Monge, so each layer is solved by
  divide and conquer on monotone argmins (O(K n log n)): :func:`levelsets_dp`.

Each has a plain O(n^2 K) twin (``*_reference``) for tests and benchmarks. Ties go to the same choice in both.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = [
    "intervals_dp",
    "intervals_dp_reference",
    "levelsets_dp",
    "levelsets_dp_reference",
    "merge_sorted_atoms",
    "kmeans_1d",
    "run_cost",
]

# Intervals DP: candidates are bounded in blocks of this many j; rows i are split into this many parallel chunks.
_BLOCK = 32
_CHUNKS = 64
# Work n * K from which the layers run multi-threaded by default.
_PARALLEL_WORK = 1 << 24
# The parallel level-sets layer solves this many top levels of its recursion serially, then the segments in parallel.
_SEGMENTS_LEVELS = 6


@numba.njit(cache=True)
def _cost(W, FW, F2, j, i):  # pragma: no cover - compiled
    # The hot loops repeat these lines inline: a call per candidate is several times slower in numba, and so is this
    # function with numba.njit(inline="always") (measured: 2.3-4.3x on the intervals and level-sets DPs, one thread).
    mass = W[i] - W[j]
    value = F2[i] - F2[j]
    if mass > 0.0:
        first = FW[i] - FW[j]
        value -= first * first / mass
    if value < 0.0:  # cancellation
        value = 0.0
    return value


def run_cost(prefix: np.ndarray, j: int, i: int) -> float:
    """cost(j, i) of the run of atoms j..i-1 from prefix sums ``prefix`` (rows W, FW, F2)."""
    return float(_cost(prefix[0], prefix[1], prefix[2], j, i))


# ----------------------------------------------------------------------------------------------------------------------
# Intervals mode


@numba.njit(cache=True)
def _intervals_row(W, FW, F2, previous, block_min, block, k, i, guess):  # pragma: no cover - compiled
    """min over j of previous[j] + cost(j, i), ties to the largest j; ``guess`` is a likely argmin (or -1)."""
    best = np.inf
    best_j = -1
    if k - 1 <= guess < i:
        best = previous[guess] + _cost(W, FW, F2, guess, i)
        best_j = guess
    j = i - 1
    while j >= k - 1:
        start = max((j // block) * block, k - 1)
        mass = W[i] - W[j]
        cost = F2[i] - F2[j]
        if mass > 0.0:
            first = FW[i] - FW[j]
            cost -= first * first / mass
        if cost < 0.0:
            cost = 0.0
        # Every j' <= j costs at least cost(j, i) (the cost only grows leftwards) plus previous[j'] >= 0 ...
        if cost > best or (cost == best and j < best_j):
            break
        # ... and in this block previous[j'] >= block_min: skip the block when that cannot beat the best.
        bound = block_min[j // block] + cost
        if bound > best or (bound == best and j < best_j):
            j = start - 1
            continue
        for jj in range(j, start - 1, -1):
            mass = W[i] - W[jj]
            cost = F2[i] - F2[jj]
            if mass > 0.0:
                first = FW[i] - FW[jj]
                cost -= first * first / mass
            if cost < 0.0:
                cost = 0.0
            if cost > best or (cost == best and jj < best_j):
                return best, best_j
            candidate = previous[jj] + cost
            if candidate < best or (candidate == best and jj > best_j):
                best = candidate
                best_j = jj
        j = start - 1
    return best, best_j


@numba.njit(cache=True)
def _block_minima(values, block):  # pragma: no cover - compiled
    blocks = (values.size + block - 1) // block
    out = np.empty(blocks)
    for b in range(blocks):
        out[b] = values[b * block : min((b + 1) * block, values.size)].min()
    return out


@numba.njit(cache=True)
def _intervals_rows(W, FW, F2, previous, block_min, current, argmin, k, i_start, i_stop):  # pragma: no cover
    # Rows i in order: the argmin of i - 1 is the first candidate for i.
    guess = -1
    for i in range(i_start, i_stop):
        best, best_j = _intervals_row(W, FW, F2, previous, block_min, _BLOCK, k, i, guess)
        current[i] = best
        argmin[i] = best_j
        guess = best_j


@numba.njit(cache=True, parallel=True)
def _intervals_layer_parallel(W, FW, F2, previous, current, argmin, k, first_i, last_i):  # pragma: no cover
    block_min = _block_minima(previous, _BLOCK)
    count = last_i - first_i + 1
    chunks = min(count, _CHUNKS)
    for c in numba.prange(chunks):
        i_start = first_i + (c * count) // chunks
        i_stop = first_i + ((c + 1) * count) // chunks
        _intervals_rows(W, FW, F2, previous, block_min, current, argmin, k, i_start, i_stop)


@numba.njit(cache=True)
def _intervals_layer_serial(W, FW, F2, previous, current, argmin, k, first_i, last_i):  # pragma: no cover
    block_min = _block_minima(previous, _BLOCK)
    _intervals_rows(W, FW, F2, previous, block_min, current, argmin, k, first_i, last_i + 1)


@numba.njit(cache=True)
def _intervals_reference_layer(W, FW, F2, previous, current, argmin, k, first_i, last_i):  # pragma: no cover
    for i in range(first_i, last_i + 1):
        best = np.inf
        best_j = -1
        for j in range(i - 1, k - 2, -1):
            mass = W[i] - W[j]
            cost = F2[i] - F2[j]
            if mass > 0.0:
                first = FW[i] - FW[j]
                cost -= first * first / mass
            if cost < 0.0:
                cost = 0.0
            candidate = previous[j] + cost
            if candidate < best:  # ties: the largest j
                best = candidate
                best_j = j
        current[i] = best
        argmin[i] = best_j


@numba.njit(cache=True)
def _first_layer(W, FW, F2):  # pragma: no cover - compiled
    out = np.full(W.size, np.inf)
    for i in range(1, W.size):
        out[i] = _cost(W, FW, F2, 0, i)
    return out


def _check_prefix(prefix: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    prefix = np.ascontiguousarray(prefix, dtype=np.float64)
    assert prefix.ndim == 2 and prefix.shape[0] == 3, "prefix must have rows W, FW, F2"
    n = prefix.shape[1] - 1
    assert 1 <= K <= n, f"need 1 <= K <= atoms, got K={K}, atoms={n}"
    return prefix[0], prefix[1], prefix[2], n


def _layers(layer, prefix: np.ndarray, K: int) -> tuple[float, np.ndarray]:
    W, FW, F2, n = _check_prefix(prefix, K)
    argmins = np.zeros((K, n + 1), dtype=np.int32)
    previous = _first_layer(W, FW, F2)
    current = np.full(n + 1, np.inf)
    for k in range(2, K + 1):
        current.fill(np.inf)
        # With k runs, i >= k atoms; the last layer needs only i = n.
        first_i = n if k == K else k
        layer(W, FW, F2, previous, current, argmins[k - 1], k, first_i, n)
        previous, current = current, previous
    cuts = np.empty(K - 1, dtype=np.int64)
    i = n
    for k in range(K, 1, -1):
        i = int(argmins[k - 1, i])
        cuts[k - 2] = i
    return float(previous[n]), cuts


def _parallel(parallel: bool | None, n: int, K: int) -> bool:
    """Whether to use the multi-threaded layers: by default when numba has several threads and the work is large.

    Small problems run serially: a parallel region per layer costs more than it saves there, and much more when
    the cores are shared with other processes.
    """
    if parallel is not None:
        return bool(parallel)
    return numba.get_num_threads() > 1 and n * K >= _PARALLEL_WORK


def intervals_dp(prefix: np.ndarray, K: int, *, parallel: bool | None = None) -> tuple[float, np.ndarray]:
    """Exact optimal split of n grid cells into K intervals (eq. 7), with exact pruning.

    ``prefix`` holds rows W, FW, F2 of prefix integrals (length n + 1). Returns the optimal cost and the K - 1 cut
    indices 0 < c_1 < ... < c_{K-1} < n (grid points where intervals meet). ``parallel`` runs rows i on all numba
    threads (default: only for large n * K, see :func:`_parallel`). Memory: O(n) per layer plus an int32 argmin
    table of K x (n + 1).

    >>> prefix = np.cumsum(np.array([[0, 1, 1, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]], float), axis=1)
    >>> intervals_dp(prefix, 2)
    (0.0, array([2]))
    """
    n = np.shape(prefix)[1] - 1
    layer = _intervals_layer_parallel if _parallel(parallel, n, K) else _intervals_layer_serial
    return _layers(layer, prefix, K)


def intervals_dp_reference(prefix: np.ndarray, K: int) -> tuple[float, np.ndarray]:
    """The plain O(n^2 K) version of :func:`intervals_dp` (serial, no pruning): the test and benchmark baseline."""
    return _layers(_intervals_reference_layer, prefix, K)


# ----------------------------------------------------------------------------------------------------------------------
# Level-sets mode


@numba.njit(cache=True)
def _scan(W, FW, F2, previous, i, low, high):  # pragma: no cover - compiled
    best = np.inf
    best_j = low
    for j in range(low, high + 1):
        mass = W[i] - W[j]
        cost = F2[i] - F2[j]
        if mass > 0.0:
            first = FW[i] - FW[j]
            cost -= first * first / mass
        if cost < 0.0:
            cost = 0.0
        candidate = previous[j] + cost
        if candidate < best:
            best = candidate
            best_j = j
    return best, best_j


@numba.njit(cache=True)
def _solve_segment(W, FW, F2, previous, current, argmin, lo, hi, opt_lo, opt_hi):  # pragma: no cover - compiled
    """Divide and conquer over i in [lo, hi] with argmins known to lie in [opt_lo, opt_hi] (monotone argmins)."""
    stack = np.empty((256, 4), dtype=np.int64)
    stack[0, 0], stack[0, 1], stack[0, 2], stack[0, 3] = lo, hi, opt_lo, opt_hi
    top = 1
    while top > 0:
        top -= 1
        a, b, oa, ob = stack[top, 0], stack[top, 1], stack[top, 2], stack[top, 3]
        if a > b:
            continue
        mid = (a + b) // 2
        best, best_j = _scan(W, FW, F2, previous, mid, oa, min(ob, mid - 1))
        current[mid] = best
        argmin[mid] = best_j
        stack[top, 0], stack[top, 1], stack[top, 2], stack[top, 3] = mid + 1, b, best_j, ob
        stack[top + 1, 0], stack[top + 1, 1], stack[top + 1, 2], stack[top + 1, 3] = a, mid - 1, oa, best_j
        top += 2


@numba.njit(cache=True)
def _levelsets_layer_serial(W, FW, F2, previous, current, argmin, k, first_i, last_i):  # pragma: no cover
    _solve_segment(W, FW, F2, previous, current, argmin, first_i, last_i, k - 1, last_i - 1)


@numba.njit(cache=True, parallel=True)
def _levelsets_layer_parallel(W, FW, F2, previous, current, argmin, k, first_i, last_i):  # pragma: no cover
    # Top levels of the recursion serially (few, wide segments), then the segments in parallel. The split step is
    # _solve_segment's written out: shared as a function (a call, or numba.njit(inline="always")) it made the
    # level-sets DP 1.5-4x slower (n = 2e4-1e5, K = 8-256, serial and parallel; measured, A/B against this code).
    capacity = 1 << (_SEGMENTS_LEVELS + 1)
    segments = np.empty((capacity, 4), dtype=np.int64)
    segments[0, 0], segments[0, 1], segments[0, 2], segments[0, 3] = first_i, last_i, k - 1, last_i - 1
    count = 1
    for _ in range(_SEGMENTS_LEVELS):
        following = np.empty((capacity, 4), dtype=np.int64)
        used = 0
        for s in range(count):
            a, b, oa, ob = segments[s, 0], segments[s, 1], segments[s, 2], segments[s, 3]
            if a > b:
                continue
            mid = (a + b) // 2
            best, best_j = _scan(W, FW, F2, previous, mid, oa, min(ob, mid - 1))
            current[mid] = best
            argmin[mid] = best_j
            following[used, 0], following[used, 1], following[used, 2], following[used, 3] = a, mid - 1, oa, best_j
            following[used + 1, 0], following[used + 1, 1] = mid + 1, b
            following[used + 1, 2], following[used + 1, 3] = best_j, ob
            used += 2
        segments = following
        count = used
    for s in numba.prange(count):
        _solve_segment(
            W, FW, F2, previous, current, argmin, segments[s, 0], segments[s, 1], segments[s, 2], segments[s, 3]
        )


def levelsets_dp(prefix: np.ndarray, K: int, *, parallel: bool | None = None) -> tuple[float, np.ndarray]:
    """Exact weighted 1-D k-means of atoms sorted by value: optimal split into K contiguous clusters.

    ``prefix`` holds rows W, FW, F2 of prefix sums over atoms sorted by their mean value FW/W, each atom with
    positive mass. Divide and conquer per layer (the cost is Monge on sorted values: O(K n log n)); ``parallel``
    solves the segments of each layer on all numba threads. Returns the optimal cost and the K - 1 cut indices
    (atom i belongs to cluster r when cuts[r-1] <= i < cuts[r]).

    >>> values = np.array([0.0, 0.1, 5.0, 5.2])
    >>> prefix = np.vstack([np.arange(5.0), np.r_[0, np.cumsum(values)], np.r_[0, np.cumsum(values**2)]])
    >>> cost, cuts = levelsets_dp(prefix, 2)
    >>> round(cost, 6), cuts.tolist()
    (0.025, [2])
    """
    n = np.shape(prefix)[1] - 1
    layer = _levelsets_layer_parallel if _parallel(parallel, n, K) else _levelsets_layer_serial
    return _layers(layer, prefix, K)


@numba.njit(cache=True)
def _levelsets_reference_layer(W, FW, F2, previous, current, argmin, k, first_i, last_i):  # pragma: no cover
    for i in range(first_i, last_i + 1):
        best, best_j = _scan(W, FW, F2, previous, i, k - 1, i - 1)
        current[i] = best
        argmin[i] = best_j


def levelsets_dp_reference(prefix: np.ndarray, K: int) -> tuple[float, np.ndarray]:
    """The plain O(n^2 K) version of :func:`levelsets_dp`: the test and benchmark baseline."""
    return _layers(_levelsets_reference_layer, prefix, K)


# ----------------------------------------------------------------------------------------------------------------------
# Atoms


def merge_sorted_atoms(
    values: np.ndarray, masses: np.ndarray, seconds: np.ndarray | None = None, *, tolerance: float = 1e-12
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort atoms by value, drop massless ones and merge (nearly) identical values.

    ``values`` are the atoms' mean values, ``masses`` their masses (> 0 to count) and ``seconds`` their second moments
    (default mass * value**2, i.e. point masses). Values within ``tolerance * (1 + |v|)`` of the first value of a run
    are merged. Returns ``(prefix, group, sums)``: prefix sums over the merged atoms (rows W, FW, F2, length
    groups + 1); for each kept atom in the order ``np.argsort(values, kind="stable")``, its group index; and the
    merged atoms' own W, FW, F2 (3, groups).
    """
    prefix, group, sums, _ = _merge(values, masses, seconds, tolerance)
    return prefix, group, sums


def _merge(values, masses, seconds, tolerance):
    """:func:`merge_sorted_atoms` plus the sorted kept values."""
    values = np.asarray(values, dtype=np.float64).ravel()
    masses = np.asarray(masses, dtype=np.float64).ravel()
    seconds = None if seconds is None else np.asarray(seconds, dtype=np.float64).ravel()
    keep = masses > 0
    if not keep.all():
        values, masses = values[keep], masses[keep]
        seconds = None if seconds is None else seconds[keep]
    order = np.argsort(values, kind="stable")
    values, masses = values[order], masses[order]
    first = masses * values
    seconds = first * values if seconds is None else seconds[order]
    group = _group_runs(values, tolerance)
    groups = int(group[-1]) + 1 if group.size else 0
    sums = np.zeros((3, groups))
    if groups:
        sums[0] = np.bincount(group, masses, groups)
        sums[1] = np.bincount(group, first, groups)
        sums[2] = np.bincount(group, seconds, groups)
    from .integrals import _compensated_cumsum

    return _compensated_cumsum(sums), group, sums, values


@numba.njit(cache=True)
def _group_runs(sorted_values, tolerance):  # pragma: no cover - compiled
    group = np.empty(sorted_values.size, dtype=np.int64)
    current = -1
    start = 0.0
    for i in range(sorted_values.size):
        v = sorted_values[i]
        if current < 0 or v - start > tolerance * (1.0 + abs(start)):
            current += 1
            start = v
        group[i] = current
    return group


def kmeans_1d(
    values: np.ndarray,
    weights: np.ndarray | None = None,
    K: int = 2,
    *,
    reference: bool = False,
    parallel: bool | None = None,
) -> tuple[float, np.ndarray, np.ndarray]:
    """Exact weighted 1-D k-means: the K levels minimising sum w_i (v_i - level(v_i))**2.

    Returns ``(cost, levels, boundaries)``: ascending levels (fewer than K when there are fewer distinct values)
    and the K - 1 value thresholds between clusters (a value v belongs to cluster searchsorted(boundaries, v,
    'right')). ``reference`` uses the plain O(n^2 K) DP.

    >>> cost, levels, _ = kmeans_1d(np.array([1.0, 1.0, 2.0, 9.0, 10.0]), K=2)
    >>> levels.tolist()
    [1.3333333333333333, 9.5]
    """
    values = np.asarray(values, dtype=np.float64).ravel()
    weights = np.ones_like(values) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    prefix, group, _, kept = _merge(values, weights, None, 1e-12)
    groups = prefix.shape[1] - 1
    K = min(int(K), groups)
    cost, cuts = levelsets_dp_reference(prefix, K) if reference else levelsets_dp(prefix, K, parallel=parallel)
    edges = np.concatenate([[0], cuts, [groups]])
    mass = prefix[0, edges[1:]] - prefix[0, edges[:-1]]
    levels = (prefix[1, edges[1:]] - prefix[1, edges[:-1]]) / mass
    # Threshold between clusters: the first value of the next cluster.
    first_of_group = np.searchsorted(group, np.arange(groups))
    thresholds = kept[first_of_group[cuts]] if cuts.size else np.empty(0)
    return cost, levels, thresholds
