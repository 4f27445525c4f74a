"""ViTBalanceConfig: seed defaults and validation messages."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

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


def test_a_windowed_cost_without_a_window_is_rejected() -> None:
    # Every windowed cost would be 0: the term priced nothing, silently.
    with pytest.raises(
        ValueError, match=r"cost_window_patches=0 .*expected a window > 0 \(patches\) with cost_windowed"
    ):
        ViTBalanceConfig(cost_windowed=1.0)


def test_all_zero_cost_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"cost_quadratic=0\.0.*at least one cost coefficient"):
        ViTBalanceConfig(cost_quadratic=0.0)


def test_valid_values_accepted() -> None:
    config = ViTBalanceConfig(max_len_ratio=1, trigger_threshold=0, min_gain=0.0, solver="seed")
    assert config.max_len_ratio == 1


#: Another valid value of each field, and whether the fingerprint must tell it apart.
OTHER_VALUES: dict[str, tuple[Any, bool]] = {
    "enabled": (False, True),
    "max_len_ratio": (1.5, True),
    "trigger_threshold": (0.3, True),
    "verbose": (True, False),  # what a rank prints
    "solver": ("lpt", True),
    "cost_quadratic": (2.0, True),
    "cost_linear": (1.0, True),
    "cost_constant": (1.0, True),
    "cost_windowed": (1.0, True),
    "cost_window_patches": (32, True),
    "cost_per_frame_attention": (True, True),
    "refine_tolerance": (0.1, True),
    "refine_iterations": (5, True),
    "min_gain": (0.1, True),
    "empty_rank_forward": ("no_grad", True),
    "gather_capacity": (8, False),  # no longer used
    "overlap_pixel_trip": (True, True),
    "calibrate_cost": (True, True),
    "plan_ahead": (True, True),
    "split_videos": (True, True),
    "check_skipped_calls": (True, True),
}


def test_the_fingerprint_tells_each_setting_apart_by_name_and_nothing_else() -> None:
    """A field the fingerprint left out would let ranks that plan or exchange otherwise meet
    without a word; one it kept too many (1 and 1.0, an alias) would fail ranks that agree."""
    assert set(OTHER_VALUES) == {f.name for f in dataclasses.fields(ViTBalanceConfig)}
    base = dict(ViTBalanceConfig(cost_window_patches=64).fingerprint())
    for field, (value, told) in OTHER_VALUES.items():
        changed = dict(ViTBalanceConfig(**{"cost_window_patches": 64, field: value}).fingerprint())
        apart = {name for name in base if changed[name] != base[name]}
        assert apart == ({field} if told else set()), (field, apart)
    assert ViTBalanceConfig(solver="seed").fingerprint() == ViTBalanceConfig(solver="lpt").fingerprint()
    numbers = {"cost_quadratic": 2, "cost_linear": 1, "trigger_threshold": 0, "max_len_ratio": 2}
    as_floats = {name: float(value) for name, value in numbers.items()}
    assert ViTBalanceConfig(**numbers).fingerprint() == ViTBalanceConfig(**as_floats).fingerprint()


def test_the_package_sources_digest_does_not_follow_the_file_system_s_listing_order(tmp_path: Path) -> None:
    from lightning_vit_balance import config as config_module

    package = Path(config_module.__file__).resolve().parent
    listed = list(package.rglob("*.py"))
    with mock.patch.object(Path, "rglob", lambda self, pattern: iter(reversed(listed))):
        reversed_digest = config_module._sources_digest(package)
    assert reversed_digest == config_module._sources_digest(package)


def test_the_fingerprint_covers_the_package_sources(tmp_path: Path) -> None:
    """Ranks whose package differs in any source file (a stale install that kept its version
    number, a file edited on one node) send different fingerprints."""
    from lightning_vit_balance import config as config_module

    package = Path(config_module.__file__).resolve().parent
    names = dict(ViTBalanceConfig().fingerprint())
    assert names["package_sources"] == config_module.setting_digest(config_module._sources_digest(package))
    copy = tmp_path / "copy"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    digests = [config_module._sources_digest(copy)]
    solver = copy / "solvers" / "tuning.py"
    solver.write_text(solver.read_text().replace("SLACK = 0.004", "SLACK = 0.005"))
    digests.append(config_module._sources_digest(copy))
    (copy / "solvers" / "tuning.py").rename(copy / "solvers" / "tuning_renamed.py")
    digests.append(config_module._sources_digest(copy))
    assert digests[0] == config_module._sources_digest(package)
    assert len(set(digests)) == 3


def test_numpy_scalars_are_taken_as_python_numbers() -> None:
    """Settings read from a NumPy array (a sweep's grid, a config file loaded through NumPy) are
    valid numbers: taken, and held as Python's, so they compare, fingerprint and pickle (a
    checkpoint loaded with ``weights_only=True``) as the same values written as Python's."""
    import pickle

    import numpy as np

    from lightning_vit_balance import CostCalibrator, CostModel

    config = ViTBalanceConfig(
        max_len_ratio=np.float32(1.5),
        trigger_threshold=np.float32(0.25),
        refine_iterations=np.int64(5),
        cost_windowed=np.float64(1.0),
        cost_window_patches=np.int64(64),
    )
    plain = ViTBalanceConfig(
        max_len_ratio=1.5,
        trigger_threshold=0.25,
        refine_iterations=5,
        cost_windowed=1.0,
        cost_window_patches=64,
    )
    assert config == plain and config.fingerprint() == plain.fingerprint()
    assert {type(config.max_len_ratio), type(config.refine_iterations), type(config.cost_window_patches)} == {
        float,
        int,
    }
    assert "numpy" not in pickle.dumps(config).decode("latin-1")
    model = CostModel(quadratic=np.float32(2.0), windowed=1.0, window_patches=np.int64(16))
    assert type(model.quadratic) is float and type(model.window_patches) is int
    calibrator = CostCalibrator(history=np.int64(8), warmup_steps=np.int64(1))
    assert type(calibrator.history) is int and type(calibrator.warmup_steps) is int
    with pytest.raises(ValueError, match=r"max_len_ratio=np.float32\(0.5\) is invalid"):
        ViTBalanceConfig(max_len_ratio=np.float32(0.5))
    with pytest.raises(ValueError, match=r"refine_iterations=np.True_ is invalid|refine_iterations=True"):
        ViTBalanceConfig(refine_iterations=np.bool_(True))


