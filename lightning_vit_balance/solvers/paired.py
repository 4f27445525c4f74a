"""Paired exchanges: the repair's first stage on many ranks, every pair of ranks at once in numpy.

With hundreds of ranks and images of similar sizes, a plan leaves hundreds of ranks a little
above the target, and :func:`~.repair.repair`, which relieves them one at a time in Python, would
take tens of milliseconds. :func:`paired_exchanges` relieves most of them in a few numpy rounds
and leaves the repair the few that need more (pairs of images, or several exchanges):

* *Pairing*: the ranks above the target, heaviest first, with the ranks below it, roomiest first
  (room: the target minus the load), that list shifted by one place per round; each rank is in
  at most one pair per round.
* *Candidates*: per pair, every single image of the loaded rank moved to its partner, or swapped
  for a cheaper image of the partner's, that shifts a positive cost within the partner's room.
  A loaded rank never gives away its last image without one back: alone above the target,
  that image fits in no partner's room.
* *Selection*: per pair, the exchange that brings the loaded rank within the target with the
  fewest pixel rows added (an image leaving its home adds its rows, one coming home takes them
  off); when none does, the one that shifts the most cost. Ties: the first image of the loaded
  rank, then a move before a swap, then the first partner image, in image order.

No exchange takes a partner above the target, so the makespan never grows.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from lightning_vit_balance.solvers import tuning
from lightning_vit_balance.solvers.batch import Arrays, Batch, group_order

__all__ = ["paired_exchanges"]

#: Rows-added score of an exchange that is not a candidate (above any real count of rows).
_NONE = np.iinfo(np.int64).max


def paired_exchanges(batch: Batch, dest: np.ndarray, target: float, rounds: int) -> np.ndarray:
    """``dest`` after at most ``rounds`` rounds of exchanges between paired ranks (a new array).

    Args:
        batch: The images.
        dest: ``[n]`` int64 destinations, every rank that must hold an image holding one.
        target: The load no rank should exceed.
        rounds: This many rounds, fewer when no rank is left above the target.

    Returns:
        ``[n]`` int64 destinations.
    """
    cost = batch.arrays.cost
    dest = dest.copy()
    limit = target * (1.0 + tuning.EPS)
    for turn in range(rounds):
        loads = np.bincount(dest, weights=cost, minlength=batch.num_ranks)
        over = np.flatnonzero(loads > limit)
        under = np.flatnonzero(loads < target)
        pairs = min(over.size, under.size)
        if pairs == 0:
            break
        loaded = over[np.argsort(-loads[over], kind="stable")[:pairs]]
        # Roomiest first, shifted by one place each round: a loaded rank that found no exchange
        # meets a new partner next round. Pairing by room alone met the same partners again and
        # left 3-13 ranks above after 4-8 rounds (P = 512-1024, similar sizes) instead of 0-3.
        partner = np.roll(under[np.argsort(loads[under], kind="stable")], -(turn % under.size))[:pairs]
        pair = _Pairs(loaded, partner, loads[loaded] - target, target - loads[partner])
        at, sent, returned = _exchanges(batch.arrays, dest, pair, batch.num_ranks)
        dest[sent] = partner[at]
        swap = returned >= 0
        dest[returned[swap]] = loaded[at[swap]]
    return dest


class _Pairs(NamedTuple):
    """One round's pairs: ``[pairs]`` arrays."""

    loaded: np.ndarray  # ranks above the target
    partner: np.ndarray  # ranks below it
    excess: np.ndarray  # the loaded rank's load minus the target
    room: np.ndarray  # the target minus the partner's load


def _exchanges(
    arrays: Arrays, dest: np.ndarray, pair: _Pairs, num_ranks: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The selected exchange of every pair that has one (module docstring): the pairs' indices,
    the images sent and the images returned (``-1``: none, a move)."""
    count = pair.loaded.size
    ranks = np.concatenate([pair.loaded, pair.partner])
    table = _images_of(dest, ranks, num_ranks)  # [2 * pairs, 1 + most held]
    rows_table = _rows_added(arrays, table, ranks, np.concatenate([pair.partner, pair.loaded]))
    mine, theirs = table[:count, 1:], table[count:]  # the partner's column 0: nothing (a move)
    cost_sent = np.where(mine >= 0, arrays.cost[mine], np.nan)  # [pairs, a]
    cost_back = np.where(theirs >= 0, arrays.cost[theirs], np.nan)  # [pairs, 1 + b]
    cost_back[:, 0] = 0.0
    # [pairs, a, 1 + b]; NaN where an image is missing, which no comparison admits.
    shift = cost_sent[:, :, None] - cost_back[:, None, :]
    ok = (shift > 0.0) & (shift <= pair.room[:, None, None])
    rows = rows_table[:count, 1:, None] + rows_table[count:, None, :]
    flat = np.where(ok & (shift >= pair.excess[:, None, None]), rows, _NONE).reshape(count, -1)
    pick = flat.argmin(axis=1)
    whole = flat[np.arange(count), pick] != _NONE
    most = np.where(ok, shift, -np.inf).reshape(count, -1)
    pick = np.where(whole, pick, most.argmax(axis=1))
    at = np.flatnonzero(whole | (most[np.arange(count), pick] > -np.inf))
    a, b = np.divmod(pick[at], theirs.shape[1])
    return at, mine[at, a], theirs[at, b]


def _images_of(dest: np.ndarray, ranks: np.ndarray, num_ranks: int) -> np.ndarray:
    """``[len(ranks), 1 + most held]``: row ``i`` holds ``-1``, then rank ``ranks[i]``'s images
    in image order, then ``-1``."""
    wanted = np.full(num_ranks, -1, dtype=np.int64)
    wanted[ranks] = np.arange(ranks.size)
    images = np.flatnonzero(wanted[dest] >= 0)
    row = wanted[dest[images]]
    order = group_order(row, ranks.size)
    images, row = images[order], row[order]
    held = np.bincount(row, minlength=ranks.size)
    column = np.arange(1, images.size + 1) - (np.cumsum(held) - held)[row]
    table = np.full((ranks.size, 1 + int(held.max(initial=0))), -1, dtype=np.int64)
    table[row, column] = images
    return table


def _rows_added(arrays: Arrays, images: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Pixel rows each of ``images`` (``-1``: none, 0 rows) adds by going from ``src[i]`` to
    ``dst[i]``: its rows when it leaves its home, minus its rows when it comes home."""
    real = images >= 0
    home = np.where(real, arrays.home[images], -1)
    patches = np.where(real, arrays.patches[images], 0)
    return np.where(home == src[:, None], patches, np.where(home == dst[:, None], -patches, 0))
