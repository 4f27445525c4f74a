"""Tiny ViT towers for tests, with the calling convention ``tower(pixel_values, grid_thw)``.

Each tower attends within an image only (like Qwen-VL towers), so an image's outputs do not depend
on which other images share its batch: the property balancing relies on.

* :class:`TensorTower`: returns one tensor, a row per merged token.
* :class:`WindowTower`: the seed's ``(pixel_embeds, window_index, deepstack_list)``, embeddings in
  window order, with ``get_window_index(grid_thw) -> (window_index, cu_window_seqlens)``.
* :class:`DictTower`: a dict with per-patch, per-merged, deepstack, integer and passthrough entries.
* :class:`BadRowsTower`: drops one output row on a chosen rank (output validation tests).
* :class:`PerImageTower`: merged tokens with rows per image besides them: a pooled vector, a
  resampler's queries and an integer count (the ``"image"`` kind).
* :func:`qwen2_vl_tower`, :func:`qwen2_5_vl_tower`, :func:`qwen3_vl_tower`: Hugging Face vision
  towers from tiny random configs (import transformers lazily).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "CHANNELS",
    "BadRowsTower",
    "DictTower",
    "GlobalTokenTower",
    "PerImageTower",
    "TensorTower",
    "WindowTower",
    "make_batch",
    "qwen2_5_vl_tower",
    "qwen2_vl_tower",
    "qwen3_vl_tower",
]

#: Pixel channels of the tiny towers: 3 colours x 2x2 patch x temporal patch 1, as in the HF configs below.
CHANNELS = 12


class _Core(nn.Module):
    """Patch embedding and one single-head self-attention layer applied per image."""

    def __init__(self, channels: int, dim: int, merge: int) -> None:
        super().__init__()
        self.spatial_merge_size = merge
        self.embed = nn.Linear(channels, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(pixel_values)  # [S, D]
        counts = (grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).tolist()
        outputs = []
        for image in torch.split(hidden, counts):
            q, k, v = self.qkv(image).chunk(3, dim=-1)
            attention = torch.softmax(q @ k.T / q.shape[-1] ** 0.5, dim=-1)
            outputs.append(image + self.proj(attention @ v))
        return self.norm(torch.cat(outputs))  # [S, D]


class TensorTower(nn.Module):
    """Returns ``[S / merge**2, out_dim]``: one row per merged token."""

    def __init__(self, channels: int = CHANNELS, dim: int = 16, out_dim: int = 24, merge: int = 2) -> None:
        super().__init__()
        self.core = _Core(channels, dim, merge)
        self.spatial_merge_size = merge
        self.merger = nn.Linear(dim * merge * merge, out_dim)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        hidden = self.core.encode(pixel_values, grid_thw)
        return self.merger(hidden.reshape(-1, hidden.shape[-1] * self.spatial_merge_size**2))


def _window_index(grid_thw: torch.Tensor, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    indices = []
    cu_seqlens = [0]
    offset = 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        units = torch.arange(t * gh * gw).reshape(t, gh, gw)
        for frame in units:
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    block = frame[r : r + window, c : c + window].reshape(-1)
                    indices.append(block + offset)
                    cu_seqlens.append(cu_seqlens[-1] + block.numel() * merge * merge)
        offset += t * gh * gw
    index = torch.cat(indices) if indices else torch.zeros(0, dtype=torch.long)
    return index.to(grid_thw.device), cu_seqlens


class WindowTower(nn.Module):
    """The seed's output: ``(embeds in window order, window_index, [deepstack layers])``."""

    def __init__(
        self, channels: int = CHANNELS, dim: int = 16, out_dim: int = 24, merge: int = 2, deepstack: int = 3
    ) -> None:
        super().__init__()
        self.core = _Core(channels, dim, merge)
        self.spatial_merge_size = merge
        self.window = 2
        self.merger = nn.Linear(dim * merge * merge, out_dim)
        self.deepstack = nn.ModuleList(nn.Linear(dim * merge * merge, out_dim) for _ in range(deepstack))

    def get_window_index(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        return _window_index(grid_thw, self.spatial_merge_size, self.window)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[Any, ...]:
        hidden = self.core.encode(pixel_values, grid_thw)
        units = hidden.reshape(-1, hidden.shape[-1] * self.spatial_merge_size**2)  # [S/m^2, m^2 D]
        window_index, _ = self.get_window_index(grid_thw)
        embeds = self.merger(units)[window_index]
        return embeds, window_index, [layer(units) for layer in self.deepstack]


class DictTower(nn.Module):
    """A dict: ``patch_embeds``, ``merged``, ``deepstack`` (list), ``patch_ids`` (int64, optional),
    ``extra`` (None) and ``merge`` (an int)."""

    def __init__(
        self,
        channels: int = CHANNELS,
        dim: int = 16,
        out_dim: int = 24,
        merge: int = 2,
        int_output: bool = True,
    ) -> None:
        super().__init__()
        self.core = _Core(channels, dim, merge)
        self.config = type("Config", (), {"spatial_merge_size": merge})()
        self.merger = nn.Linear(dim * merge * merge, out_dim)
        self.deep = nn.Linear(dim * merge * merge, out_dim)
        self.int_output = int_output

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> dict[str, Any]:
        merge = self.config.spatial_merge_size
        hidden = self.core.encode(pixel_values, grid_thw)
        units = hidden.reshape(-1, hidden.shape[-1] * merge**2)
        out: dict[str, Any] = {
            "patch_embeds": hidden,
            "merged": self.merger(units),
            "deepstack": [self.deep(units), 2 * self.deep(units)],
        }
        if self.int_output:
            out["patch_ids"] = hidden.argmax(dim=-1)
        out["extra"] = None
        out["merge"] = merge
        return out


class MergedOnly(nn.Module):
    """A :class:`DictTower`'s ``merged`` output alone (the caller's way to leave the rest out)."""

    def __init__(self, tower: DictTower) -> None:
        super().__init__()
        self.tower = tower
        self.config = tower.config

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.tower(pixel_values, grid_thw)["merged"]


class GlobalTokenTower(TensorTower):
    """``{"tokens": [S / merge**2, D], "global": [1, D]}``: a learned token per batch, not per image.

    The rows of ``"global"`` fit no kind (or, in a batch of one merged token, look per-merged), so
    balancing it needs ``output_layout={"global": "passthrough"}``.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.global_token = nn.Parameter(torch.randn(1, self.merger.out_features))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"tokens": super().forward(pixel_values, grid_thw), "global": self.global_token * 1.0}


class PerImageTower(TensorTower):
    """``{"tokens": [S / m**2, D], "pooled": [n, D], "queries": [n, K, D], "sizes": [n] int64}``:
    each image's merged tokens, their mean projected, ``K`` learned queries attending over them
    (a resampler), and their count. The last three have a row per image, which balancing them
    needs ``output_layout`` to name (``"image"``)."""

    def __init__(self, queries: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        width = self.merger.out_features
        self.pool = nn.Linear(width, width)
        self.queries = nn.Parameter(torch.randn(queries, width))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens = super().forward(pixel_values, grid_thw)  # [S / m^2, D]
        counts = (grid_thw.prod(dim=1) // self.spatial_merge_size**2).tolist()
        pooled, queried = [], []
        for image in torch.split(tokens, counts):
            pooled.append(self.pool(image.mean(dim=0)))
            attention = torch.softmax(self.queries @ image.T / image.shape[-1] ** 0.5, dim=-1)
            queried.append(attention @ image)  # [K, D]
        return {
            "tokens": tokens,
            "pooled": torch.stack(pooled),
            "queries": torch.stack(queried),
            "sizes": torch.tensor(counts, dtype=torch.int64, device=tokens.device),
        }


class BadRowsTower(TensorTower):
    """A :class:`TensorTower` that drops its last output row on rank ``bad_rank`` (of the default group)."""

    def __init__(self, bad_rank: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bad_rank = bad_rank

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        out = super().forward(pixel_values, grid_thw)
        if dist.is_initialized() and dist.get_rank() == self.bad_rank:
            return out[:-1]
        return out


def make_batch(
    grids: list[tuple[int, int, int]],
    seed: int,
    channels: int = CHANNELS,
    dtype: torch.dtype = torch.float32,
    grid_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``pixel_values [sum(T*H*W), channels]`` and ``grid_thw [n, 3]`` for ``grids``."""
    generator = torch.Generator().manual_seed(seed)
    rows = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(rows, channels, generator=generator).to(dtype)
    grid = torch.tensor(grids, dtype=grid_dtype).reshape(-1, 3)
    return pixels, grid


def hf_towers_return_model_outputs() -> bool:
    """Whether this transformers' vision towers return a ``ModelOutput`` (5.x) rather than the
    merged tokens (4.x); the balancer takes either."""
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def merged_tokens(output: Any) -> torch.Tensor:
    """The merged-token rows of a Hugging Face tower's output, whatever its transformers version.

    transformers 5 returns a ``ModelOutput`` (``pooler_output``); 4.x returns the merged tokens
    themselves (Qwen2-VL, Qwen2.5-VL) or a tuple starting with them (Qwen3-VL, then deepstack).
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple):
        return output[0]
    return output.pooler_output


def qwen2_vl_tower() -> nn.Module:
    """Hugging Face Qwen2-VL vision tower, tiny random config (patch 2, temporal patch 1, merge 2)."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    config = Qwen2VLVisionConfig(
        depth=2, embed_dim=16, hidden_size=24, num_heads=2, in_channels=3, patch_size=2,
        temporal_patch_size=1, spatial_merge_size=2,
    )  # fmt: skip
    return Qwen2VisionTransformerPretrainedModel(config).eval()


def qwen2_5_vl_tower() -> nn.Module:
    """Hugging Face Qwen2.5-VL vision tower (windowed attention), tiny random config."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLVisionConfig(
        depth=2, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=2,
        temporal_patch_size=1, spatial_merge_size=2, out_hidden_size=24, window_size=8,
        fullatt_block_indexes=[1],
    )  # fmt: skip
    return Qwen2_5_VisionTransformerPretrainedModel(config).eval()


def qwen3_vl_tower() -> nn.Module:
    """Hugging Face Qwen3-VL vision tower with two deepstack layers, tiny random config."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    config = Qwen3VLVisionConfig(
        depth=3, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=2,
        temporal_patch_size=1, spatial_merge_size=2, out_hidden_size=24, num_position_embeddings=16,
        deepstack_visual_indexes=[0, 2],
    )  # fmt: skip
    return Qwen3VLVisionModel(config).eval()
