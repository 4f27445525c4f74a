"""The gathered batch as the solvers see it: every image of every rank in one flat list.

Image ``k`` is rank ``home[k]``'s image ``k - starts[home[k]]``. Plain Python lists, because the
solvers' per-image decisions run in Python and, at the sizes real jobs have (a few to a few
hundred images), converting to and from numpy costs more than the work itself. The numpy
variants for many images (more than :data:`~tuning.VECTORISE_ABOVE`) take the arrays from
:attr:`Batch.arrays` and keep their destinations in an array: converting thousands of Python
ints costs about a millisecond each way.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import reduce
from itertools import accumulate, chain, pairwise
from operator import add
from typing import Any

import numpy as np

from lightning_vit_balance.caching import cached_value
from lightning_vit_balance.cost import CostModel
from lightning_vit_balance.solvers import tuning

__all__ = [
    "Arrays",
    "Batch",
    "Destinations",
    "add_up",
    "first_of_alike",
    "group_order",
    "rank_loads",
    "rank_patches",
    "score",
    "split_of_two_within",
    "subset_sums",
]

#: ``dest[k]``: the rank that encodes image ``k``. A list, or an int64 array in the numpy variants.
Destinations = list[int] | np.ndarray


@dataclass(frozen=True, eq=False)
class Arrays:
    """The batch's per-image lists as numpy arrays, for the vectorised variants."""

    home: np.ndarray  # [n] int64
    patches: np.ndarray  # [n] int64
    cost: np.ndarray  # [n] float64
    order: np.ndarray  # [n] int64, largest cost first, ties by index

    @cached_value
    def by_cost_per_row(self) -> np.ndarray:
        """``[n]`` int64: the images grouped by home rank, in rank order, within each the most cost
        per pixel row first, ties by index (two stable sorts: 1.4x faster than ``np.lexsort``)."""
        by_row = np.argsort(-(self.cost / self.patches), kind="stable")
        return by_row[group_order(self.home[by_row], int(self.home.max(initial=0)) + 1)]

    @cached_value
    def rank(self) -> np.ndarray:
        """``rank[k]``: image ``k``'s position in :attr:`order`."""
        rank = np.empty_like(self.order)
        rank[self.order] = np.arange(self.order.size)
        return rank


