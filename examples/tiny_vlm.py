"""A small but real vision-language model for the demo and tests, plus a synthetic dataset.

The vision tower follows Qwen2-VL's layout so that it exercises everything the balancer handles:

* input ``pixel_values`` is ``[sum(l_i), C]`` (one row per flattened patch, ``C = 3*2*14*14`` by
  default) and ``grid_thw`` is ``[n_images, 3]`` with ``l_i = T*H*W``;
* attention stays within each image (block-diagonal by image lengths), so an image's result
  does not depend on which other images share the batch: that is what makes moving images
  between ranks exact;
* a 2x2 spatial merge turns every four consecutive patches into one token;
* optional windowed attention (Qwen2.5-VL style, returning a ``window_index``) and deepstack
  outputs (Qwen3-VL style: merged features taken from intermediate blocks).

The tower returns the seed's triple ``(pixel_embeds, window_index, deepstack_features)``.
:class:`TinyTextDecoder` consumes the merged image tokens of each sample as a prefix and predicts
the sample's text. :class:`SyntheticVLMDataset` yields samples with very uneven visual sizes:
multi-page documents and videos next to thumbnails.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "SAMPLE_KINDS",
    "SyntheticVLMDataset",
    "TinyTextDecoder",
    "TinyVisionTower",
    "collate_vlm",
    "patch_positions",
    "positive_float",
    "positive_int",
    "seed_int",
]

MERGE = 2  # spatial merge size: 2x2 patches become one token


def positive_int(text: str) -> int:
    """An argparse ``type`` for the examples' counts (steps, samples): an integer >= 1, else a
    usage error naming the flag instead of a traceback from deep inside the run."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected an integer >= 1")
    return value


