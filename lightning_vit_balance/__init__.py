"""Balance vision-encoder (ViT) work across data-parallel ranks in VLM training.

The engine needs only torch: its configuration, cost model and planning only NumPy. Everything
beyond those three (the exchange, the balanced encode, the integrations, and submodules accessed
as attributes) is imported on first use: the simulator and offline planning never import torch,
plain ``torch.distributed`` programs and the spawned processes of a job never import Lightning
(:class:`ViTBalanceMixin`, :class:`ViTBalanceCallback`, :func:`dp_group_from_strategy`) or
transformers (:class:`ViTBalanceTrainerCallback`).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from lightning_vit_balance.config import ViTBalanceConfig, add_vit_balance_args
from lightning_vit_balance.cost import CostCalibrator, CostModel
from lightning_vit_balance.planning import REASONS, RebalancePlan, plan_rebalance

if TYPE_CHECKING:
    from lightning_vit_balance.balancer import BalanceStats, PreparedPlan, ViTBalancer, balanced_encode
    from lightning_vit_balance.hf import BalancedVisionTower, balance_vision_tower, encode_visual
    from lightning_vit_balance.hf_trainer import ViTBalanceTrainerCallback
    from lightning_vit_balance.host_group import make_host_group, release_host_group
    from lightning_vit_balance.lightning import (
        ViTBalanceCallback,
        ViTBalanceMixin,
        dp_group_from_strategy,
    )
    from lightning_vit_balance.metrics import BalanceMetrics
    from lightning_vit_balance.outputs import OutputLayout

__all__ = [
    "REASONS",
    "BalanceMetrics",
    "BalanceStats",
    "BalancedVisionTower",
    "CostCalibrator",
    "CostModel",
    "OutputLayout",
    "PreparedPlan",
    "RebalancePlan",
    "ViTBalanceCallback",
    "ViTBalanceConfig",
    "ViTBalanceMixin",
    "ViTBalanceTrainerCallback",
    "ViTBalancer",
    "add_vit_balance_args",
    "balance_vision_tower",
    "balanced_encode",
    "dp_group_from_strategy",
    "encode_visual",
    "make_host_group",
    "plan_rebalance",
    "release_host_group",
]

#: Names that need an optional dependency, and the extra that installs it.
_EXTRAS = {"ViTBalanceTrainerCallback": ("transformers", "hf")}
# ``from lightning_vit_balance import *`` without an optional dependency leaves out what needs it
# (looking for a package imports nothing).
__all__ = [name for name in __all__ if name not in _EXTRAS or importlib.util.find_spec(_EXTRAS[name][0])]

#: Names imported on first use (they import torch, Lightning or transformers), and their modules.
_LAZY_NAMES = {
    "BalanceStats": "lightning_vit_balance.balancer",
    "PreparedPlan": "lightning_vit_balance.balancer",
    "ViTBalancer": "lightning_vit_balance.balancer",
    "balanced_encode": "lightning_vit_balance.balancer",
    "BalancedVisionTower": "lightning_vit_balance.hf",
    "balance_vision_tower": "lightning_vit_balance.hf",
    "encode_visual": "lightning_vit_balance.hf",
    "make_host_group": "lightning_vit_balance.host_group",
    "release_host_group": "lightning_vit_balance.host_group",
    "BalanceMetrics": "lightning_vit_balance.metrics",
    "OutputLayout": "lightning_vit_balance.outputs",
    "ViTBalanceCallback": "lightning_vit_balance.lightning",
    "ViTBalanceMixin": "lightning_vit_balance.lightning",
    "dp_group_from_strategy": "lightning_vit_balance.lightning",
    "ViTBalanceTrainerCallback": "lightning_vit_balance.hf_trainer",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the installed distribution's, which ranks compare (see config.py)
        from lightning_vit_balance.config import package_version

        return package_version()
    if name in _LAZY_NAMES:
        needed, extra = _EXTRAS.get(name, (None, None))
        if needed is not None and importlib.util.find_spec(needed) is None:
            raise ImportError(
                f"lightning_vit_balance.{name} needs {needed}, which is not installed: "
                f"pip install 'lightning-vit-balance[{extra}]' (or {needed} itself)."
            )
        value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # A submodule (``lightning_vit_balance.exchange``), as after an import of it.
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'lightning_vit_balance' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
