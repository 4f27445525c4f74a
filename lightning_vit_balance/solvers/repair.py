"""Repair: bring every rank within a target load by exchanges with the ranks that have room.

Shed-and-place balances in one pass, so with few images per rank it often ends above its target:
whole images are coarse, and with images of similar sizes no greedy placement fills every rank
evenly. :func:`repair` relieves the ranks above the target one at a time, heaviest first, by
exchanges with ranks below it (*receivers*; room: the target minus the load):

* *Whole relief*: one exchange that brings the rank within the target and keeps its receiver
  within it. First one image moved, or swapped for a cheaper one, trying the receivers with the
  least room that suffices first (best fit: large rooms stay whole for large excesses); then
  groups of up to :data:`~tuning.EXCHANGE_SIZE` images each way with the
  :data:`~tuning.EXCHANGE_RECEIVERS` roomiest, between ranks holding at most
  :data:`~tuning.GROUP_EXCHANGES_UP_TO` images (of the groups alike in cost and rows, the first
  alone). Scoring: the pixel rows the exchange adds (an
  image leaving its home adds its rows, one coming home takes them off); selection: the fewest,
  the first found on ties.
* *Partial relief*, when no exchange relieves the rank whole: the exchange that shifts the most
  cost to the roomiest receiver without taking it above the target (single images first), then
  again, at most :data:`~tuning.REPAIR_STEPS` exchanges for the rank.

No exchange takes a receiver above the target, so a relieved rank stays relieved. When a rank
cannot be relieved the repair moves on to its next, looser target from where it stands.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import NamedTuple

import numpy as np

from lightning_vit_balance.solvers import tuning
from lightning_vit_balance.solvers.batch import Batch, first_of_alike, group_order

__all__ = ["repair"]


class _Exchange(NamedTuple):
    """Images sent from the relieved rank and sent back to it; the pixel rows this adds and the
    cost it shifts to the receiver."""

    rows: int
    shift: float
    sent: tuple[int, ...]
    returned: tuple[int, ...]


#: A group of images to exchange: its summed cost, the images, and the pixel rows moving it adds.
_Group = tuple[float, tuple[int, ...], int]


class _State:
    """A plan being repaired: destinations, each rank's images (by cost) and load, ranks by load."""

    def __init__(self, batch: Batch, dest: list[int], loads: list[float]) -> None:
        self.batch = batch
        self.dest = dest
        self.loads = loads
        #: ``members[r]``: rank ``r``'s images, the cheapest first (``batch.order`` reversed);
        #: ``member_costs[r]``: their costs, in the same order (for bisection).
        self.members, self.member_costs = _members(batch, dest)
        self.by_load = sorted(zip(loads, range(batch.num_ranks)))
        #: The group search's candidates by ``(src, dst)``, sent (``True``) or sent back
        #: (``False``), kept until ``src``'s images change: a rank's whole relief and then its
        #: partial relief search the same two ranks, and at few ranks every relief does.
        self._group_cache: dict[tuple[int, int, bool], tuple[list[_Group], list[float]]] = {}

    def rows_added(self, k: int, src: int, dst: int) -> int:
        """Pixel rows that moving image ``k`` from ``src`` to ``dst`` adds (may be < 0)."""
        home = self.batch.home[k]
        return self.batch.patches[k] if home == src else -self.batch.patches[k] if home == dst else 0

    def apply(self, step: _Exchange, relieved: int, receiver: int) -> None:
        """Carry out ``step``, keeping ``members``, ``member_costs`` and ``by_load`` sorted."""
        loads, by_load, cost = self.loads, self.by_load, self.batch.cost
        for r in (relieved, receiver):
            by_load.pop(bisect_left(by_load, (loads[r], r)))
        for images, src, dst in ((step.sent, relieved, receiver), (step.returned, receiver, relieved)):
            for k in images:
                at = self.members[src].index(k)
                del self.members[src][at], self.member_costs[src][at]
                # After the images of equal cost, as ``insort`` by cost places it.
                at = bisect_right(self.member_costs[dst], cost[k])
                self.members[dst].insert(at, k)
                self.member_costs[dst].insert(at, cost[k])
                self.dest[k] = dst
                loads[src] -= cost[k]
                loads[dst] += cost[k]
        for r in (relieved, receiver):
            insort(by_load, (loads[r], r))
        for key in [key for key in self._group_cache if key[0] in (relieved, receiver)]:
            del self._group_cache[key]

    def groups(self, src: int, dst: int, sent: bool) -> tuple[list[_Group], list[float]]:
        """The groups of ``src``'s images to move to ``dst`` and their costs, of those alike the
        first: sent, in the order of :func:`_groups`; sent back, nothing first and then by cost
        (ties: by images)."""
        key = (src, dst, sent)
        if key not in self._group_cache:
            groups = _groups(self, self.members[src], src, dst)
            found = _first_of_each(groups if sent else [(0.0, (), 0), *sorted(groups)])
            self._group_cache[key] = found, [c for c, _, _ in found]
        return self._group_cache[key]


