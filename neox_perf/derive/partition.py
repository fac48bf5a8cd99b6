"""DeepSpeed's pipeline partitioning (runtime/pipe/module.py:_partition_layers).

Re-implemented from DeepSpeed 0.19.8 (same algorithm as the DeeperSpeed commit NeoX pins):
`partition_uniform`, the dynamic program in `partition_balanced`, and `_find_layer_type`. The
tests compare every result with DeepSpeed's own functions. The DP runs state by state in plain
Python for small cuts, and a row of states at a time in numpy for large ones (many layers, many
stages: the cuts a plan of a large model asks for), where its per-row overhead pays.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

from .errors import PartitionError

_INF = float("inf")
# The DP's work (~ stages x (items - stages)^2 / 2 steps): above this many, it runs a row of
# states at a time in numpy (a 96-layer model cut in 16-64 stages: 4-6 ms per cut in Python,
# 1-2 ms in numpy; below ~20,000 Python is as fast).
_VECTORISE_ABOVE = 40_000


def partition_uniform(num_items: int, num_parts: int) -> List[int]:
    """Boundaries of num_parts chunks; the first (num_items % num_parts) chunks get one more."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> List[int]:
    """DeepSpeed's linear-partition DP: minimise (max - min) part weight, ties to the later cut.

    Memoised on (weights, parts): the answer depends on nothing else, and a plan asks the same
    question many times -- `type:` weights are one per matching layer whatever the tensor
    parallelism, so every model-parallel degree with the same stages repeats the same DP (its
    cost grows as stages x layers^2: GPT-NeoX's 175B config cut into 2..64 stages for each
    tensor parallelism was 22 DPs, 7 distinct).
    """
    return list(_balanced(tuple(weights), num_parts))


@lru_cache(maxsize=256)
def _balanced(weights: Tuple[float, ...], num_parts: int) -> Tuple[int, ...]:
    """partition_balanced's DP, as DeepSpeed iterates it.

    The DP is greedy per state (it keeps only the max/min of the chosen predecessor), so its answer
    is not always the true optimum; reproducing its exact iteration order and `>=` tie rule is
    what makes the cuts identical to DeepSpeed's. Two prunings keep it cheap without changing
    the result: predecessors (k, j-1) with k < j-1 are unreachable (DeepSpeed scores them +inf
    and any reachable one replaces them), and states that leave fewer items than remaining parts
    are never read by the back-track.
    """
    n, m = len(weights), num_parts
    if n <= m:
        return tuple(partition_uniform(n, m))
    prefix = [0] * (n + 1)
    for i, w in enumerate(weights):
        prefix[i + 1] = prefix[i] + w
    if m * (n - m + 1) ** 2 > _VECTORISE_ABOVE and _exact_in_float64(prefix):
        return _balanced_rows(prefix, m)
    # Rows indexed by j (parts used), columns by i (items covered); only j-1 -> j transitions.
    prev_max: List[float] = [_INF] * (n + 1)
    prev_min: List[float] = [_INF] * (n + 1)
    prev_max[0] = 0
    position = [[0] * (n + 1) for _ in range(m + 1)]
    for j in range(1, m + 1):
        cur_max: List[float] = [_INF] * (n + 1)
        cur_min: List[float] = [_INF] * (n + 1)
        pos_j = position[j]
        last_i = n - (m - j)
        for i in range(j, last_i + 1):
            best = _INF
            best_max = best_min = _INF
            best_k = 0
            pi = prefix[i]
            ks = range(0, 1) if j == 1 else range(j - 1, i)
            for k in ks:
                seg = pi - prefix[k]
                hi = prev_max[k]
                lo = prev_min[k]
                if seg > hi:
                    hi = seg
                if seg < lo:
                    lo = seg
                cost = hi - lo
                if best >= cost:
                    best, best_max, best_min, best_k = cost, hi, lo, k
            cur_max[i], cur_min[i], pos_j[i] = best_max, best_min, best_k
        prev_max, prev_min = cur_max, cur_min
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[j][parts[-1]])
    parts.reverse()
    return tuple(parts)


