"""The Lightning face: mixin, callback, strategy adapter and the seed's argparse flags.

The only modules of the package that import Lightning.
"""

from lightning_vit_balance.lightning.callback import ViTBalanceCallback
from lightning_vit_balance.lightning.flags import add_vit_balance_args, vit_balance_config_from_args
from lightning_vit_balance.lightning.mixin import ViTBalanceMixin
from lightning_vit_balance.lightning.strategy import dp_group_from_strategy

__all__ = [
    "ViTBalanceCallback",
    "ViTBalanceMixin",
    "add_vit_balance_args",
    "dp_group_from_strategy",
    "vit_balance_config_from_args",
]