def _members(batch: Batch, dest: list[int]) -> tuple[list[list[int]], list[list[float]]]:
    """Each rank's images under ``dest``, ``batch.order`` reversed (the cheapest first), and their
    costs; in numpy with many images."""
    cost = batch.cost
    if batch.size <= tuning.VECTORISE_ABOVE:
        members: list[list[int]] = [[] for _ in range(batch.num_ranks)]
        for k in reversed(batch.order):
            members[dest[k]].append(k)
        return members, [[cost[k] for k in images] for images in members]
    arrays = batch.arrays
    dest_array = np.asarray(dest)
    cheapest_first = arrays.order[::-1]
    images = cheapest_first[group_order(dest_array[cheapest_first], batch.num_ranks)]
    bounds = [0, *accumulate(np.bincount(dest_array, minlength=batch.num_ranks).tolist())]
    flat, flat_costs = images.tolist(), arrays.cost[images].tolist()
    return [flat[a:b] for a, b in pairwise(bounds)], [flat_costs[a:b] for a, b in pairwise(bounds)]


def repair(batch: Batch, dest: list[int], loads: list[float], targets: Sequence[float]) -> float | None:
    """Bring every rank's load within the first of ``targets`` it can by exchanges; updates
    ``dest`` and ``loads`` in place (no cap: the exchanges do not check one).

    The ranks above ``targets[0]`` are relieved heaviest first. When one cannot be brought within
    the current target, the repair moves on to the next (looser) target from where it stands: the
    ranks relieved so far are within that one too.

    Args:
        batch: The images.
        dest: A plan's destinations, every rank that must hold an image holding one.
        loads: Each rank's load under ``dest``, summed as :func:`~.batch.score` sums.
        targets: Loads no rank should exceed, tightest first.

    Returns:
        The target every rank ends within, or ``None`` when it is not even the last (``dest``
        and ``loads`` then hold a partly repaired plan).
    """
    at = 0
    limit = targets[at] * (1.0 + tuning.EPS)
    over = sorted((r for r in range(batch.num_ranks) if loads[r] > limit), key=lambda r: (-loads[r], r))
    if not over:
        return targets[at]
    state = _State(batch, dest, loads)
    for relieved in over:
        while not _relieve(state, relieved, limit):
            at += 1
            if at == len(targets):
                return None
            limit = targets[at] * (1.0 + tuning.EPS)
    return targets[at]


def _relieve(state: _State, relieved: int, limit: float) -> bool:
    """Bring ``relieved`` within ``limit``: whole relief, else partial relief and again."""
    for _ in range(tuning.REPAIR_STEPS):
        excess = state.loads[relieved] - limit
        if excess <= 0.0:
            return True
        found = _whole_relief(state, relieved, excess, limit) or _partial_relief(state, relieved, limit)
        if found is None:
            return False
        state.apply(found[0], relieved, found[1])
    return state.loads[relieved] <= limit


