"""Balance vision-encoder (ViT) work across data-parallel ranks in VLM training."""

from lightning_vit_balance.config import ViTBalanceConfig
from lightning_vit_balance.cost import CostModel
from lightning_vit_balance.planning import REASONS, RebalancePlan, plan_rebalance

__all__ = ["REASONS", "CostModel", "RebalancePlan", "ViTBalanceConfig", "plan_rebalance"]
