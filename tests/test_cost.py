"""Cost models: the seed's l^2, the general polynomial, from a ViT's shape, config or modules, fitted
offline and online (:class:`CostCalibrator`)."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import io
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hf_models import (
    IMAGE_ONLY_FAMILIES,
    LATEST_FAMILIES,
    NEWER_FAMILIES,
    WHOLE_VIDEO_FAMILIES,
    available,
    tiny_model,
    tower_of,
)

from lightning_vit_balance import CostModel, ViTBalanceConfig
from lightning_vit_balance.cost import CostCalibrator, _median


def test_default_is_the_seeds_l_squared_and_vectorised() -> None:
    model = CostModel()
    assert model(64) == 4096.0
    np.testing.assert_array_equal(model(np.array([1, 2, 300])), np.array([1.0, 4.0, 90000.0]))
    assert model([3, 4]).dtype == np.float64


def test_polynomial_and_windowed_terms() -> None:
    model = CostModel(quadratic=2.0, linear=3.0, constant=5.0, windowed=7.0, window_patches=64)
    counts = np.array([10, 64, 1000])
    expected = 2 * counts**2 + 3 * counts + 5 + 7 * counts * np.minimum(counts, 64)
    np.testing.assert_array_equal(model(counts), expected.astype(np.float64))


@pytest.mark.parametrize(
    "model",
    [
        CostModel(),
        CostModel(quadratic=3, linear=7, constant=2),
        CostModel(quadratic=1e-5, linear=0.0123, constant=0.1, windowed=2e-4, window_patches=256),
        CostModel(quadratic=2.5e-6, windowed=1e-6, window_patches=64, per_frame_attention=True),
        CostModel(quadratic=1.7, linear=3.1, per_frame_attention=True),
    ],
)
def test_plain_python_costs_are_the_array_calls_floats(model: CostModel) -> None:
    # Plans read costs from either path (a few images or many), so the floats must be identical,
    # not merely close: equal plans on every rank rely on equal sums.
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 200_000, 300).tolist()
    frames = rng.integers(1, 17, 300).tolist()
    assert model.costs(counts) == model(np.array(counts)).tolist()
    assert model.costs(counts, frames) == model(np.array(counts), frames=np.array(frames)).tolist()
    # Frames of fewer patches than a window (rare among the random ones): the windowed term's span.
    small, steps = [40, 256, 1000, 64], [1, 8, 16, 2]
    assert model.costs(small, steps) == model(np.array(small), frames=np.array(steps)).tolist()


def test_config_round_trip() -> None:
    model = CostModel(quadratic=0.5, linear=2.0, constant=1.0, windowed=3.0, window_patches=16)
    config = model.to_config(ViTBalanceConfig(trigger_threshold=0.3))
    assert config.trigger_threshold == 0.3
    assert CostModel.from_config(config) == model


@pytest.mark.parametrize("name", ["quadratic", "linear", "constant", "windowed"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True, "1"])
def test_invalid_coefficients(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"CostModel.{name}="):
        CostModel(**{name: value})  # type: ignore[arg-type]


def test_counts_configs_and_flags_of_another_kind_are_named() -> None:
    # Each had surfaced as NumPy's or Python's own error naming no argument, or passed silently.
    for counts in ("x", [-4], [math.nan], [1, math.inf]):
        with pytest.raises(
            ValueError, match=r"CostModel: patch_counts=.* is invalid: expected a number or an array"
        ):
            CostModel()(counts)
    assert CostModel()([0, 2]).tolist() == [0.0, 4.0]
    for counts, seconds, name in ((["a", "b"], [1.0, 2.0], "patch_counts"), ([1, 2], ["x", 2.0], "seconds")):
        with pytest.raises(ValueError, match=rf"CostModel.fit: {name}=.* is invalid: expected numbers"):
            CostModel.fit(counts, seconds)
    with pytest.raises(
        TypeError, match=r"CostModel.from_config\(config=3\) is invalid: expected a ViTBalanceConfig"
    ):
        CostModel.from_config(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"from_vit_shape\(gated_mlp='y'\) is invalid: expected a bool"):
        CostModel.from_vit_shape(hidden_size=8, depth=2, gated_mlp="y")  # type: ignore[arg-type]
    gated = CostModel.from_vit_shape(hidden_size=8, depth=2, gated_mlp=np.bool_(True))  # type: ignore[arg-type]
    assert gated == CostModel.from_vit_shape(hidden_size=8, depth=2, gated_mlp=True)


def test_invalid_window() -> None:
    with pytest.raises(ValueError, match=r"CostModel\.window_patches=-1"):
        CostModel(window_patches=-1)
    with pytest.raises(ValueError, match="window_patches"):
        CostModel.from_vit_shape(hidden_size=8, depth=2, window_layers=[0])
    with pytest.raises(ValueError, match="window_layers"):
        CostModel.from_vit_shape(hidden_size=8, depth=2, window_layers=[2], window_patches=4)
    with pytest.raises(ValueError, match="hidden_size"):
        CostModel.from_vit_shape(hidden_size=0, depth=2)
    # Each argument is named: a bad width read as an invalid CostModel.linear, a fractional one passed.
    with pytest.raises(ValueError, match=r"hidden_size and depth as ints > 0, got hidden_size=64\.5"):
        CostModel.from_vit_shape(hidden_size=64.5, depth=2)
    bad = [("intermediate_size", -1), ("mlp_ratio", -10.0), ("patch_input_dim", -1), ("mlp_ratio", math.nan)]
    for name, value in bad:
        with pytest.raises(ValueError, match=rf"from_vit_shape: {name}={value!r} is invalid"):
            CostModel.from_vit_shape(hidden_size=8, depth=2, **{name: value})


def test_a_windowed_layer_named_twice_is_priced_once() -> None:
    once = CostModel.from_vit_shape(hidden_size=8, depth=3, window_layers=[1], window_patches=4)
    assert CostModel.from_vit_shape(hidden_size=8, depth=3, window_layers=[1, 1], window_patches=4) == once


def test_from_vit_shape_counts_flops() -> None:
    # d = 8, m = 32, 3 layers, layer 1 windowed with 4 patches; 2-matrix MLP.
    model = CostModel.from_vit_shape(
        hidden_size=8, depth=3, intermediate_size=32, window_layers=[1], window_patches=4, patch_input_dim=12
    )
    assert model.quadratic == 4 * 8 * 2  # two full-attention layers
    assert model.windowed == 4 * 8 * 1
    assert model.window_patches == 4
    assert model.linear == 3 * 2 * (4 * 8 * 8 + 2 * 8 * 32) + 2 * 12 * 8
    # The MLP term dominates small images: for l below ~6 d the linear part is larger.
    assert model.linear * 16 > model.quadratic * 16**2


def test_from_vit_shape_prices_grouped_query_attention() -> None:
    full = CostModel.from_vit_shape(hidden_size=8, depth=3, intermediate_size=32)
    grouped = CostModel.from_vit_shape(hidden_size=8, depth=3, intermediate_size=32, kv_size=2)
    # Key and value projections 8 -> 2 instead of 8 -> 8: 2 * 2 * 8 * (8 - 2) fewer FLOPs per
    # layer and patch; every query head still attends over all l patches.
    assert full.linear - grouped.linear == 3 * 2 * 2 * 8 * (8 - 2)
    assert grouped.quadratic == full.quadratic
    assert CostModel.from_vit_shape(hidden_size=8, depth=3, kv_size=8) == CostModel.from_vit_shape(
        hidden_size=8, depth=3
    )
    with pytest.raises(ValueError, match="kv_size=0"):
        CostModel.from_vit_shape(hidden_size=8, depth=3, kv_size=0)


def _tiny_configs() -> dict[str, object]:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    return {
        "qwen2_vl": Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=4),
        "qwen2_5_vl": Qwen2_5_VLVisionConfig(
            depth=4,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            out_hidden_size=64,
            window_size=56,
            fullatt_block_indexes=[3],
        ),
        "qwen3_vl": Qwen3VLVisionConfig(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            deepstack_visual_indexes=[0],
            num_position_embeddings=16,
        ),
    }


def test_from_vit_reads_hugging_face_vision_configs() -> None:
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    configs = _tiny_configs()
    # A real (tiny, random) tower for one of them; the configs alone for the others.
    tower = Qwen2VisionTransformerPretrainedModel._from_config(configs["qwen2_vl"])
    qwen2 = CostModel.from_vit(tower)
    in_dim = 3 * 2 * 14 * 14
    # Hugging Face's Qwen-VL towers attend within each temporal step: per-frame models.
    assert qwen2 == CostModel.from_vit_shape(
        hidden_size=32, depth=2, mlp_ratio=4, patch_input_dim=in_dim, per_frame_attention=True
    )

    class Tower:
        def __init__(self, config: object) -> None:
            self.config = config

    qwen25 = CostModel.from_vit(Tower(configs["qwen2_5_vl"]))
    # Three of four blocks use 56-pixel windows: (56 / 14)^2 = 16 patches; the MLP is gated.
    assert qwen25 == CostModel.from_vit_shape(
        hidden_size=32,
        depth=4,
        intermediate_size=48,
        gated_mlp=True,
        patch_input_dim=in_dim,
        window_layers=[0, 1, 2],
        window_patches=16,
        per_frame_attention=True,
    )
    qwen3 = CostModel.from_vit(Tower(configs["qwen3_vl"]))
    assert qwen3 == CostModel.from_vit_shape(
        hidden_size=32,
        depth=2,
        intermediate_size=64,
        patch_input_dim=3 * 2 * 16 * 16,
        per_frame_attention=True,
    )
    with pytest.raises(ValueError, match="from_vit_shape"):
        CostModel.from_vit(object())


@pytest.mark.parametrize(
    "family",
    [f for f in LATEST_FAMILIES if f != "glm5_next" and f not in IMAGE_ONLY_FAMILIES],
)
def test_from_vit_prices_the_latest_towers_per_temporal_step(family: str) -> None:
    """transformers 5.24's other towers of the Qwen-VL design (Qwen4-Exp, EXAONE 4.5, Cohere Compass,
    Cosmos3, the Omni thinkers', LFM3-VL, ERNIE-4.5-VL, Dots3-Note) and 5.25's LLaVA-OneVision-1.5
    attend within each temporal step too: priced so. MiniMax-M3-VL's and Kimi-K2.5's attend over a
    whole video: priced whole."""
    pytest.importorskip("transformers")
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    per_frame = CostModel.from_vit(tower_of(tiny_model(family))).per_frame_attention
    assert per_frame is (family not in WHOLE_VIDEO_FAMILIES)


def test_from_vit_reads_windows_named_per_block() -> None:
    """Ovis2.5's tower (transformers 5.25) names each block's attention in ``layer_types``: its
    ``window_attention`` blocks are priced with windows of ``(window_size / patch)**2`` patches, the
    ``full_attention`` ones whole."""
    pytest.importorskip("transformers")
    if not available("ovis2_5"):
        pytest.skip("this transformers has no ovis2_5")
    model = CostModel.from_vit(tower_of(tiny_model("ovis2_5")))
    # tests/hf_models.py: 2 blocks of width 16, MLP 32, rows 3 * 2 * 2, window 8 px of 2 px patches.
    assert model == CostModel.from_vit_shape(
        hidden_size=16, depth=2, intermediate_size=32, patch_input_dim=12,
        window_layers=[0], window_patches=16, per_frame_attention=True,
    )  # fmt: skip
    assert model.windowed > 0.0


def test_from_vit_reads_kimi_k25_rows_as_rgb_patches() -> None:
    """Kimi-K2.5's config names no channels (its ``Conv2d`` takes 3, fixed in its code): its rows
    are priced ``3 * patch**2`` wide, as the drop-in moves them."""
    pytest.importorskip("transformers")
    if not available("kimi_k25"):
        pytest.skip("this transformers has no kimi_k25")
    model = CostModel.from_vit(tower_of(tiny_model("kimi_k25")))
    assert model == CostModel.from_vit_shape(
        hidden_size=16, depth=2, intermediate_size=32, patch_input_dim=3 * 2 * 2
    )


@pytest.mark.parametrize("family", NEWER_FAMILIES)
def test_from_vit_prices_newer_qwen_towers_like_qwen3_vl(family: str) -> None:
    """Qwen3-VL-MoE's and Qwen3.5's towers are Qwen3-VL's, attention per temporal step included (a
    whole-video price would make a 16-step video 16 times too heavy)."""
    pytest.importorskip("transformers")
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    tower = tiny_model(family).model.visual
    expected = CostModel.from_vit(tiny_model("qwen3_vl").model.visual)
    assert expected.per_frame_attention
    assert CostModel.from_vit(tower) == expected


def test_from_vit_prices_exaone_grouped_query_attention() -> None:
    """EXAONE 4.5's tower has fewer key-value heads than query heads (here 1 of 2): its config and
    its modules (a fused qkv of d + 2 * kv outputs) both give the narrower key and value
    projections, which a model priced as full attention overstates."""
    pytest.importorskip("transformers")
    if not available("exaone4_5"):
        pytest.skip("this transformers has no exaone4_5")
    from torch import nn

    tower = tiny_model("exaone4_5").model.visual
    config = tower.config
    kv = config.num_key_value_heads * (config.hidden_size // config.num_heads)
    assert kv < config.hidden_size
    model = CostModel.from_vit(tower)
    holder = nn.Module()  # the same modules, no config
    holder.tower = tower
    windows = [i for i in range(config.depth) if i not in config.fullatt_block_indexes]
    assert CostModel.from_vit(holder, window_layers=windows, window_patches=model.window_patches) == model
    ungrouped = copy.deepcopy(config)
    ungrouped.num_key_value_heads = config.num_heads

    class Tower:
        def __init__(self, config: object) -> None:
            self.config = config

    full = CostModel.from_vit(Tower(ungrouped))
    assert full.linear - model.linear == config.depth * 2 * 2 * config.hidden_size * (config.hidden_size - kv)
    assert (full.quadratic, full.windowed) == (model.quadratic, model.windowed)


def test_fit_recovers_known_coefficients() -> None:
    truth = CostModel(quadratic=2e-9, linear=3e-6, constant=1e-4)
    counts = np.array([16, 64, 256, 1024, 2048, 4096, 8192, 16384], dtype=np.float64)
    fitted = CostModel.fit(counts, truth(counts))
    assert fitted.quadratic == pytest.approx(2e-9, rel=1e-6)
    assert fitted.linear == pytest.approx(3e-6, rel=1e-6)
    assert fitted.constant == pytest.approx(1e-4, rel=1e-6)
    windowed_truth = CostModel(quadratic=1e-9, windowed=4e-9, window_patches=64, linear=1e-6)
    fitted = CostModel.fit(counts, windowed_truth(counts), window_patches=64)
    assert fitted.windowed == pytest.approx(4e-9, rel=1e-6)
    assert fitted.window_patches == 64
    with pytest.raises(ValueError, match="fit"):
        CostModel.fit([1.0], [1.0])


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ({"seconds": [1.0, math.nan, 3.0]}, r"seconds\[1\]=nan is invalid"),
        ({"seconds": [1.0, math.inf, 3.0]}, r"seconds\[1\]=inf is invalid"),
        ({"seconds": [-1.0, 2.0, 3.0]}, r"seconds\[0\]=-1.0 is invalid"),
        ({"patch_counts": [16, 0, 64]}, r"patch_counts\[1\]=0.0 is invalid: expected a finite number > 0"),
        ({"window_patches": -4}, r"window_patches=-4 is invalid"),
        ({"window_patches": 4.5}, r"window_patches=4.5 is invalid"),
        # Before, a model of zeros, which to_config refused naming cost_quadratic.
        ({"seconds": [0.0, 0.0, 0.0]}, r"seconds=\[0\.0, 0\.0, 0\.0\] give every coefficient 0"),
    ],
)
def test_fit_names_the_measurement_it_cannot_use(case: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"patch_counts": [16, 32, 64], "seconds": [1.0, 2.0, 3.0], **case}
    counts, seconds = arguments.pop("patch_counts"), arguments.pop("seconds")
    with pytest.raises(ValueError, match=rf"CostModel\.fit: {message}"):
        CostModel.fit(counts, seconds, **arguments)


# -- CostModel.from_vit without a Hugging Face config ------------------------------------------


def _load(module: str) -> Any:
    """``tests/towers.py`` or ``examples/tiny_vlm.py``, imported by path."""
    root = Path(__file__).resolve().parents[1]
    folder = root / ("tests" if module == "towers" else "examples")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return importlib.import_module(module)


@pytest.mark.parametrize("name", ["TensorTower", "DictTower", "GlobalTokenTower"])
def test_from_vit_reads_the_module_tree(name: str) -> None:
    towers = _load("towers")
    # One block: a fused qkv Linear(16, 48), no MLP; the patch embedding is Linear(12, 16).
    # DictTower's `config` has no width, so the modules are read there too.
    expected = CostModel.from_vit_shape(hidden_size=16, depth=1, intermediate_size=0, patch_input_dim=12)
    assert CostModel.from_vit(getattr(towers, name)()) == expected


def test_from_vit_on_the_demo_tower_matches_its_shape() -> None:
    tiny_vlm = _load("tiny_vlm")
    kwargs = {"embed_dim": 96, "depth": 4, "num_heads": 4, "mlp_ratio": 2.0, "window_layers": (1,)}
    tower = tiny_vlm.TinyVisionTower(**kwargs, window_size=4, deepstack_layers=(0, 2))
    # Windows are in the forward code, not in the modules: the tower must say which blocks use them.
    with pytest.raises(ValueError, match=r"get_window_index.*window_layers=\[block indices\]"):
        CostModel.from_vit(tower)
    model = CostModel.from_vit(tower, window_layers=[1], window_patches=64)
    assert model == CostModel.from_vit_shape(
        hidden_size=96, depth=4, mlp_ratio=2.0, patch_input_dim=1176, window_layers=[1], window_patches=64
    )
    # It has a get_window_index even with no windowed block; () says so.
    full = tiny_vlm.TinyVisionTower(embed_dim=32, depth=2, num_heads=2, mlp_ratio=3.0, patch_dim=24)
    assert CostModel.from_vit(full, window_layers=()) == CostModel.from_vit_shape(
        hidden_size=32, depth=2, intermediate_size=96, patch_input_dim=24
    )


def test_from_vit_window_tower_needs_window_layers() -> None:
    towers = _load("towers")
    with pytest.raises(ValueError, match=r"window_layers=\(\) when every block"):
        CostModel.from_vit(towers.WindowTower())
    full = CostModel.from_vit(towers.TensorTower())
    assert CostModel.from_vit(towers.WindowTower(), window_layers=()) == full


@pytest.mark.parametrize("name", ["qwen2_vl_tower", "qwen2_5_vl_tower", "qwen3_vl_tower"])
def test_from_vit_modules_agree_with_hugging_face_configs(name: str) -> None:
    pytest.importorskip("transformers")
    from torch import nn

    tower = getattr(_load("towers"), name)()
    from_config = CostModel.from_vit(tower)
    holder = nn.Module()  # the same modules, no config
    holder.tower = tower
    windows = [0] if from_config.window_patches else []  # Qwen2.5-VL: block 0 windowed, block 1 full
    window = from_config.window_patches
    assert CostModel.from_vit(holder, window_layers=windows, window_patches=window) == from_config


def test_from_vit_reads_a_tower_through_its_wrapper_and_each_window_override_alone() -> None:
    pytest.importorskip("transformers")
    from torch import nn

    tower = _load("towers").qwen2_5_vl_tower()
    from_config = CostModel.from_vit(tower)
    assert from_config.windowed > 0 and from_config.window_patches == 16
    # DataParallel holds the tower as DistributedDataParallel does (no config, no get_window_index).
    assert CostModel.from_vit(nn.DataParallel(tower)) == from_config
    holder = nn.Module()  # a tower's own child named "module" is not a wrapper's
    holder.module = tower
    with pytest.raises(ValueError, match="has windowed attention"):  # its modules read, windows unknown
        CostModel.from_vit(holder)
    # Each override alone keeps the config's other half.
    assert CostModel.from_vit(tower, window_patches=64) == dataclasses.replace(from_config, window_patches=64)
    assert CostModel.from_vit(tower, window_layers=[0, 1]).window_patches == 16
    with pytest.raises(ValueError, match=r"window_patches=64 was given, but .* no windowed blocks"):
        CostModel.from_vit(tower, window_layers=(), window_patches=64)
    with pytest.raises(ValueError, match=r"window_layers='ab' is invalid: expected block indices"):
        CostModel.from_vit(tower, window_layers="ab")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"window_patches=4.5 is invalid: expected an int"):
        CostModel.from_vit(tower, window_patches=4.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"window_patches=tensor\(16.7000\) is invalid"):
        CostModel.from_vit(tower, window_patches=torch.tensor(16.7))  # type: ignore[arg-type]
    assert CostModel.from_vit(tower, window_patches=np.int64(64)).window_patches == 64


def test_from_vit_reads_a_lora_adapted_tower_as_its_base() -> None:
    """A LoRA layer is a linear holding a base layer and a low-rank pair: the parts are not more
    MLP projections, so the adapted tower prices as its base."""
    pytest.importorskip("peft")
    from peft import LoraConfig, inject_adapter_in_model
    from torch import nn

    tower = _load("tiny_vlm").TinyVisionTower(patch_dim=12, embed_dim=64, depth=2)
    base = CostModel.from_vit(tower, window_layers=())
    for targets in (["qkv", "proj"], ["qkv", "proj", "mlp.0", "mlp.2"]):
        adapted = inject_adapter_in_model(LoraConfig(r=8, target_modules=targets), copy.deepcopy(tower))
        assert CostModel.from_vit(adapted, window_layers=()) == base, targets
    # A convolutional patch embedding adapted too: read by its kernel, not the adapter's 3 inputs.
    convolutional = nn.Module()
    convolutional.patch_embed = nn.Conv2d(3, 64, 14, 14)
    convolutional.blocks = copy.deepcopy(tower.blocks)
    base = CostModel.from_vit(convolutional)
    blocks_alone = nn.Module()
    blocks_alone.blocks = tower.blocks
    assert base.linear == CostModel.from_vit(blocks_alone).linear + 2.0 * (3 * 14 * 14) * 64
    adapted = inject_adapter_in_model(LoraConfig(r=4, target_modules=["patch_embed", "qkv"]), convolutional)
    assert CostModel.from_vit(adapted) == base


def test_from_vit_multihead_attention_and_clear_errors() -> None:
    from torch import nn

    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64), 3, enable_nested_tensor=False)
    expected = CostModel.from_vit_shape(hidden_size=32, depth=3, intermediate_size=64)
    assert CostModel.from_vit(encoder) == expected
    with pytest.raises(ValueError, match=r"Sequential has no `config`.*from_vit_shape\(hidden_size="):
        CostModel.from_vit(nn.Sequential(nn.Linear(4, 8), nn.ReLU()))
    mixed = nn.Module()
    mixed.a, mixed.b = nn.Linear(8, 24), nn.Linear(16, 48)
    mixed.a.qkv, mixed.b.qkv = nn.Linear(8, 24), nn.Linear(16, 48)
    with pytest.raises(ValueError, match=r"different widths \[8, 16\]: expected the vision tower alone"):
        CostModel.from_vit(mixed)


def test_from_vit_reads_grouped_key_value_projections_from_the_modules() -> None:
    from torch import nn

    def block(kv: int, fused: bool) -> nn.Module:
        attention = nn.Module()
        if fused:
            attention.qkv = nn.Linear(16, 16 + 2 * kv)
        else:
            attention.q_proj, attention.k_proj = nn.Linear(16, 16), nn.Linear(16, kv)
            attention.v_proj = nn.Linear(16, kv)
        attention.proj = nn.Linear(16, 16)
        layer = nn.Module()
        layer.attn, layer.fc1, layer.fc2 = attention, nn.Linear(16, 32), nn.Linear(32, 16)
        return layer

    expected = CostModel.from_vit_shape(hidden_size=16, depth=2, intermediate_size=32, kv_size=4)
    for fused in (True, False):
        tower = nn.Module()
        tower.blocks = nn.ModuleList([block(4, fused), block(4, fused)])
        assert CostModel.from_vit(tower) == expected, fused
    tower.blocks[1] = block(8, fused=True)
    with pytest.raises(ValueError, match=r"key and value projections of different widths \[4, 8\]"):
        CostModel.from_vit(tower)


# -- CostCalibrator ------------------------------------------------------------------------------

TRUTH = CostModel(quadratic=2e-6, linear=3e-3, constant=0.5)


def _steps(
    seed: int, steps: int, ranks: int = 4, truth: CostModel = TRUTH, overhead: float = 2.0
) -> list[tuple[list[list[int]], list[float]]]:
    """Random rank batches and their exact times under ``truth`` plus a per-call overhead."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        counts = [rng.integers(16, 4000, rng.integers(1, 5)).tolist() for _ in range(ranks)]
        out.append((counts, [float(np.sum(truth(np.array(c)))) + overhead for c in counts]))
    return out