def find_layer_type(names: Sequence[Optional[str]], layertype: str) -> List[int]:
    """Indices whose name matches `layertype` (case-insensitive search), as _find_layer_type.

    DeepSpeed uses the third-party `regex` module; for the patterns NeoX configs use (names and
    `|`) the standard `re` behaves the same.
    """
    try:
        pattern = re.compile(layertype, re.IGNORECASE)
    except re.error as exc:
        raise PartitionError(f"pipe_partition_method type:{layertype}: invalid regex ({exc})")
    idxs = [i for i, name in enumerate(names) if name is not None and pattern.search(name)]
    if not idxs:
        raise PartitionError(f"pipe_partition_method 'type:{layertype}' matches no layer; "
                             f"DeepSpeed raises \"Partitioning '{layertype}' found no valid layers "
                             f"to partition\"")
    return idxs


def partition_weights(layers: Sequence, method: str) -> Optional[List[int]]:
    """The weights DeepSpeed balances for `method` (None for uniform)."""
    method = method.lower()  # DeepSpeed lowers the whole method string, regex included
    if method == "uniform":
        return None
    if method == "parameters":
        # _count_layer_params: trainable parameters of each LayerSpec built alone, 0 for functions.
        return [0 if layer.is_function else layer.params for layer in layers]
    if method.startswith("type:"):
        weights = [0] * len(layers)
        for idx in find_layer_type([layer.name for layer in layers], method.split(":")[1]):
            weights[idx] = 1
        return weights
    raise PartitionError(f"pipe_partition_method {method!r} is not implemented in DeepSpeed "
                         f"(use type:<regex>, parameters or uniform)")


def partition(layers: Sequence, num_stages: int, method: str) -> List[int]:
    """Stage boundaries `parts` (len num_stages + 1): stage s owns layers[parts[s]:parts[s+1]].

    Raises PartitionError where DeepSpeed raises, and where it would hand a stage no layer at all
    (more stages than specs): that stage has no parameters and its optimizer cannot be built.
    """
    if num_stages < 1:
        raise PartitionError(f"number of pipeline stages must be >= 1, got {num_stages}")
    weights = partition_weights(layers, method)
    if weights is None:
        parts = partition_uniform(len(layers), num_stages)
    else:
        parts = partition_balanced(weights, num_stages)
    empty = [s for s in range(num_stages) if parts[s + 1] <= parts[s]]
    if empty:
        raise PartitionError(
            f"{num_stages} pipeline stages but only {len(layers)} layer specs: stage(s) "
            f"{', '.join(map(str, empty))} would get no layers (reduce pipe_parallel_size)")
    return parts


def _exact_in_float64(prefix: Sequence[float]) -> bool:
    """numpy computes in float64: the same numbers as Python's when the weights are floats
    already, or whole numbers whose sums stay below 2**53 (parameter counts do)."""
    return all(isinstance(x, float) or abs(x) < 2 ** 53 for x in prefix)


def _balanced_rows(prefix: Sequence[float], m: int) -> Tuple[int, ...]:
    """_balanced's DP with every state (j, i) of one row j at once: for each i the predecessor
    k in [j-1, i) of least cost, the last of equals (DeepSpeed's `>=`): the same operations on
    the same numbers, so the same cuts (tests/derive/test_partition.py compares the two)."""
    import numpy as np
    n = len(prefix) - 1
    P = np.asarray(prefix, dtype=np.float64)
    prev_max = np.full(n + 1, np.inf)
    prev_min = np.full(n + 1, np.inf)
    prev_max[0] = 0.0
    position = np.zeros((m + 1, n + 1), dtype=np.int64)
    for j in range(1, m + 1):
        last_i = n - (m - j)
        rows = np.arange(j, last_i + 1)
        ks = np.arange(0, 1) if j == 1 else np.arange(j - 1, last_i)
        seg = P[rows][:, None] - P[ks][None, :]
        hi = np.maximum(seg, prev_max[ks][None, :])
        lo = np.minimum(seg, prev_min[ks][None, :])
        cost = np.where(ks[None, :] < rows[:, None], hi - lo, np.nan)  # only k < i
        # the last k of least cost: the first in reversed order (NaN, k >= i, never chosen)
        pick = len(ks) - 1 - np.nanargmin(cost[:, ::-1], axis=1)
        at = np.arange(len(rows))
        cur_max = np.full(n + 1, np.inf)
        cur_min = np.full(n + 1, np.inf)
        cur_max[rows], cur_min[rows] = hi[at, pick], lo[at, pick]
        position[j, rows] = ks[pick]
        prev_max, prev_min = cur_max, cur_min
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(int(position[j, parts[-1]]))
    parts.reverse()
    return tuple(parts)
