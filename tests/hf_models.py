"""Tiny random Hugging Face Qwen-VL and GLM-4.xV models (``*ForConditionalGeneration``) and batches.

Built from configs, nothing downloaded. :func:`tiny_model` gives a Qwen2-VL, Qwen2.5-VL or
Qwen3-VL model (text hidden 32, one or two layers, vision tower of depth 2 with patch 2,
temporal patch 1 and merge 2, so a pixel row has :data:`CHANNELS` values). :func:`make_inputs`
builds what a processor would return for a list of samples, each a list of images, videos and
text: ``input_ids`` with one placeholder token per merged vision token (framed by vision
start/end tokens, videos frame by frame for Qwen3-VL), ``mm_token_type_ids``, ``labels`` and the
pixel rows and grids, ``None`` where a modality is absent, as a Qwen-VL collator gives them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "CHANNELS",
    "FAMILIES",
    "GLM_FAMILIES",
    "IDS",
    "IMAGE_ONLY_FAMILIES",
    "LATEST_FAMILIES",
    "NEWER_FAMILIES",
    "REFUSED_FAMILIES",
    "WHOLE_VIDEO_FAMILIES",
    "available",
    "generation_prompt",
    "generation_settings",
    "make_inputs",
    "tiny_config",
    "tiny_model",
    "tower_of",
]

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
#: Newer families, each with a Qwen3-VL-style tower: Qwen3-VL-MoE (transformers 4.57 and 5), Qwen3.5
#: and Qwen3.5-MoE (transformers 5; their decoders mix linear and full attention). :func:`available`
#: says which the installed transformers has.
NEWER_FAMILIES = ("qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
#: GLM-4.1V, GLM-4.5V (MoE), GLM-4.6V and GLM-OCR (those two transformers 5 only): their models pass
#: the tower a video one temporal step per grid row, and take no rank batch with images and videos
#: together (a video's frames are image tokens, which the image features must match in number).
GLM_FAMILIES = ("glm4v", "glm4v_moe", "glm46v", "glm_ocr")
#: More families of transformers 5.24 whose models meet the drop-in's contract: Qwen4-Exp, EXAONE 4.5,
#: Cohere Compass, Cosmos3-Omni and Cosmos3-Edge (a SigLIP-style tower), the Qwen2.5-Omni and
#: Qwen3-Omni-MoE thinkers (no audio here), GLM-5-Next (GLM's video steps), five whose tower is
#: ``vision_tower``: LFM3-VL, ERNIE-4.5-VL, Dots3-Note (MoE blocks in the tower; no audio here), Muse
#: Spark and Muse-Glimmer (one tower: pixels by keyword, merged by a pixel shuffle of
#: ``config.merge_size``), HyperCLOVAX Vision V2 (a Qwen2.5-VL tower under ``vision_model``); from
#: 5.25, LLaVA-OneVision-1.5 (RICE-ViT: a class token per frame, no temporal patches, 1-D text
#: positions) and Ovis2.5 (a windowed tower under ``vision_tower``, read by its projection from the
#: last layer's hidden states); MiniMax-M3-VL, PaddleOCR-VL and Kimi-K2.5 (see below).
LATEST_FAMILIES = (
    "qwen4_exp", "exaone4_5", "cohere_compass", "cosmos3_omni", "cosmos3_edge", "qwen2_5_omni",
    "qwen3_omni_moe", "glm5_next", "llava_onevision1_5", "lfm3_vl", "ernie4_5_vl_moe", "dots3_note",
    "hyperclovax_vision_v2", "muse_spark", "muse_glimmer", "minimax_m3_vl", "paddleocr_vl", "kimi_k25",
    "ovis2_5",
)  # fmt: skip
#: Of :data:`LATEST_FAMILIES`, MiniMax-M3-VL's tower attends over a whole video (3-D rotary
#: positions) and Kimi-K2.5's too (a temporal position per frame; it pools each video's frames into
#: one ``H*W/merge**2`` block of tokens): their videos are never split by step. PaddleOCR-VL takes
#: images only.
WHOLE_VIDEO_FAMILIES = ("minimax_m3_vl", "kimi_k25")
IMAGE_ONLY_FAMILIES = ("paddleocr_vl",)
#: Families of transformers 5.24 that the drop-in refuses, built only for that check: HunYuanVL (its
#: ``vision_tower`` returns a batch dimension and, per image, a row per merged token plus one per
#: merged row and two more; no videos), GLM-Image (no videos; its tower is given the grid without
#: each sample's target grids) and MiniCPM-V 4.6 (pixels packed as ``[1, C, patch, n*patch]`` with
#: ``[n, 2]`` sizes and no ``grid_thw``; MiniCPM-V 4.7's and MiniCPM-OCR's tower is the same).
#: HY-V4-VL's ``vision_tower`` is refused too: like HunYuanVL's, its outputs have a batch dimension
#: and a newline row after each merged row (``T * H/m * (W/m + 1)`` rows per item).
REFUSED_FAMILIES = ("hunyuan_vl", "glm_image", "minicpmv4_6", "hy_v4_vl")
#: Families whose processors put a video's tokens in one block (no ``mm_token_type_ids``).
_ONE_VIDEO_BLOCK = (
    "exaone4_5", "qwen2_5_omni", "qwen3_omni_moe", "llava_onevision1_5", "dots3_note",
    "hyperclovax_vision_v2", "muse_spark", "muse_glimmer", "minimax_m3_vl", "kimi_k25", "ovis2_5",
)  # fmt: skip
#: Families that frame a video's block with their own video start/end tokens (Ovis2.5).
_VIDEO_FRAMED = ("ovis2_5",)
#: Families whose processors give pixel rows as patch images ``[S, 3, patch, patch]``.
_PATCH_IMAGES = ("paddleocr_vl", "kimi_k25")
#: Families whose towers pool a video's frames: one frame's tokens per video.
_POOLED_FRAMES = ("kimi_k25",)
#: Of :data:`_ONE_VIDEO_BLOCK`, the families whose rotary index wants each video's seconds per
#: temporal patch (the Omni thinkers, LLaVA-OneVision-1.5).
_SECONDS_PER_GRID = ("qwen2_5_omni", "qwen3_omni_moe", "llava_onevision1_5")
_CLASSES = {
    "qwen2_vl": "Qwen2VL",
    "qwen2_5_vl": "Qwen2_5_VL",
    "qwen3_vl": "Qwen3VL",
    "qwen3_vl_moe": "Qwen3VLMoe",
    "qwen3_5": "Qwen3_5",
    "qwen3_5_moe": "Qwen3_5Moe",
    "glm4v": "Glm4v",
    "glm4v_moe": "Glm4vMoe",
    "glm46v": "Glm46V",
    "glm_ocr": "GlmOcr",
    "qwen4_exp": "Qwen4Exp",
    "exaone4_5": "Exaone4_5_",
    "cohere_compass": "CohereCompass",
    "cosmos3_omni": "Cosmos3Omni",
    "cosmos3_edge": "Cosmos3Edge",
    "qwen2_5_omni": "Qwen2_5OmniThinker",
    "qwen3_omni_moe": "Qwen3OmniMoeThinker",
    "glm5_next": "Glm5Next",
    "llava_onevision1_5": "LlavaOnevision15",
    "lfm3_vl": "Lfm3Vl",
    "ernie4_5_vl_moe": "Ernie4_5_VLMoe",
    "dots3_note": "Dots3Note",
    "hyperclovax_vision_v2": "HyperCLOVAXVisionV2",
    "muse_spark": "MuseSpark",
    "muse_glimmer": "MuseGlimmer",
    "hunyuan_vl": "HunYuanVL",
    "glm_image": "GlmImage",
    "minicpmv4_6": "MiniCPMV4_6",
    "minimax_m3_vl": "MiniMaxM3VL",
    "paddleocr_vl": "PaddleOCRVL",
    "hy_v4_vl": "HYV4VL",
    "kimi_k25": "Kimi_K25",
    "ovis2_5": "Ovis2_5",
}
#: Model classes not named ``{_CLASSES[family]}ForConditionalGeneration``.
_MODEL_CLASSES = {"minimax_m3_vl": "MiniMaxM3SparseForConditionalGeneration"}


def _model_class(family: str) -> str:
    return _MODEL_CLASSES.get(family, f"{_CLASSES[family]}ForConditionalGeneration")


#: Pixel values per patch row: 3 colours x 2x2 patch x temporal patch 1.
CHANNELS = 12
MERGE = 2
VOCAB = 64
#: Special token ids (the tiny vocabulary's last nine; GLM's video start/end and the Omni thinkers'
#: audio ids only for those).
IDS = {
    "image": 60, "video": 61, "vision_start": 62, "vision_end": 63, "video_start": 58, "video_end": 59,
    "audio": 55, "audio_start": 56, "audio_end": 57,
}  # fmt: skip
_TEXT = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512,
    "bos_token_id": 0, "eos_token_id": 1,
}  # fmt: skip
_VISION = {"in_channels": 3, "patch_size": 2, "temporal_patch_size": 1, "spatial_merge_size": MERGE}


def _rope(**extra: Any) -> dict[str, Any]:
    """Multimodal rotary settings under the key every supported transformers reads: 5.x turns
    ``rope_scaling`` into ``rope_parameters``, 4.x reads it as it is (and wants ``type``)."""
    return {"type": "mrope", "rope_type": "default", "mrope_section": [2, 3, 3], **extra}


_QWEN_IDS = {
    "image_token_id": IDS["image"], "video_token_id": IDS["video"],
    "vision_start_token_id": IDS["vision_start"], "vision_end_token_id": IDS["vision_end"],
}  # fmt: skip
_GLM_IDS = {
    "image_token_id": IDS["image"], "video_token_id": IDS["video"],
    "image_start_token_id": IDS["vision_start"], "image_end_token_id": IDS["vision_end"],
    "video_start_token_id": IDS["video_start"], "video_end_token_id": IDS["video_end"],
}  # fmt: skip
#: A Qwen2.5-VL-style tower (windows of 2x2 merged tokens, block 1 full attention).
_QWEN2_5_TOWER = {
    **_VISION, "depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
    "window_size": 8, "fullatt_block_indexes": [1],
}  # fmt: skip
#: A Qwen3-VL-style tower (learned position embeddings, deepstack after both blocks).
_QWEN3_TOWER = {
    **_VISION, "depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
    "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1],
}  # fmt: skip
#: GLM-4.xV's tower (its position embedding interpolated from a 4x4 table).
_GLM_TOWER = {
    **_VISION, "depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
    "image_size": 8,
}  # fmt: skip
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}


def tiny_config(family: str) -> Any:
    """The model config of ``family`` (one of :data:`FAMILIES`)."""
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig

        text = {**_TEXT, "rope_scaling": _rope()}
        vision = {**_VISION, "depth": 2, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2}
        return Qwen2VLConfig(text_config=text, vision_config=vision, **_QWEN_IDS)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        text = {**_TEXT, "rope_scaling": _rope()}
        return Qwen2_5_VLConfig(text_config=text, vision_config=_QWEN2_5_TOWER, **_QWEN_IDS)
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        text = {**_TEXT, "head_dim": 16, "rope_scaling": _rope(mrope_interleaved=True)}
        return Qwen3VLConfig(text_config=text, vision_config=_QWEN3_TOWER, **_QWEN_IDS)
    if family in GLM_FAMILIES:
        return _glm_config(family)
    if family in LATEST_FAMILIES or family in REFUSED_FAMILIES:
        return _latest_config(family)
    if family in NEWER_FAMILIES:
        import transformers

        text = {**_TEXT, "head_dim": 16, "rope_scaling": _rope(mrope_interleaved=True)}
        if family.startswith("qwen3_5"):
            # One linear-attention (gated delta rule) layer and one full-attention layer.
            text.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
            text.update(linear_key_head_dim=8, linear_value_head_dim=8)
            text.update(linear_num_key_heads=2, linear_num_value_heads=2)
        if family.endswith("moe"):
            text.update(moe_intermediate_size=16, num_experts_per_tok=2, num_experts=4)
            text.update(shared_expert_intermediate_size=16, decoder_sparse_step=1)
        vision = _QWEN3_TOWER if family == "qwen3_vl_moe" else _without_deepstack(_QWEN3_TOWER)
        config = getattr(transformers, f"{_CLASSES[family]}Config")
        return config(text_config=text, vision_config=vision, **_QWEN_IDS)
    known = FAMILIES + NEWER_FAMILIES + GLM_FAMILIES + LATEST_FAMILIES + REFUSED_FAMILIES
    raise ValueError(f"family={family!r} is unknown: expected one of {known}.")


def _latest_config(family: str) -> Any:
    """The config of one of :data:`LATEST_FAMILIES` or :data:`REFUSED_FAMILIES` (transformers 5:
    ``rope_parameters``)."""
    import transformers

    config = getattr(transformers, f"{_CLASSES[family]}Config")
    if family in ("qwen2_5_omni", "qwen3_omni_moe"):
        return _omni_thinker_config(family, config)
    return _LATEST_BUILDERS[family](config)


def _qwen4_exp_config(config: Any) -> Any:
    """One gated-delta-rule layer and one QSA-indexed layer, MoE, hyper-connections."""
    text: dict[str, Any] = {**_TEXT, "head_dim": 16, "num_hidden_layers": 2}
    text.update(layer_types=["linear_attention", "indexed_attention"])
    text.update(
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2
    )
    text.update(
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2
    )
    text.update(hc_count=2, hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16)
    text.update(
        indexer_budget=4, indexer_compress_ratio=2, rope_parameters={**_MROPE, "mrope_interleaved": True}
    )
    return config(text_config=text, vision_config=_without_deepstack(_QWEN3_TOWER), **_QWEN_IDS)


def _exaone4_5_config(config: Any) -> Any:
    """Sliding and full attention, 1-D positions; a Qwen2.5-VL-style tower with GQA and windows."""
    text = {**_TEXT, "model_type": "exaone4", "num_hidden_layers": 2, "sliding_window": 8}
    text.update(sliding_window_pattern=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    vision = {**_QWEN2_5_TOWER, "num_key_value_heads": 1}
    return config(
        text_config=text, vision_config=vision, image_token_id=IDS["image"], video_token_id=IDS["video"]
    )


def _cohere_compass_config(config: Any) -> Any:
    text = {**_TEXT, "model_type": "cohere_compass_text", "pad_token_id": 0}
    text.update(layer_types=["full_attention"], rope_parameters={"full_attention": _MROPE})
    vision = {**_QWEN3_TOWER, "model_type": "cohere_compass_vision"}
    vision["rope_parameters"] = {"rope_type": "axial", "rope_theta": 10000.0}
    return config(text_config=text, vision_config=vision, **_QWEN_IDS)


def _cosmos3_omni_config(config: Any) -> Any:
    text = {**_TEXT, "head_dim": 16, "model_type": "qwen3_vl_text"}
    text["rope_parameters"] = {**_MROPE, "mrope_interleaved": True}
    return config(
        text_config=text, vision_config={**_QWEN3_TOWER, "model_type": "qwen3_vl_vision"}, **_QWEN_IDS
    )


def _cosmos3_edge_config(config: Any) -> Any:
    """A SigLIP-style tower: num_channels, no temporal patches, the projector outside the tower."""
    text = {**_TEXT, "head_dim": 16, "rope_parameters": _MROPE, "pad_token_id": 0}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision.update(num_channels=3, patch_size=2, num_patches=16, spatial_merge_size=MERGE)
    return config(text_config=text, vision_config=vision, projector_hidden_size=32, **_QWEN_IDS)


def _glm5_next_config(config: Any) -> Any:
    """Linear and indexed (MLA, NoPE) attention, MoE, hyper-connections; GLM's tower."""
    text = {**_TEXT, "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": None}
    text.update(layer_types=["linear_attention", "indexed_attention"], mlp_layer_types=["dense", "sparse"])
    text.update(moe_intermediate_size=16, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2)
    text.update(n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=0)
    text.update(
        qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_kpool=4, index_head_dim=8, index_n_heads=2
    )
    text.update(
        linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=4, hc_mult=2, hc_sinkhorn_iters=3
    )
    vision = {**_GLM_TOWER, "projection_intermediate_size": 32}
    return config(text_config=text, vision_config=vision, **_GLM_IDS)