def test_calibrator_recovers_coefficients_and_overhead() -> None:
    calibrator = CostCalibrator(warmup_steps=1)
    for counts, ms in _steps(0, 5):
        model = calibrator.observe(counts, ms)
    assert model is calibrator.model
    # Exact data: only float rounding separates the fit from the truth.
    assert model.quadratic == pytest.approx(2e-6, rel=1e-9)
    assert model.linear == pytest.approx(3e-3, rel=1e-9)
    assert model.constant == pytest.approx(0.5, rel=1e-9)
    assert calibrator.call_overhead_ms == pytest.approx(2.0, rel=1e-9)
    assert calibrator.fingerprint() == (model.quadratic, model.linear, model.constant, 0.0, 0)
    assert CostModel.from_config(model.to_config()) == model


def test_calibrator_tells_how_far_its_model_was_off_before_refitting() -> None:
    calibrator = CostCalibrator(warmup_steps=1)
    steps = _steps(3, 6)
    calibrator.observe(*steps[0])  # warm-up
    assert math.isnan(calibrator.last_error)
    calibrator.observe(*steps[1])  # 4 rows: too few to fit, so nothing to be off
    calibrator.observe(*steps[2])
    assert calibrator.fits == 0 and math.isnan(calibrator.last_error)
    calibrator.observe(*steps[3])  # the first fit, on 12 exact rows
    assert calibrator.fits == 1 and math.isnan(calibrator.last_error)
    calibrator.observe(*steps[4])
    assert calibrator.last_error < 1e-9  # exact data: the fit predicts it
    # Every rank 25% slower, one rank 100% slower: the median of the ranks' errors against the
    # model in force, its overhead included (0.2 = 1 - 1/1.25 is the error relative to the time).
    counts, ms = steps[5]
    slower = [m * 1.25 for m in ms[:-1]] + [ms[-1] * 2.0]
    calibrator.observe(counts, slower)
    assert calibrator.last_error == pytest.approx(0.2, rel=1e-9)
    calibrator.observe(counts, [math.nan] * 4)  # a step that measured no rank
    assert math.isnan(calibrator.last_error)
    resumed = CostCalibrator(warmup_steps=0)
    calibrator.observe(counts, ms)
    resumed.load_state_dict(calibrator.state_dict())
    # The refit took in the slower rows; a new process has measured nothing, also where the
    # calibrator loaded into had measured a step of its own.
    assert math.isfinite(calibrator.last_error) and math.isnan(resumed.last_error)
    calibrator.load_state_dict(calibrator.state_dict())
    assert math.isnan(calibrator.last_error)


