"""The locality solver's heuristics: plans that balance while most images stay at home.

Each heuristic is a pure function ``(batch, target, cap) -> destinations`` with one scoring and
one selection rule:

* :func:`home_first`: images, largest first, stay home while the home rank's load stays within
  ``target``; the others go to the currently lightest rank with room (LPT). Small images come
  last and fill the gaps, so the makespan stays close to LPT's while most images never move.
* :func:`home_first_blocks`: the same rule in blocks of images (``P`` by default; fewer
  keep more images at home), no cap: ``(batch, target)``, and a block size.
* :func:`shed_and_place`: every rank above ``target`` sheds its largest images (cost per row
  grows with ``l``, so they shed the most cost per row), finishing with the image that covers the
  rest of its excess in the fewest rows; the shed images then go, largest first, to the lightest
  rank with room.
* :func:`shed_and_fit`: for many images per rank, no cap: the shedding in numpy, by cost per row,
  and the shed images, largest first, each to the rank it fills best under a limit.

:func:`bring_home` and :func:`fill_empty_ranks` adjust a finished plan; :mod:`.select` runs the
heuristics, finishes their plans and picks one.

The patch cap: a rank receives an image only while its patches stay within ``cap``. An image
larger than the cap on its own (*pinned*) fits nowhere and stays at home.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Any

import numpy as np

from lightning_vit_balance.solvers import tuning
from lightning_vit_balance.solvers.batch import Batch, Destinations, add_up, rank_loads, rank_patches
from lightning_vit_balance.solvers.lpt import lpt_blocks
from lightning_vit_balance.solvers.roomheap import RoomHeap

__all__ = [
    "bring_home",
    "cap_excess",
    "fill_empty_ranks",
    "home_first",
    "home_first_blocks",
    "shed_and_fit",
    "shed_and_place",
    "shed_by_cost_per_row",
]


def home_first(batch: Batch, target: float, cap: float | None) -> Destinations:
    """LPT that keeps an image at home while its home rank stays within ``target`` (and the cap).

    Each rank's room under the cap starts with all of its own images reserved; an image that
    leaves frees its rows, so a rank that receives never ends above the cap.
    """
    cost, patches, home = batch.cost, batch.patches, batch.home
    limit = target * (1.0 + tuning.EPS)
    load = [0.0] * batch.num_ranks
    dest = list(home)
    pinned = batch.pinned(cap)
    room = None
    if cap is not None:
        room = [cap - n for n in batch.rank_patches]
        for k in range(batch.size):
            if pinned[k]:
                load[home[k]] += cost[k]
    # Loads only grow: a rank's entry may be too low until it reaches the top (RoomHeap).
    ranks = RoomHeap(load, room if room is not None else [math.inf] * batch.num_ranks)
    for k in batch.order:
        if pinned[k]:
            continue
        c, h = cost[k], home[k]
        if load[h] + c <= limit:
            load[h] += c
            continue
        if room is not None:
            room[h] += patches[k]
            ranks.room_changed(h)
        r = ranks.lightest(patches[k])
        r = dest[k] = h if r is None else r  # no rank has room: it stays home
        load[r] += c
        if room is not None:
            room[r] -= patches[k]
            ranks.room_changed(r)
    return dest


def home_first_blocks(batch: Batch, target: float) -> np.ndarray:
    """:func:`home_first` for many images (the numpy variants), in blocks of ``P`` images; no cap.

    Within a block (images largest first) an image stays home when its home rank's load plus the
    block's earlier images bound for the same home stays within ``target``; the rest of the block
    goes to the lightest ranks by :func:`~.lpt.lpt_blocks`. A few numpy calls per block, so
    destinations come back as an int64 array.
    """
    arrays, num_ranks = batch.arrays, batch.num_ranks
    cost, home = arrays.cost, arrays.home
    limit = target * (1.0 + tuning.EPS)
    load = np.zeros(num_ranks)
    dest = home.copy()
    for start in range(0, batch.size, num_ranks):
        ids = arrays.order[start : start + num_ranks]
        by_home = np.argsort(home[ids], kind="stable")
        homes = home[ids][by_home]
        running = np.cumsum(cost[ids][by_home])
        first = np.ones(homes.size, dtype=bool)
        first[1:] = homes[1:] != homes[:-1]
        group_start = np.maximum.accumulate(np.where(first, np.arange(homes.size), 0))
        before = np.where(group_start > 0, running[group_start - 1], 0.0)
        stays = np.empty(ids.size, dtype=bool)
        stays[by_home] = load[homes] + (running - before) <= limit
        load += np.bincount(home[ids][stays], weights=cost[ids][stays], minlength=num_ranks)
        leaving = ids[~stays]
        if leaving.size:
            lpt_blocks(leaving, cost, load, dest)
    return dest


def shed_and_place(batch: Batch, target: float, cap: float | None) -> Destinations:
    """Shed every rank down to ``target`` (and the cap), then place the shed images.

    Each rank above the target sheds by :func:`_shed` (largest images first: the fewest rows for
    the cost); the shed images then go, largest first, to the lightest rank with room.
    """
    cost, patches = batch.cost, batch.patches
    limit = target * (1.0 + tuning.EPS)
    pinned = batch.pinned(cap) if cap is not None else []
    shed: list[int] = []
    for r in range(batch.num_ranks):
        over_cap = cap is not None and batch.rank_patches[r] > cap
        if batch.loads[r] <= limit and not over_cap:
            continue
        own = range(batch.starts[r], batch.starts[r + 1])
        if cap is not None:
            own = [k for k in own if not pinned[k]]
        ids = sorted(own, key=cost.__getitem__, reverse=True)
        dropped = _shed(ids, batch.loads[r] - limit, cost, patches)
        if cap is not None:
            excess = batch.rank_patches[r] - sum(patches[k] for k in dropped) - cap
            rest = sorted((k for k in ids if k not in dropped), key=lambda k: (-patches[k], k))
            dropped |= _shed(rest, excess, patches, patches)
        shed.extend(sorted(dropped))
    dest = list(batch.home)
    if shed:
        shed.sort(key=cost.__getitem__, reverse=True)
        _place(batch, shed, dest, cap)
    return dest


def shed_and_fit(
    batch: Batch, target: float, limit: float, give_up_above: float = math.inf
) -> np.ndarray | None:
    """Shed every rank down to ``target`` in numpy, then fit the shed images under ``limit``; no cap.

    For many images per rank, where the other heuristics' Python loops over every image cost the
    most: the shedding is vectorised, and only the shed images are fitted one by one. Shedding
    (:func:`shed_by_cost_per_row`): each rank above ``target`` sheds the images that carry the
    most cost per pixel row, until it is within ``target``: the fewest rows for the cost, as the
    fractional bound on rows moved counts them. Fitting: the shed images, largest first, each go
    to the rank with the least room under ``limit`` that still holds it (best fit, so the large
    rooms stay for the large images), or to the roomiest rank when none does (over ``limit``).

    Returns:
        The destinations, ``[n]`` int64; ``None`` as soon as a rank's load would exceed
        ``give_up_above`` (loads only grow while fitting, so the plan would too).
    """
    arrays, num_ranks = batch.arrays, batch.num_ranks
    shed = shed_by_cost_per_row(batch, target)
    dest = arrays.home.copy()
    ids = arrays.order[shed[arrays.order]]  # largest first
    if not ids.size:
        return dest
    shed_cost = np.bincount(arrays.home[shed], weights=arrays.cost[shed], minlength=num_ranks)
    left = (np.asarray(batch.loads) - shed_cost).tolist()
    # (room under the limit, rank), least room first; ties by rank.
    rooms = sorted((limit - load, r) for r, load in enumerate(left))
    least_room = limit - give_up_above
    images, costs = ids.tolist(), arrays.cost[ids].tolist()
    at = 0
    while at < len(images):
        c = costs[at]
        i = bisect.bisect_left(rooms, (c, -1))
        fits = i < len(rooms)
        room, r = rooms.pop(min(i, len(rooms) - 1))
        # Images alike in cost (a video's steps) go on to the same rank while it holds them: its
        # room was the least that held one, and only shrinks. Placed one by one, each would pick it.
        while True:
            if room - c < least_room:
                return None
            room -= c
            dest[images[at]] = r
            at += 1
            if not (fits and at < len(images) and costs[at] == c and room >= c):
                break
        bisect.insort(rooms, (room, r))
    return dest


def shed_by_cost_per_row(batch: Batch, target: float) -> np.ndarray:
    """Which images the ranks above ``target`` shed (``[n]`` bool): each sheds its images in order
    of cost per pixel row, most first (ties by index), up to and including the one that brings it
    within ``target``."""
    arrays = batch.arrays
    excess = np.asarray(batch.loads) - target
    # Images are grouped by home rank already; within each group, most cost per row first.
    order = arrays.by_cost_per_row
    ordered_cost = arrays.cost[order]
    running = np.cumsum(ordered_cost)
    starts = np.asarray(batch.starts[:-1])
    before_rank = np.where(starts > 0, running[np.maximum(starts - 1, 0)], 0.0)
    homes = arrays.home[order]
    # Shed while what the rank shed before this image does not cover its excess.
    shed = np.zeros(batch.size, dtype=bool)
    shed[order] = running - ordered_cost - before_rank[homes] < excess[homes]
    return shed


def _shed(ids: list[int], excess: float, size: list[Any], rows: list[int]) -> set[int]:
    """Which of ``ids`` (sorted by ``size``, largest first) to shed to cover ``excess`` of size.

    Scoring: pixel rows shed. Selection: at each step either finish with the image that covers
    what is left in the fewest rows, or shed the largest image that does not cover it and go on;
    the ending with the fewest rows wins. Large images carry the most cost per row for a convex
    cost, so this stays close to the fractional bound.
    """
    if excess <= 0:
        return set()
    sizes, image_rows = [size[k] for k in ids], [rows[k] for k in ids]
    shed: list[int] = []
    shed_rows, end = 0, len(ids)
    best: list[int] | None = None
    best_rows = 0
    remaining = add_up(sizes)
    i = 0
    while i < end:
        covering = i
        while covering < end and sizes[covering] >= excess:
            covering += 1
        if covering > i:
            # Fewest rows; ties: the smallest image (the last in the order).
            last = i
            for t in range(i + 1, covering):
                if image_rows[t] <= image_rows[last]:
                    last = t
            if best is None or shed_rows + image_rows[last] < best_rows:
                best, best_rows = [*shed, ids[last]], shed_rows + image_rows[last]
            remaining -= add_up(sizes[i:covering])
            i = covering
        if i == end or remaining < excess:
            break
        shed.append(ids[i])
        shed_rows += image_rows[i]
        excess -= sizes[i]
        remaining -= sizes[i]
        i += 1
    return set(best) if best is not None else set(ids)


def _place(batch: Batch, shed: list[int], dest: Destinations, cap: float | None) -> None:
    """Give each of ``shed`` (largest first), in turn, to the lightest rank with room for it; with
    no room anywhere the image stays where it is (its rank is over the cap anyway).

    An image that stays home takes room its rank may already have given to another rank's image;
    then the placement starts again with that image kept home from the start, so a rank that
    receives never ends above the cap (each retry keeps one more image home, so this ends).
    """
    if cap is None:  # every image finds a rank: one pass, from home
        _place_once(batch, shed, dest, cap)
        return
    kept: set[int] = set()
    while True:
        placing = [k for k in shed if k not in kept]
        for k in placing:
            dest[k] = batch.home[k]
        stayed = _place_once(batch, placing, dest, cap)
        if not stayed:
            return
        receivers = {d for k, d in enumerate(dest) if d != batch.home[k]}
        clash = {k for k in stayed if batch.home[k] in receivers}
        if not clash:
            return
        kept |= clash


def _place_once(batch: Batch, shed: list[int], dest: Destinations, cap: float | None) -> list[int]:
    """One placement pass of :func:`_place`; returns the images that found no room and stayed home."""
    cost, patches, home = batch.cost, batch.patches, batch.home
    # Each rank's shed cost is summed first, then taken off its load once.
    shed_cost = [0.0] * batch.num_ranks
    for k in shed:
        shed_cost[home[k]] += cost[k]
    if cap is None:
        heap = [(load - taken, r) for r, (load, taken) in enumerate(zip(batch.loads, shed_cost))]
        heapq.heapify(heap)
        for k in shed:
            top, r = heap[0]
            heapq.heapreplace(heap, (top + cost[k], r))
            dest[k] = r
        return []
    held = list(batch.rank_patches)
    for k in shed:
        held[home[k]] -= patches[k]
    room = [cap - n for n in held]
    load = [load - taken for load, taken in zip(batch.loads, shed_cost)]
    ranks = RoomHeap(load, room)
    stayed: list[int] = []
    for k in shed:
        r = ranks.lightest(patches[k])
        if r is None:  # no rank has room: it stays home
            r = dest[k]
            stayed.append(k)
        dest[k] = r
        load[r] += cost[k]
        room[r] -= patches[k]
        ranks.room_changed(r)
    return stayed


def bring_home(batch: Batch, dest: Destinations, limit: float, must_hold: list[bool]) -> Destinations:
    """Fewer rows at the same quality: send moved images home, alone or in a swap (no cap).

    Up to :data:`~tuning.BRING_HOME_PASSES` passes over the images away from home, largest
    first. Scoring: rows saved. Selection: move the image home if its home stays within ``limit``
    (and its current rank keeps an image it must hold); else swap it with the image on its home
    rank that saves the most rows and keeps both ranks within ``limit``.
    """
    home, cost, patches = batch.home, batch.cost, batch.patches
    dest = list(dest)
    load = rank_loads(batch, dest)
    members: list[list[int]] = [[] for _ in range(batch.num_ranks)]
    for k, d in enumerate(dest):
        members[d].append(k)
    for _ in range(tuning.BRING_HOME_PASSES):
        # Largest first, ties by index (a stable sort keeps them in index order).
        away = sorted([k for k, d in enumerate(dest) if d != home[k]], key=patches.__getitem__, reverse=True)
        changed = False
        # ``fruitless[h, d]``: images on ``d`` for which no swap with their home ``h`` was found
        # since either rank last changed, by what the search reads of them (cost, patches): one
        # alike (a frame of the same video, say) would find none either.
        fruitless: dict[tuple[int, int], set[tuple[float, int]]] = {}
        for k in away:
            h, d = home[k], dest[k]
            if d == h:
                continue
            if load[h] + cost[k] <= limit and (len(members[d]) > 1 or not must_hold[d]):
                partner = -1
            else:
                tried, alike = fruitless.setdefault((h, d), set()), (cost[k], patches[k])
                partner = -1 if alike in tried else _best_swap(batch, k, members[h], dest, load, limit)
                if partner < 0:
                    tried.add(alike)
                    continue
            for j, src, dst in ((k, d, h), (partner, h, d)):
                if j >= 0:
                    members[src].remove(j)
                    members[dst].append(j)
                    dest[j] = dst
                    load[dst] += cost[j]
                    load[src] -= cost[j]
            changed = True
            for pair in [pair for pair in fruitless if h in pair or d in pair]:
                del fruitless[pair]
        if not changed:
            break
    return dest


def _best_swap(
    batch: Batch, k: int, candidates: list[int], dest: Destinations, load: list[float], limit: float
) -> int:
    """The image on ``k``'s home rank to swap with ``k``: the most rows saved with both ranks
    within ``limit``; -1 when no swap saves rows."""
    home, cost, patches = batch.home, batch.cost, batch.patches
    h, d = home[k], dest[k]
    # Both ranks stay within the limit iff the partner's cost lies in [lowest, highest].
    lowest, highest = load[h] + cost[k] - limit, limit - (load[d] - cost[k])
    best_saving, partner = 0, -1
    for j in candidates:
        if not lowest <= cost[j] <= highest:
            continue
        saving = patches[k] - (patches[j] if home[j] == h else 0) + (patches[j] if home[j] == d else 0)
        if saving > best_saving:
            best_saving, partner = saving, j
    return partner


def fill_empty_ranks(batch: Batch, dest: Destinations, cap: float | None) -> bool:
    """Give every rank that must encode an image one, taken where it costs the least; in place.
    Returns whether ``dest`` changed.

    Preferred donors: images within the cap, then the empty rank's own images (they go back
    home), then images already away from home (no extra rows), then the cheapest, then the
    lowest index; never a rank's last image unless that rank need not hold one. This rule wins
    over the cap: an empty rank may receive one image larger than the cap when no other is left.
    """
    if isinstance(dest, np.ndarray):
        held = np.bincount(dest, minlength=batch.num_ranks).tolist()
        if min(held) > 0:
            return False
        as_list = dest.tolist()
        changed = fill_empty_ranks(batch, as_list, cap)
        dest[:] = as_list
        return changed
    if len(set(dest)) == batch.num_ranks:
        return False
    must_hold, home = batch.must_hold, batch.home
    held = [0] * batch.num_ranks
    for d in dest:
        held[d] += 1
    empty = [r for r in range(batch.num_ranks) if must_hold[r] and not held[r]]
    # Every image by the preference that does not depend on the empty rank, best first. An image
    # leaves the donors for good once taken (its new rank holds one) or once its rank is down to
    # one, so a pointer into this order finds the best donor, and one per empty rank the best of
    # its own images: O(n log n) in all instead of a scan of every image per empty rank.
    pinned = batch.pinned(cap)
    order = _donor_order(batch, dest, pinned)
    own: dict[int, list[int]] = {r: [] for r in empty}
    for k in order:
        if home[k] in own:
            own[home[k]].append(k)
    at = 0
    changed = False
    for r in empty:
        while at < len(order) and not _is_donor(order[at], dest, held, must_hold):
            at += 1
        best_own = next((k for k in own[r] if _is_donor(k, dest, held, must_hold)), None)
        best = order[at] if at < len(order) else None
        # The full preference puts the pinned flag first, then the empty rank's own images.
        if best is None or (best_own is not None and pinned[best_own] <= pinned[best]):
            best = best_own
        if best is None:
            continue
        held[dest[best]] -= 1
        dest[best] = r
        held[r] += 1
        changed = True
    return changed


def _donor_order(batch: Batch, dest: list[int], pinned: list[bool]) -> list[int]:
    """Images by (pinned, at home, cost, index), least first (so images within the cap, then those
    already away from home): :func:`fill_empty_ranks`'s preference without its empty-rank term."""
    if batch.prebuilt is not None:  # many images: numpy's stable sort, the same order
        at_home = np.asarray(dest) == batch.prebuilt.home
        return np.lexsort((batch.prebuilt.cost, at_home, np.asarray(pinned))).tolist()
    home, cost = batch.home, batch.cost
    return sorted(range(batch.size), key=lambda k: (pinned[k], dest[k] == home[k], cost[k]))


def _is_donor(k: int, dest: list[int], held: list[int], must_hold: list[bool]) -> bool:
    """Whether image ``k`` may go: its rank keeps another image, or need not hold one."""
    return held[dest[k]] >= 2 or not must_hold[dest[k]]


def cap_excess(batch: Batch, dest: Destinations, cap: float | None) -> float:
    """Patches above the cap on ranks that receive images and hold more than one.

    A rank holding a single image is exempt: the image may be larger than the cap, and giving an
    otherwise idle rank one image comes first.
    """
    if cap is None:
        return 0.0
    held = [0] * batch.num_ranks
    receiving = [False] * batch.num_ranks
    for k, d in enumerate(dest):
        held[d] += 1
        receiving[d] = receiving[d] or d != batch.home[k]
    limit = cap * (1.0 + tuning.EPS)
    patches = rank_patches(batch, dest)
    excess = (max(patches[r] - limit, 0.0) for r in range(batch.num_ranks) if receiving[r] and held[r] > 1)
    return add_up(excess)