def _llava_onevision1_5_config(config: Any) -> Any:
    """A Qwen3 decoder (1-D positions) and RICE-ViT: 2-D rotary positions, a class token per frame."""
    text = {**_TEXT, "model_type": "qwen3", "head_dim": 16}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32}
    vision.update(in_channels=3, patch_size=2, spatial_merge_size=MERGE)
    return config(text_config=text, vision_config=vision, **_QWEN_IDS)


def _lfm3_vl_config(config: Any) -> Any:
    """An LFM3 decoder and LFM3-VL's tower (a convolution block, then full attention), its vision
    tower under ``vision_tower``."""
    text = {
        **_TEXT,
        "model_type": "lfm3",
        "head_dim": 16,
        "pad_token_id": 0,
        "layer_types": ["full_attention"],
    }
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision.update(num_key_value_heads=1, layer_types=["conv", "full_attention"], **_VISION)
    return config(text_config=text, vision_config=vision, projector_hidden_size=32, **_QWEN_IDS)


def _ernie4_5_vl_moe_config(config: Any) -> Any:
    """ERNIE-4.5-VL: an MoE decoder with 3-D rotary positions; its tower under ``vision_tower``, and a
    resampler outside it that merges each video's frames in pairs."""
    text = {**_TEXT, "head_dim": 16, "pad_token_id": 0, "moe_intermediate_size": [16, 16], "moe_k": 2}
    text.update(moe_num_experts=4, moe_num_shared_experts=1)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}
    vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "in_channels": 3}
    vision.update(patch_size=2, spatial_merge_size=MERGE, temporal_merge_size=2)
    return config(text_config=text, vision_config=vision, **_GLM_IDS)