@dataclass(eq=False)
class Batch:
    """One step's images, flat, with their costs and each rank's load with every image at home.

    Read-only by convention (not a frozen dataclass: its ``__init__`` runs for every plan, and a
    frozen one costs a microsecond more, a tenth of a plan for two ranks).

    Attributes:
        counts: ``counts[r][i]``: patches of rank ``r``'s ``i``-th image, as given.
        starts: ``starts[r]``: flat index of rank ``r``'s first image; ``starts[P]`` is ``n``.
        patches: ``patches[k]``: its patch count (pixel rows).
        cost: ``cost[k]``: its cost under the plan's cost model.
        loads: ``loads[r]``: rank ``r``'s cost, summed in image order (the order
            :func:`rank_loads` sums in, so equal plans give equal floats).
    """

    counts: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]
    patches: list[int]
    cost: list[float]
    loads: list[float]
    #: ``P``, the number of data-parallel ranks (a field, not a property: the loops read it often).
    num_ranks: int
    #: ``n``, the number of images.
    size: int
    #: The arrays, when :meth:`build` made them anyway (many images).
    prebuilt: Arrays | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls, counts: tuple[tuple[int, ...], ...], model: Callable[..., Any], frames: list[int] | None = None
    ) -> Batch:
        """Flatten validated ``counts`` and cost every image with one call of ``model``.

        Args:
            counts: Validated patch counts, one tuple per rank.
            model: A :class:`~lightning_vit_balance.CostModel`, or any vectorised callable on an
                array of patch counts.
            frames: Validated temporal steps ``T`` of the flat images, or ``None`` (1 each); a
                callable other than a ``CostModel`` then receives them as ``frames=``.

        Raises:
            ValueError: ``model`` does not map the patch counts to as many finite costs ``>= 0``.
            TypeError: ``frames`` are given and ``model`` takes no ``frames`` keyword.
        """
        starts = (0, *accumulate(map(len, counts)))
        patches = [*chain.from_iterable(counts)]
        if len(patches) <= tuning.PYTHON_COSTS_UP_TO and isinstance(model, CostModel):
            cost = _checked(model.costs(patches, frames), len(patches))
            return cls(counts, starts, patches, cost, _loads(cost, starts), len(counts), len(patches))
        patch_array = np.array(patches, dtype=np.int64)
        cost_array = _costs(model, patch_array, frames)
        cost = cost_array.tolist()
        if len(patches) <= tuning.VECTORISE_ABOVE:
            return cls(counts, starts, patches, cost, _loads(cost, starts), len(counts), len(patches))
        home_array = np.repeat(np.arange(len(counts), dtype=np.int64), np.diff(starts))
        arrays = Arrays(
            home=home_array,
            patches=patch_array,
            cost=cost_array,
            order=np.argsort(-cost_array, kind="stable"),
        )
        # bincount sums each rank's images in image order too: the same floats.
        loads = np.bincount(home_array, weights=cost_array, minlength=len(counts)).tolist()
        return cls(counts, starts, patches, cost, loads, len(counts), len(patches), arrays)

    @cached_value
    def home(self) -> list[int]:
        """``home[k]``: the rank image ``k`` comes from."""
        if self.prebuilt is not None:
            return self.prebuilt.home.tolist()
        return [r for r, row in enumerate(self.counts) for _ in row]

    @cached_value
    def order(self) -> list[int]:
        """Images largest cost first, ties by index (both sorts are stable)."""
        if self.prebuilt is not None:
            return self.prebuilt.order.tolist()
        return sorted(range(self.size), key=self.cost.__getitem__, reverse=True)

    @cached_value
    def lower_bound(self) -> float:
        """No plan's makespan is below ``max(total / P, largest image cost)``."""
        return max(add_up(self.loads) / self.num_ranks, max(self.cost, default=0.0))

    @cached_value
    def tight_bound(self) -> float:
        """No plan's makespan is below this either: :attr:`lower_bound`, or the pigeonhole bound
        when it is higher.

        Pigeonhole: of the ``k*P + 1`` costliest images, some rank encodes at least ``k + 1``, so
        its load is at least the sum of the ``k + 1`` cheapest of them. With few images per rank
        (two ranks, or sizes so alike that whole images cannot split the load evenly) this is
        often the higher bound, so a plan that reaches it is known to be as good as any.
        """
        return max(self.lower_bound, self._pigeonhole_bound())

    def _pigeonhole_bound(self) -> float:
        """``max over k >= 1`` of the ``k + 1`` cheapest of the ``k*P + 1`` costliest images (0.0
        with at most ``P`` images)."""
        num_ranks, size = self.num_ranks, self.size
        if size <= num_ranks:
            return 0.0
        if self.prebuilt is not None:
            ranked = np.concatenate(([0.0], np.cumsum(self.prebuilt.cost[self.prebuilt.order])))
            k = np.arange(1, (size - 1) // num_ranks + 1)
            return float((ranked[k * num_ranks + 1] - ranked[k * num_ranks - k]).max())
        ranked = [0.0, *accumulate(sorted(self.cost, reverse=True))]
        best = 0.0
        for k in range(1, (size - 1) // num_ranks + 1):
            best = max(best, ranked[k * num_ranks + 1] - ranked[k * num_ranks - k])
        return best

    @cached_value
    def rank_patches(self) -> list[int]:
        """Patches per rank with every image at home."""
        return [sum(row) for row in self.counts]

    @cached_value
    def must_hold(self) -> list[bool]:
        """Ranks that encode at least one image in an applied plan: all of them when there are
        at least as many images as ranks, otherwise those that have images."""
        if self.size >= self.num_ranks:
            return [True] * self.num_ranks
        return [bool(row) for row in self.counts]

    @cached_value
    def arrays(self) -> Arrays:
        """The per-image lists as numpy arrays."""
        if self.prebuilt is not None:
            return self.prebuilt
        return Arrays(
            home=np.array(self.home, dtype=np.int64),
            patches=np.array(self.patches, dtype=np.int64),
            cost=np.array(self.cost, dtype=np.float64),
            order=np.array(self.order, dtype=np.int64),
        )

    def cap(self, max_len_ratio: float | None) -> float | None:
        """The patch cap ``mean patches per rank * max_len_ratio`` (``None``: no cap)."""
        if max_len_ratio is None:
            return None
        return sum(self.patches) / self.num_ranks * max_len_ratio

    def pinned(self, cap: float | None) -> list[bool]:
        """Images larger than the cap: they fit nowhere, so they stay at home."""
        if cap is None:
            return [False] * self.size
        return [n > cap for n in self.patches]

    def rows(self, flat: Sequence[Any]) -> tuple[tuple[Any, ...], ...]:
        """Split a flat per-image sequence back into one tuple per rank."""
        # Slices of one tuple are tuples: one copy per image, not two (10-20% faster).
        return tuple(map(tuple(flat).__getitem__, map(slice, self.starts, self.starts[1:])))


def _costs(model: Callable[..., Any], patches: np.ndarray, frames: list[int] | None) -> np.ndarray:
    """``model`` on the patch counts (``[n]`` int64) as float64, with ``frames=`` when given, checked."""
    counts = patches.astype(np.float64)
    if frames is None:
        raw = model(counts)
    elif isinstance(model, CostModel):
        raw = model(counts, frames=np.array(frames, dtype=np.int64))
    else:
        steps = np.array(frames, dtype=np.int64)
        try:
            inspect.signature(model).bind(counts, frames=steps)
        except (TypeError, ValueError):  # no frames keyword, or no signature to read
            raise TypeError(
                f"cost_model={model!r} takes no `frames` keyword: expected a callable accepting "
                "(patch_counts, frames=...) when plan_rebalance is given frames, or no frames."
            ) from None
        raw = model(counts, frames=steps)
    cost = np.asarray(raw, dtype=np.float64).reshape(-1)
    if cost.size != counts.size:
        raise ValueError(
            f"cost_model must map an array of {counts.size} patch counts to as many finite costs "
            f">= 0, got {cost.size} values."
        )
    bad = np.flatnonzero(~np.isfinite(cost) | (cost < 0))
    if bad.size:
        k = int(bad[0])
        raise ValueError(
            f"cost_model must map patch counts to finite costs >= 0, got {float(cost[k])!r} for "
            f"{int(patches[k])} patches ({bad.size} of {cost.size} costs invalid; a cost too large "
            "for float64 is inf)."
        )
    return cost


def add_up(values: Iterable[float]) -> float:
    """``values`` summed left to right from ``0.0``, one rounding per addition.

    The solvers' float sums use this, not :func:`sum` as such: from Python 3.12 on, :func:`sum`
    compensates float sums, so its result would differ in the last bits from the loads
    :func:`rank_loads` adds one by one, and between ranks that run different Python versions.
    """
    if _SUM_ADDS_LEFT_TO_RIGHT:
        # The same floats, 3-5x faster than reduce: with reduce, 64 ranks' loads alone cost a
        # tenth of a heap LPT more.
        return sum(values, 0.0)
    return reduce(add, values, 0.0)


#: Whether the builtin :func:`sum` adds floats one by one (before Python 3.12).
_SUM_ADDS_LEFT_TO_RIGHT = sys.version_info < (3, 12)


def first_of_alike(keys: Iterable[Hashable]) -> list[int]:
    """Positions of the first of ``keys`` equal to each other, ascending (one per distinct key).

    The searches score candidates by what the key holds (cost, pixel rows), keep the first found
    on ties and replace it only by a strictly better one, so the later candidates alike can only
    tie: trying the first of each is exact. Frames of one video are alike by the hundred.
    """
    seen: set[Hashable] = set()
    first = []
    for position, key in enumerate(keys):
        if key not in seen:
            seen.add(key)
            first.append(position)
    return first


def split_of_two_within(cost: Sequence[float], limit: float) -> bool:
    """Whether some split of ``cost`` (a few dozen at most) between two ranks keeps both loads
    within ``limit``.

    Meet in the middle: every subset sum of each half of the images (:func:`subset_sums`); a split
    within the limit pairs a sum ``a`` of the first half with one of the second in
    ``[total - limit - a, limit - a]``. Exact up to the rounding of float sums (a few ulps), and
    that rounding is the same on every machine, as the ranks' plans must be.
    """
    costs = np.asarray(cost, dtype=np.float64)
    half = costs.size // 2
    first = subset_sums(costs[:half])
    second = subset_sums(costs[half:])
    second.sort()
    total = first[-1] + second[-1]
    low = second.searchsorted(total - limit - first, "left")
    high = second.searchsorted(limit - first, "right")
    return bool((low < high).any())


def subset_sums(costs: np.ndarray) -> np.ndarray:
    """Every subset sum of ``costs`` (``[n]`` float64, a dozen at most): entry ``m`` sums the
    costs whose bits are set in ``m``, lowest first; the last entry is the full set
    (``[2**n]``).

    Each sum adds one cost at a time in index order (Python floats for the first few, where numpy
    calls cost more than they do, then element by element in numpy), so every machine rounds it
    alike. A product with a matrix of 0/1 masks, which this replaces, summed in whatever order the
    BLAS kernel of the CPU picked: ranks on nodes of different CPUs could decide a split
    differently, and plan apart.
    """
    values = costs.tolist()
    sums = [0.0]
    for value in values[:_PYTHON_SUMS_UP_TO]:
        sums += [s + value for s in sums]
    if len(values) <= _PYTHON_SUMS_UP_TO:
        return np.array(sums, dtype=np.float64)
    out = np.empty(1 << len(values), dtype=np.float64)
    out[: len(sums)] = sums
    for bit in range(_PYTHON_SUMS_UP_TO, len(values)):
        np.add(out[: 1 << bit], values[bit], out=out[1 << bit : 2 << bit])
    return out


#: :func:`subset_sums` adds the first costs in Python lists (64 sums), then in numpy.
_PYTHON_SUMS_UP_TO = 6


def group_order(groups: np.ndarray, num_groups: int) -> np.ndarray:
    """The stable order of ``groups`` (ints in ``[0, num_groups)``, e.g. ranks): by group, ties
    in place order. Below 65,536 groups numpy radix-sorts them as ``uint16``, 10-15x faster than
    a merge sort of int64 at 8,000 images."""
    if num_groups <= 1 << 16:
        groups = groups.astype(np.uint16)
    return np.argsort(groups, kind="stable")


def _loads(cost: list[float], starts: tuple[int, ...]) -> list[float]:
    """Each rank's costs summed in image order, from 0.0 (the order :func:`rank_loads` sums in)."""
    return [add_up(cost[s:e]) for s, e in pairwise(starts)]


def _checked(cost: list[float], size: int) -> list[float]:
    """A cost model's plain-Python costs, checked as :func:`_costs` checks the array's: its
    coefficients are finite and ``>= 0``, so only an overflow to infinity can be wrong."""
    if cost and not max(cost) < math.inf:
        raise ValueError(
            f"cost_model must map an array of {size} patch counts to as many finite costs >= 0, "
            f"got {max(cost)!r} (a patch count, or a cost coefficient, too large for float64 arithmetic)."
        )
    return cost


def rank_loads(batch: Batch, dest: Destinations) -> list[float]:
    """Each rank's cost under ``dest``, summed over its images in flat (arrival) order."""
    if isinstance(dest, np.ndarray):
        # bincount sums in image order too: the same floats, in C.
        return np.bincount(dest, weights=batch.arrays.cost, minlength=batch.num_ranks).tolist()
    loads = [0.0] * batch.num_ranks
    for d, c in zip(dest, batch.cost):
        loads[d] += c
    return loads


def rank_patches(batch: Batch, dest: Destinations) -> list[int]:
    """Each rank's patches under ``dest``."""
    out = [0] * batch.num_ranks
    for d, n in zip(dest, batch.patches):
        out[d] += n
    return out


def score(batch: Batch, dest: Destinations) -> tuple[list[float], int]:
    """Each rank's load under ``dest`` (summed as :func:`rank_loads` does) and the patches (pixel
    rows) it sends to another rank, in one pass."""
    if isinstance(dest, np.ndarray):
        arrays = batch.arrays
        loads = np.bincount(dest, weights=arrays.cost, minlength=batch.num_ranks).tolist()
        return loads, int(arrays.patches[dest != arrays.home].sum())
    loads = [0.0] * batch.num_ranks
    moved = 0
    for d, h, c, n in zip(dest, batch.home, batch.cost, batch.patches):
        loads[d] += c
        if d != h:
            moved += n
    return loads, moved