def test_calibrator_fits_the_windowed_term() -> None:
    truth = CostModel(quadratic=1e-6, windowed=4e-5, window_patches=64, linear=1e-3)
    initial = CostModel(quadratic=1.0, window_patches=64)  # the window comes from the initial model
    calibrator = CostCalibrator(initial, warmup_steps=0)
    rng = np.random.default_rng(1)
    for _ in range(6):
        # Images below and above the window, so that l*min(l, 64) differs from 64*l.
        counts = [rng.integers(4, 400, 3).tolist() for _ in range(4)]
        calibrator.observe(counts, [float(np.sum(truth(np.array(c)))) for c in counts])
    model = calibrator.model
    assert (model.windowed, model.window_patches) == (pytest.approx(4e-5, rel=1e-6), 64)
    assert model.quadratic == pytest.approx(1e-6, rel=1e-6)
    assert model.linear == pytest.approx(1e-3, rel=1e-6)


def test_calibrator_keeps_its_model_until_there_is_enough_data() -> None:
    initial = CostModel(linear=1.0)
    calibrator = CostCalibrator(initial, warmup_steps=2, min_rank_steps=12)
    steps = _steps(2, 6)
    calibrator.observe(steps[0][0], [math.nan] * 4)  # the first call: no figures yet, no warm-up
    for counts, ms in steps[:4]:  # 2 warm-up steps, then 8 rows: too few
        assert calibrator.observe(counts, ms) is initial
    assert (calibrator.fits, calibrator.steps_observed) == (0, 5)
    # Ranks without images or without a time add no rows; a step without any is not counted.
    assert calibrator.observe([[], [5], [7], [9]], [1.0, math.nan, math.nan, math.nan]) is initial
    calibrator.observe(*steps[4])  # 12 rows
    assert calibrator.fits == 1 and calibrator.model != initial
    fitted = calibrator.model
    # Equal-sized images cannot tell l^2 from l: the last fit stays.
    same = CostCalibrator(initial, warmup_steps=0)
    for _ in range(10):
        same.observe([[256, 256]] * 4, [3.0] * 4)
    assert same.model is initial and same.fits == 0
    assert calibrator.observe(*steps[5]).quadratic == pytest.approx(fitted.quadratic, rel=1e-9)