def _dots3_note_config(config: Any) -> Any:
    """Dots3-Note: an MLA decoder (one indexed-attention layer, MoE), its tower under ``vision_tower``
    (2-D rotary positions, no temporal patches, block 1 a top-2 MoE of 4 experts), and a tiny audio
    tower that these tests never feed."""
    text = {**_TEXT, "num_key_value_heads": 2, "pad_token_id": 0, "layer_types": ["indexed_attention"]}
    text.update(mlp_layer_types=["sparse"], moe_intermediate_size=16, shared_experts_intermediate_size=16)
    text.update(n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16)
    text.update(q_lora_rank=16, head_dim=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    text.update(index_topk=8, index_head_dim=8, index_n_heads=2)
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision.update(num_channels=3, patch_size=2, spatial_merge_size=MERGE, adapter_merge_size=MERGE)
    vision.update(adapter_in_dim=16, adapter_out_dim=32, pyramid_num_routed=[-1, 4])
    vision.update(moe_intermediate_size=16, num_experts_per_tok=2)
    audio = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    audio.update(adapter_input_size=16, adapter_out_dim=32, feature_size=8, downsample_hidden_size=8)
    ids = {"image_token_id": IDS["image"], "video_token_id": IDS["video"], "audio_token_id": IDS["audio"]}
    return config(text_config=text, vision_config=vision, audio_config=audio, **ids)


def _hyperclovax_vision_v2_config(config: Any) -> Any:
    """A HyperCLOVAX decoder (1-D positions) and a Qwen2.5-VL tower (windows) under ``vision_model``,
    its projector outside the tower."""
    text = {**_TEXT, "model_type": "hyperclovax"}
    vision = {**_QWEN2_5_TOWER, "model_type": "qwen2_5_vl_vision"}
    return config(
        text_config=text, vision_config=vision, image_token_id=IDS["image"], video_token_id=IDS["video"]
    )


#: Muse Spark's and Muse-Glimmer's tower: windows of 4x4 patches, 2x2 blocks merged at its end.
_MUSE_TOWER = {
    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "patch_size": 2, "patch_temporal": 1, "merge_size": MERGE, "pos_emb_height": 4, "pos_emb_width": 4,
    "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
}  # fmt: skip


def _muse_spark_config(config: Any) -> Any:
    """Muse Spark: an MoE decoder (sliding and full attention, 1-D positions), a tower with windows of
    4x4 patches that merges 2x2 blocks at its end, and a tiny audio tower these tests never feed."""
    text = {**_TEXT, "head_dim": 16, "sliding_window": 8, "moe_intermediate_size": 16, "moe_hidden_size": 16}
    text.update(num_local_experts=4, num_experts_per_tok=2)
    audio = {"patch_sizes": [2], "hidden_sizes": [8], "depths": [1], "num_hidden_layers": 1}
    ids = {"image_token_id": IDS["image"], "video_token_id": IDS["video"], "audio_token_id": IDS["audio"]}
    audio["out_hidden_size"] = _TEXT["hidden_size"]  # scattered onto the text embeddings
    return config(
        text_config=text, vision_config=_MUSE_TOWER, audio_config=audio, out_hidden_size=16 * MERGE**2,
        projector_hidden_size=32, **ids,
    )  # fmt: skip


def _muse_glimmer_config(config: Any) -> Any:
    """Muse-Glimmer: a dense decoder (sliding and full attention, 1-D positions) and Muse Spark's
    tower (:func:`_muse_spark_config`), no audio."""
    text = {**_TEXT, "head_dim": 16, "sliding_window": 8}
    ids = {"image_token_id": IDS["image"], "video_token_id": IDS["video"]}
    return config(
        text_config=text,
        vision_config=_MUSE_TOWER,
        out_hidden_size=16 * MERGE**2,
        projector_hidden_size=32,
        **ids,
    )


def _hunyuan_vl_config(config: Any) -> Any:
    """HunYuanVL (refused): a dense decoder and a SigLIP-style tower under ``vision_tower`` whose
    patch merger adds a row per merged row and begin/end rows."""
    text = {**_TEXT, "head_dim": 16, "pad_token_id": 0}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision.update(num_channels=3, patch_size=2, spatial_merge_size=MERGE, max_image_size=8)
    vision.update(text_hidden_size=32, out_hidden_size=32)
    return config(text_config=text, vision_config=vision, image_token_id=IDS["image"])


def _glm_image_config(config: Any) -> Any:
    """GLM-Image (refused): a GLM decoder, a tower without merging and a VQ quantiser after it."""
    text = {**_TEXT, "head_dim": 16, "pad_token_id": 0, "vision_vocab_size": VOCAB, "rope_parameters": _MROPE}
    vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "in_channels": 3}
    vision.update(patch_size=2, image_size=8)
    vq = {"embed_dim": 8, "num_embeddings": 16, "latent_channels": 16}
    return config(
        text_config=text, vision_config=vision, vq_config=vq, image_token_id=IDS["image"],
        image_start_token_id=IDS["vision_start"], image_end_token_id=IDS["vision_end"],
    )  # fmt: skip


