"""The lightest rank with room, for the heuristics that place images under a patch cap.

Under a cap, LPT-style placement gives each image to the lightest rank with room for its
patches. Popping the full ranks off a ``(load, rank)`` heap and pushing them back for every image
costs ``O(P)`` heap operations per image once most ranks are near the cap: 45-100 ms a plan at
P = 1024 x 8. :class:`RoomHeap` sets those ranks aside, by room, and takes a rank back only for an
image it has room for, so each image looks at the ranks with room alone. The rank it picks is the
same: the lowest ``(load, rank)`` among the ranks with room.
"""

from __future__ import annotations

import heapq

__all__ = ["RoomHeap"]


class RoomHeap:
    """Ranks by ``(load, rank)``, lightest first, the ranks short of room set aside.

    It reads the caller's ``load`` and ``room`` lists, which the caller updates: a rank's load may
    only grow, and a change of room must be reported with :meth:`room_changed`.

    Args:
        load: ``load[r]``: rank ``r``'s load.
        room: ``room[r]``: patches rank ``r`` may still take.
    """

    def __init__(self, load: list[float], room: list[float]) -> None:
        self.load, self.room = load, room
        #: ``(load, rank)`` of the ranks not set aside; an entry may be low (the load grew since):
        #: it is refreshed when it reaches the top.
        self.heap = [(value, r) for r, value in enumerate(load)]
        heapq.heapify(self.heap)
        #: ``(-room, rank)`` of the ranks set aside; an entry whose room is no longer the rank's
        #: is stale (a newer one was pushed) and skipped. Skipping only saves work: a rank taken
        #: back without room would be set aside again.
        self.aside: list[tuple[float, int]] = []
        self.is_aside = [False] * len(load)
        #: ``(load, rank)`` of every rank, entries refreshed at the top as in ``heap``; built on
        #: the first :meth:`lightest_of_all` (only the seed's LPT asks, when no rank has room).
        self.every: list[tuple[float, int]] | None = None

    def lightest(self, need: float) -> int | None:
        """The lowest ``(load, rank)`` among the ranks with at least ``need`` room (``None``:
        no rank has)."""
        aside, heap, load, room = self.aside, self.heap, self.load, self.room
        while aside and -aside[0][0] >= need:
            negative_room, r = heapq.heappop(aside)
            if self.is_aside[r] and room[r] == -negative_room:
                self.is_aside[r] = False
                heapq.heappush(heap, (load[r], r))
        while heap:
            top_load, top = heap[0]
            if top_load != load[top]:
                heapq.heapreplace(heap, (load[top], top))
            elif room[top] < need:
                heapq.heappop(heap)
                self.is_aside[top] = True
                heapq.heappush(aside, (-room[top], top))
            else:
                return top
        return None

    def lightest_of_all(self) -> int:
        """The lowest ``(load, rank)`` of every rank, room or not (when no rank has room)."""
        load = self.load
        if self.every is None:
            self.every = [(value, r) for r, value in enumerate(load)]
            heapq.heapify(self.every)
        every = self.every
        while every[0][0] != load[every[0][1]]:
            heapq.heapreplace(every, (load[every[0][1]], every[0][1]))
        return every[0][1]

    def room_changed(self, rank: int) -> None:
        """Note that ``room[rank]`` changed (a rank not set aside needs no note)."""
        if self.is_aside[rank]:
            heapq.heappush(self.aside, (-self.room[rank], rank))