def _whole_relief(state: _State, relieved: int, excess: float, limit: float) -> tuple[_Exchange, int] | None:
    """The first receiver and exchange that shift at least ``excess`` within its room: single
    images with the receivers :func:`_best_fit` picks, then groups with the few roomiest."""
    by_load = state.by_load
    # Ranks with room for the excess: a prefix of ``by_load`` (the lightest first).
    able = bisect_left(by_load, True, key=lambda entry: limit - entry[0] < excess)
    for at in _best_fit(able):
        load, r = by_load[at]
        step = _best_single(state, relieved, r, excess, limit - load, fill=False)
        if step is not None:
            return step, r
    for load, r in by_load[: min(able, tuning.EXCHANGE_RECEIVERS)]:
        step = _best_exchange(state, relieved, r, excess, limit - load, fill=False)
        if step is not None:
            return step, r
    return None


def _best_fit(able: int) -> list[int]:
    """Positions in ``by_load`` of the receivers to try for single exchanges, of the first
    ``able`` (those with room for the excess): the least room first (best fit: large rooms stay
    whole for large excesses), the :data:`~tuning.BEST_FIT_RECEIVERS` next in line, then every
    receiver whose place in that order is a power of two, so that with many ranks a relief tries
    a few dozen, not hundreds."""
    near = min(able, tuning.BEST_FIT_RECEIVERS)
    order = list(range(able - 1, able - 1 - near, -1))
    place = tuning.BEST_FIT_RECEIVERS
    while place < able:
        order.append(able - 1 - place)
        place *= 2
    return order


def _partial_relief(state: _State, relieved: int, limit: float) -> tuple[_Exchange, int] | None:
    """The exchange that shifts the most cost to the roomiest receiver within its room: single
    images, else groups."""
    load, receiver = state.by_load[0]
    if load >= limit:
        return None
    step = _best_single(state, relieved, receiver, 0.0, limit - load, fill=True)
    if step is None:
        step = _best_exchange(state, relieved, receiver, 0.0, limit - load, fill=True)
    return None if step is None else (step, receiver)


def _better(candidate: _Exchange, best: _Exchange | None, fill: bool) -> bool:
    """Scoring: the fewest rows; with ``fill``, the most cost shifted first."""
    if best is None:
        return True
    if fill and candidate.shift != best.shift:
        return candidate.shift > best.shift
    return candidate.rows < best.rows


def _best_single(
    state: _State, relieved: int, receiver: int, low: float, high: float, fill: bool
) -> _Exchange | None:
    """The move or swap of single images from ``relieved`` to ``receiver`` that shifts a positive
    cost in ``[low, high]``, best by :func:`_better`; ``None`` when there is none."""
    mine, mine_costs = state.members[relieved], state.member_costs[relieved]
    theirs, theirs_costs = state.members[receiver], state.member_costs[receiver]
    may_empty = len(mine) > 1 or not state.batch.must_hold[relieved]
    best: _Exchange | None = None
    # Of the images alike in cost and rows added only the first is tried: a later one makes the
    # same exchanges, which can only tie, and ties keep the first found. The scan is by cost, so
    # alike ones come in runs of one cost (frames of one video, by the hundred); ``tried``: the
    # rows added by the images of the current run tried so far, read from the run's second on.
    run_cost, tried = -1.0, ()
    # The costliest first (the cheaper ones shift less), down to the cheapest that shifts ``low``.
    for i in range(len(mine) - 1, bisect_left(mine_costs, low) - 1, -1):
        a, ca = mine[i], mine_costs[i]
        if ca <= 0.0:
            break
        if ca == run_cost:
            tried = tried or (state.rows_added(mine[i + 1], relieved, receiver),)
            rows = state.rows_added(a, relieved, receiver)
            if rows in tried:
                continue
            tried = (*tried, rows)
        else:
            run_cost, tried = ca, ()
        if ca <= high and may_empty:
            step = _Exchange(state.rows_added(a, relieved, receiver), ca, (a,), ())
            if _better(step, best, fill):
                best = step
        # A swap for b shifts ca - cost[b]: within [low, high] (``low >= 0``) and positive.
        start, end = bisect_left(theirs_costs, ca - high), bisect_right(theirs_costs, ca - low)
        for j in range(start, end):
            cb = theirs_costs[j]
            if cb < ca:
                b = theirs[j]
                rows = state.rows_added(a, relieved, receiver) + state.rows_added(b, receiver, relieved)
                step = _Exchange(rows, ca - cb, (a,), (b,))
                if _better(step, best, fill):
                    best = step
    return best