def _minicpm_config(config: Any) -> Any:
    """MiniCPM-V 4.6 (refused): a Qwen3.5 decoder (one linear-attention layer, one full) and a
    SigLIP-style tower of two layers, its window merger after the first."""
    text = {**_TEXT, "model_type": "qwen3_5_text", "head_dim": 16, "num_hidden_layers": 2}
    text.update(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8)
    text.update(linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2)
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision.update(num_channels=3, patch_size=2, image_size=16)
    ids = {"image_token_id": IDS["image"], "video_token_id": IDS["video"]}
    return config(text_config=text, vision_config=vision, insert_layer_id=0, **ids)


def _minimax_m3_vl_config(config: Any) -> Any:
    """MiniMax-M3-VL: an MoE decoder (1-D positions) and a tower under ``vision_tower`` with 3-D
    rotary positions and attention over a whole video, returning a batch dimension; the projector
    merges 2x2 patches after it."""
    text = {**_TEXT, "head_dim": 16, "rotary_dim": 8, "layer_types": ["full_attention"]}
    text.update(mlp_layer_types=["sparse"], num_local_experts=4, num_experts_per_tok=2)
    text.update(dense_intermediate_size=48, shared_intermediate_size=16, index_n_heads=2)
    text.update(index_head_dim=8, index_block_size=4, index_topk_blocks=2)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision.update(num_channels=3, patch_size=2, temporal_patch_size=1, spatial_merge_size=MERGE)
    return config(
        text_config=text, vision_config=vision, projector_hidden_size=32, merged_hidden_size=32 * MERGE**2,
        image_token_index=IDS["image"], video_token_index=IDS["video"],
    )  # fmt: skip


