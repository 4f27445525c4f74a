"""Cost models for the simulator: the seed's ``l**2``, ViT shapes by name or numbers, coefficients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_vit_balance.cost import CostModel

__all__ = ["COST_MODELS", "VIT_PRESETS", "coefficients_model", "named_cost_model", "vit_shape_model"]


def _all_but(depth: int, full: tuple[int, ...]) -> list[int]:
    return [i for i in range(depth) if i not in full]


#: Vision towers of released checkpoints, as :meth:`CostModel.from_vit_shape` arguments (their
#: ``config.json`` ``vision_config``; Qwen2.5-VL: windows of 112 px = 8x8 patches in all blocks
#: but 7, 15, 23 and 31). All three attend within each temporal step of a video, as Hugging Face's
#: towers do (``per_frame_attention``).
VIT_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2-vl": {
        "hidden_size": 1280,
        "depth": 32,
        "mlp_ratio": 4.0,
        "patch_input_dim": 3 * 2 * 14 * 14,
        "per_frame_attention": True,
    },
    "qwen2.5-vl": {
        "hidden_size": 1280,
        "depth": 32,
        "intermediate_size": 3420,
        "gated_mlp": True,
        "patch_input_dim": 3 * 2 * 14 * 14,
        "window_layers": _all_but(32, (7, 15, 23, 31)),
        "window_patches": 64,
        "per_frame_attention": True,
    },
    "qwen3-vl": {
        "hidden_size": 1152,
        "depth": 27,
        "intermediate_size": 4304,
        "patch_input_dim": 3 * 2 * 16 * 16,
        "per_frame_attention": True,
    },
}
#: Names ``--cost-model`` takes: ``"seed"`` (``l**2``) or a preset.
COST_MODELS: tuple[str, ...] = ("seed", *VIT_PRESETS)


def named_cost_model(name: str) -> CostModel:
    """``"seed"``: the seed's ``l**2``; a :data:`VIT_PRESETS` name: that ViT's FLOPs, attention per
    temporal step."""
    if name == "seed":
        return CostModel()
    if name not in VIT_PRESETS:
        raise ValueError(f"cost model {name!r} is unknown: expected one of {', '.join(COST_MODELS)}.")
    return CostModel.from_vit_shape(**VIT_PRESETS[name])


def _as_bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError("expected true or false")
    return text.lower() in ("true", "1", "yes")


def _as_layers(text: str) -> list[int]:
    """``"0-6+8-14+16"`` -> ``[0, ..., 6, 8, ..., 14, 16]``."""
    layers: list[int] = []
    for part in filter(None, text.split("+")):
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if last < first:
            raise ValueError(f"{part}: expected LOW-HIGH with LOW <= HIGH")
        layers.extend(range(first, last + 1))
    return layers


_SHAPE_TYPES: dict[str, Callable[[str], Any]] = {
    "hidden_size": int,
    "depth": int,
    "intermediate_size": int,
    "mlp_ratio": float,
    "gated_mlp": _as_bool,
    "patch_input_dim": int,
    "window_layers": _as_layers,
    "window_patches": int,
    "per_frame_attention": _as_bool,
    "kv_size": int,
}
_COEFFICIENT_TYPES: dict[str, Callable[[str], Any]] = {
    "quadratic": float,
    "linear": float,
    "constant": float,
    "windowed": float,
    "window_patches": int,
    "per_frame_attention": _as_bool,
}


def _assignments(option: str, text: str, types: dict[str, Callable[[str], Any]]) -> dict[str, Any]:
    """Parse ``"key=value,key=value"`` with a converter per allowed key."""
    values: dict[str, Any] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or key not in types:
            raise ValueError(f"{option} {text!r}: {pair!r} is not KEY=VALUE with KEY in {', '.join(types)}.")
        try:
            values[key] = types[key](raw.strip())
        except ValueError as error:
            raise ValueError(f"{option} {text!r}: {key}={raw!r} is invalid ({error}).") from None
    return values


def vit_shape_model(text: str) -> CostModel:
    """A model from ``"hidden_size=1280,depth=32,..."`` (:meth:`CostModel.from_vit_shape` keywords;
    ``window_layers`` as ranges joined by ``+``, e.g. ``0-6+8-14``)."""
    values = _assignments("--vit-shape", text, _SHAPE_TYPES)
    missing = [key for key in ("hidden_size", "depth") if key not in values]
    if missing:
        raise ValueError(
            f"--vit-shape {text!r} lacks {', '.join(missing)}: expected at least hidden_size and depth."
        )
    return CostModel.from_vit_shape(**values)


def coefficients_model(text: str) -> CostModel:
    """A model from ``"quadratic=1,linear=2048,..."`` (the :class:`CostModel` fields)."""
    return CostModel(**{"quadratic": 0.0, **_assignments("--cost-coefficients", text, _COEFFICIENT_TYPES)})
