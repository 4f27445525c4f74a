"""Activation checkpointing around a balanced call: its recomputation in the backward pass.

``torch.utils.checkpoint`` (reentrant or not) runs the checkpointed function again in the backward
pass and uses the activations it recomputes in place of the ones the forward dropped. A balanced
call recomputed there must encode the same balanced batch as in the forward, so every rank
recomputes it with the plan the forward used, and counts it nowhere (it is the same call).

Without the online cost fit a plan is a function of the gathered grids and the configuration, so
the recomputation's own gather and plan give it again. With ``calibrate_cost`` the model may be
refitted between a call and its recomputation (by later calls of the step), so the balancer keeps
its recent plans in a :class:`PlanMemory` and the recomputation recalls the one made for the same
gathered grids, or raises the same error on every rank where it cannot tell which that was.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from lightning_vit_balance.exchange import RankMetadata
from lightning_vit_balance.planning import RebalancePlan

__all__ = ["REMEMBERED_PLANS", "UNKNOWN_PLAN_MESSAGE", "PlanMemory", "in_backward_pass"]

#: Plans a :class:`PlanMemory` keeps: the forward calls whose recomputation may still come (a step's
#: checkpointed calls are recomputed in its own backward pass, before the next step's forward).
REMEMBERED_PLANS = 64

#: Raised, on every rank alike, when a recomputation's plan cannot be told for sure.
UNKNOWN_PLAN_MESSAGE = (
    "lightning_vit_balance: a balanced call recomputed by activation checkpointing cannot tell which "
    "plan its forward call used: {why}. With calibrate_cost=True the cost fit refits between calls, "
    "so calls of the same images on every rank may be planned differently; the plans of the latest "
    "{size} calls are kept, and a call whose graph was never backpropagated (a skipped step) stays "
    "among them. Keep one such call between a forward and its backward pass, or set "
    "calibrate_cost=False."
)


def in_backward_pass() -> bool:
    """Whether autograd runs a backward pass on this thread now: a ViT call made then is
    activation checkpointing's recomputation of a call from the forward."""
    # torch's own checkpoint code reads this id (a private function: a torch without it reads "no").
    current_task = getattr(torch._C, "_current_graph_task_id", None)
    return current_task is not None and current_task() != -1


class PlanMemory:
    """The plans of a balancer's recent forward calls, recalled by their recomputations.

    Every rank remembers the plans made from the same gathered metadata in the same order, and
    recalls alike, so every rank recalls the same plan or raises the same error. A recomputation
    takes the plan of the calls of its gathered grids that no recomputation took yet, those that
    built a graph first (a reentrant checkpoint's forward builds none); failing those, the ones
    taken already (a second backward pass recomputes again). Where the calls it chooses from were
    planned differently (the same images on every rank, the cost fit refitted between them), it
    cannot tell which was its own and raises rather than guess.
    """

    def __init__(self, size: int = REMEMBERED_PLANS) -> None:
        self.size = size
        # [every rank's grid rows, the plan made from them, built a graph, recalled], oldest first.
        self._plans: deque[list[Any]] = deque(maxlen=size)
        #: Plans remembered so far, less those forgotten: a mark for :meth:`forget_since`.
        self.remembered = 0

    def remember(self, metadata: Sequence[RankMetadata], plan: RebalancePlan) -> None:
        """Keep the plan a forward call made from ``metadata`` (every rank's)."""
        self._plans.append([tuple(m.grids for m in metadata), plan, torch.is_grad_enabled(), False])
        self.remembered += 1

    def forget_since(self, mark: int) -> None:
        """Let go of the plans remembered after :attr:`remembered` was ``mark``: those of a call
        that raised, which built no graph, so that no recomputation of it will come (a batch
        retried after it would otherwise find two calls of its images, maybe planned apart)."""
        for _ in range(min(self.remembered - mark, len(self._plans))):
            self._plans.pop()
        self.remembered = min(self.remembered, mark)

    def recall(self, metadata: Sequence[RankMetadata]) -> RebalancePlan:
        """The plan remembered for the same gathered grids (see the class docstring).

        Raises:
            RuntimeError: None is remembered, or the candidates were planned differently
                (:data:`UNKNOWN_PLAN_MESSAGE`).
        """
        grids = tuple(m.grids for m in metadata)
        found = [entry for entry in self._plans if entry[0] == grids]
        waiting = [entry for entry in found if not entry[3]]
        candidates = [entry for entry in waiting if entry[2]] or waiting or found
        if not candidates:
            why = f"none of the latest {self.size} calls had its images"
            raise RuntimeError(UNKNOWN_PLAN_MESSAGE.format(why=why, size=self.size))
        if len({(entry[1].applied, entry[1].destinations) for entry in candidates}) > 1:
            why = f"{len(candidates)} calls had its images and were planned differently"
            raise RuntimeError(UNKNOWN_PLAN_MESSAGE.format(why=why, size=self.size))
        for entry in candidates:
            entry[3] = True
        plan: RebalancePlan = candidates[-1][1]
        return plan