def test_calibrator_rejects_a_fit_without_size_dependence() -> None:
    calibrator = CostCalibrator(warmup_steps=0)
    rng = np.random.default_rng(3)
    for _ in range(6):  # time depends only on the number of images, never on their sizes
        counts = [rng.integers(16, 4000, rng.integers(1, 5)).tolist() for _ in range(4)]
        calibrator.observe(counts, [1.0 + 0.5 * len(c) for c in counts])
    assert calibrator.fits == 0 and calibrator.model == CostModel()


def test_calibrator_drops_outliers() -> None:
    steps = _steps(4, 6)
    steps[3][1][2] *= 10.0  # one rank stalled for a step
    calibrator = CostCalibrator(warmup_steps=0)
    for counts, ms in steps:
        calibrator.observe(counts, ms)
    assert calibrator.model.quadratic == pytest.approx(2e-6, rel=1e-9)
    assert calibrator.model.linear == pytest.approx(3e-3, rel=1e-9)


@pytest.mark.parametrize("ranks", [2, 8])
@pytest.mark.parametrize("faster", [10.0, 1e4])
@pytest.mark.parametrize("step", [1, 9], ids=["before-the-first-fit", "after-it"])
def test_calibrator_drops_a_time_too_fast_that_would_bend_the_fit(
    ranks: int, faster: float, step: int
) -> None:
    # Weighted by 1/ms, such a row outweighs all others: without screens of its own the fit bent
    # to it and the outlier screen dropped nothing (5 of these 8 cases ended far from the truth).
    steps = _steps(11, 12, ranks=ranks)
    steps[step][1][0] = max(steps[step][1][0] / faster, 1e-3)
    calibrator = CostCalibrator(warmup_steps=0)
    for counts, ms in steps:
        calibrator.observe(counts, ms)
    # Exact data on the rows kept: only float rounding separates the fit from the truth.
    assert calibrator.model.quadratic == pytest.approx(2e-6, rel=1e-9)
    assert calibrator.model.linear == pytest.approx(3e-3, rel=1e-9)
    assert calibrator.call_overhead_ms == pytest.approx(2.0, rel=1e-9)


@pytest.mark.parametrize("ranks", [2, 8])
@pytest.mark.parametrize(("fast", "slow"), [(1, 2), (9, 10), (3, 3)])
def test_calibrator_drops_a_time_too_fast_and_one_too_slow_together(ranks: int, fast: int, slow: int) -> None:
    # The too-fast screen first, and the outlier screen on the refit's predictions: in the other
    # order, or on the bent fit's, most of these cases ended away from the truth.
    steps = _steps(11, 12, ranks=ranks)
    steps[fast][1][0] /= 100.0
    steps[slow][1][ranks - 1] *= 10.0
    calibrator = CostCalibrator(warmup_steps=0)
    for counts, ms in steps:
        calibrator.observe(counts, ms)
    assert calibrator.model.quadratic == pytest.approx(2e-6, rel=1e-9)
    assert calibrator.model.linear == pytest.approx(3e-3, rel=1e-9)