def seed_int(text: str) -> int:
    """An argparse ``type`` for the examples' ``--seed``: an integer in [0, 2**32 - 1], the seeds
    Lightning's ``seed_everything`` takes (else a traceback once the models are built)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected an integer from 0 to 2**32 - 1")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type`` for the examples' scales: a finite number > 0, else a usage error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a finite number > 0")
    return value


def output_dir(text: str) -> str:
    """An argparse ``type`` for the examples' ``--output`` folders: a usage error when the path, or
    a folder above it, is an existing file (the run would end in a traceback once it had trained,
    and under torchrun leave the other ranks waiting for the one that raised)."""
    if not text:
        raise argparse.ArgumentTypeError("'' is invalid: expected a folder")
    path = Path(text)
    for existing in (path, *path.parents):
        if existing.exists():
            if not existing.is_dir():
                raise argparse.ArgumentTypeError(
                    f"{text!r} is invalid: {str(existing)!r} is a file, not a folder"
                )
            break
    return text


def patch_positions(grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every patch, in Qwen2-VL's patch order.

    Qwen2-VL's processor emits the patches of each 2x2 merge block consecutively
    (order ``t, h/2, w/2, 2, 2``), so the merge is a plain reshape of four rows.

    Args:
        grid_thw: ``[n_images, 3]`` integer grid rows.

    Returns:
        ``(rows, cols)``, each ``[sum(l_i)]`` long.
    """
    rows, cols = [], []
    for t, h, w in grid_thw.tolist():
        hh = torch.arange(h).view(h // MERGE, MERGE, 1, 1).expand(h // MERGE, MERGE, w // MERGE, MERGE)
        ww = torch.arange(w).view(1, 1, w // MERGE, MERGE).expand(h // MERGE, MERGE, w // MERGE, MERGE)
        # [h/2, 2, w/2, 2] -> [h/2, w/2, 2, 2]: the merge-block order
        rows.append(hh.permute(0, 2, 1, 3).reshape(-1).repeat(t))
        cols.append(ww.permute(0, 2, 1, 3).reshape(-1).repeat(t))
    if not rows:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    return torch.cat(rows), torch.cat(cols)


class _Block(nn.Module):
    """Pre-norm transformer block whose attention runs separately on each segment of rows."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, segment_lengths: Sequence[int]) -> torch.Tensor:
        """Args: x ``[N, D]``; segment_lengths sum to ``N`` (images or windows)."""
        d = x.shape[1]
        head_dim = d // self.num_heads
        qkv = self.qkv(self.norm1(x))  # [N, 3D]
        outs = []
        for seg in torch.split(qkv, list(segment_lengths)):
            # [l, 3, H, hd] -> 3 x [1, H, l, hd]
            q, k, v = seg.view(-1, 3, self.num_heads, head_dim).permute(1, 2, 0, 3).unsqueeze(1)
            out = F.scaled_dot_product_attention(q, k, v)  # [1, H, l, hd]
            outs.append(out.squeeze(0).permute(1, 0, 2).reshape(-1, d))
        attn = torch.cat(outs) if outs else qkv.new_zeros(0, d)
        x = x + self.proj(attn)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    """2x2 spatial merge: four consecutive patch rows -> one token of ``out_dim``."""

    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim * MERGE * MERGE, dim * MERGE), nn.GELU(), nn.Linear(dim * MERGE, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[sum(l_i), D]`` -> ``[sum(l_i) / 4, out_dim]``."""
        return self.mlp(self.norm(x).reshape(-1, x.shape[-1] * MERGE * MERGE))


class TinyVisionTower(nn.Module):
    """A Qwen2-VL style vision encoder, small enough for CPU.

    Args:
        patch_dim: Features per flattened patch, ``in_channels * temporal_patch * patch**2``
            (Qwen2-VL: ``3 * 2 * 14 * 14 = 1176``).
        embed_dim: Width of the transformer blocks.
        depth: Number of blocks.
        num_heads: Attention heads.
        mlp_ratio: MLP width / ``embed_dim``.
        out_dim: Width of the merged output tokens (the text decoder's width).
        window_layers: Blocks that attend within windows of ``window_size x window_size`` merged
            tokens instead of the whole image (Qwen2.5-VL). The tower then returns a
            ``window_index`` (the window order of the merged tokens), else ``None``.
        window_size: Window side, in merged tokens.
        deepstack_layers: Blocks whose output is merged and returned as a deepstack feature
            (Qwen3-VL), one ``[sum(l_i) / 4, out_dim]`` tensor per listed block.
        max_side: Largest grid height or width, in patches (size of the position tables).
    """

    def __init__(
        self,
        *,
        patch_dim: int = 3 * 2 * 14 * 14,
        embed_dim: int = 64,
        depth: int = 4,
        num_heads: int = 4,
        mlp_ratio: float = 2.0,
        out_dim: int = 64,
        window_layers: Sequence[int] = (),
        window_size: int = 4,
        deepstack_layers: Sequence[int] = (),
        max_side: int = 256,
    ) -> None:
        super().__init__()
        for name, layers in (("window_layers", window_layers), ("deepstack_layers", deepstack_layers)):
            if any(not 0 <= i < depth for i in layers):
                raise ValueError(f"{name}={tuple(layers)!r} must lie in [0, depth={depth}).")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}.")
        self.patch_dim = patch_dim
        self.spatial_merge_size = MERGE  # read by the balancer to route merged-token outputs
        self.embed_dim = embed_dim
        self.depth = depth
        self.mlp_ratio = mlp_ratio
        self.window_layers = tuple(sorted(set(window_layers)))
        self.window_size = window_size
        self.deepstack_layers = tuple(deepstack_layers)
        self.max_side = max_side
        self.patch_embed = nn.Linear(patch_dim, embed_dim, bias=False)
        self.row_embed = nn.Embedding(max_side, embed_dim)
        self.col_embed = nn.Embedding(max_side, embed_dim)
        self.blocks = nn.ModuleList(_Block(embed_dim, num_heads, mlp_ratio) for _ in range(depth))
        self.merger = _Merger(embed_dim, out_dim)
        self.deepstack_mergers = nn.ModuleList(_Merger(embed_dim, out_dim) for _ in self.deepstack_layers)

    def get_window_index(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Window order of the merged tokens, as Qwen2.5-VL's ``get_window_index``.

        Args:
            grid_thw: ``[n_images, 3]``.

        Returns:
            ``(window_index, cu_window_seqlens)``: ``window_index`` ``[sum(l_i) / 4]`` lists the
            merged tokens of all images window by window; ``cu_window_seqlens`` ``[n_windows + 1]``
            are the cumulative window lengths in patches.
        """
        indexes, window_patches = [], [0]
        offset = 0
        for t, h, w in grid_thw.tolist():
            hm, wm = h // MERGE, w // MERGE
            tokens = torch.arange(t * hm * wm).view(t, hm, wm)
            for frame in tokens:
                for y in range(0, hm, self.window_size):
                    for x in range(0, wm, self.window_size):
                        window = frame[y : y + self.window_size, x : x + self.window_size].reshape(-1)
                        indexes.append(window + offset)
                        window_patches.append(window.numel() * MERGE * MERGE)
            offset += t * hm * wm
        window_index = torch.cat(indexes) if indexes else torch.zeros(0, dtype=torch.long)
        return window_index, torch.tensor(window_patches).cumsum(0)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """Encode a batch of images.

        Args:
            pixel_values: ``[sum(l_i), patch_dim]``.
            grid_thw: ``[n_images, 3]``, ``H`` and ``W`` even.

        Returns:
            ``(pixel_embeds [sum(l_i)/4, out_dim], window_index [sum(l_i)/4] or None,
            deepstack_features: list of [sum(l_i)/4, out_dim])``, rows in input image order.
        """
        grid_thw = grid_thw.to(device="cpu", dtype=torch.long)
        image_lengths = grid_thw.prod(-1).tolist()
        if pixel_values.shape != (sum(image_lengths), self.patch_dim):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, expected "
                f"({sum(image_lengths)}, {self.patch_dim}) for grid_thw={grid_thw.tolist()}."
            )
        rows, cols = patch_positions(grid_thw)
        device = pixel_values.device
        x = self.patch_embed(pixel_values)  # [sum(l_i), D]
        x = x + self.row_embed(rows.to(device)) + self.col_embed(cols.to(device))

        window_index = None
        if self.window_layers:
            window_index, cu_window = self.get_window_index(grid_thw)
            window_lengths = cu_window.diff().tolist()
            # merged-token order -> patch order: each merged token is 4 consecutive patches
            patch_order = (window_index[:, None] * MERGE * MERGE + torch.arange(MERGE * MERGE)).reshape(-1)
            patch_order = patch_order.to(device)
            inverse_order = torch.argsort(patch_order)

        deepstack: list[torch.Tensor] = []
        for layer, block in enumerate(self.blocks):
            if layer in self.window_layers:
                x = block(x[patch_order], window_lengths)[inverse_order]
            else:
                x = block(x, image_lengths)
            if layer in self.deepstack_layers:
                deepstack.append(self.deepstack_mergers[self.deepstack_layers.index(layer)](x))
        pixel_embeds = self.merger(x)
        if window_index is not None:
            window_index = window_index.to(device)
        return pixel_embeds, window_index, deepstack


class TinyTextDecoder(nn.Module):
    """A tiny causal decoder: each sample's merged image tokens form a prefix to its text.

    Deepstack features (if any) are added to the image positions after the first blocks, one
    feature layer per block, as Qwen3-VL does.

    Args:
        vocab_size: Text vocabulary.
        dim: Width (equal to the tower's ``out_dim``).
        depth: Number of blocks.
        num_heads: Attention heads.
    """

    def __init__(self, *, vocab_size: int = 256, dim: int = 64, depth: int = 2, num_heads: int = 4) -> None:
        super().__init__()
        self.token_embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim, num_heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(
        self,
        image_tokens: torch.Tensor,
        tokens_per_sample: Sequence[int],
        input_ids: torch.Tensor,
        deepstack: Sequence[torch.Tensor] = (),
    ) -> torch.Tensor:
        """Next-token loss on the text.

        Args:
            image_tokens: ``[sum(tokens_per_sample), dim]`` merged image tokens of the batch.
            tokens_per_sample: Image tokens of each sample (0 for a text-only sample).
            input_ids: ``[batch, text_len]``.
            deepstack: Extra image-token features, each shaped like ``image_tokens``.

        Returns:
            Mean cross-entropy over the predicted text tokens (a scalar).
        """
        batch, text_len = input_ids.shape
        prefix = max(tokens_per_sample, default=0)
        dim = self.token_embed.embedding_dim
        seq_len = prefix + text_len
        # Right-align each sample's image prefix so that its text always starts at `prefix`.
        image_slots = torch.zeros(batch, seq_len, dtype=torch.bool, device=input_ids.device)
        for b, n in enumerate(tokens_per_sample):
            image_slots[b, prefix - n : prefix] = True
        flat_slots = image_slots.view(-1).nonzero().squeeze(1)  # [sum(tokens_per_sample)]

        def scatter_image(hidden: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
            return hidden.view(-1, dim).index_add(0, flat_slots, features).view(batch, seq_len, dim)

        hidden = image_tokens.new_zeros(batch, seq_len, dim)
        hidden[:, prefix:] = self.token_embed(input_ids)
        hidden = scatter_image(hidden, image_tokens)
        # Empty prefix slots stay zero vectors (a left padding the model learns to ignore); a key
        # padding mask would leave fully masked rows under the causal mask.
        causal = nn.Transformer.generate_square_subsequent_mask(seq_len, device=hidden.device)
        for layer, block in enumerate(self.blocks):
            hidden = block(hidden, src_mask=causal, is_causal=True)
            if layer < len(deepstack):
                hidden = scatter_image(hidden, deepstack[layer])
        logits = self.head(self.norm(hidden[:, prefix:-1]))  # predict token t+1 from t
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))


@dataclass(frozen=True)
class _Kind:
    name: str
    weight: float


# What a sample carries. The heavy kinds (multi-page documents, videos) are rare, so in each
# step some ranks hold far more ViT work than others: the imbalance the balancer removes.
SAMPLE_KINDS: tuple[_Kind, ...] = (
    _Kind("thumbnails", 0.45),  # 1-3 small images
    _Kind("photo", 0.25),  # one medium image
    _Kind("document", 0.18),  # 2-4 high-resolution pages
    _Kind("video", 0.12),  # several temporal patches of a medium frame
)


class SyntheticVLMDataset(torch.utils.data.Dataset):
    """Deterministic synthetic samples with very uneven image and video sizes.

    Sample ``i`` depends only on ``(seed, i)``, so every run and every rank sees the same data.

    Args:
        num_samples: Dataset length.
        patch_dim: Features per flattened patch (must match the tower).
        scale: Multiplies every image side (in merge blocks); lower it for faster tests.
        vocab_size: Text vocabulary.
        text_len: Text tokens per sample.
        seed: Seed of the per-sample generators.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        patch_dim: int = 3 * 2 * 14 * 14,
        scale: float = 1.0,
        vocab_size: int = 256,
        text_len: int = 24,
        seed: int = 0,
    ) -> None:
        self.num_samples = num_samples
        self.patch_dim = patch_dim
        self.scale = scale
        self.vocab_size = vocab_size
        self.text_len = text_len
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def _side(self, gen: torch.Generator, low: int, high: int) -> int:
        """An even side length in patches, ``low..high`` merge blocks scaled by ``scale``."""
        blocks = int(torch.randint(low, high + 1, (1,), generator=gen))
        return MERGE * max(1, math.ceil(blocks * self.scale))

    def grids(self, index: int) -> tuple[str, list[tuple[int, int, int]]]:
        """The sample's kind and its ``(T, H, W)`` grid rows, without drawing pixels."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        weights = torch.tensor([k.weight for k in SAMPLE_KINDS])
        kind = SAMPLE_KINDS[int(torch.multinomial(weights, 1, generator=gen))].name
        if kind == "thumbnails":
            count = int(torch.randint(1, 4, (1,), generator=gen))
            return kind, [(1, self._side(gen, 2, 4), self._side(gen, 2, 4)) for _ in range(count)]
        if kind == "photo":
            return kind, [(1, self._side(gen, 5, 8), self._side(gen, 5, 8))]
        if kind == "document":
            pages = int(torch.randint(3, 7, (1,), generator=gen))
            return kind, [(1, self._side(gen, 11, 14), self._side(gen, 8, 11)) for _ in range(pages)]
        frames = int(torch.randint(2, 4, (1,), generator=gen))
        return kind, [(frames, self._side(gen, 6, 8), self._side(gen, 8, 10))]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        _, grids = self.grids(index)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 7919)
        grid_thw = torch.tensor(grids, dtype=torch.long)  # [n, 3]
        num_patches = int(grid_thw.prod(-1).sum())
        pixel_values = torch.randn(num_patches, self.patch_dim, generator=gen)  # [sum(l_i), C]
        # A learnable text: an arithmetic sequence whose start and step depend on the sample.
        start, step = (int(v) for v in torch.randint(0, self.vocab_size, (2,), generator=gen))
        input_ids = (start + (step | 1) * torch.arange(self.text_len)) % self.vocab_size
        return {"pixel_values": pixel_values, "image_grid_thw": grid_thw, "input_ids": input_ids}


def collate_vlm(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate the patches and grid rows of a batch; stack the texts.

    Returns:
        ``pixel_values [sum(l_i), C]``, ``image_grid_thw [n_images, 3]``, ``input_ids [B, L]``
        and ``images_per_sample [B]`` (to give each sample its image tokens back).
    """
    return {
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples]),
        "input_ids": torch.stack([s["input_ids"] for s in samples]),
        "images_per_sample": torch.tensor([len(s["image_grid_thw"]) for s in samples]),
    }
