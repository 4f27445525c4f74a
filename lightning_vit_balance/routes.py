"""The exchange values of recent plans on this rank, made once per plan instead of once per call.

A plan made ahead (:meth:`~lightning_vit_balance.ViTBalancer.prepare`) is used by its call's
forward, and again by activation checkpointing's recomputation; an unprepared plan by its call
and that recomputation. Its :class:`~lightning_vit_balance.exchange.ExchangeRoute`, pixel trips
and return layouts (with their codec's pieces) depend only on the plan, this rank and the ViT's
output signature, so they are made once, in :meth:`RouteCache.warm` where a plan is made ahead:
the forward then only looks them up. On hundreds of ranks they cost milliseconds of host time
(BENCHMARKS.md, "Host work of the return trip").

Entries are found by the plan's identity (``is``), not its value: hashing a plan would cost
what the cache saves. A plan is a frozen value, so an entry never goes stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_vit_balance.exchange import ExchangeRoute, PixelTrip, ReturnLayout
from lightning_vit_balance.planning import RebalancePlan

__all__ = ["RETURN_SIGNATURES", "ROUTED_PLANS", "OutputSignature", "RouteCache"]

#: Plans whose exchange values are kept: a step's calls (two or three towers) and their
#: recomputations, with room to spare.
ROUTED_PLANS = 8
#: Output signatures kept per plan: one, unless the ViT's outputs change between calls.
RETURN_SIGNATURES = 4

#: What a return layout depends on besides the plan: each token output's kind, the merge size and
#: each output's transit elements per row.
OutputSignature = tuple[tuple[str, ...], int, tuple[int, ...]]


@dataclass
class _Entry:
    plan: RebalancePlan
    rank: int
    route: ExchangeRoute
    trips: dict[bool, PixelTrip] = field(default_factory=dict)
    layouts: dict[OutputSignature, ReturnLayout] = field(default_factory=dict)


class RouteCache:
    """Routes, pixel trips and return layouts of this rank's recent plans (see the module)."""

    def __init__(self, plans: int = ROUTED_PLANS) -> None:
        self._plans = plans
        self._entries: list[_Entry] = []  # most recent last
        self._last_signature: OutputSignature | None = None

    def route(self, plan: RebalancePlan, rank: int) -> ExchangeRoute:
        """This rank's route under ``plan``."""
        return self._entry(plan, rank).route

    def trip(self, plan: RebalancePlan, rank: int, *, home: bool = True) -> PixelTrip:
        """This rank's pixel trip under ``plan`` (``home``: as :meth:`PixelTrip.from_route`), its
        pieces made."""
        entry = self._entry(plan, rank)
        trip = entry.trips.get(home)
        if trip is None:
            trip = entry.trips[home] = PixelTrip.from_route(entry.route, plan.patch_counts[rank], home=home)
            _ = trip.pieces
        return trip

    def layout(self, plan: RebalancePlan, rank: int, signature: OutputSignature) -> ReturnLayout:
        """This rank's return layout under ``plan`` for outputs of ``signature`` (kinds, merge size,
        elements per row: as :meth:`ReturnLayout.from_plan` takes them), its codec's pieces made."""
        entry = self._entry(plan, rank)
        self._last_signature = signature
        layout = entry.layouts.get(signature)
        if layout is None:
            if len(entry.layouts) >= RETURN_SIGNATURES:
                entry.layouts.pop(next(iter(entry.layouts)))
            layout = ReturnLayout.from_route(plan, entry.route, *signature)
            _ = layout.send_pieces, layout.receive_pieces
            entry.layouts[signature] = layout
        return layout

    def warm(self, plan: RebalancePlan, rank: int, *, homes: Sequence[bool] = (True,)) -> None:
        """Make ``plan``'s values before its call: the route, the trips of ``homes`` and the return
        layout of the last call's outputs (the ViT's outputs rarely change; a call whose do makes
        its own)."""
        if not plan.applied:
            return
        for home in homes:
            self.trip(plan, rank, home=home)
        if self._last_signature is not None:
            self.layout(plan, rank, self._last_signature)

    def _entry(self, plan: RebalancePlan, rank: int) -> _Entry:
        for at in range(len(self._entries) - 1, -1, -1):
            entry = self._entries[at]
            if entry.plan is plan and entry.rank == rank:
                return entry
        entry = _Entry(plan, rank, ExchangeRoute.from_plan(plan, rank))
        self._entries.append(entry)
        if len(self._entries) > self._plans:
            del self._entries[0]
        return entry
