"""The seed's argparse flags and the config built from them."""

from __future__ import annotations

import argparse

import pytest

from lightning_vit_balance import ViTBalanceConfig, add_vit_balance_args


def test_defaults_are_the_seeds() -> None:
    args = add_vit_balance_args(argparse.ArgumentParser()).parse_args([])
    assert vars(args) == {
        "use_vit_dp_balance": False,
        "dp_balance_max_len_ratio_vit": None,
        "dp_balance_trigger_threshold_vit": 0.2,
        "dp_balance_verbose": False,
    }
    config = ViTBalanceConfig.from_args(args)
    # The seed's flag defaults to off, the dataclass to on: the flag wins.
    assert config == ViTBalanceConfig(enabled=False)


def test_every_flag_reaches_its_field() -> None:
    parser = add_vit_balance_args(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--use-vit-dp-balance",
            "--dp-balance-max-len-ratio-vit",
            "1.5",
            "--dp-balance-trigger-threshold-vit",
            "0.35",
            "--dp-balance-verbose",
        ]
    )
    config = ViTBalanceConfig.from_args(args)
    assert (config.enabled, config.max_len_ratio, config.trigger_threshold, config.verbose) == (
        True,
        1.5,
        0.35,
        True,
    )


def test_base_supplies_the_fields_without_flags() -> None:
    args = add_vit_balance_args(argparse.ArgumentParser()).parse_args(["--use-vit-dp-balance"])
    base = ViTBalanceConfig(solver="seed", cost_linear=3.0, trigger_threshold=0.9)
    config = ViTBalanceConfig.from_args(args, base=base)
    assert config == ViTBalanceConfig(solver="seed", cost_linear=3.0, enabled=True, trigger_threshold=0.2)


def test_shared_verbose_flag_is_kept() -> None:
    parser = argparse.ArgumentParser()
    # A seed trainer defines --dp-balance-verbose for its VLM-level balance too.
    parser.add_argument("--dp-balance-verbose", action="store_true")
    add_vit_balance_args(parser)
    args = parser.parse_args(["--dp-balance-verbose", "--use-vit-dp-balance"])
    assert ViTBalanceConfig.from_args(args).verbose is True


def test_invalid_values_name_the_field() -> None:
    # A namespace the parser did not check (a script's own parsing, or a value set after it).
    args = add_vit_balance_args(argparse.ArgumentParser()).parse_args([])
    args.dp_balance_max_len_ratio_vit = 0.5
    with pytest.raises(ValueError, match=r"max_len_ratio=0\.5"):
        ViTBalanceConfig.from_args(args)


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--dp-balance-max-len-ratio-vit", "0.5", ">= 1"),
        ("--dp-balance-max-len-ratio-vit", "inf", ">= 1"),
        ("--dp-balance-max-len-ratio-vit", "abc", "invalid float value"),
        ("--dp-balance-trigger-threshold-vit", "-0.1", ">= 0"),
        ("--dp-balance-trigger-threshold-vit", "nan", ">= 0"),
    ],
)
def test_values_out_of_range_are_usage_errors_naming_the_flag(
    flag: str, value: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        add_vit_balance_args(argparse.ArgumentParser()).parse_args([flag, value])
    error = capsys.readouterr().err
    assert f"argument {flag}:" in error and expected in error, error


def test_missing_flags_are_named() -> None:
    with pytest.raises(ValueError, match=r"use_vit_dp_balance.*add_vit_balance_args"):
        ViTBalanceConfig.from_args(argparse.Namespace(dp_balance_verbose=True))
    with pytest.raises(TypeError, match="ArgumentParser"):
        add_vit_balance_args("--use-vit-dp-balance")  # type: ignore[arg-type]
