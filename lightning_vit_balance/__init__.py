"""Balance vision-encoder (ViT) work across data-parallel ranks in VLM training."""

from lightning_vit_balance.balancer import BalanceStats, ViTBalancer, balanced_encode
from lightning_vit_balance.config import ViTBalanceConfig, add_vit_balance_args
from lightning_vit_balance.cost import CostModel
from lightning_vit_balance.lightning import (
    ViTBalanceCallback,
    ViTBalanceMixin,
    dp_group_from_strategy,
)
from lightning_vit_balance.outputs import OutputLayout
from lightning_vit_balance.planning import REASONS, RebalancePlan, plan_rebalance

__all__ = [
    "REASONS",
    "BalanceStats",
    "CostModel",
    "OutputLayout",
    "RebalancePlan",
    "ViTBalanceCallback",
    "ViTBalanceConfig",
    "ViTBalanceMixin",
    "ViTBalancer",
    "add_vit_balance_args",
    "balanced_encode",
    "dp_group_from_strategy",
    "plan_rebalance",
]