def _paddleocr_vl_config(config: Any) -> Any:
    """PaddleOCR-VL: images only, a SigLIP-style tower under ``visual`` taking patch images with a
    batch dimension, its position table interpolated from 4x4; the projector merges after it."""
    text = {**_TEXT, "head_dim": 16, "pad_token_id": 0}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision.update(num_channels=3, patch_size=2, image_size=8, spatial_merge_size=MERGE)
    return config(text_config=text, vision_config=vision, **_QWEN_IDS)


def _kimi_k25_config(config: Any) -> Any:
    """Kimi-K2.5: a DeepSeek-V3 decoder (MLA, 1-D positions) and a tower under ``vision_tower``
    taking RGB patches through a ``Conv2d``, a 4x4 position table resampled per image, a temporal
    position per frame (up to 4), attention over a whole video and its frames pooled per 2x2 block."""
    text = {**_TEXT, "model_type": "deepseek_v3", "num_key_value_heads": 2, "pad_token_id": 0}
    text.update(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    text.update(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision.update(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=4)
    vision.update(merge_kernel_size=[MERGE, MERGE])
    vision["rope_parameters"] = {"rope_type": "axial", "rope_theta": 10000.0}
    return config(text_config=text, vision_config=vision, projection_hidden_size=16, **_QWEN_IDS)


def _ovis2_5_config(config: Any) -> Any:
    """Ovis2.5: a Qwen3 decoder (1-D positions) and a tower under ``vision_tower`` (a 4x4 position
    table resampled per image, windows of 2x2 merged tokens in block 0, block 1 full attention).
    Its projection reads the last block's hidden states, softmaxes them over a visual vocabulary and
    embeds the result; each image's and video's block of tokens sits between the model's own
    start/end tokens, which take the embeddings of four indicator tokens."""
    text = {**_TEXT, "model_type": "qwen3", "head_dim": 16}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision.update(num_channels=3, patch_size=2, spatial_merge_size=MERGE, temporal_patch_size=1)
    vision.update(image_size=8, window_size=8, layer_types=["window_attention", "full_attention"])
    vision.update(vocab_size=24, num_visual_indicator_tokens=4)
    return config(text_config=text, vision_config=vision, **_GLM_IDS)


def _hy_v4_vl_config(config: Any) -> Any:
    """HY-V4-VL (refused): its decoder as small as it builds, and a SigLIP-style tower under
    ``vision_tower`` whose merger adds a newline row per merged row."""
    text = {**_TEXT, "head_dim": 16, "pad_token_id": 0}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "attention_heads": 2}
    vision.update(num_channels=3, patch_size=2, spatial_merge_size=MERGE, max_image_size=8)
    vision["out_hidden_size"] = 32
    return config(text_config=text, vision_config=vision, **_QWEN_IDS)


#: The builders of :func:`_latest_config`, by family (the omni thinkers have their own).
_LATEST_BUILDERS: dict[str, Callable[[Any], Any]] = {
    "qwen4_exp": _qwen4_exp_config,
    "exaone4_5": _exaone4_5_config,
    "cohere_compass": _cohere_compass_config,
    "cosmos3_omni": _cosmos3_omni_config,
    "cosmos3_edge": _cosmos3_edge_config,
    "glm5_next": _glm5_next_config,
    "llava_onevision1_5": _llava_onevision1_5_config,
    "lfm3_vl": _lfm3_vl_config,
    "ernie4_5_vl_moe": _ernie4_5_vl_moe_config,
    "dots3_note": _dots3_note_config,
    "hyperclovax_vision_v2": _hyperclovax_vision_v2_config,
    "muse_spark": _muse_spark_config,
    "muse_glimmer": _muse_glimmer_config,
    "hunyuan_vl": _hunyuan_vl_config,
    "glm_image": _glm_image_config,
    "minicpmv4_6": _minicpm_config,
    "minimax_m3_vl": _minimax_m3_vl_config,
    "paddleocr_vl": _paddleocr_vl_config,
    "hy_v4_vl": _hy_v4_vl_config,
    "kimi_k25": _kimi_k25_config,
    "ovis2_5": _ovis2_5_config,
}


def _omni_thinker_config(family: str, config: Any) -> Any:
    """A Qwen2.5-Omni or Qwen3-Omni-MoE thinker: a tiny audio tower that these tests never feed."""
    text: dict[str, Any] = {**_TEXT, "rope_parameters": _MROPE}
    audio = {"num_mel_bins": 8, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 32}
    audio.update(d_model=16, output_dim=32, max_source_positions=64, n_window=4)
    if family == "qwen2_5_omni":
        vision = _QWEN2_5_TOWER
        ids = {
            "image_token_index": IDS["image"],
            "video_token_index": IDS["video"],
            "audio_token_index": IDS["audio"],
        }
    else:
        text.update(
            head_dim=16, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1
        )
        text["rope_parameters"] = {**_MROPE, "interleaved": True}
        vision = _QWEN3_TOWER
        audio.update(n_window_infer=8, downsample_hidden_size=8)
        ids = {"image_token_id": IDS["image"], "video_token_id": IDS["video"], "audio_token_id": IDS["audio"]}
    return config(
        text_config=text, vision_config=vision, audio_config=audio, **ids, user_token_id=1,
        audio_start_token_id=IDS["audio_start"], audio_end_token_id=IDS["audio_end"],
        vision_start_token_id=IDS["vision_start"], vision_end_token_id=IDS["vision_end"],
    )  # fmt: skip


def _glm_config(family: str) -> Any:
    """A GLM-4.xV config: the image tokens frame by frame between GLM's own start/end tokens."""
    import transformers

    # The MoE decoder rotates half of each head (partial_rotary_factor 0.5): 4 frequencies, not 8.
    section = [2, 1, 1] if family == "glm4v_moe" else [2, 3, 3]
    text = {**_TEXT, "head_dim": 16, "rope_scaling": {"rope_type": "default", "mrope_section": section}}
    if family == "glm4v_moe":
        text.update(moe_intermediate_size=16, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1)
        text.update(first_k_dense_replace=0, n_group=1, topk_group=1)
    config = getattr(transformers, f"{_CLASSES[family]}Config")
    return config(text_config=text, vision_config=_GLM_TOWER, **_GLM_IDS)


def _without_deepstack(tower: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in tower.items() if key != "deepstack_visual_indexes"}


#: The first transformers whose :data:`LATEST_FAMILIES` models these tests and the drop-in are written
#: for. Earlier 5.x releases hold older forms of some: 5.17's MiniMax-M3-VL tower attends across all
#: the images of a call and its Kimi-K2.5 pools frames in the tower's forward (the drop-in refuses
#: both, as it does the Omni thinkers there and Cosmos3-Edge's merge kept in its config), and the tiny
#: Qwen4-Exp and GLM-5-Next configs name a layer type 5.17 lacks.
LATEST_FROM = (5, 24)


def available(family: str) -> bool:
    """Whether the installed transformers has ``family``'s model in the form the tests are written
    for (:data:`LATEST_FAMILIES`: from :data:`LATEST_FROM`; :data:`REFUSED_FAMILIES`: as in 5.x;
    4.57's Omni thinkers keep the tower on the model that computes the loss, which the drop-in
    refuses)."""
    import transformers

    version = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if family in LATEST_FAMILIES and version < LATEST_FROM:
        return False
    if family in REFUSED_FAMILIES and version < (5, 0):
        return False
    return hasattr(transformers, _model_class(family))


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised ``*ForConditionalGeneration`` of ``family``, in training mode."""
    import transformers

    config = tiny_config(family)
    torch.manual_seed(seed)
    model = getattr(transformers, _model_class(family))(config)
    if family == "glm5_next":
        # Its tower in float64 (the model casts the pixels to it): in float32 its patch embedding's
        # gradient, a sum with much cancellation, differs by up to 3e-4 relative between two batch
        # layouts of the same images; in float64 the balanced model's stays within 1e-9.
        model.model.visual.double()
    return model.train()


def tower_of(model: torch.nn.Module) -> torch.nn.Module:
    """The vision tower of a :func:`tiny_model`: ``model.model.visual``, or ``vision_tower`` (LFM3-VL,
    ERNIE-4.5-VL, Dots3-Note, Muse Spark), or ``vision_model`` (HyperCLOVAX Vision V2)."""
    base = model.model
    for name in ("visual", "vision_tower"):
        if hasattr(base, name):
            return getattr(base, name)
    return base.vision_model


Grid = tuple[int, int, int]


def _tokens(family: str, kind: str, grid: Grid) -> tuple[list[int], list[int]]:
    """Token ids and mm token types of one image or video with its vision start/end tokens."""
    t, h, w = grid
    per_frame = h * w // MERGE**2
    code = 1 if kind == "image" else 2
    if family in (*GLM_FAMILIES, "glm5_next") and kind == "video":
        # GLM: each frame's image tokens (typed as video) between image start/end, inside video start/end.
        frame = [IDS["vision_start"], *[IDS["image"]] * per_frame, IDS["vision_end"]]
        kinds = [0, *[code] * per_frame, 0]
        return [IDS["video_start"], *frame * t, IDS["video_end"]], [0, *kinds * t, 0]
    # Qwen3-VL, its successors and the latest families place each video frame in its own start/end
    # pair (timestamps separate them).
    whole = family in _ONE_VIDEO_BLOCK or not family.startswith(("qwen3", *LATEST_FAMILIES))
    frames = [t * per_frame] if whole or kind != "video" else [per_frame] * t
    if family == "ernie4_5_vl_moe" and kind == "video":  # its resampler merges frames in pairs
        frames = [(t + 1) // 2 * per_frame]
    if family in _POOLED_FRAMES and kind == "video":  # its tower pools the frames
        frames = [per_frame]
    start, end = IDS["vision_start"], IDS["vision_end"]
    if family in _VIDEO_FRAMED and kind == "video":
        start, end = IDS["video_start"], IDS["video_end"]
    ids: list[int] = []
    types: list[int] = []
    for count in frames:
        ids += [start, *[IDS[kind]] * count, end]
        types += [0, *[code] * count, 0]
    return ids, types


def _add_pixels(
    family: str, batch: dict[str, Any], grids: dict[str, list[Grid]], generator: torch.Generator
) -> None:
    """Random pixel rows and the grids of ``grids``' images and videos, in ``family``'s form."""
    for kind, pixels_key, grid_key in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        found = grids[kind]
        rows_needed = sum(t * h * w for t, h, w in found)
        batch[pixels_key] = torch.randn(rows_needed, CHANNELS, generator=generator) if found else None
        batch[grid_key] = torch.tensor(found, dtype=torch.long) if found else None
    for pixels_key in ("pixel_values", "pixel_values_videos") if family in _PATCH_IMAGES else ():
        # PaddleOCR-VL's and Kimi-K2.5's processors give patch images [S, 3, patch, patch].
        pixels = batch[pixels_key]
        batch[pixels_key] = pixels.reshape(-1, 3, 2, 2) if pixels is not None else None
    if family in IMAGE_ONLY_FAMILIES:  # PaddleOCR-VL: no video keys
        del batch["pixel_values_videos"], batch["video_grid_thw"]


def make_inputs(
    family: str, samples: Sequence[dict[str, Any]], seed: int, text_len: int = 6
) -> dict[str, Any]:
    """Model inputs for ``samples``, each ``{"images": [grid, ...], "videos": [grid, ...]}``.

    Every sample gets ``text_len`` random text tokens after its images and videos; sequences are
    right-padded (``attention_mask`` 0, ``labels`` -100).
    """
    generator = torch.Generator().manual_seed(seed)
    rows: list[tuple[list[int], list[int]]] = []
    grids: dict[str, list[Grid]] = {"image": [], "video": []}
    for sample in samples:
        ids: list[int] = []
        types: list[int] = []
        for kind in ("image", "video"):
            for grid in sample.get(f"{kind}s", ()):
                more_ids, more_types = _tokens(family, kind, tuple(grid))
                ids += more_ids
                types += more_types
                grids[kind].append(tuple(grid))
        ids += torch.randint(0, VOCAB - len(IDS), (text_len,), generator=generator).tolist()
        types += [0] * text_len
        rows.append((ids, types))
    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    types = torch.zeros(len(rows), length, dtype=torch.int32)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    for i, (ids, kinds) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        types[i, : len(ids)] = torch.tensor(kinds, dtype=torch.int32)
        attention[i, : len(ids)] = 1
    labels = input_ids.masked_fill(attention == 0, -100)
    batch: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "mm_token_type_ids": types,
        "labels": labels,
    }
    if family in _ONE_VIDEO_BLOCK:
        # Their forwards take no token types; the Omni thinkers' rotary index wants each video's
        # seconds per temporal patch.
        del batch["mm_token_type_ids"]
        if family in _SECONDS_PER_GRID:
            batch["video_second_per_grid"] = torch.ones(len(grids["video"])) if grids["video"] else None
    _add_pixels(family, batch, grids, generator)
    return batch


def generation_prompt(model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` as ``generate()`` inputs: no labels, only what the model's forward names
    (transformers 4.x's ``generate()`` refuses the rest), and no key for an absent modality, as a
    processor gives them (transformers 5.24's ``generate()`` encodes a modality whose key is there,
    even as None, and fails)."""
    accepted = inspect.signature(model.forward).parameters
    return {k: v for k, v in batch.items() if k != "labels" and k in accepted and v is not None}


def generation_settings(rank: int) -> dict[str, Any]:
    """Greedy ``generate()`` settings under which each rank generates a different number of tokens."""
    return {"max_new_tokens": 2 + rank, "do_sample": False}