def _groups(state: _State, images: list[int], src: int, dst: int) -> list[_Group]:
    """Every group of up to :data:`~tuning.EXCHANGE_SIZE` of ``images`` with its summed cost
    (summed in the order of ``images``, from 0.0 as :func:`~.batch.add_up` sums) and the pixel rows
    moving it from ``src`` to ``dst`` adds; in the order of :func:`itertools.combinations`, size
    by size. Each group of a size is one of the size before grown by a later image."""
    cost = state.batch.cost
    singles = [(cost[k], k, state.rows_added(k, src, dst)) for k in images]
    groups: list[_Group] = [(c, (k,), rows) for c, k, rows in singles]
    # (cost, images, rows, position of the last image) of the groups of the current size.
    grown = [(c, (k,), rows, at) for at, (c, k, rows) in enumerate(singles)]
    for _ in range(2, tuning.EXCHANGE_SIZE + 1):
        grown = [
            (c + c_next, (*ids, k_next), rows + rows_next, at)
            for c, ids, rows, last in grown
            for at, (c_next, k_next, rows_next) in enumerate(singles[last + 1 :], last + 1)
        ]
        groups += [(c, ids, rows) for c, ids, rows, _ in grown]
    return groups


def _first_of_each(groups: list[_Group]) -> list[_Group]:
    """``groups`` with only the first of those alike in cost, rows and size.

    A later group alike can only tie with the first, and the search keeps the first found on ties,
    so it finds the same exchange. With many images of one size (frames of a video) this leaves a
    handful of the thousands of groups: at P = 8 with 52 frames of a few videos per rank one plan
    tried 2.2 million pairs of groups and took 10 s. Without single images alike it returns
    ``groups`` as they are: pairs alike are then rare, and the dedupe took a fifth of a profiled
    plan at P = 2.
    """
    singles = [(cost, rows) for cost, ids, rows in groups if len(ids) == 1]
    if len(set(singles)) == len(singles):
        return groups
    return [groups[i] for i in first_of_alike((cost, rows, len(ids)) for cost, ids, rows in groups)]


def _best_exchange(
    state: _State, relieved: int, receiver: int, low: float, high: float, fill: bool
) -> _Exchange | None:
    """The exchange of up to :data:`~tuning.EXCHANGE_SIZE` images each way that shifts a positive
    cost in ``[low, high]`` to ``receiver``, best by :func:`_better` (ties: the first found);
    ``None`` when there is none."""
    mine, theirs = state.members[relieved], state.members[receiver]
    if max(len(mine), len(theirs)) > tuning.GROUP_EXCHANGES_UP_TO:
        return None
    # Nothing back first (costs are >= 0), then every group by cost (ties: by images).
    back, back_costs = state.groups(receiver, relieved, sent=False)
    keep_one = state.batch.must_hold[relieved]
    best: _Exchange | None = None
    for sent_cost, sent, sent_rows in state.groups(relieved, receiver, sent=True)[0]:
        # Sent minus returned in [low, high]: returned costs in [sent - high, sent - low].
        start = bisect_left(back_costs, sent_cost - high)
        end = bisect_right(back_costs, sent_cost - low)
        # With ``fill`` the first in the window shifts the most.
        for back_cost, returned, back_rows in back[start : start + 1 if fill else end]:
            shift = sent_cost - back_cost
            if shift <= 0.0 or (keep_one and not returned and len(sent) == len(mine)):
                continue
            step = _Exchange(sent_rows + back_rows, shift, sent, returned)
            if _better(step, best, fill):
                best = step
    return best