def _one_large_image(seed: int, steps: int, truth: CostModel) -> list[tuple[list[list[int]], list[float]]]:
    """Steps of 8 ranks: rank 0 one image of 3,000-4,000 patches, the others 2-5 small ones."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        counts = [[int(rng.integers(3000, 4000))]] + [
            rng.integers(16, 400, rng.integers(2, 6)).tolist() for _ in range(7)
        ]
        out.append((counts, [float(np.sum(truth(np.array(c)))) + 2.0 for c in counts]))
    return out


def test_calibrator_keeps_every_row_of_exact_times_with_a_large_call_overhead() -> None:
    calibrator = CostCalibrator(warmup_steps=0)
    for counts, ms in _one_large_image(15, 20, TRUTH):
        calibrator.observe(counts, [t + 58.0 for t in ms])  # 60 ms per call: the screens count it
    assert [len(step.rows) for step in calibrator._steps] == [8] * 20
    assert calibrator.call_overhead_ms == pytest.approx(60.0, rel=1e-9)


def test_calibrator_follows_a_tower_that_got_cheaper_in_attention_within_a_few_steps() -> None:
    # Against the fit in force, rank 0's large image looks far too fast step after step; kept out
    # every time, it had left the fit 7-33x off for a whole window. One step's rows out at most,
    # then all of the next step's come in.
    before, after = (
        CostModel(quadratic=2e-5, linear=1e-3, constant=0.5),
        CostModel(quadratic=1e-6, linear=1e-3, constant=0.5),
    )
    calibrator = CostCalibrator(warmup_steps=0)
    for counts, ms in _one_large_image(16, 20, before) + _one_large_image(17, 5, after):
        calibrator.observe(counts, ms)

    def large_over_small(model: CostModel) -> float:
        return float(np.sum(model(np.array([3500]))) / np.sum(model(np.array([200] * 4))))

    # Its window still holds the older steps: a fit between the two towers, near the new one's.
    assert 0.5 < large_over_small(calibrator.model) / large_over_small(after) < 1.5


def test_calibrator_screens_new_rows_again_after_a_step_let_in() -> None:
    # A step after one that lost a row lets every row in; screening goes on after it, also in a
    # calibrator that loaded a state (the flag is not saved: it restarts with the warm-up).
    steps = _steps(12, 16, ranks=8)
    for step in (8, 9, 12, 15):
        steps[step][1][0] /= 100.0
    calibrator = CostCalibrator(warmup_steps=0)
    for counts, ms in steps[:14]:
        calibrator.observe(counts, ms)
    assert [len(step.rows) for step in list(calibrator._steps)[8:14]] == [7, 8, 8, 8, 7, 8]
    calibrator.observe(*steps[14])  # the step after 12 is let in whole; 13 was, so 14 is screened
    assert calibrator._screened_last is False
    state = calibrator.state_dict()
    calibrator._screened_last = True  # as if step 14 had lost a row: a loaded state knows nothing of it
    resumed = copy.deepcopy(calibrator)
    resumed.load_state_dict(state)
    for fitting in (calibrator, resumed):
        fitting.observe(*steps[15])
    assert len(resumed._steps[-1].rows) == 7 and len(calibrator._steps[-1].rows) == 8


def test_calibrators_median_is_numpys_to_the_bit() -> None:
    rng = np.random.default_rng(14)
    for size in (1, 2, 3, 8, 9, 1000, 1001):
        values = rng.lognormal(0.0, 3.0, size)
        assert _median(values) == float(np.median(values))


def test_calibrator_keeps_a_speed_up_of_every_rank() -> None:
    calibrator = CostCalibrator(warmup_steps=0, history=8)
    for counts, ms in _steps(12, 4):
        calibrator.observe(counts, ms)
    faster = CostModel(quadratic=1e-6, linear=1.5e-3, constant=0.25)  # compiled: twice as fast
    for counts, ms in _steps(13, 8, truth=faster, overhead=1.0):
        calibrator.observe(counts, ms)
    assert calibrator.model.quadratic == pytest.approx(1e-6, rel=1e-9)
    assert calibrator.call_overhead_ms == pytest.approx(1.0, rel=1e-9)


def test_calibrator_forgets_old_steps() -> None:
    calibrator = CostCalibrator(warmup_steps=0, history=4)
    for counts, ms in _steps(5, 4):
        calibrator.observe(counts, ms)
    slower = CostModel(quadratic=4e-6, linear=6e-3, constant=1.0)  # the machine got twice as slow
    for counts, ms in _steps(6, 4, truth=slower, overhead=4.0):
        calibrator.observe(counts, ms)
    assert calibrator.model.quadratic == pytest.approx(4e-6, rel=1e-9)
    assert calibrator.call_overhead_ms == pytest.approx(4.0, rel=1e-9)


def test_calibrator_is_bit_identical_whatever_the_rank_order() -> None:
    rng = np.random.default_rng(7)
    noisy = [(c, [t * rng.uniform(0.8, 1.25) for t in ms]) for c, ms in _steps(8, 12, ranks=8)]
    first, second, permuted = CostCalibrator(), CostCalibrator(), CostCalibrator()
    for counts, ms in noisy:
        first.observe(counts, ms)
        second.observe([list(c) for c in counts], list(ms))
        order = rng.permutation(len(counts))
        # Sums are correctly rounded, so the order of the rows changes no bit.
        permuted.observe([counts[r] for r in order], [ms[r] for r in order])
    assert first.fits > 0
    assert first.fingerprint() == second.fingerprint() == permuted.fingerprint()
    assert first.call_overhead_ms == permuted.call_overhead_ms


def test_calibrator_invalid_input() -> None:
    calibrator = CostCalibrator()
    with pytest.raises(ValueError, match="milliseconds has 1 ranks, patch_counts has 2"):
        calibrator.observe([[4], [8]], [1.0])
    with pytest.raises(ValueError, match=r"patch_counts\[1\]=\[0\] is invalid"):
        calibrator.observe([[4], [0]], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"milliseconds\[0\]=-1\.0 is invalid"):
        calibrator.observe([[4], [8]], [-1.0, 1.0])
    with pytest.raises(ValueError, match=r"milliseconds\[1\]=inf"):
        calibrator.observe([[4], [8]], [1.0, math.inf])
    # Below a microsecond (what the balancer measures): such a row outweighs every measured one,
    # and from about 1e-160 ms its weight squared overflowed every later fit of the window.
    for below in (1e-310, 5e-4):
        with pytest.raises(
            ValueError, match=rf"milliseconds\[1\]={below!r} is invalid: expected a time of at least"
        ):
            calibrator.observe([[4], [8]], [1.0, below])
    with pytest.raises(ValueError, match="expected patch_counts as one sequence"):
        calibrator.observe([4, 8], [1.0, 1.0])
    # int() had fitted 1.5 patches as 1; bools among integers, and unsigned ones past int64, too.
    for counts in ([[1.5, 2.9]], [[0.5]], [[True]], [[True, 3]], [[np.True_, 3]], [[np.uint64(2**63)]]):
        with pytest.raises(ValueError, match="expected patch_counts as one sequence of integers per rank"):
            calibrator.observe(counts, [1.0])
    assert calibrator.steps_observed == 0
    with pytest.raises(TypeError, match="initial="):
        CostCalibrator("l2")  # type: ignore[arg-type]
    for name, value in [("history", 0), ("warmup_steps", -1), ("min_rank_steps", 1), ("window_patches", -4)]:
        with pytest.raises(ValueError, match=rf"CostCalibrator\.{name}={value}"):
            CostCalibrator(**{name: value})
    with pytest.raises(ValueError, match=r"CostCalibrator\.min_spread=0\.5"):
        CostCalibrator(min_spread=0.5)
    with pytest.raises(ValueError, match=r"CostCalibrator\.outlier_factor=1"):
        CostCalibrator(outlier_factor=1)


def _saved_and_loaded(state: dict[str, Any], through: str = "torch.save") -> dict[str, Any]:
    """``state`` through ``torch.save`` and a ``weights_only`` load, as a Lightning checkpoint, or
    through JSON, as Hugging Face's ``trainer_state.json``."""
    if through == "json":
        return json.loads(json.dumps(state))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("through", ["torch.save", "json"])
def test_calibrator_state_resumes_the_fit_bit_for_bit(through: str) -> None:
    rng = np.random.default_rng(11)
    noisy = [(c, [t * rng.uniform(0.8, 1.25) for t in ms]) for c, ms in _steps(12, 24)]
    whole, first = CostCalibrator(history=16), CostCalibrator(history=16)
    for counts, ms in noisy[:12]:
        whole.observe(counts, ms)
        first.observe(counts, ms)
    state = _saved_and_loaded(first.state_dict(), through)
    assert state == first.state_dict() and first.fits > 0
    resumed, fresh = CostCalibrator(history=16), CostCalibrator(history=16)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert (resumed.fingerprint(), resumed.call_overhead_ms) == (first.fingerprint(), first.call_overhead_ms)
    # A new process warms up again: its first two measured steps are left out, as a fresh one's.
    for counts, ms in noisy[12:14]:
        assert resumed.observe(counts, ms) == first.model
    fingerprints, afresh = set(), set()
    for counts, ms in noisy[14:]:
        assert whole.observe(counts, ms) == resumed.observe(counts, ms)
        assert whole.call_overhead_ms == resumed.call_overhead_ms
        fresh.observe(counts, ms)
        fingerprints.add(whole.fingerprint())
        afresh.add(fresh.fingerprint())
    # Noisy times move every refit, and the restored rows count in each: a calibrator started
    # afresh on the same steps fits other coefficients at every step.
    assert len(fingerprints) == len(noisy[14:]) and not fingerprints & afresh
    assert resumed.steps_observed == whole.steps_observed + 2 and resumed.fits == whole.fits