def test_a_bool_is_not_taken_for_an_int_setting() -> None:
    """``True`` is an ``int`` to Python, not a number of refinements: refused by name."""
    with pytest.raises(ValueError, match=r"ViTBalanceConfig\.refine_iterations=True is invalid"):
        ViTBalanceConfig(refine_iterations=True)


def test_the_seeds_flags_take_their_bounds() -> None:
    """``--dp-balance-max-len-ratio-vit 1`` and ``--dp-balance-trigger-threshold-vit 0`` are the
    smallest valid values (>= 1 and >= 0), not usage errors."""
    import argparse

    from lightning_vit_balance import add_vit_balance_args

    parser = add_vit_balance_args(argparse.ArgumentParser())
    args = ["--dp-balance-max-len-ratio-vit", "1", "--dp-balance-trigger-threshold-vit", "0"]
    config = ViTBalanceConfig.from_args(parser.parse_args(args))
    assert (config.max_len_ratio, config.trigger_threshold) == (1.0, 0.0)


def test_an_unpickled_config_is_validated() -> None:
    """Unpickling runs ``__init__``'s checks: a state holding an invalid value raises, naming it."""
    import pickle

    state = dict(vars(ViTBalanceConfig()), min_gain=1.5)
    config = ViTBalanceConfig.__new__(ViTBalanceConfig)
    with pytest.raises(ValueError, match=r"ViTBalanceConfig\.min_gain=1\.5 is invalid"):
        config.__setstate__(state)
    assert pickle.loads(pickle.dumps(ViTBalanceConfig(min_gain=0.5))).min_gain == 0.5
