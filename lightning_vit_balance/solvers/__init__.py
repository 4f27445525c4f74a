"""The solvers behind :func:`~lightning_vit_balance.plan_rebalance`. Pure Python, no torch.

Internal: users pick a solver by name in :class:`~lightning_vit_balance.ViTBalanceConfig` and get
plans from :func:`~lightning_vit_balance.plan_rebalance`.

* ``"locality"`` (default): :mod:`.select` runs the heuristics of :mod:`.locality` and keeps the
  plan that moves the fewest pixel rows within 0.4% of the best makespan.
* ``"lpt"`` (``"seed"`` is an alias): :mod:`.lpt`, the seed's algorithm.

Every solver is deterministic: ties are broken by rank and image index, never by hash or dict
order, so every rank computes the same plan. Tuning constants live in :mod:`.tuning`.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_vit_balance.config import ViTBalanceConfig
from lightning_vit_balance.solvers.batch import Batch, Destinations
from lightning_vit_balance.solvers.lpt import solve_lpt
from lightning_vit_balance.solvers.select import solve_locality

__all__ = ["Batch", "canonical_solver", "solve"]

#: Canonical solver name -> solver. A solver returns destinations or a skip reason.
_SOLVERS: dict[str, Callable[[Batch, ViTBalanceConfig], Destinations | str]] = {
    "locality": solve_locality,
    "lpt": solve_lpt,
}

#: Other accepted names: ``"seed"`` was the LPT solver's first name.
_ALIASES: dict[str, str] = {"seed": "lpt"}


def canonical_solver(name: str) -> str:
    """The canonical name of a solver: ``"seed"`` -> ``"lpt"``, the others unchanged."""
    return _ALIASES.get(name, name)


def solve(batch: Batch, config: ViTBalanceConfig) -> Destinations | str:
    """Destinations of the batch's flat images under ``config.solver``, or a skip reason."""
    return _SOLVERS[canonical_solver(config.solver)](batch, config)
