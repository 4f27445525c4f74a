"""Activation checkpointing around a balanced call: its recomputation in the backward pass.

``torch.utils.checkpoint`` (reentrant or not) runs the checkpointed function again in the backward
pass and uses the activations it recomputes in place of the ones the forward dropped. A balanced
call recomputed there must encode the same balanced batch as in the forward, so every rank
recomputes it with the plan the forward used, and counts it nowhere (it is the same call).

Without the online cost fit a plan is a function of the gathered grids and the configuration, so
the recomputation's own gather and plan give it again. With ``calibrate_cost`` the model may be
refitted between a call and its recomputation (by later calls of the step), so the balancer keeps
its recent plans in a :class:`PlanMemory` and the recomputation recalls the one made for the same
gathered grids.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from lightning_vit_balance.exchange import RankMetadata
from lightning_vit_balance.planning import RebalancePlan

__all__ = ["REMEMBERED_PLANS", "PlanMemory", "in_backward_pass"]

#: Plans a :class:`PlanMemory` keeps: the forward calls whose recomputation may still come (a step's
#: checkpointed calls are recomputed in its own backward pass, before the next step's forward).
REMEMBERED_PLANS = 16


def in_backward_pass() -> bool:
    """Whether autograd runs a backward pass on this thread now: a ViT call made then is
    activation checkpointing's recomputation of a call from the forward."""
    # torch's own checkpoint code reads this id (a private function: a torch without it reads "no").
    current_task = getattr(torch._C, "_current_graph_task_id", None)
    return current_task is not None and current_task() != -1


class PlanMemory:
    """The plans of a balancer's recent forward calls, recalled by their recomputations.

    Every rank remembers the plans made from the same gathered metadata in the same order, so
    every rank recalls the same plan for the same gathered grids. The same grids may come again
    (a fixed batch, an epoch's repeat): a recomputation takes the latest call of its grids that no
    recomputation took yet, which is its own where autograd recomputes a step's regions in the
    reverse order of their forward calls, as it does for a chain of regions.
    """

    def __init__(self, size: int = REMEMBERED_PLANS) -> None:
        # [every rank's grid rows, the plan made from them, whether recalled], oldest first.
        self._plans: deque[list[Any]] = deque(maxlen=size)

    def remember(self, metadata: Sequence[RankMetadata], plan: RebalancePlan) -> None:
        """Keep the plan a forward call made from ``metadata`` (every rank's)."""
        self._plans.append([tuple(m.grids for m in metadata), plan, False])

    def recall(self, metadata: Sequence[RankMetadata]) -> RebalancePlan | None:
        """The plan remembered for the same gathered grids (see the class docstring); None when
        none is."""
        grids = tuple(m.grids for m in metadata)
        found = [entry for entry in reversed(self._plans) if entry[0] == grids]
        if not found:
            return None
        entry = next((entry for entry in found if not entry[2]), found[0])
        entry[2] = True
        plan: RebalancePlan = entry[1]
        return plan
