"""Cost models: the seed's l^2, the general polynomial, from a ViT's shape or config, fitted."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_vit_balance import CostModel, ViTBalanceConfig


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


def test_invalid_window() -> None:
    with pytest.raises(ValueError, match=r"CostModel\.window_patches=-1"):
        CostModel(window_patches=-1)
    with pytest.raises(ValueError, match="window_patches"):
        CostModel.from_vit_shape(hidden_size=8, depth=2, window_layers=[0])
    with pytest.raises(ValueError, match="window_layers"):
        CostModel.from_vit_shape(hidden_size=8, depth=2, window_layers=[2], window_patches=4)
    with pytest.raises(ValueError, match="hidden_size"):
        CostModel.from_vit_shape(hidden_size=0, depth=2)


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
    assert qwen2 == CostModel.from_vit_shape(hidden_size=32, depth=2, mlp_ratio=4, patch_input_dim=in_dim)

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
    )
    qwen3 = CostModel.from_vit(Tower(configs["qwen3_vl"]))
    assert qwen3 == CostModel.from_vit_shape(
        hidden_size=32, depth=2, intermediate_size=64, patch_input_dim=3 * 2 * 16 * 16
    )
    with pytest.raises(ValueError, match="from_vit_shape"):
        CostModel.from_vit(object())


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
