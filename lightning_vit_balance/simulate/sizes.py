"""Qwen-VL grids from raw image and video sizes: the processors' resize rule, reimplemented.

Qwen2-VL's image and video processors resize every picture so that both sides are multiples of
``factor = patch_size * merge_size``, keeping the aspect ratio as well as they can, with the area
between a minimum and a maximum number of pixels; a video's frames are padded (by repeating the
last one) to a multiple of ``temporal_patch_size``. The grid ``(t, h, w)`` then counts patches
along time, height and width, and the ViT encodes ``t * h * w`` patches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ResizeRule", "smart_resize"]

# The processors refuse pictures more elongated than this.
_MAX_ASPECT_RATIO = 200


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Resized ``(height, width)`` under the Qwen2-VL processors' rule.

    Each side is rounded to the nearest multiple of ``factor`` (Python's ``round``, so halves go
    to the even multiple). When that area exceeds ``max_pixels``, both sides are scaled down by
    the same ratio and floored to a multiple of ``factor`` (at least ``factor``); when it is
    below ``min_pixels``, scaled up and ceiled.

    Raises:
        ValueError: a side is not positive, or the aspect ratio exceeds 200.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"height={height!r} and width={width!r} must both be positive.")
    if max(height, width) / min(height, width) > _MAX_ASPECT_RATIO:
        raise ValueError(
            f"aspect ratio {max(height, width) / min(height, width):.1f} of {width}x{height} exceeds "
            f"{_MAX_ASPECT_RATIO}, which the processors refuse."
        )
    rounded = (round(height / factor) * factor, round(width / factor) * factor)
    if rounded[0] * rounded[1] > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        down = [max(factor, math.floor(side / shrink / factor) * factor) for side in (height, width)]
        return down[0], down[1]
    if rounded[0] * rounded[1] < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        up = [math.ceil(side * grow / factor) * factor for side in (height, width)]
        return up[0], up[1]
    return rounded


def _require_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"ResizeRule.{name}={value!r} is invalid: expected a positive int.")


@dataclass(frozen=True)
class ResizeRule:
    """The processor settings that turn sizes into grids; the defaults are Qwen2-VL's.

    Args:
        patch_size: Pixels per patch side (Qwen2-VL 14, Qwen3-VL 16).
        merge_size: Patches merged per side after the ViT; grid sides are multiples of it.
        temporal_patch_size: Frames per patch along time (images count as one step).
        min_pixels: Images: smallest area after resizing (the processor's ``shortest_edge``).
        max_pixels: Images: largest area after resizing (``longest_edge``).
        video_min_pixels: Videos: smallest area of a frame after resizing.
        video_max_pixels: Videos: largest area of a frame after resizing.
        video_max_tokens: When set, also bound each frame by an even share of this many tokens'
            worth of pixels over the whole video, as ``cap_pixels_per_frame=True`` (and
            qwen-vl-utils) does; ``None`` keeps the per-frame bound only (the processor's default).
    """

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 28 * 28 * 768
    video_max_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            _require_positive(name, getattr(self, name))
        _require_positive("video_min_pixels", self.video_min_pixels)
        _require_positive("video_max_pixels", self.video_max_pixels)
        if self.video_max_tokens is not None:
            _require_positive("video_max_tokens", self.video_max_tokens)
        for low, high in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(
                    f"ResizeRule.{low}={getattr(self, low)!r} is invalid: expected at most "
                    f"{high}={getattr(self, high)!r}."
                )

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this many pixels."""
        return self.patch_size * self.merge_size

    @property
    def channels(self) -> int:
        """Values per patch row of RGB pixels: ``3 * temporal_patch_size * patch_size**2``."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def image_grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``(1, h, w)`` patches of an image of ``width`` x ``height`` pixels."""
        side_h, side_w = smart_resize(
            height, width, factor=self.factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels
        )
        return 1, side_h // self.patch_size, side_w // self.patch_size

    def video_grid(self, width: int, height: int, frames: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patches of ``frames`` (already sampled) frames of ``width`` x ``height``."""
        if frames <= 0:
            raise ValueError(f"frames={frames!r} must be positive.")
        max_pixels = self.video_max_pixels
        if self.video_max_tokens is not None:
            # qwen-vl-utils' budget: 90% of the tokens, shared evenly by the frames (before padding).
            budget = int(self.video_max_tokens * self.factor * self.factor * 0.9)
            share = budget * self.temporal_patch_size // frames
            max_pixels = max(min(max_pixels, share), int(self.video_min_pixels * 1.05))
        side_h, side_w = smart_resize(
            height, width, factor=self.factor, min_pixels=self.video_min_pixels, max_pixels=max_pixels
        )
        steps = -(-frames // self.temporal_patch_size)  # the last frame repeats to fill a step
        return steps, side_h // self.patch_size, side_w // self.patch_size
