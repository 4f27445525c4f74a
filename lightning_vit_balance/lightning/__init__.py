"""The Lightning face: mixin, callback and strategy adapter.

The only modules of the package that import Lightning.
"""

from lightning_vit_balance.lightning.callback import ViTBalanceCallback
from lightning_vit_balance.lightning.mixin import ViTBalanceMixin
from lightning_vit_balance.lightning.strategy import dp_group_from_strategy

__all__ = [
    "ViTBalanceCallback",
    "ViTBalanceMixin",
    "dp_group_from_strategy",
]
