"""Cost models: how much ViT work one image is, from its patch count.

The seed estimates an image with ``l = T*H*W`` patches at ``l**2`` (self-attention). That ignores
the per-patch work of the MLP and projections, which dominates below a few thousand patches, and
it overestimates windowed attention (Qwen2.5-VL), whose cost grows with ``l * window``. The one
model here covers all three::

    cost(l) = quadratic * l**2 + windowed * l * min(l, window_patches) + linear * l + constant

Its coefficients come from the seed's default, from a ViT's shape (FLOPs per layer), or from a
least-squares fit to measured timings.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_vit_balance.config import ViTBalanceConfig, _check_int, _check_number

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel:
    """``quadratic*l**2 + windowed*l*min(l, window_patches) + linear*l + constant`` per image.

    A plain callable on patch counts: ``model(4096)`` gives a float, ``model(np.array([...]))``
    an array of float64 costs, vectorised.

    Args:
        quadratic: Coefficient of ``l**2`` (full self-attention).
        linear: Coefficient of ``l`` (MLP, projections, patch embedding).
        constant: Fixed cost per image.
        windowed: Coefficient of ``l * min(l, window_patches)`` (windowed self-attention).
        window_patches: Patches per attention window; 0 when no layer uses windows.
    """

    quadratic: float = 1.0
    linear: float = 0.0
    constant: float = 0.0
    windowed: float = 0.0
    window_patches: int = 0

    def __post_init__(self) -> None:
        for name in ("quadratic", "linear", "constant", "windowed"):
            _check_number(name, getattr(self, name), ">= 0", lambda v: v >= 0, owner="CostModel")
        _check_int("window_patches", self.window_patches, 0, owner="CostModel")

    def __call__(self, patch_counts: Any) -> Any:
        """Cost of images with ``patch_counts`` patches (a number or an array-like, float64)."""
        counts = np.asarray(patch_counts, dtype=np.float64)
        cost = (self.quadratic * counts + self.linear) * counts + self.constant
        if self.windowed:
            cost = cost + self.windowed * counts * np.minimum(counts, float(self.window_patches))
        return float(cost) if cost.ndim == 0 else cost

    @classmethod
    def from_config(cls, config: ViTBalanceConfig) -> CostModel:
        """The model described by a config's ``cost_*`` fields."""
        return cls(
            quadratic=config.cost_quadratic,
            linear=config.cost_linear,
            constant=config.cost_constant,
            windowed=config.cost_windowed,
            window_patches=config.cost_window_patches,
        )

    def to_config(self, config: ViTBalanceConfig | None = None) -> ViTBalanceConfig:
        """``config`` (default: a default config) with its ``cost_*`` fields set to this model."""
        return dataclasses.replace(
            config if config is not None else ViTBalanceConfig(),
            cost_quadratic=float(self.quadratic),
            cost_linear=float(self.linear),
            cost_constant=float(self.constant),
            cost_windowed=float(self.windowed),
            cost_window_patches=int(self.window_patches),
        )

    @classmethod
    def from_vit_shape(
        cls,
        *,
        hidden_size: int,
        depth: int,
        intermediate_size: int | None = None,
        mlp_ratio: float = 4.0,
        gated_mlp: bool = False,
        patch_input_dim: int = 0,
        window_layers: Iterable[int] = (),
        window_patches: int = 0,
    ) -> CostModel:
        """FLOPs of a pre-norm ViT forward per image, as a cost model.

        Per layer and patch, the projections cost ``2 * 4 * d**2`` and the MLP ``2 * k * d * m``
        (``k`` = 2, or 3 for a gated MLP); full attention costs ``4 * d * l`` more per patch (scores
        and weighted sum), windowed attention ``4 * d * min(l, window)``.

        Args:
            hidden_size: Width ``d`` of the transformer blocks.
            depth: Number of blocks.
            intermediate_size: MLP width ``m``; defaults to ``hidden_size * mlp_ratio``.
            mlp_ratio: Used when ``intermediate_size`` is not given.
            gated_mlp: The MLP has a gate projection (SwiGLU, as in Qwen2.5-VL).
            patch_input_dim: Input features per patch of the patch embedding (e.g. 3*2*14*14).
            window_layers: Indices of blocks that use windowed attention.
            window_patches: Patches per attention window in those blocks.
        """
        if hidden_size <= 0 or depth <= 0:
            raise ValueError(
                f"from_vit_shape needs hidden_size > 0 and depth > 0, got hidden_size={hidden_size!r}, "
                f"depth={depth!r}."
            )
        windowed_layers = sorted({int(i) for i in window_layers})
        if any(not 0 <= i < depth for i in windowed_layers):
            raise ValueError(f"window_layers={windowed_layers!r} must lie in [0, depth={depth}).")
        if windowed_layers and window_patches <= 0:
            raise ValueError(
                f"window_patches={window_patches!r} must be > 0 when window_layers={windowed_layers!r}."
            )
        mlp_width = intermediate_size if intermediate_size is not None else round(hidden_size * mlp_ratio)
        mlp_mats = 3 if gated_mlp else 2
        per_layer_linear = 2.0 * (4 * hidden_size**2 + mlp_mats * hidden_size * mlp_width)
        full_layers = depth - len(windowed_layers)
        return cls(
            quadratic=4.0 * hidden_size * full_layers,
            linear=depth * per_layer_linear + 2.0 * patch_input_dim * hidden_size,
            constant=0.0,
            windowed=4.0 * hidden_size * len(windowed_layers),
            window_patches=int(window_patches) if windowed_layers else 0,
        )

    @classmethod
    def from_vit(cls, vit: Any) -> CostModel:
        """Derive the model from a Hugging Face style vision tower's ``config``.

        Reads Qwen2-VL (``embed_dim``, ``mlp_ratio``), Qwen2.5-VL (``hidden_size``,
        ``intermediate_size``, gated MLP, ``window_size`` in pixels with ``fullatt_block_indexes``)
        and Qwen3-VL (``hidden_size``, ``intermediate_size``) vision configs.

        Raises:
            ValueError: when ``vit`` has no config with a width and a depth; use
                :meth:`from_vit_shape` then.
        """
        config = getattr(vit, "config", None)
        width = getattr(config, "embed_dim", None) or getattr(config, "hidden_size", None)
        depth = getattr(config, "depth", None) or getattr(config, "num_hidden_layers", None)
        if config is None or not width or not depth:
            raise ValueError(
                f"CostModel.from_vit: {type(vit).__name__} has no `config` with a hidden size and a "
                "depth; build the model with CostModel.from_vit_shape(...) instead."
            )
        patch = int(getattr(config, "patch_size", 14))
        in_dim = int(getattr(config, "in_channels", 3)) * int(getattr(config, "temporal_patch_size", 2))
        full_indexes = getattr(config, "fullatt_block_indexes", None)
        window_px = getattr(config, "window_size", None)
        window_layers: list[int] = []
        window_patches = 0
        if full_indexes is not None and window_px:
            window_layers = [i for i in range(depth) if i not in set(full_indexes)]
            window_patches = (int(window_px) // patch) ** 2
        return cls.from_vit_shape(
            hidden_size=int(width),
            depth=int(depth),
            intermediate_size=getattr(config, "intermediate_size", None),
            mlp_ratio=float(getattr(config, "mlp_ratio", 4.0)),
            gated_mlp=full_indexes is not None,
            patch_input_dim=in_dim * patch * patch,
            window_layers=window_layers,
            window_patches=window_patches,
        )

    @classmethod
    def fit(
        cls, patch_counts: Sequence[float], seconds: Sequence[float], *, window_patches: int = 0
    ) -> CostModel:
        """Least-squares fit with non-negative coefficients to measured per-image ViT times.

        Args:
            patch_counts: Patches of each timed image (or batch of equal images).
            seconds: Measured forward (or forward+backward) time of each.
            window_patches: Also fit a windowed-attention term with this window, when > 0.

        Returns:
            The best fit among all subsets of terms whose coefficients are all non-negative.
        """
        counts = np.asarray(patch_counts, dtype=np.float64)
        times = np.asarray(seconds, dtype=np.float64)
        if counts.ndim != 1 or counts.shape != times.shape or counts.size < 2:
            raise ValueError(
                "CostModel.fit needs two 1-D sequences of the same length >= 2, got "
                f"patch_counts shape {counts.shape} and seconds shape {times.shape}."
            )
        columns = {"quadratic": counts**2, "linear": counts, "constant": np.ones_like(counts)}
        if window_patches > 0:
            columns["windowed"] = counts * np.minimum(counts, float(window_patches))
        # Scale columns to unit norm so the least-squares problem is well conditioned.
        scales = {name: float(np.linalg.norm(col)) or 1.0 for name, col in columns.items()}
        best: tuple[float, dict[str, float]] | None = None
        names = list(columns)
        for size in range(1, len(names) + 1):
            for subset in itertools.combinations(names, size):
                matrix = np.stack([columns[n] / scales[n] for n in subset], axis=1)
                coef, *_ = np.linalg.lstsq(matrix, times, rcond=None)
                if np.any(coef < 0):
                    continue
                residual = float(np.sum((matrix @ coef - times) ** 2))
                if best is None or residual < best[0] - 1e-15:
                    best = (residual, {n: float(c) / scales[n] for n, c in zip(subset, coef)})
        fitted = best[1] if best is not None else {"linear": float(np.sum(times) / np.sum(counts))}
        return cls(
            quadratic=fitted.get("quadratic", 0.0),
            linear=fitted.get("linear", 0.0),
            constant=fitted.get("constant", 0.0),
            windowed=fitted.get("windowed", 0.0),
            window_patches=window_patches if "windowed" in fitted else 0,
        )