def test_calibrator_reads_each_step_once_whatever_its_iterables() -> None:
    """Generators for the ranks and for a rank's counts are read once, as lists are."""
    steps = _steps(3, 4)
    as_lists, as_generators = CostCalibrator(warmup_steps=0), CostCalibrator(warmup_steps=0)
    for counts, ms in steps:
        as_lists.observe(counts, ms)
        as_generators.observe((iter(row) for row in counts), iter(ms))
    assert as_generators.state_fingerprint() == as_lists.state_fingerprint()
    assert len(as_generators._steps[-1].rows) == len(steps[-1][0])


def test_calibrator_state_fingerprint_sees_the_window_rows() -> None:
    """Two states with equal counters but other measured rows fit apart at the next refit, so
    their fingerprints must differ before either plans; a saved and loaded state keeps its own."""
    steps = _steps(21, 6)
    shifted = [(counts, [t * 1.5 if rank == 0 else t for rank, t in enumerate(ms)]) for counts, ms in steps]
    first, second = CostCalibrator(warmup_steps=0), CostCalibrator(warmup_steps=0)
    for (counts, ms), (_, other_ms) in zip(steps, shifted):
        first.observe(counts, ms)
        second.observe(counts, other_ms)
    counters = slice(5, 9)
    assert first.state_fingerprint()[counters] == second.state_fingerprint()[counters]
    assert first.state_fingerprint() != second.state_fingerprint()
    loaded, reloaded = CostCalibrator(warmup_steps=0), CostCalibrator(warmup_steps=0)
    loaded.load_state_dict(first.state_dict())
    reloaded.load_state_dict(_saved_and_loaded(first.state_dict()))
    assert loaded.state_fingerprint() == reloaded.state_fingerprint()
    assert loaded.state_fingerprint()[-1] == first.state_fingerprint()[-1]  # the same rows


def test_expansions_sum_exactly() -> None:
    from fractions import Fraction

    from lightning_vit_balance.cost import _expansion

    rng = np.random.default_rng(5)
    for scale in (0.0, 1.0, 30.0, 100.0):  # magnitudes alike, then up to about 2**+-500 apart
        values = (rng.normal(size=200) * np.exp(rng.normal(0.0, scale, 200))).tolist()
        terms = _expansion(values, math.fsum(values))
        assert terms[0] == math.fsum(values) and 1 <= len(terms) <= 30
        assert sum(map(Fraction, terms)) == sum(map(Fraction, values))
    assert _expansion([], 0.0) == (0.0,)


def test_a_refit_without_outliers_is_the_kept_rows_fit_bit_for_bit() -> None:
    rng = np.random.default_rng(8)
    calibrator = CostCalibrator(warmup_steps=0, window_patches=64)
    for counts, ms in _steps(31, 10, ranks=16):
        calibrator.observe(counts, [t * (25.0 if rng.random() < 0.1 else rng.uniform(0.9, 1.1)) for t in ms])
    rows = np.concatenate([step.rows for step in calibrator._steps])
    dropped = rng.random(len(rows)) < 0.15
    kept = calibrator._equations(rows[~dropped])
    assert calibrator._equations_without(rows[dropped]) == kept  # each entry the same float
    assert calibrator._equations_without(rows[:0]) == calibrator._equations(rows)


def test_calibrator_state_of_other_terms_is_refused_and_changes_nothing() -> None:
    fitted = CostCalibrator(warmup_steps=0)
    for counts, ms in _steps(13, 4):
        fitted.observe(counts, ms)
    windowed = CostCalibrator(CostModel(windowed=1.0, window_patches=64))
    before = windowed.state_dict()
    with pytest.raises(
        ValueError, match=r"state\['window_patches'\]=0, but this calibrator fits window_patches=64"
    ):
        windowed.load_state_dict(fitted.state_dict())
    per_frame = CostCalibrator(CostModel(per_frame_attention=True))
    with pytest.raises(ValueError, match=r"state\['per_frame_attention'\]=False"):
        per_frame.load_state_dict(fitted.state_dict())
    bad_time = fitted.state_dict()
    bad_time["history"][0][0][-1] = 0.0
    broken = [
        {"version": 2},
        "state",
        {**fitted.state_dict(), "fits": -1},
        {**fitted.state_dict(), "model": {}},
    ]
    same_terms = CostCalibrator()
    same_terms.load_state_dict(fitted.state_dict())
    kept = same_terms.state_dict()
    for state in [*broken, bad_time]:
        # A calibrator of the same terms, so that its window's setting does not refuse them first.
        with pytest.raises(ValueError, match=r"CostCalibrator\.load_state_dict"):
            same_terms.load_state_dict(state)  # type: ignore[arg-type]
    assert windowed.state_dict() == before and same_terms.state_dict() == kept
    # Saved before any fit: the counters and rows come back, the model stays this one's own.
    early = CostCalibrator(warmup_steps=1)
    for counts, ms in _steps(14, 2):
        early.observe(counts, ms)
    own = CostCalibrator(CostModel(quadratic=3.0), warmup_steps=1)
    own.load_state_dict(early.state_dict())
    assert own.model == CostModel(quadratic=3.0) and own.steps_observed == 2
    assert own.state_dict()["history"] == early.state_dict()["history"]


