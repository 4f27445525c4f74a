"""The seed trainer's argparse flags, for training scripts that migrate from it.

The flag names and defaults are the seed's exactly; :func:`vit_balance_config_from_args` turns a
parsed namespace into a :class:`~lightning_vit_balance.ViTBalanceConfig`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

from lightning_vit_balance.config import ViTBalanceConfig

__all__ = ["add_vit_balance_args", "vit_balance_config_from_args"]

#: namespace attribute (argparse ``dest``) -> ViTBalanceConfig field.
_DEST_TO_FIELD: dict[str, str] = {
    "use_vit_dp_balance": "enabled",
    "dp_balance_max_len_ratio_vit": "max_len_ratio",
    "dp_balance_trigger_threshold_vit": "trigger_threshold",
    "dp_balance_verbose": "verbose",
}


def add_vit_balance_args(
    parser: argparse.ArgumentParser,
) -> argparse.ArgumentParser:
    """Add the seed's four ViT-balance flags to ``parser`` and return it.

    ``--use-vit-dp-balance`` (off), ``--dp-balance-max-len-ratio-vit`` (``None``),
    ``--dp-balance-trigger-threshold-vit`` (``0.2``) and ``--dp-balance-verbose`` (off). In the
    seed ``--dp-balance-verbose`` is shared with the VLM-level balance, so a parser that already
    defines it keeps its own definition.

    Args:
        parser: The training script's parser.

    Returns:
        The same parser, so calls can be chained.
    """
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(
            f"add_vit_balance_args(parser={parser!r}) expected an argparse.ArgumentParser, "
            f"got {type(parser).__name__}."
        )
    group = parser.add_argument_group("ViT data-parallel balance")
    group.add_argument(
        "--use-vit-dp-balance",
        action="store_true",
        default=False,
        help="Balance ViT encoder work across data-parallel ranks.",
    )
    group.add_argument(
        "--dp-balance-max-len-ratio-vit",
        type=float,
        default=None,
        help="Cap on patches per rank after balancing: avg_patches * ratio. Default: no cap.",
    )
    group.add_argument(
        "--dp-balance-trigger-threshold-vit",
        type=float,
        default=0.2,
        help="Skip balancing while the imbalance max_load/mean_load - 1 is below this. Default: 0.2.",
    )
    # Already defined when the script also has the seed's VLM-level balance, which shares it.
    with contextlib.suppress(argparse.ArgumentError):
        group.add_argument(
            "--dp-balance-verbose",
            action="store_true",
            default=False,
            help="Print per step: imbalance, load per rank, decision and applied/total count.",
        )
    return parser


def vit_balance_config_from_args(
    namespace: argparse.Namespace, base: ViTBalanceConfig | None = None
) -> ViTBalanceConfig:
    """Build the configuration from a namespace parsed with :func:`add_vit_balance_args`'s flags.

    Args:
        namespace: The result of ``parser.parse_args()``.
        base: Supplies every field the seed has no flag for (solver, cost model...); default
            ``ViTBalanceConfig()``.

    Returns:
        ``base`` with ``enabled``, ``max_len_ratio``, ``trigger_threshold`` and ``verbose`` taken
        from the flags. Invalid values raise ``ValueError`` from the config, naming the field.
    """
    if base is None:
        base = ViTBalanceConfig()
    elif not isinstance(base, ViTBalanceConfig):
        raise TypeError(f"vit_balance_config_from_args(base={base!r}) expected a ViTBalanceConfig or None.")
    missing = [dest for dest in _DEST_TO_FIELD if not hasattr(namespace, dest)]
    if missing:
        raise ValueError(
            f"vit_balance_config_from_args(namespace) lacks {', '.join(missing)}: expected a namespace "
            f"parsed by a parser given to add_vit_balance_args(parser)."
        )
    values = {field: getattr(namespace, dest) for dest, field in _DEST_TO_FIELD.items()}
    return dataclasses.replace(base, **values)
