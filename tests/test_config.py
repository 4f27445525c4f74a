"""ViTBalanceConfig: seed defaults and validation messages."""

from __future__ import annotations

import pytest

from lightning_vit_balance import ViTBalanceConfig


def test_defaults_follow_the_seed() -> None:
    config = ViTBalanceConfig()
    assert config.max_len_ratio is None
    assert config.trigger_threshold == 0.2
    assert config.refine_tolerance == 0.05
    assert config.refine_iterations == 20
    assert config.solver == "locality"
    assert (config.cost_quadratic, config.cost_linear, config.cost_constant) == (1.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("enabled", 1),
        ("verbose", "yes"),
        ("max_len_ratio", 0.5),
        ("max_len_ratio", float("nan")),
        ("trigger_threshold", -0.1),
        ("trigger_threshold", True),
        ("refine_tolerance", -1.0),
        ("refine_iterations", -1),
        ("refine_iterations", 2.0),
        ("min_gain", 1.0),
        ("solver", "magic"),
        ("empty_rank_forward", "skip"),
        ("cost_linear", -2.0),
        ("cost_window_patches", -4),
        ("gather_capacity", 0),
    ],
)
def test_invalid_values_name_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"ViTBalanceConfig\.{field}={value!r}".replace("(", r"\(")) as info:
        ViTBalanceConfig(**{field: value})  # type: ignore[arg-type]
    assert "expected" in str(info.value)


def test_all_zero_cost_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"cost_quadratic=0\.0.*at least one cost coefficient"):
        ViTBalanceConfig(cost_quadratic=0.0)


def test_valid_values_accepted() -> None:
    config = ViTBalanceConfig(max_len_ratio=1, trigger_threshold=0, min_gain=0.0, solver="seed")
    assert config.max_len_ratio == 1