def _edited(state: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    copied = _saved_and_loaded(state, "json")
    edit(copied)
    return copied


def _near_overflow(*where: tuple[int, int]) -> Callable[[dict[str, Any]], None]:
    """Rows whose own products stay finite but whose sum overflows: two in one step, or one in
    each of two steps (``where``: their step and row)."""
    from lightning_vit_balance.cost import _ROW

    def edit(state: dict[str, Any]) -> None:
        for step, row in where:
            values = state["history"][step][row]
            values[_ROW.index("quadratic")] = 1.2e154 * values[_ROW.index("ms")]

    return edit


def _set_row(column: str, value: float) -> Callable[[dict[str, Any]], None]:
    from lightning_vit_balance.cost import _ROW

    def edit(state: dict[str, Any]) -> None:
        state["history"][0][0][_ROW.index(column)] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s["model"].pop("constant"), r"state\['model'\] holds \[.*\]: expected the keys"),
        (
            lambda s: s["model"].update(per_frame_attention=True),
            r"per_frame_attention=True: expected a model this calibrator fits \(window_patches 0, per_frame",
        ),
        (lambda s: s["model"].update(windowed=1.0, window_patches=64), r"window_patches=64, per_frame"),
        (
            lambda s: s["model"].update(quadratic=0.0, linear=0.0, windowed=0.0, window_patches=0),
            r"no coefficient that grows with the patch count",
        ),
        (lambda s: s["model"].update(linear=-1.0), r"state\['model'\] is invalid \(CostModel\.linear=-1"),
        (lambda s: s.update(call_overhead_ms=-2.0), r"state\['call_overhead_ms'\]=-2\.0 is invalid"),
        (lambda s: s.update(call_overhead_ms="1"), r"state\['call_overhead_ms'\]='1' is invalid"),
        (
            lambda s: s["history"].__setitem__(0, [v for row in s["history"][0] for v in row]),
            r"history'\]\[0\] has shape \[\d+\]",
        ),
        (lambda s: s["history"].__setitem__(0, []), r"history'\]\[0\] has shape \[0\]"),
        (
            lambda s: [row.append(1.0) for row in s["history"][0]],
            r"has shape \[\d+, 9\]: expected rows of 8 columns",
        ),
        (lambda s: s.update(history="rows"), r"state\['history'\] holds no rows of numbers"),
        (_set_row("quadratic", -5.0), r"state\['history'\]\[0\]\[0\]=\[-5\.0, .* is invalid"),
        (_set_row("constant", 1.5), r"\[0\]\[0\]=.* is invalid: expected a calibrator's row"),
        (_set_row("overhead", 2.0), r"\[0\]\[0\]=.* is invalid"),
        (_set_row("smallest", 1e9), r"\[0\]\[0\]=.* is invalid"),
        (_set_row("ms", math.nan), r"\[0\]\[0\]=.* is invalid"),
        (
            _set_row("ms", 1e-4),
            r"\[0\]\[0\]=.* is invalid: expected a calibrator's row",
        ),  # under a microsecond
        (_set_row("windowed", -5.0), r"\[0\]\[0\]=.* is invalid"),
        (_set_row("constant", 0.0), r"\[0\]\[0\]=.* is invalid"),  # no image
        (lambda s: s.update(call_overhead_ms=math.inf), r"state\['call_overhead_ms'\]=inf is invalid"),
        (
            lambda s: s["model"].update(extra=1.0),
            r"state\['model'\] holds \[.*'extra'.*\]: expected the keys",
        ),
        (_set_row("quadratic", 1e200), r"sums too large to fit"),
        (_near_overflow((0, 0), (0, 1)), r"sums too large to fit"),
        (_near_overflow((0, 0), (1, 0)), r"sums too large to fit"),
    ],
)
def test_a_calibrator_state_no_calibrator_saved_is_refused_and_changes_nothing(
    edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    """A state edited by hand, or of another program: each value a calibrator could not have saved
    is refused naming it (a partial model planned as ``l**2``; negative sums or overflowing rows
    spoiled every fit of the window), and the calibrator stays as it was."""
    fitted = CostCalibrator(warmup_steps=0)
    for counts, ms in _steps(13, 4):
        fitted.observe(counts, ms)
    assert fitted.fits > 0
    loading = CostCalibrator()
    loading.load_state_dict(fitted.state_dict())  # the saved state itself loads
    before = loading.state_dict()
    with pytest.raises(ValueError, match=r"CostCalibrator\.load_state_dict: .*" + message):
        loading.load_state_dict(_edited(fitted.state_dict(), edit))
    assert loading.state_dict() == before


def test_a_calibrator_takes_a_microsecond_and_zero_or_nan_for_not_measured() -> None:
    calibrator = CostCalibrator(warmup_steps=0)
    for milliseconds in ([1.0, 1e-3], [1.0, 0.0], [1.0, math.nan]):
        calibrator.observe([[4], [8]], milliseconds)
    assert [len(step.rows) for step in calibrator._steps] == [2, 1, 1]  # 0 and NaN: no row


def test_a_windowed_calibrator_loads_its_own_fit_without_a_windowed_term() -> None:
    """A calibrator fitting a windowed term whose fit chose none saves a model of window 0."""
    fitted = CostCalibrator(window_patches=64, warmup_steps=0)
    for counts, ms in _steps(13, 6):
        fitted.observe(counts, ms)
    assert fitted.fits > 0 and fitted.model.window_patches == 0
    loaded = CostCalibrator(window_patches=64)
    loaded.load_state_dict(fitted.state_dict())
    assert loaded.state_dict() == fitted.state_dict()


def test_a_calibrator_that_fitted_goes_back_to_its_initial_model_with_a_state_saved_before_a_fit() -> None:
    """Loading an early state into a calibrator that has fitted since (an evaluation that fitted,
    then a resume from an early checkpoint) leaves it as a fresh one that loaded the same state."""
    early = CostCalibrator(warmup_steps=1)
    for counts, ms in _steps(14, 2):
        early.observe(counts, ms)
    fitted = CostCalibrator(CostModel(quadratic=3.0), warmup_steps=0)
    for counts, ms in _steps(13, 8):
        fitted.observe(counts, ms)
    assert fitted.fits > 0 and fitted.call_overhead_ms > 0
    fresh = CostCalibrator(CostModel(quadratic=3.0), warmup_steps=0)
    for calibrator in (fitted, fresh):
        calibrator.load_state_dict(early.state_dict())
    assert fitted.model == CostModel(quadratic=3.0) and fitted.call_overhead_ms == 0.0
    assert fitted.state_dict() == fresh.state_dict()
    assert fitted.state_fingerprint() == fresh.state_fingerprint()


def test_a_state_saved_before_a_fit_holds_plain_numbers_whatever_the_config_held() -> None:
    """numpy's ``float64`` passes for a float (coefficients from ``np.polyfit``); a checkpoint
    holding it would not load with ``weights_only=True``, as Lightning resumes."""
    initial = CostModel(*np.polyfit([256.0, 1024.0, 4096.0], [0.3, 1.5, 9.0], 2).clip(0.0))
    assert all(type(value) is float for value in (initial.quadratic, initial.linear, initial.constant))
    state = CostCalibrator(initial).state_dict()
    assert _saved_and_loaded(state) == state


# -- Attention per temporal step (Qwen-VL videos) -------------------------------------------------


def test_per_frame_model_prices_attention_within_each_temporal_step() -> None:
    per_frame = CostModel(
        quadratic=2.0, linear=3.0, constant=5.0, windowed=7.0, window_patches=64, per_frame_attention=True
    )
    counts = np.array([10, 64, 16 * 640, 4 * 1000])
    frames = np.array([1, 1, 16, 4])
    span = counts // frames  # patches of one temporal step
    expected = 2 * counts * span + 7 * counts * np.minimum(span, 64) + 3 * counts + 5
    np.testing.assert_array_equal(per_frame(counts, frames=frames), expected.astype(np.float64))
    # A 16-step video costs 1/16 of the seed's whole-video l**2 attention.
    assert CostModel(per_frame_attention=True)(16 * 640, frames=16) == CostModel()(16 * 640) / 16
    # Without frames every item is one step; a whole-item model ignores frames: both are the old costs.
    whole = dataclasses.replace(per_frame, per_frame_attention=False)
    np.testing.assert_array_equal(per_frame(counts), whole(counts))
    np.testing.assert_array_equal(whole(counts, frames=frames), whole(counts))
    with pytest.raises(ValueError, match=r"CostModel\.per_frame_attention=1 is invalid"):
        CostModel(per_frame_attention=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("frames", [[1, 2], [[1, 2, 3]], [1, 0, 2], [1, float("nan"), 2], ["a", "b", "c"]])
def test_per_frame_model_rejects_bad_frames(frames: object) -> None:
    with pytest.raises(ValueError, match=r"frames=.* is invalid: expected the temporal steps T"):
        CostModel(per_frame_attention=True)([4, 8, 12], frames=frames)


def test_per_frame_attention_travels_through_the_config() -> None:
    model = CostModel(quadratic=0.5, linear=2.0, per_frame_attention=True)
    config = model.to_config()
    assert config.cost_per_frame_attention is True
    assert CostModel.from_config(config) == model
    assert CostModel.from_config(ViTBalanceConfig()).per_frame_attention is False
    names = dict(ViTBalanceConfig().fingerprint())
    assert dict(config.fingerprint())["cost_per_frame_attention"] != names["cost_per_frame_attention"]
    with pytest.raises(ValueError, match=r"ViTBalanceConfig.cost_per_frame_attention='yes' is invalid"):
        ViTBalanceConfig(cost_per_frame_attention="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["qwen2_vl_tower", "qwen2_5_vl_tower", "qwen3_vl_tower"])
def test_from_vit_on_hugging_face_towers_attends_per_frame(name: str) -> None:
    pytest.importorskip("transformers")
    from torch import nn

    tower = getattr(_load("towers"), name)()
    assert CostModel.from_vit(tower).per_frame_attention is True
    holder = nn.Module()  # a module tree that holds the tower, with no config of its own
    holder.tower = tower
    windows = {"window_layers": [0], "window_patches": 16} if "2_5" in name else {"window_layers": []}
    assert CostModel.from_vit(holder, **windows).per_frame_attention is True
    assert CostModel.from_vit(tower, per_frame_attention=False).per_frame_attention is False


def test_from_vit_on_other_towers_attends_per_item() -> None:
    tiny_vlm = _load("tiny_vlm")
    # examples/tiny_vlm.py's full-attention blocks attend over a whole video (its windows are per frame).
    tower = tiny_vlm.TinyVisionTower(embed_dim=32, depth=2, num_heads=2)
    assert CostModel.from_vit(tower, window_layers=()).per_frame_attention is False
    assert CostModel.from_vit(_load("towers").TensorTower()).per_frame_attention is False
    assert CostModel.from_vit(tower, window_layers=(), per_frame_attention=True).per_frame_attention is True


def _video_mix(seed: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Patch counts and temporal steps of a mix of images (T = 1) and videos (T = 2..16)."""
    rng = np.random.default_rng(seed)
    frames = np.where(rng.random(size) < 0.5, 1, rng.integers(2, 17, size))
    per_step = rng.integers(16, 1500, size)
    return frames * per_step, frames


def test_fit_recovers_a_per_frame_model_from_per_frame_timings() -> None:
    truth = CostModel(quadratic=2e-6, linear=3e-3, constant=0.5, windowed=4e-5, window_patches=64)
    truth = dataclasses.replace(truth, per_frame_attention=True)
    counts, frames = _video_mix(11, 40)
    seconds = truth(counts, frames=frames)
    fitted = CostModel.fit(counts, seconds, window_patches=64, frames=frames)
    assert fitted.per_frame_attention is True
    for name in ("quadratic", "linear", "constant", "windowed"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    # Fitting l**2 to the same timings misses them; frames without the flag fit the whole-item model.
    whole = CostModel.fit(counts, seconds, window_patches=64)
    assert np.abs(whole(counts) / seconds - 1).max() > 0.1
    assert (
        CostModel.fit(counts, seconds, window_patches=64, frames=frames, per_frame_attention=False) == whole
    )


def _video_steps(seed: int, steps: int, truth: CostModel, ranks: int = 4) -> list[tuple[Any, Any, Any]]:
    """Random rank batches of images and videos, with frames, and their times under ``truth``."""
    out = []
    sizes = np.random.default_rng(seed).integers(1, 5, (steps, ranks))  # items per rank
    for step in range(steps):
        counts, frames = _video_mix(1000 * seed + step, int(sizes[step].sum()))
        ends = np.cumsum(sizes[step]).tolist()
        rows = [counts[a:b].tolist() for a, b in zip([0, *ends[:-1]], ends)]
        steps_of = [frames[a:b].tolist() for a, b in zip([0, *ends[:-1]], ends)]
        ms = [float(np.sum(truth(np.array(c), frames=np.array(f)))) + 2.0 for c, f in zip(rows, steps_of)]
        out.append((rows, ms, steps_of))
    return out


def test_calibrator_recovers_a_per_frame_model_deterministically() -> None:
    truth = CostModel(quadratic=2e-6, linear=3e-3, constant=0.5, per_frame_attention=True)
    calibrator = CostCalibrator(CostModel(per_frame_attention=True), warmup_steps=0)
    permuted = CostCalibrator(CostModel(per_frame_attention=True), warmup_steps=0)
    rng = np.random.default_rng(5)
    for counts, ms, frames in _video_steps(3, 6, truth):
        model = calibrator.observe(counts, ms, frames)
        order = rng.permutation(len(counts))
        permuted.observe([counts[r] for r in order], [ms[r] for r in order], [frames[r] for r in order])
    assert model.per_frame_attention is True and calibrator.fits > 0
    assert model.quadratic == pytest.approx(2e-6, rel=1e-9)
    assert model.linear == pytest.approx(3e-3, rel=1e-9)
    assert calibrator.call_overhead_ms == pytest.approx(2.0, rel=1e-9)
    assert permuted.fingerprint() == calibrator.fingerprint()  # bit-identical whatever the rank order
    # A whole-item calibrator ignores frames (its sums are l**2) and fits these timings worse.
    whole = CostCalibrator(warmup_steps=0)
    for counts, ms, frames in _video_steps(3, 6, truth):
        whole.observe(counts, ms, frames)
    assert whole.fits > 0 and whole.model.per_frame_attention is False
    assert whole.model.quadratic != pytest.approx(2e-6, rel=1e-3)


def test_calibrator_rejects_bad_frames() -> None:
    calibrator = CostCalibrator(CostModel(per_frame_attention=True))
    with pytest.raises(ValueError, match="frames has 1 ranks, patch_counts has 2"):
        calibrator.observe([[4], [8]], [1.0, 1.0], [[1]])
    with pytest.raises(ValueError, match=r"frames\[1\] has 2 items, patch_counts\[1\] has 1"):
        calibrator.observe([[4], [8]], [1.0, 1.0], [[1], [1, 2]])
    with pytest.raises(ValueError, match=r"frames\[0\]=\[0\] is invalid: expected temporal steps > 0"):
        calibrator.observe([[4], [8]], [1.0, 1.0], [[0], [2]])
    with pytest.raises(ValueError, match="expected frames as one sequence"):
        calibrator.observe([[4], [8]], [1.0, 1.0], [1, 2])
    assert calibrator.steps_observed == 0


def test_a_windowed_cost_model_without_a_window_is_rejected() -> None:
    """``CostModel(windowed>0, window_patches=0)`` is refused: every windowed cost would be 0
    (a dropped check let it through, pricing windowed attention at nothing)."""
    with pytest.raises(ValueError, match=r"CostModel\.window_patches=0 is invalid with windowed=2\.0"):
        CostModel(windowed=2.0)
    assert CostModel(windowed=0.0, window_patches=0).windowed == 0.0


def _exact_times(counts: list[list[int]], truth: CostModel = TRUTH, overhead: float = 2.0) -> list[float]:
    return [float(np.sum(truth(np.array(c)))) + overhead for c in counts]


def test_calibrator_reads_the_spread_from_every_rank_s_smallest_image() -> None:
    """The spread rule compares the largest image with the smallest of all, not with each rank's
    largest: every rank's largest image here is 512 patches, yet the images span 32 to 512, so a
    fit is made (one that read the ranks' largest images twice never fitted)."""
    calibrator = CostCalibrator(warmup_steps=0, min_rank_steps=4)
    counts = [[512, 32], [512, 64, 100], [512], [512, 200, 48]]
    calibrator.observe(counts, _exact_times(counts))
    assert calibrator.fits == 1
    assert calibrator.model.quadratic == pytest.approx(2e-6, rel=1e-6)


def test_calibrator_fits_at_a_spread_of_exactly_min_spread() -> None:
    """``max(l) / min(l) >= min_spread`` allows a fit: images of 100 to 200 patches span exactly 2
    (a strict comparison never fitted them)."""
    calibrator = CostCalibrator(warmup_steps=0, min_rank_steps=4, min_spread=2.0)
    counts = [[100, 150], [200], [100, 100, 200], [150, 150, 150]]
    calibrator.observe(counts, _exact_times(counts))
    assert calibrator.fits == 1
    assert calibrator.model.quadratic == pytest.approx(2e-6, rel=1e-6)
    assert calibrator.model.linear == pytest.approx(3e-3, rel=1e-6)


def test_calibrator_drops_an_outlier_that_leaves_exactly_min_rank_steps_rows() -> None:
    """A screen's refit needs ``min_rank_steps`` rows left, not more: 12 rows with one stalled
    rank and ``min_rank_steps=11`` fit without it, on the truth (keeping it bent the fit)."""
    steps = _steps(4, 3)
    steps[2][1][1] *= 10.0  # one rank stalled for a step
    calibrator = CostCalibrator(warmup_steps=0, min_rank_steps=11)
    for counts, ms in steps:
        calibrator.observe(counts, ms)
    assert calibrator.fits == 1
    assert calibrator.model.quadratic == pytest.approx(2e-6, rel=1e-9)
    assert calibrator.model.linear == pytest.approx(3e-3, rel=1e-9)


def test_calibrator_keeps_rows_off_by_less_than_five_percent_however_exact_the_rest() -> None:
    """The outlier screen drops a row only when it is off by more than 5% too: three rows 2% slow
    among exact ones are kept, so the fit equals a calibrator's whose screens never drop anything
    (without the 5% floor, ``outlier_factor`` times a near-zero median error dropped them)."""
    steps = _steps(4, 4)
    for step, rank in ((1, 0), (2, 2), (3, 3)):
        steps[step][1][rank] *= 1.02
    calibrator = CostCalibrator(warmup_steps=0)
    unscreened = CostCalibrator(warmup_steps=0, outlier_factor=1e9)
    for counts, ms in steps:
        calibrator.observe(counts, ms)
        unscreened.observe(counts, ms)
    assert calibrator.fits == unscreened.fits == 2
    assert calibrator.fingerprint() == unscreened.fingerprint()
    assert calibrator.call_overhead_ms == unscreened.call_overhead_ms


def test_a_vision_config_without_temporal_patches_prices_one_frame_per_patch() -> None:
    """A SigLIP-style config (``num_channels``, no ``temporal_patch_size``) has pixel rows of
    ``channels * patch**2``: its temporal patch size reads as 1, and ``from_vit`` prices the patch
    embedding from that (a default of 2 doubled it)."""
    from lightning_vit_balance.cost import pixel_row_factors

    class SiglipLike:
        model_type = "siglip_vision_model"
        hidden_size = 32
        num_hidden_layers = 2
        intermediate_size = 64
        num_channels = 3
        patch_size = 16

    class Tower:
        config = SiglipLike()

    assert pixel_row_factors(SiglipLike()) == {"in_channels": 3, "temporal_patch_size": 1, "patch_size": 16}
    assert CostModel.from_vit(Tower()) == CostModel.from_vit_shape(
        hidden_size=32, depth=2, intermediate_size=64, patch_input_dim=3 * 16 * 16
    )
