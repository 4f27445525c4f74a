"""Cost models: how much ViT work one image is, from its patch count.

The seed estimates an image with ``l = T*H*W`` patches at ``l**2`` (self-attention). That ignores
the per-patch work of the MLP and projections, which dominates below a few thousand patches, and
it overestimates windowed attention (Qwen2.5-VL), whose cost grows with ``l * window``. The one
model here covers all three::

    cost(l) = quadratic * l**2 + windowed * l * min(l, window_patches) + linear * l + constant

Videos: Hugging Face's Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers attend within each temporal step
of a video (``T`` segments of ``H*W`` patches), not over all ``l = T*H*W`` patches at once, so
with ``per_frame_attention`` an item of ``T`` steps costs::

    quadratic * l**2 / T + windowed * l * min(l / T, window_patches) + linear * l + constant

Its coefficients come from the seed's default, from a ViT's shape (FLOPs per layer), or from a
least-squares fit to measured timings.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import math
import numbers
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_vit_balance.config import (
    ViTBalanceConfig,
    check_int,
    check_number,
    require_config,
    require_flag,
    stable_digest,
)

__all__ = ["CostCalibrator", "CostModel", "pixel_row_factors"]


@dataclass(frozen=True)
class CostModel:
    """``quadratic*l**2 + windowed*l*min(l, window_patches) + linear*l + constant`` per image.

    A plain callable on patch counts: ``model(4096)`` gives a float, ``model(np.array([...]))``
    an array of float64 costs, vectorised. ``model(counts, frames=steps)`` gives the temporal
    steps ``T`` of each item; they count only when ``per_frame_attention`` is set, and then an item
    costs ``quadratic*l**2/T + windowed*l*min(l/T, window_patches) + linear*l + constant``
    (attention within each of its ``T`` steps of ``l/T`` patches).

    Args:
        quadratic: Coefficient of ``l**2`` (full self-attention).
        linear: Coefficient of ``l`` (MLP, projections, patch embedding).
        constant: Fixed cost per image.
        windowed: Coefficient of ``l * min(l, window_patches)`` (windowed self-attention).
        window_patches: Patches per attention window; 0 when no layer uses windows.
        per_frame_attention: Attention (full and windowed) runs within each temporal step of a
            video, as in Hugging Face's Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers; ``False`` (the
            seed's model): over the whole item.
    """

    quadratic: float = 1.0
    linear: float = 0.0
    constant: float = 0.0
    windowed: float = 0.0
    window_patches: int = 0
    per_frame_attention: bool = False

    def __post_init__(self) -> None:
        for name in ("quadratic", "linear", "constant", "windowed"):
            check_number(name, getattr(self, name), ">= 0", lambda v: v >= 0, owner="CostModel")
            # Plain floats (numpy's ``float64`` passes as a float): checkpoints of the model then
            # load with ``torch.load(weights_only=True)``.
            object.__setattr__(self, name, float(getattr(self, name)))
        check_int("window_patches", self.window_patches, 0, owner="CostModel")
        object.__setattr__(self, "window_patches", int(self.window_patches))
        if self.windowed > 0 and self.window_patches == 0:  # every windowed cost would be 0
            raise ValueError(
                f"CostModel.window_patches=0 is invalid with windowed={self.windowed!r}: expected a "
                "window > 0 (patches), or windowed=0."
            )
        if not isinstance(self.per_frame_attention, bool):
            raise ValueError(
                f"CostModel.per_frame_attention={self.per_frame_attention!r} is invalid: expected a bool."
            )

    def __call__(self, patch_counts: Any, frames: Any = None) -> Any:
        """Cost of images with ``patch_counts`` patches (a number or an array-like, float64).

        Args:
            patch_counts: ``l = T*H*W`` of each item.
            frames: ``T`` of each item, the same shape as ``patch_counts``; ``None``: 1 each. Used
                only when :attr:`per_frame_attention` is set.

        Raises:
            ValueError: ``patch_counts`` holds a value that is not a finite number >= 0, or
                ``frames`` has another shape or a value that is not a finite number > 0.
        """
        counts = _patch_counts(patch_counts)
        # Patches that attend to each other: a temporal step's, or the whole item's.
        span = counts if frames is None or not self.per_frame_attention else counts / _steps(frames, counts)
        cost = (self.quadratic * span + self.linear) * counts + self.constant
        if self.windowed:
            cost = cost + self.windowed * counts * np.minimum(span, float(self.window_patches))
        return float(cost) if cost.ndim == 0 else cost

    def costs(self, patch_counts: Sequence[int], frames: Sequence[int] | None = None) -> list[float]:
        """:meth:`__call__` on a short list of validated counts, in plain Python.

        The same floats as the array call (the same IEEE operations in the same order), without
        numpy's per-call overhead: a few microseconds, which is most of a plan for a few ranks.

        Args:
            patch_counts: ``l = T*H*W`` of each item, positive ints.
            frames: ``T`` of each item, positive ints, as many; ``None``: 1 each.
        """
        quadratic, linear, constant = float(self.quadratic), float(self.linear), float(self.constant)
        windowed, window = float(self.windowed), float(self.window_patches)
        # Each expression is the array call's, term by term (``n`` converts to float exactly).
        if frames is None or not self.per_frame_attention:
            if not windowed:
                return [(quadratic * n + linear) * n + constant for n in patch_counts]
            return [
                (quadratic * n + linear) * n + constant + windowed * n * min(n, window) for n in patch_counts
            ]
        spans = [n / t for n, t in zip(patch_counts, frames)]
        if not windowed:
            return [(quadratic * s + linear) * n + constant for s, n in zip(spans, patch_counts)]
        return [
            (quadratic * s + linear) * n + constant + windowed * n * min(s, window)
            for s, n in zip(spans, patch_counts)
        ]

    @classmethod
    def from_config(cls, config: ViTBalanceConfig) -> CostModel:
        """The model described by a config's ``cost_*`` fields."""
        if not isinstance(config, ViTBalanceConfig):
            raise TypeError(
                f"CostModel.from_config(config={config!r}) is invalid: expected a ViTBalanceConfig."
            )
        return cls(
            quadratic=config.cost_quadratic,
            linear=config.cost_linear,
            constant=config.cost_constant,
            windowed=config.cost_windowed,
            window_patches=config.cost_window_patches,
            per_frame_attention=config.cost_per_frame_attention,
        )

    def to_config(self, config: ViTBalanceConfig | None = None) -> ViTBalanceConfig:
        """``config`` (default: a default config) with its ``cost_*`` fields set to this model."""
        require_config("CostModel.to_config", config)
        return dataclasses.replace(
            config if config is not None else ViTBalanceConfig(),
            cost_quadratic=float(self.quadratic),
            cost_linear=float(self.linear),
            cost_constant=float(self.constant),
            cost_windowed=float(self.windowed),
            cost_window_patches=int(self.window_patches),
            cost_per_frame_attention=bool(self.per_frame_attention),
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
        per_frame_attention: bool = False,
        kv_size: int | None = None,
    ) -> CostModel:
        """FLOPs of a pre-norm ViT forward per image, as a cost model.

        Per layer and patch, the projections cost ``2 * (2 * d**2 + 2 * d * kv)`` (query and output
        ``d`` wide, key and value ``kv``) and the MLP ``2 * k * d * m`` (``k`` = 2, or 3 for a gated
        MLP); full attention costs ``4 * d * l`` more per patch (scores and weighted sum over every
        query head), windowed attention ``4 * d * min(l, window)``.

        Args:
            hidden_size: Width ``d`` of the transformer blocks.
            depth: Number of blocks.
            intermediate_size: MLP width ``m``; defaults to ``hidden_size * mlp_ratio``.
            mlp_ratio: Used when ``intermediate_size`` is not given.
            gated_mlp: The MLP has a gate projection (SwiGLU, as in Qwen2.5-VL).
            patch_input_dim: Input features per patch of the patch embedding (e.g. 3*2*14*14).
            window_layers: Indices of blocks that use windowed attention.
            window_patches: Patches per attention window in those blocks.
            per_frame_attention: Attention runs within each temporal step of a video (see
                :attr:`per_frame_attention`).
            kv_size: Width ``kv`` of the key and the value projections: ``num_key_value_heads *
                head_dim`` under grouped-query attention (EXAONE 4.5's tower); ``None``: ``d``.
        """
        windowed_layers = sorted({int(i) for i in window_layers})
        _check_vit_shape(hidden_size, depth, windowed_layers, window_patches, kv_size)
        _check_widths(intermediate_size, mlp_ratio, patch_input_dim)
        kv_width = hidden_size if kv_size is None else kv_size
        mlp_width = intermediate_size if intermediate_size is not None else round(hidden_size * mlp_ratio)
        gated = bool(gated_mlp) if isinstance(gated_mlp, np.bool_) else gated_mlp  # as it took before
        mlp_mats = 3 if require_flag("CostModel.from_vit_shape", "gated_mlp", gated) else 2
        projections = 2 * hidden_size**2 + 2 * hidden_size * kv_width
        per_layer_linear = 2.0 * (projections + mlp_mats * hidden_size * mlp_width)
        full_layers = depth - len(windowed_layers)
        return cls(
            quadratic=4.0 * hidden_size * full_layers,
            linear=depth * per_layer_linear + 2.0 * patch_input_dim * hidden_size,
            constant=0.0,
            windowed=4.0 * hidden_size * len(windowed_layers),
            window_patches=int(window_patches) if windowed_layers else 0,
            per_frame_attention=per_frame_attention,
        )

    @classmethod
    def from_vit(
        cls,
        vit: Any,
        *,
        window_layers: Iterable[int] | None = None,
        window_patches: int | None = None,
        per_frame_attention: bool | None = None,
    ) -> CostModel:
        """Derive the model from a vision tower: its Hugging Face ``config``, else its modules (read
        through a wrapper: DDP, DataParallel, DeepSpeed's engine, FSDP1, a checkpoint wrapper).

        With a ``config``, reads Qwen2-VL (``embed_dim``, ``mlp_ratio``), Qwen2.5-VL
        (``hidden_size``, ``intermediate_size``, gated MLP, ``window_size`` in pixels with
        ``fullatt_block_indexes``) and Qwen3-VL (``hidden_size``, ``intermediate_size``) vision
        configs, and ``num_key_value_heads`` where it is below the heads (EXAONE 4.5's grouped-query
        attention). Without one (or one lacking a width and a depth), reads the module tree:

        * every attention layer is an ``nn.Linear`` named ``*qkv*`` with ``out = in + 2 * kv``,
          ``0 < kv <= in`` (a fused projection; ``kv < in``: grouped-query attention), a ``q_proj`` /
          ``query`` / ``q`` linear (its sibling ``k_proj`` / ``key`` / ``k`` gives ``kv``), or an
          ``nn.MultiheadAttention``; their count is the depth and their input width the hidden
          size ``d``;
        * a block is the largest module holding one attention layer; its other linears from ``d`` to
          a width other than ``d`` are the MLP (two of them: a gated MLP; none: no MLP);
        * the patch embedding is the first linear (or convolution) into ``d`` from a width other
          than ``d`` and the MLP's; spatial mergers (inputs of ``merge**2 * d``) are not counted;
        * an adapter holding a ``base_layer`` (peft's LoRA) is read as that base layer.

        Which blocks attend within windows is not in the modules: a tower holding a module with a
        ``get_window_index`` (or transformers 5's ``permute_input_for_window_attn``) and no config
        saying which needs ``window_layers``; one whose config alone names them (Ovis2.5's) is
        read as attending to whole images without it.

        Whether attention runs per temporal step (:attr:`per_frame_attention`): ``True`` for
        Hugging Face's Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and -MoE) and Qwen3.5 (and -MoE) towers
        (their ``config.model_type``, on ``vit`` or on a module inside it), which split a video
        into one attention sequence per temporal step; ``False`` for any other tower, whose
        forward code cannot be read from its modules (``examples/tiny_vlm.py``'s tower, for one,
        attends over a whole video). Pass ``per_frame_attention`` to say otherwise.

        Args:
            vit: The vision tower.
            window_layers: Blocks with windowed attention, overriding the config; ``()`` for none.
            window_patches: Patches per window in the windowed blocks, overriding the config's
                (each of the two overrides alone).
            per_frame_attention: Overrides what the tower's type says (see above).

        Raises:
            ValueError: when neither the config nor the modules give a width and a depth, when
                the blocks differ, or when windows are unknown; the message says what to pass.
        """
        vit = _unwrapped(vit)
        shape = _shape_from_config(getattr(vit, "config", None)) or _shape_from_modules(vit)
        if shape is None:
            raise _no_shape(vit)
        _set_windows(vit, shape, window_layers, window_patches)
        if per_frame_attention is None:
            per_frame_attention = _attends_per_frame(vit)
        return cls.from_vit_shape(**shape, per_frame_attention=per_frame_attention)

    @classmethod
    def fit(
        cls,
        patch_counts: Sequence[float],
        seconds: Sequence[float],
        *,
        window_patches: int = 0,
        frames: Sequence[float] | None = None,
        per_frame_attention: bool | None = None,
    ) -> CostModel:
        """Least-squares fit with non-negative coefficients to measured per-image ViT times.

        Args:
            patch_counts: Patches of each timed image (or batch of equal images).
            seconds: Measured forward (or forward+backward) time of each.
            window_patches: Also fit a windowed-attention term with this window, when > 0.
            frames: Temporal steps ``T`` of each timed item (``None``: 1 each).
            per_frame_attention: Fit a per-frame model (attention terms ``l**2/T`` and
                ``l*min(l/T, window)``, see :attr:`per_frame_attention`); ``None``: when ``frames``
                are given.

        Returns:
            The best fit among all subsets of terms whose coefficients are all non-negative (the
            same floats on every machine, see :class:`CostCalibrator`).
        """
        counts = _floats("CostModel.fit", "patch_counts", patch_counts)
        times = _floats("CostModel.fit", "seconds", seconds)
        if counts.ndim != 1 or counts.shape != times.shape or counts.size < 2:
            raise ValueError(
                "CostModel.fit needs two 1-D sequences of the same length >= 2, got "
                f"patch_counts shape {counts.shape} and seconds shape {times.shape}."
            )
        _check_measurements(counts, times, window_patches)
        per_frame = frames is not None if per_frame_attention is None else per_frame_attention
        span = counts / _steps(frames, counts) if per_frame and frames is not None else counts
        columns = {"quadratic": counts * span, "linear": counts, "constant": np.ones_like(counts)}
        if window_patches > 0:
            columns["windowed"] = counts * np.minimum(span, float(window_patches))
        fitted = _nonnegative_least_squares(columns, times)
        if fitted is None:
            fitted = {"linear": math.fsum(times.tolist()) / math.fsum(counts.tolist())}
        if not any(value > 0 for value in fitted.values()):  # a model every rank's batch costs 0 in
            raise ValueError(
                f"CostModel.fit: seconds={_short(times.tolist())} give every coefficient 0: expected "
                "measured times, some > 0."
            )
        return cls._from_terms(fitted, window_patches, per_frame)

    @classmethod
    def _from_terms(
        cls, terms: Mapping[str, float], window_patches: int, per_frame_attention: bool = False
    ) -> CostModel:
        return cls(
            quadratic=terms.get("quadratic", 0.0),
            linear=terms.get("linear", 0.0),
            constant=terms.get("constant", 0.0),
            windowed=terms.get("windowed", 0.0),
            window_patches=int(window_patches) if terms.get("windowed", 0.0) > 0 else 0,
            per_frame_attention=per_frame_attention,
        )


def _check_measurements(counts: np.ndarray, times: np.ndarray, window_patches: Any) -> None:
    """:meth:`CostModel.fit`'s measurements checked: a ``ValueError`` naming the first bad one."""
    for name, values, rule in (("patch_counts", counts, counts > 0), ("seconds", times, times >= 0)):
        bad = np.flatnonzero(~(rule & np.isfinite(values)))
        if bad.size:
            raise ValueError(
                f"CostModel.fit: {name}[{bad[0]}]={float(values[bad[0]])!r} is invalid: expected a finite "
                f"number {'> 0' if name == 'patch_counts' else '>= 0'}."
            )
    if not _is_int(window_patches) or window_patches < 0:
        raise ValueError(
            f"CostModel.fit: window_patches={window_patches!r} is invalid: expected an int >= 0 (0: no "
            "windowed term)."
        )


def _patch_counts(patch_counts: Any) -> np.ndarray:
    """:meth:`CostModel.__call__`'s counts as float64, or a ValueError naming them."""
    expected = "a number or an array-like of numbers >= 0 (patches per item)"
    counts = _floats("CostModel", "patch_counts", patch_counts, expected)
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise ValueError(f"CostModel: patch_counts={_short(patch_counts)} is invalid: expected {expected}.")
    return counts


def _floats(owner: str, name: str, values: Any, expected: str = "numbers") -> np.ndarray:
    """``values`` as a float64 array, or a ValueError naming them (not NumPy's, naming a value)."""
    try:
        return np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: {name}={_short(values)} is invalid: expected {expected}.") from None


def _steps(frames: Any, counts: np.ndarray) -> np.ndarray:
    """``frames`` as float64 temporal steps, one per entry of ``counts``; raises ValueError if not."""
    expected = f"the temporal steps T (finite, > 0) of each item, shaped like the patch counts {counts.shape}"
    steps = _floats("CostModel", "frames", frames, expected)  # ragged, or not numbers: raised there
    if steps.shape != counts.shape or not (
        steps.min(initial=1.0) > 0 and math.isfinite(steps.max(initial=1.0))
    ):
        raise ValueError(f"CostModel: frames={_short(frames)} is invalid: expected {expected}.")
    return steps


def _is_int(value: Any) -> bool:
    """An integer, Python's or NumPy's (not a bool, not a float however whole)."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)  # a float tensor has an __index__ that raises
    except TypeError:
        return False
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


#: ``model_type`` of Hugging Face vision configs (and of their models' configs) whose towers attend
#: within each temporal step (``get_vision_cu_seqlens(..., merge_temporal=False)``).
_PER_FRAME_MODEL_TYPES = frozenset(
    {
        *("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"),
        *("qwen2_vl_vision", "qwen2_5_vl_vision", "qwen3_vl_vision", "qwen3_vl_moe_vision"),
        *("qwen3_5_vision", "qwen3_5_moe_vision", "qwen4_exp", "qwen4_exp_vision"),
        # Towers of the same design in transformers 5.24 (Cosmos3-Omni's is Qwen3-VL's).
        *("exaone4_5", "exaone4_5_vision", "cohere_compass", "cohere_compass_vision"),
        *("cosmos3_edge", "cosmos3_edge_vision", "qwen2_5_omni_thinker", "qwen2_5_omni_vision_encoder"),
        *("qwen3_omni_moe_thinker", "qwen3_omni_moe_vision_encoder"),
        # Under ``vision_tower``: LFM3-VL's and ERNIE-4.5-VL's; in 5.25 LLaVA-OneVision-1.5's RICE-ViT
        # (a class token per temporal step).
        *("lfm3_vl", "lfm3_vl_vision", "ernie4_5_vl_moe", "ernie4_5_vl_moe_vision"),
        *("llava_onevision1_5", "llava_onevision1_5_vision"),
        # Muse Spark's and Muse-Glimmer's (one tower, under ``vision_tower``): windows within a
        # frame, no temporal position.
        *("muse_spark", "muse_spark_vision", "muse_glimmer", "muse_glimmer_vision"),
        # Dots3-Note's (a video's T > 1 grid rows, attention and 2-D rotary positions per step).
        *("dots3_note", "dots3_note_vision_encoder"),
        # Ovis2.5's in 5.25 (under ``vision_tower``; windows and 2-D rotary positions per step).
        *("ovis2_5", "ovis2_5_vision"),
    }
)


def _no_shape(vit: Any) -> ValueError:
    """:meth:`CostModel.from_vit`'s error for a tower it cannot read."""
    return ValueError(
        f"CostModel.from_vit: {type(vit).__name__} has no `config` with a hidden size and a "
        "depth, and no attention layers in its modules (an nn.Linear named *qkv* with "
        "out_features == in_features + 2 * kv, 0 < kv <= in_features, a q_proj, or an "
        "nn.MultiheadAttention). Build the model with CostModel.from_vit_shape(hidden_size=..., "
        "depth=..., intermediate_size=..., patch_input_dim=..., window_layers=..., "
        "window_patches=...) instead."
    )


def _set_windows(
    vit: Any, shape: dict[str, Any], window_layers: Iterable[int] | None, window_patches: int | None
) -> None:
    """Put the caller's windowed blocks and window into ``shape`` (each overrides the config's
    alone), or refuse a windowed tower that says none."""
    if window_layers is not None:
        shape["window_layers"] = _block_indices(window_layers)
    if window_patches is not None:
        if not _is_int(window_patches):
            raise ValueError(
                f"CostModel.from_vit: window_patches={window_patches!r} is invalid: expected an int "
                "(patches per attention window)."
            )
        if window_patches and not shape.get("window_layers"):
            raise ValueError(
                f"CostModel.from_vit: window_patches={window_patches!r} was given, but "
                f"{type(vit).__name__} has no windowed blocks: pass window_layers=[block indices] too."
            )
        shape["window_patches"] = window_patches
    if "window_layers" not in shape and _has_windows(vit):
        raise ValueError(
            f"CostModel.from_vit: {type(vit).__name__} has windowed attention (a module with a "
            f"{' or '.join(_WINDOW_METHODS)}) but no config saying which blocks use windows; pass "
            "window_layers=[block indices] and window_patches=<patches per window>, or "
            "window_layers=() when every block attends to whole images."
        )


#: Methods of towers with windowed attention: Qwen2.5-VL's in transformers 4.x (and towers of
#: its shape), and in 5.x.
_WINDOW_METHODS = ("get_window_index", "permute_input_for_window_attn")


def _has_windows(vit: Any) -> bool:
    """Whether ``vit``, or a module inside it, has windowed attention (:data:`_WINDOW_METHODS`)."""
    named = getattr(vit, "named_modules", None)
    modules = [m for _, m in named()] if callable(named) else [vit]
    return any(callable(getattr(m, name, None)) for m in modules for name in _WINDOW_METHODS)


def _block_indices(window_layers: Iterable[int]) -> tuple[int, ...]:
    """``window_layers`` as block indices, or a ValueError naming it."""
    try:
        indices = tuple(window_layers)
    except TypeError:
        indices = None
    if indices is None or not all(_is_int(i) for i in indices):
        raise ValueError(
            f"CostModel.from_vit: window_layers={window_layers!r} is invalid: expected block indices "
            "(ints), or () when every block attends to whole images."
        )
    return indices


#: Wrappers that hide the ``config`` and ``get_window_index`` of the module they wrap, by type
#: name, with the attribute holding it (``torch.compile``'s module forwards attributes by itself).
_WRAPPERS = {
    "DistributedDataParallel": "module",
    "DataParallel": "module",
    "DeepSpeedEngine": "module",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",
    "CheckpointWrapper": "_checkpoint_wrapped_module",
}


def _unwrapped(vit: Any) -> Any:
    """The tower inside such wrappers (a tower's own child named ``module`` is not one)."""
    while (name := _WRAPPERS.get(type(vit).__name__)) is not None:
        inner = getattr(vit, name, None)
        if not callable(getattr(inner, "named_modules", None)):
            return vit
        vit = inner
    return vit


def _attends_per_frame(vit: Any) -> bool:
    """Whether ``vit`` is, or holds, a Hugging Face Qwen-VL vision tower (see :meth:`CostModel.from_vit`)."""
    if getattr(getattr(vit, "config", None), "model_type", None) in _PER_FRAME_MODEL_TYPES:
        return True
    named = getattr(vit, "named_modules", None)
    if not callable(named):
        return False
    return any(
        getattr(getattr(m, "config", None), "model_type", None) in _PER_FRAME_MODEL_TYPES for _, m in named()
    )


#: Vision config types whose pixel rows are RGB, the channels fixed in their code and named in no
#: config, by the config field of their temporal patch (None: no temporal patches): Muse Spark's and
#: Muse-Glimmer's tower (``patch_temporal`` frames), Kimi-K2.5's (a ``Conv2d`` from 3).
_RGB_TEMPORAL_FIELD: dict[str, str | None] = {
    "muse_spark_vision": "patch_temporal",
    "muse_glimmer_vision": "patch_temporal",
    "kimi_k25_vision": None,
}


def pixel_row_factors(config: Any) -> dict[str, Any]:
    """The factors of a pixel row's width ``C = channels * temporal_patch_size * patch_size**2`` in a
    Hugging Face vision config, by name (None where it does not say): ``in_channels``
    (``num_channels`` in SigLIP-style configs), ``temporal_patch_size`` (1 in a config without
    temporal patches) and ``patch_size``."""
    model_type = getattr(config, "model_type", None)
    if model_type in _RGB_TEMPORAL_FIELD:
        temporal = _RGB_TEMPORAL_FIELD[model_type]
        return {
            "in_channels": 3,
            "temporal_patch_size": getattr(config, temporal, None) if temporal is not None else 1,
            "patch_size": getattr(config, "patch_size", None),
        }
    channels = getattr(config, "in_channels", None)
    return {
        "in_channels": channels if channels is not None else getattr(config, "num_channels", None),
        "temporal_patch_size": getattr(config, "temporal_patch_size", 1) if config is not None else None,
        "patch_size": getattr(config, "patch_size", None),
    }


def _check_vit_shape(
    hidden_size: int, depth: int, windowed_layers: list[int], window_patches: int, kv_size: int | None
) -> None:
    """:meth:`CostModel.from_vit_shape`'s arguments checked: a ``ValueError`` naming the first bad one."""
    if not (_is_int(hidden_size) and _is_int(depth)) or hidden_size <= 0 or depth <= 0:
        raise ValueError(
            f"from_vit_shape needs hidden_size and depth as ints > 0, got hidden_size={hidden_size!r}, "
            f"depth={depth!r}."
        )
    if any(not 0 <= i < depth for i in windowed_layers):
        raise ValueError(f"window_layers={windowed_layers!r} must lie in [0, depth={depth}).")
    if windowed_layers and not _is_int(window_patches):
        raise ValueError(f"window_patches={window_patches!r} is invalid: expected an int (patches a window).")
    if windowed_layers and window_patches <= 0:
        raise ValueError(
            f"window_patches={window_patches!r} must be > 0 when window_layers={windowed_layers!r}."
        )
    if kv_size is not None and kv_size <= 0:
        raise ValueError(
            f"from_vit_shape: kv_size={kv_size!r} is invalid: expected a width > 0, or None for hidden_size."
        )


def _check_widths(intermediate_size: int | None, mlp_ratio: float, patch_input_dim: int) -> None:
    """The MLP's and the patch embedding's arguments of :meth:`CostModel.from_vit_shape` checked,
    each named (a bad one would otherwise surface as an invalid ``CostModel.linear``)."""
    if intermediate_size is not None and (not _is_int(intermediate_size) or intermediate_size < 0):
        raise ValueError(
            f"from_vit_shape: intermediate_size={intermediate_size!r} is invalid: expected an int >= 0 "
            "(the MLP's width; 0 for blocks without one), or None for hidden_size * mlp_ratio."
        )
    ratio_ok = isinstance(mlp_ratio, numbers.Real) and not isinstance(mlp_ratio, bool)
    if not ratio_ok or not math.isfinite(mlp_ratio) or mlp_ratio <= 0:
        raise ValueError(f"from_vit_shape: mlp_ratio={mlp_ratio!r} is invalid: expected a finite number > 0.")
    if not _is_int(patch_input_dim) or patch_input_dim < 0:
        raise ValueError(
            f"from_vit_shape: patch_input_dim={patch_input_dim!r} is invalid: expected an int >= 0 "
            "(input features per patch, e.g. 3*2*14*14; 0 leaves the patch embedding out)."
        )


def _shape_from_config(config: Any) -> dict[str, Any] | None:
    """:meth:`CostModel.from_vit_shape` arguments from a Qwen-VL style vision config, if it has a
    width and a depth. Windowed blocks: those not in ``fullatt_block_indexes`` (Qwen2.5-VL), or
    those ``layer_types`` names ``"window_attention"`` (Ovis2.5), with ``window_size`` pixels a side."""
    width = getattr(config, "embed_dim", None) or getattr(config, "hidden_size", None)
    depth = getattr(config, "depth", None) or getattr(config, "num_hidden_layers", None)
    if config is None or not width or not depth:
        return None
    patch = int(getattr(config, "patch_size", 14))
    factors = pixel_row_factors(config)
    in_dim = int(factors["in_channels"] or 3) * int(factors["temporal_patch_size"])
    full_indexes = getattr(config, "fullatt_block_indexes", None)
    window_px = getattr(config, "window_size", None)
    window_layers: list[int] = []
    window_patches = 0
    layer_types = getattr(config, "layer_types", None)
    if full_indexes is not None and window_px:
        window_layers = [i for i in range(int(depth)) if i not in set(full_indexes)]
        window_patches = (int(window_px) // patch) ** 2
    elif window_px and isinstance(layer_types, (list, tuple)) and "window_attention" in layer_types:
        # The windowed blocks named per block (Ovis2.5's tower), the window in pixels as Qwen2.5-VL's.
        window_layers = [i for i, kind in enumerate(layer_types) if kind == "window_attention"]
        window_patches = (int(window_px) // patch) ** 2
    return {
        "hidden_size": int(width),
        "depth": int(depth),
        "intermediate_size": getattr(config, "intermediate_size", None),
        "mlp_ratio": float(getattr(config, "mlp_ratio", 4.0)),
        "gated_mlp": full_indexes is not None,
        "patch_input_dim": in_dim * patch * patch,
        "window_layers": window_layers,
        "window_patches": window_patches,
        "kv_size": _kv_size_from_config(config, int(width)),
    }


def _kv_size_from_config(config: Any, width: int) -> int | None:
    """Width of the key and value projections under grouped-query attention (fewer key-value
    heads than query heads, as EXAONE 4.5's tower has); ``None`` when they are ``width`` wide."""
    heads = getattr(config, "num_heads", None) or getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if not heads or not kv_heads or int(kv_heads) == int(heads):
        return None
    return int(kv_heads) * (width // int(heads))


# Linears of an attention layer with separate projections; never part of an MLP.
_QUERY_NAMES = frozenset({"q_proj", "query", "q"})
# Looked up in this order beside a query linear (a tuple: the order must not depend on hashing).
_KEY_NAMES = ("k_proj", "key", "k")
_ATTENTION_PART_NAMES = _QUERY_NAMES | set(_KEY_NAMES) | {"v_proj", "o_proj", "out_proj", "value", "v"}


def _is_linear(module: Any) -> bool:
    # Duck-typed (nn.Linear and its subclasses) so that this layer needs no torch import.
    return isinstance(getattr(module, "in_features", None), int) and isinstance(
        getattr(module, "out_features", None), int
    )


def _attention_width(name: str, module: Any) -> int | None:
    """The hidden size an attention layer marked by ``module`` reads, or ``None`` if it is none."""
    leaf = name.rsplit(".", 1)[-1]
    if _is_linear(module):
        if "qkv" in leaf and _fused_kv_size(module) is not None:
            return int(module.in_features)
        if leaf in _QUERY_NAMES:
            return int(module.in_features)
    if type(module).__name__ == "MultiheadAttention":
        return int(module.embed_dim)
    return None


def _fused_kv_size(module: Any) -> int | None:
    """``kv`` of a fused query-key-value linear, ``d`` in and ``d + 2 * kv`` out with
    ``0 < kv <= d`` (``kv < d``: grouped-query attention); ``None`` for any other shape."""
    extra = int(module.out_features) - int(module.in_features)
    if extra <= 0 or extra % 2 or extra > 2 * int(module.in_features):
        return None
    return extra // 2


def _kv_size(name: str, module: Any, width: int, by_name: Mapping[str, Any]) -> int:
    """Width of the key and value projections of the attention layer marked by ``module`` (of
    hidden size ``width``): from the fused linear's shape, or the key linear next to a separate
    query linear (none found, or an ``nn.MultiheadAttention``: ``width``)."""
    parent, _, leaf = name.rpartition(".")
    if _is_linear(module) and "qkv" in leaf:
        return _fused_kv_size(module) or width
    if leaf in _QUERY_NAMES:
        for key_name in _KEY_NAMES:
            key = by_name.get(f"{parent}.{key_name}" if parent else key_name)
            if key is not None and _is_linear(key):
                return int(key.out_features)
    return width


def _inside(name: str, block: str) -> bool:
    return block == "" or name == block or name.startswith(block + ".")


def _mlp_of(block: str, modules: list[tuple[str, Any]], width: int) -> tuple[int, bool]:
    """``(intermediate_size, gated)`` of the MLP in ``block`` (``(0, False)``: no MLP)."""
    widths = [
        int(m.out_features)
        for name, m in modules
        if _inside(name, block)
        and _is_linear(m)
        and m.in_features == width
        and m.out_features != width
        and _attention_width(name, m) is None
        and name.rsplit(".", 1)[-1] not in _ATTENTION_PART_NAMES
    ]
    if not widths:
        return 0, False
    if len(widths) > 2 or len(set(widths)) != 1:
        raise ValueError(
            f"CostModel.from_vit: block {block!r} has linears from the hidden size {width} to widths "
            f"{widths}; expected one MLP input (or a gate and an up projection). Build the model with "
            "CostModel.from_vit_shape(...) instead."
        )
    return widths[0], len(widths) == 2


def _patch_input_dim(modules: list[tuple[str, Any]], width: int, mlp: int) -> int:
    """Input features of the first linear or convolution into ``width`` (the patch embedding)."""
    for _, m in modules:
        if _is_linear(m) and m.out_features == width and m.in_features not in (width, mlp):
            return int(m.in_features)
        if getattr(m, "out_channels", None) == width and isinstance(getattr(m, "in_channels", None), int):
            kernel = m.kernel_size if isinstance(m.kernel_size, tuple) else (m.kernel_size,)
            return int(m.in_channels) * math.prod(int(k) for k in kernel)
    return 0


def _adapters_as_bases(modules: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``modules`` with each adapter (a module holding its ``base_layer``: peft's LoRA layers, on a
    linear or a convolution) read as its base layer under the adapter's name, and the adapter's
    own parts (the base layer, the low-rank pair) left out: the tower is priced as its base."""
    adapters = {
        name
        for name, m in modules
        if callable(getattr(getattr(m, "base_layer", None), "named_modules", None))
    }

    def inside_adapter(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:k]) in adapters for k in range(1, len(parts)))

    return [
        (name, m.base_layer if name in adapters else m) for name, m in modules if not inside_adapter(name)
    ]


def _shape_from_modules(vit: Any) -> dict[str, Any] | None:
    """:meth:`CostModel.from_vit_shape` arguments read from a tower's module tree (see
    :meth:`CostModel.from_vit`), or ``None`` when it has no recognisable attention layer."""
    named = getattr(vit, "named_modules", None)
    if not callable(named):
        return None
    modules = _adapters_as_bases(list(named()))
    layers = [(n, m, w) for n, m in modules if (w := _attention_width(n, m)) is not None]
    if not layers:
        return None
    attention = [(n, w) for n, _, w in layers]
    by_name = dict(modules)
    kv_sizes = sorted({_kv_size(n, m, w, by_name) for n, m, w in layers})
    widths = sorted({w for _, w in attention})
    if len(widths) != 1:
        raise ValueError(
            f"CostModel.from_vit: the attention layers of {type(vit).__name__} read different widths "
            f"{widths}: expected the vision tower alone (e.g. model.model.visual, not the whole "
            "model); for a tower of mixed widths, build the model with CostModel.from_vit_shape(...)."
        )
    width = widths[0]
    if len(kv_sizes) != 1:
        raise ValueError(
            f"CostModel.from_vit: the attention layers of {type(vit).__name__} have key and value "
            f"projections of different widths {kv_sizes}; build the model with "
            "CostModel.from_vit_shape(...) instead."
        )
    mlps = set()
    for name, _ in attention:
        # The block: the largest ancestor that holds this attention layer and no other.
        parts = name.split(".")
        ancestors = [".".join(parts[:k]) for k in range(len(parts) - 1, -1, -1)]
        alone = [a for a in ancestors if sum(_inside(n, a) for n, _ in attention) == 1]
        mlps.add(_mlp_of(alone[-1] if alone else name, modules, width))
    if len(mlps) != 1:
        raise ValueError(
            f"CostModel.from_vit: the blocks of {type(vit).__name__} have different MLPs "
            f"{sorted(mlps)} (intermediate size, gated); build the model with "
            "CostModel.from_vit_shape(...) instead."
        )
    intermediate, gated = mlps.pop()
    return {
        "hidden_size": width,
        "depth": len(attention),
        "intermediate_size": intermediate,
        "gated_mlp": gated,
        "patch_input_dim": _patch_input_dim(modules, width, intermediate),
        "kv_size": kv_sizes[0] if kv_sizes[0] != width else None,
    }


# A subset of terms is dropped when its scaled Gram matrix has a pivot below this: its columns
# are (nearly) collinear, e.g. the windowed and linear terms when every image exceeds the window.
_PIVOT_TOLERANCE = 1e-10


#: The name of the target ``y`` among the columns whose pairs make the normal equations.
_TARGET = "target"


def _pair_products(
    columns: Mapping[str, np.ndarray], negated: bool = False
) -> dict[tuple[str, str], list[float]]:
    """Per pair of columns (each with itself and the later ones, in their order), the elementwise
    products whose sum is that entry of the normal equations, as Python floats (``negated``: each
    product's negation, which is exact)."""
    if negated:
        return {(a, b): (-(columns[a] * columns[b])).tolist() for a, b in _pairs(tuple(columns))}
    return {(a, b): (columns[a] * columns[b]).tolist() for a, b in _pairs(tuple(columns))}


def _pairs(names: tuple[str, ...]) -> list[tuple[str, str]]:
    """Each name with itself and the later ones, in their order: the entries of the normal
    equations (with :data:`_TARGET` last among ``names``, the moments and the total too)."""
    return [(a, b) for i, a in enumerate(names) for b in names[i:]]


def _expansion(values: list[float], first: float) -> tuple[float, ...]:
    """Floats whose exact sum is the exact sum of ``values``; ``first`` is ``math.fsum(values)``.

    :func:`math.fsum` rounds correctly, so each pass gives what the terms so far miss, rounded,
    and 0.0 only when they miss nothing (every float is a multiple of ``2**-1074``: no rest
    rounds to 0). Each rest is below half an ulp of the one before: two terms on measured times,
    up to about 26 where the values span ``1e-100`` to ``1e100``."""
    if not math.isfinite(first):  # a NaN rest is never 0.0: refuse rather than loop
        raise ValueError(f"_expansion: the values sum to {first!r}: expected finite values.")
    terms = [first]
    while (rest := math.fsum(itertools.chain(values, [-t for t in terms]))) != 0.0:
        terms.append(rest)
    return tuple(terms)


def _cholesky_solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Solve a small symmetric positive definite system in a fixed order; ``None`` if singular."""
    n = len(rhs)
    lower = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1):
            value = matrix[i][j] - math.fsum(lower[i][k] * lower[j][k] for k in range(j))
            if i == j:
                if value <= _PIVOT_TOLERANCE:
                    return None
                lower[i][i] = math.sqrt(value)
            else:
                lower[i][j] = value / lower[j][j]
    forward = [0.0] * n
    for i in range(n):
        forward[i] = (rhs[i] - math.fsum(lower[i][k] * forward[k] for k in range(i))) / lower[i][i]
    solution = [0.0] * n
    for i in reversed(range(n)):
        tail = math.fsum(lower[k][i] * solution[k] for k in range(i + 1, n))
        solution[i] = (forward[i] - tail) / lower[i][i]
    return solution


@dataclass(frozen=True)
class _NormalEquations:
    """``X^T X``, ``X^T y`` and ``y^T y`` of a least-squares problem over named columns of ``X``,
    each entry a correctly rounded sum: the same float on every machine, whatever its BLAS."""

    names: tuple[str, ...]
    gram: dict[tuple[str, str], float]
    moments: dict[str, float]
    total: float

    @classmethod
    def of(cls, columns: Mapping[str, np.ndarray], target: np.ndarray) -> _NormalEquations:
        products = _pair_products({**columns, _TARGET: target})
        return cls.from_sums(tuple(columns), {pair: math.fsum(values) for pair, values in products.items()})

    @classmethod
    def from_sums(cls, names: tuple[str, ...], sums: Mapping[tuple[str, str], float]) -> _NormalEquations:
        """The equations whose entries are ``sums`` (by :func:`_pair_products`'s pairs)."""
        gram = {}
        for a, b in _pairs(names):
            gram[a, b] = gram[b, a] = sums[a, b]
        return cls(names, gram, {a: sums[a, _TARGET] for a in names}, sums[_TARGET, _TARGET])

    @property
    def finite(self) -> bool:
        """Whether every entry is a finite float (rows too large overflow their products)."""
        return all(map(math.isfinite, self.entries))

    def entry(self, pair: tuple[str, str]) -> float:
        """The entry of one of :func:`_pair_products`'s pairs."""
        if pair[1] != _TARGET:
            return self.gram[pair]
        return self.total if pair[0] == _TARGET else self.moments[pair[0]]

    @functools.cached_property
    def entries(self) -> tuple[float, ...]:
        """Each entry once, in :func:`_pair_products`'s order of pairs (the Gram matrix holds both
        orders of a pair)."""
        return tuple(self.entry(pair) for pair in _pairs((*self.names, _TARGET)))

    @classmethod
    def sum(cls, parts: Sequence[_NormalEquations]) -> _NormalEquations:
        """The equations of all parts' rows together (parts with the same names)."""
        names = parts[0].names
        # Entry by entry across the parts, each part's entries read once: looked up by pair, a
        # 32-step window's sum took 0.045 ms of a refit's 0.17 ms at 2 ranks, in every call (0.016).
        totals = map(math.fsum, zip(*(part.entries for part in parts)))
        return cls.from_sums(names, dict(zip(_pairs((*names, _TARGET)), totals)))


@dataclass
class _WindowStep:
    """One observed step in a :class:`CostCalibrator`'s window: its rows (``_ROW``'s columns),
    their normal equations, a digest of the rows' float64 bytes and, once a refit without
    outliers has needed them, each entry's exact sum (:func:`_expansion`)."""

    rows: np.ndarray
    equations: _NormalEquations
    digest: int
    expansions: dict[tuple[str, str], tuple[float, ...]] | None = None


def _nonnegative_least_squares(
    columns: Mapping[str, np.ndarray] | _NormalEquations, target: np.ndarray | None = None
) -> dict[str, float] | None:
    """Non-negative least squares over a few named columns, bit-identical on every machine.

    The optimum is the unconstrained least-squares fit on its own support, so the best fit among
    all subsets of columns whose coefficients come out non-negative is the answer. Every sum is
    correctly rounded (:func:`math.fsum`) and the small solves run in Python floats in a fixed
    order, so no BLAS, thread count or SIMD width changes a bit. A later (larger) subset replaces
    the best only when clearly better, so ties keep fewer terms.

    Args:
        columns: The named columns of ``X`` (with ``target``), or their normal equations.
        target: ``y``.

    Returns:
        Coefficient per column name (absent: 0), or ``None`` when no subset is solvable.
    """
    normal = columns if isinstance(columns, _NormalEquations) else _NormalEquations.of(columns, target)
    gram, moments, total = normal.gram, normal.moments, normal.total
    names = [a for a in normal.names if gram[a, a] > 0.0]
    scale = {a: math.sqrt(gram[a, a]) for a in names}
    best: tuple[float, dict[str, float]] | None = None
    for size in range(1, len(names) + 1):
        for subset in itertools.combinations(names, size):
            matrix = [[gram[a, b] / (scale[a] * scale[b]) for b in subset] for a in subset]
            scaled = _cholesky_solve(matrix, [moments[a] / scale[a] for a in subset])
            if scaled is None or any(c < 0.0 for c in scaled):
                continue
            coef = {a: c / scale[a] for a, c in zip(subset, scaled)}
            residual = (
                total
                - 2.0 * math.fsum(coef[a] * moments[a] for a in subset)
                + math.fsum(coef[a] * coef[b] * gram[a, b] for a in subset for b in subset)
            )
            if best is None or residual < best[0] - 1e-12 * total:
                best = (residual, coef)
    return best[1] if best is not None else None


class CostCalibrator:
    """Fits a :class:`CostModel` online to measured per-rank ViT times, identically on every rank.

    Each step, :meth:`observe` takes, for every rank, the patch counts of the images that rank
    encoded and its measured ViT milliseconds. A rank's time is modelled as the sum of its images'
    costs plus a per-call overhead ``o`` that every rank pays alike::

        ms = a*sum(l**2) + w*sum(l*min(l, window)) + b*sum(l) + c*n_images + o

    (with a per-frame ``initial``, :attr:`CostModel.per_frame_attention`, the attention sums are
    ``sum(l**2/T)`` and ``sum(l*min(l/T, window))`` over items of ``T`` temporal steps) fitted by
    non-negative least squares on the relative error (``(predicted - ms) / ms``: a 5 ms and a
    500 ms rank count alike) over the last ``history`` steps. The planner only compares
    ranks, so ``o`` is left out of :attr:`model` (it is :attr:`call_overhead_ms`).

    When it refits (the rule): rows (one per rank and step) with at least one image and a measured
    time are kept, after the first ``warmup_steps`` steps that have any (steps without are
    ignored). A fit needs ``min_rank_steps`` rows whose images span a patch count ratio
    ``max(l) / min(l) >= min_spread`` (with equal-sized images ``l**2`` and ``l`` cannot be told
    apart). Outliers: once a fit exists, a new step's rows more than ``outlier_factor`` times faster
    (against that fit) than the step's median row never enter the window, unless the step before
    lost some so too (then all of this step's come in). Each fit then screens the window twice:
    rows more than ``outlier_factor`` times faster than the median row (against the fit), then
    rows off by more than ``outlier_factor`` times the median relative error (and by more than
    5%); a screen that finds some drops them and refits, if ``min_rank_steps`` rows remain. A fit
    that gives every image the same cost (only ``c`` and ``o`` non-zero) is rejected. Until a fit
    succeeds :attr:`model` is ``initial``; afterwards the last successful fit, also while the
    window lacks data for a new one.

    Determinism: patch sums are exact integers, every sum of floats is correctly rounded
    (:func:`math.fsum`; per-frame terms are one correctly rounded division and product per item,
    then such a sum) and the small solves run in a fixed order, so identical observations give
    bit-identical coefficients on every rank and machine. Feed every rank the same gathered
    figures, in the same order.

    Args:
        initial: The model until the first fit (default: the seed's ``l**2``). Its
            ``per_frame_attention`` is that of every fit.
        window_patches: Fit the windowed term with this window (patches); ``None`` takes
            ``initial.window_patches``; 0 fits no windowed term.
        history: Steps kept (the oldest is dropped first).
        warmup_steps: First steps with measurements ignored (allocation, autotuning, compilation).
        min_rank_steps: Rows (one per rank and step with images) needed for a fit.
        min_spread: Smallest ``max(l) / min(l)`` over the kept images for a fit.
        outlier_factor: Rows off by more than this times the median relative error, or this many
            times faster than the median row, are outliers.

    Checkpoints: :meth:`state_dict` holds the model, the counters and the kept rows in plain
    numbers, and :meth:`load_state_dict` goes on from them in a new process (``ViTBalanceMixin``
    saves it in Lightning checkpoints).

    Attributes:
        steps_observed: Calls of :meth:`observe`, warm-up included.
        fits: Successful fits so far.
        last_error: How far the model in force was off on the newest measured step, before
            refitting on it: the median over its rows of ``|predicted - ms| / ms``, the per-call
            overhead included (``0.08``: a rank's time was typically predicted within 8%). Out of
            sample, as the plan that step ran was made without its times. NaN before the first
            fit, in the warm-up, and where the newest step measured no rank.
    """

    def __init__(
        self,
        initial: CostModel | None = None,
        *,
        window_patches: int | None = None,
        history: int = 32,
        warmup_steps: int = 2,
        min_rank_steps: int = 12,
        min_spread: float = 2.0,
        outlier_factor: float = 5.0,
    ) -> None:
        if initial is not None and not isinstance(initial, CostModel):
            raise TypeError(f"CostCalibrator: initial={initial!r} is invalid: expected a CostModel or None.")
        self._initial = initial if initial is not None else CostModel()
        self._model = self._initial
        self.window_patches = self._model.window_patches if window_patches is None else window_patches
        self.per_frame_attention = self._model.per_frame_attention
        check_int("window_patches", self.window_patches, 0, owner="CostCalibrator")
        check_int("history", history, 1, owner="CostCalibrator")
        check_int("warmup_steps", warmup_steps, 0, owner="CostCalibrator")
        check_int("min_rank_steps", min_rank_steps, 2, owner="CostCalibrator")
        check_number("min_spread", min_spread, ">= 1", lambda v: v >= 1, owner="CostCalibrator")
        check_number("outlier_factor", outlier_factor, "> 1", lambda v: v > 1, owner="CostCalibrator")
        self.window_patches = int(self.window_patches)
        self.history = int(history)
        self.warmup_steps = int(warmup_steps)
        self.min_rank_steps = int(min_rank_steps)
        self.min_spread = float(min_spread)
        self.outlier_factor = float(outlier_factor)
        self._steps: collections.deque[_WindowStep] = collections.deque(maxlen=self.history)
        self._overhead = 0.0
        self._measured_steps = 0
        self._screened_last = False  # whether the newest step lost rows far too fast
        self.steps_observed = 0
        self.fits = 0
        self.last_error = math.nan

    @property
    def model(self) -> CostModel:
        """The current model: the last successful fit, or ``initial`` before one."""
        return self._model

    @property
    def call_overhead_ms(self) -> float:
        """Fitted per-call time every rank pays whatever it encodes (0.0 before a fit)."""
        return self._overhead

    def fingerprint(self) -> tuple[float, float, float, float, int]:
        """``(quadratic, linear, constant, windowed, window_patches)`` of :attr:`model`: equal on
        every rank when the ranks plan alike (compare or hash it)."""
        m = self._model
        return (m.quadratic, m.linear, m.constant, m.windowed, m.window_patches)

    def state_fingerprint(self) -> tuple[float, ...]:
        """:meth:`fingerprint` and what decides the next fits: the counters, the window's length
        and a digest of its rows. Equal on every rank that fed the calibrator the same figures, so
        a state loaded on some ranks only, or other states on other ranks (fits apart, so plans
        apart), is told apart before it plans."""
        counters = (self.steps_observed, self._measured_steps, self.fits, len(self._steps))
        # 52 bits, so that the digest survives the float the settings' fingerprint reads it as.
        window = stable_digest(b"".join(step.digest.to_bytes(8, "little") for step in self._steps)) >> 10
        return (*self.fingerprint(), *counters, window)

    def observe(
        self,
        patch_counts: Sequence[Sequence[int]],
        milliseconds: Sequence[float],
        frames: Sequence[Sequence[int]] | None = None,
    ) -> CostModel:
        """Record one step of every rank and refit; returns the (possibly unchanged) model.

        Args:
            patch_counts: ``patch_counts[r]``: patch counts of the images rank ``r`` encoded.
            milliseconds: ``milliseconds[r]``: rank ``r``'s measured ViT time; NaN where not
                measured (the row is skipped).
            frames: ``frames[r][i]``: temporal steps ``T`` of ``patch_counts[r][i]`` (``None``: 1
                each); they count only for a per-frame model.

        Raises:
            ValueError: on ragged input, a non-positive patch count or frame count, or a time that is
                negative, infinite or positive below a microsecond.
        """
        rows = self._rows(*_parse_step(patch_counts, milliseconds, frames))
        self.steps_observed += 1
        self.last_error = math.nan
        if not len(rows):  # nothing measured (e.g. the first call): neither warm-up nor history
            return self._model
        self._measured_steps += 1
        if self._measured_steps <= self.warmup_steps:
            return self._model
        predicted = self._predict(self._terms_in_force(), rows) if self.fits else None
        if predicted is not None:
            self.last_error = _median(np.abs(predicted / rows[:, _ROW.index("ms")] - 1.0))
        self._steps.append(self._window_step(self._without_too_fast(rows, predicted)))
        fitted = self._fit()
        if fitted is not None:
            self._model, self._overhead = fitted
            self.fits += 1
        return self._model

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps so that a resumed run goes on calibrating where this one stopped:
        the model, the counters and the window of observed rows, in plain Python numbers (it loads
        with ``torch.load(weights_only=True)``). Every rank holds the same state, so rank 0's
        checkpoint restores every rank alike."""
        return {
            "version": _STATE_VERSION,
            "window_patches": self.window_patches,
            "per_frame_attention": self.per_frame_attention,
            "model": dataclasses.asdict(self._model),
            "call_overhead_ms": self._overhead,
            "steps_observed": self.steps_observed,
            "fits": self.fits,
            "history": [step.rows.tolist() for step in self._steps],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from :meth:`state_dict` of a calibrator that fits the same terms.

        The fitted model, the counters and the observed rows (the newest ``history`` steps) are
        restored; before any fit (``fits == 0``) this calibrator keeps its own ``initial`` model.
        The warm-up starts again: a new process allocates and compiles again, so its first
        ``warmup_steps`` measured steps are left out as a fresh calibrator's are. Nothing changes
        when it raises.

        Raises:
            ValueError: ``state`` is not such a state, or its calibrator fitted another
                ``window_patches`` or ``per_frame_attention`` (its rows hold other terms).
        """
        model, history = _parse_state(state, self.window_patches, self.per_frame_attention)
        steps = self._steps_that_fit(history)
        fitted = state["fits"] > 0
        self._model = model if fitted else self._initial
        self._overhead = float(state["call_overhead_ms"]) if fitted else 0.0
        self._steps.clear()
        self._steps.extend(steps)
        self._measured_steps, self._screened_last = 0, False
        self.last_error = math.nan
        self.steps_observed = state["steps_observed"]
        self.fits = state["fits"]

    def _steps_that_fit(self, history: list[np.ndarray]) -> list[_WindowStep]:
        """A loaded state's window of steps, or a ValueError where its sums overflow (a step's, or
        the window's: rows of a hand-made state, on which every later fit would fail)."""
        try:
            with np.errstate(over="ignore"):  # told below, naming the state
                steps = [self._window_step(rows) for rows in history]
                parts = [step.equations for step in steps]
                fit = all(part.finite for part in parts) and (not parts or _NormalEquations.sum(parts).finite)
        except OverflowError:  # math.fsum's intermediate overflow
            fit = False
        if not fit:
            raise ValueError(
                f"{_LOAD}: state['history'] holds sums too large to fit (their products overflow): "
                "expected a saved state."
            )
        return steps

    def _rows(self, ranks: list[np.ndarray], times: np.ndarray, steps: list[np.ndarray] | None) -> np.ndarray:
        """One row per rank with images and a time: the columns of :data:`_ROW`."""
        used = [r for r, counts in enumerate(ranks) if counts.size and times[r] > 0]  # NaN > 0 is False
        if not used:
            return np.zeros((0, len(_ROW)))
        flat = np.concatenate([ranks[r] for r in used])
        starts = np.cumsum([0] + [ranks[r].size for r in used[:-1]])
        if steps is not None and self.per_frame_attention:
            attention = self._per_frame_sums(flat, np.concatenate([steps[r] for r in used]), starts)
        else:
            # Integer sums are exact, then rounded to float once: the same on every rank.
            per_item = [flat * flat, flat * np.minimum(flat, self.window_patches)]
            attention = [np.add.reduceat(v, starts).astype(np.float64) for v in per_item]
        linear, count = (np.add.reduceat(v, starts).astype(np.float64) for v in (flat, np.ones_like(flat)))
        columns = [attention[0], linear, count, np.ones(len(used)), attention[1]]
        columns += [np.minimum.reduceat(flat, starts), np.maximum.reduceat(flat, starts), times[used]]
        return np.stack([np.asarray(c, dtype=np.float64) for c in columns], axis=1)

    def _per_frame_sums(self, flat: np.ndarray, steps: np.ndarray, starts: np.ndarray) -> list[np.ndarray]:
        """Per rank, ``sum(l**2/T)`` and ``sum(l*min(l/T, window))``: each item's value is one
        correctly rounded operation per step, each rank's sum correctly rounded (:func:`math.fsum`)."""
        counts = flat.astype(np.float64)
        span = counts / steps
        per_item = [counts * span, counts * np.minimum(span, float(self.window_patches))]
        bounds = [*starts.tolist(), len(flat)]
        return [
            np.asarray([math.fsum(values[a:b].tolist()) for a, b in itertools.pairwise(bounds)])
            for values in per_item
        ]

    def _fit(self) -> tuple[CostModel, float] | None:
        """The rule of the class docstring: enough rows and spread, one outlier pass."""
        rows = np.concatenate([step.rows for step in self._steps])
        if len(rows) < self.min_rank_steps:
            return None
        if rows[:, _ROW.index("largest")].max() < self.min_spread * rows[:, _ROW.index("smallest")].min():
            return None
        terms = _nonnegative_least_squares(_NormalEquations.sum([step.equations for step in self._steps]))
        dropped, predicted = np.zeros(len(rows), dtype=bool), None
        # Too fast rows first: weighted by 1/ms, one of them bends the fit until every row is off
        # alike, and the second screen then finds nothing.
        for screen in (self._too_fast, self._far_off):
            if terms is None:
                return None
            predicted = self._predict(terms, rows) if predicted is None else predicted
            outliers = dropped | screen(predicted, rows[:, _ROW.index("ms")], ~dropped)
            if (outliers != dropped).any() and np.count_nonzero(~outliers) >= self.min_rank_steps:
                dropped, predicted = outliers, None
                terms = _nonnegative_least_squares(self._equations_without(rows[dropped]))
        if terms is None or not any(terms.get(n, 0.0) > 0 for n in ("quadratic", "linear", "windowed")):
            return None
        fitted = CostModel._from_terms(terms, self.window_patches, self.per_frame_attention)
        return fitted, terms.get("overhead", 0.0)

    def _too_fast(self, predicted: np.ndarray, ms: np.ndarray, kept: np.ndarray) -> np.ndarray:
        """Rows more than ``outlier_factor`` times faster, against the fit, than the median row.

        One time 100x too fast among 8 ranks left the per-rank-batch error at 68% for the rest of
        the window. Against the median row, not the fit's own scale: that scale is what such a row
        bends, and a speed-up of every rank (compilation, clocks) is not an outlier."""
        ratios = ms / predicted
        return ratios * self.outlier_factor < _median(ratios[kept])

    def _without_too_fast(self, rows: np.ndarray, predicted: np.ndarray | None) -> np.ndarray:
        """A new step's rows less those too fast against the model in force, which has not seen
        them: a row that bends a fit towards itself can look right against that fit. Only where
        the step before lost none: an outlier is rare, while rows that look too fast step after
        step are a change the fit must follow (a fit of the wrong shape for new image sizes, a
        tower that got faster), so the next step's rows all come in (kept out every time, such
        rows had left a fit 7-33x off for a whole window). ``predicted``: the rows' times under
        the model in force (None before a fit: nothing to screen against)."""
        if predicted is None or self._screened_last:
            self._screened_last = False
            return rows
        fast = self._too_fast(predicted, rows[:, _ROW.index("ms")], np.ones(len(rows), dtype=bool))
        self._screened_last = bool(fast.any())
        return rows[~fast]

    def _terms_in_force(self) -> dict[str, float]:
        """The terms of :attr:`model` and the per-call overhead, as :meth:`_predict` reads them."""
        model = self._model
        terms = {"quadratic": model.quadratic, "linear": model.linear, "constant": model.constant}
        terms.update(windowed=model.windowed, overhead=self._overhead)
        return terms

    def _far_off(self, predicted: np.ndarray, ms: np.ndarray, kept: np.ndarray) -> np.ndarray:
        """Rows off by more than ``outlier_factor`` times the median relative error, and by 5%."""
        errors = np.abs(predicted / ms - 1.0)
        return errors > max(self.outlier_factor * _median(errors[kept]), 0.05)

    def _window_step(self, rows: np.ndarray) -> _WindowStep:
        # Each step's normal equations are summed once (the window's are their sum), and its rows
        # hashed once (the state's fingerprint combines the steps' digests).
        return _WindowStep(rows, self._equations(rows), stable_digest(rows.tobytes()))

    def _columns(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        names = _ROW[:5] if self.window_patches else _ROW[:4]
        return {name: rows[:, k] for k, name in enumerate(names)}

    def _equations(self, rows: np.ndarray) -> _NormalEquations:
        sums = {pair: math.fsum(values) for pair, values in self._products(rows).items()}
        return _NormalEquations.from_sums(tuple(self._columns(rows)), sums)

    def _products(self, rows: np.ndarray, negated: bool = False) -> dict[tuple[str, str], list[float]]:
        # Dividing each row by its time turns absolute into relative residuals.
        weights = 1.0 / rows[:, _ROW.index("ms")]
        columns = {n: col * weights for n, col in self._columns(rows).items()}
        return _pair_products({**columns, _TARGET: np.ones(len(rows))}, negated)

    def _equations_without(self, dropped: np.ndarray) -> _NormalEquations:
        """The window's equations without the ``dropped`` rows, bit for bit those of the rows kept
        (each entry their products' correctly rounded sum): the steps' exact sums, made once per
        step, less the dropped rows' products, so that a refit reads the few dropped rows again
        and not the whole window (it took 20 ms per call at 1,024 ranks, in the forward)."""
        sums = {}
        for pair, negated in self._products(dropped, negated=True).items():
            whole = itertools.chain.from_iterable(self._expansions(step)[pair] for step in self._steps)
            sums[pair] = math.fsum(itertools.chain(whole, negated))
        return _NormalEquations.from_sums(tuple(self._columns(dropped)), sums)

    def _expansions(self, step: _WindowStep) -> dict[tuple[str, str], tuple[float, ...]]:
        if step.expansions is None:
            products = self._products(step.rows)
            step.expansions = {
                pair: _expansion(values, step.equations.entry(pair)) for pair, values in products.items()
            }
        return step.expansions

    def _predict(self, terms: Mapping[str, float], rows: np.ndarray) -> np.ndarray:
        predicted = np.zeros(len(rows))
        for name, column in self._columns(rows).items():  # a fixed order of elementwise sums
            predicted = predicted + terms.get(name, 0.0) * column
        return predicted


def _median(values: np.ndarray) -> float:
    """``np.median(values)`` to the bit, without its overhead (10 us of a 12 us call on 8 values,
    which the calibrator takes up to three times per call)."""
    half = len(values) // 2
    if len(values) % 2:
        return float(np.partition(values, half)[half])
    middle = np.partition(values, (half - 1, half))
    return float((middle[half - 1] + middle[half]) / 2)


def _parse_step(
    patch_counts: Sequence[Sequence[int]],
    milliseconds: Sequence[float],
    frames: Sequence[Sequence[int]] | None,
) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray] | None]:
    """:meth:`CostCalibrator.observe`'s input, checked: per rank its patch counts, its time and
    (when given) its items' temporal steps."""
    ranks = _int_rows("patch_counts", patch_counts, milliseconds)
    try:
        times = np.asarray([float(t) for t in milliseconds], dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise ValueError(
            "CostCalibrator.observe: expected milliseconds as one number per rank, got "
            f"{milliseconds!r} ({error})."
        ) from None
    if len(times) != len(ranks):
        raise ValueError(
            f"CostCalibrator.observe: milliseconds has {len(times)} ranks, patch_counts has "
            f"{len(ranks)}; expected one time per rank."
        )
    bad = np.flatnonzero((times < 0) | np.isinf(times) | ((times > 0) & (times < _SHORTEST_MS)))
    if bad.size:
        raise ValueError(
            f"CostCalibrator.observe: milliseconds[{bad[0]}]={float(times[bad[0]])!r} is invalid: "
            f"expected a time of at least {_SHORTEST_MS} ms (a microsecond), or 0 or NaN for not measured."
        )
    if frames is None:
        return ranks, times, None
    steps = _int_rows("frames", frames, milliseconds)
    if len(steps) != len(ranks):
        raise ValueError(
            f"CostCalibrator.observe: frames has {len(steps)} ranks, patch_counts has {len(ranks)}; "
            "expected frames shaped like patch_counts."
        )
    for rank, (counts, row) in enumerate(zip(ranks, steps)):
        if row.shape != counts.shape:
            raise ValueError(
                f"CostCalibrator.observe: frames[{rank}] has {row.size} items, patch_counts[{rank}] "
                f"has {counts.size}; expected frames shaped like patch_counts."
            )
    return ranks, times, steps


def _parse_state(
    state: Mapping[str, Any], window_patches: int, per_frame_attention: bool
) -> tuple[CostModel, list[np.ndarray]]:
    """:meth:`CostCalibrator.load_state_dict`'s input, checked: the model and the rows per step."""
    if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
        got = state.get("version") if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            f"{_LOAD}: expected a CostCalibrator.state_dict() of version {_STATE_VERSION}, got {got!r}."
        )
    for name, expected in (("window_patches", window_patches), ("per_frame_attention", per_frame_attention)):
        if state.get(name) != expected:
            raise ValueError(
                f"{_LOAD}: state[{name!r}]={state.get(name)!r}, but this calibrator fits "
                f"{name}={expected!r}: expected a state saved with the same setting (its rows hold other "
                "terms)."
            )
    for name in ("steps_observed", "fits"):
        value = state.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{_LOAD}: state[{name!r}]={value!r} is invalid: expected an int >= 0.")
    overhead = state.get("call_overhead_ms")
    if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or not 0.0 <= overhead < math.inf:
        raise ValueError(
            f"{_LOAD}: state['call_overhead_ms']={overhead!r} is invalid: expected a finite number >= 0."
        )
    model = _parse_model(state.get("model"), window_patches, per_frame_attention, fitted=state["fits"] > 0)
    return model, _parse_history(state.get("history"))


def _parse_model(saved: Any, window_patches: int, per_frame_attention: bool, fitted: bool) -> CostModel:
    """A saved state's model, checked: every field of a :class:`CostModel`, and where it was fitted
    (``fitted``), one this calibrator could have fitted (its terms; a patch-count dependent one)."""
    fields = [f.name for f in dataclasses.fields(CostModel)]
    if not isinstance(saved, Mapping) or set(saved) != set(fields):
        keys = sorted(map(str, saved)) if isinstance(saved, Mapping) else type(saved).__name__
        raise ValueError(f"{_LOAD}: state['model'] holds {keys!r}: expected the keys {fields!r}.")
    try:
        model = CostModel(**saved)
    except ValueError as error:
        raise ValueError(f"{_LOAD}: state['model'] is invalid ({error}).") from None
    if not fitted:
        return model  # the saving calibrator's initial model, which this one does not take
    size_dependent = max(model.quadratic, model.linear, model.windowed) > 0
    if model.per_frame_attention != per_frame_attention or model.window_patches not in (0, window_patches):
        problem = f"window_patches={model.window_patches}, per_frame_attention={model.per_frame_attention}"
    elif not size_dependent:
        problem = "no coefficient that grows with the patch count"
    else:
        return model
    raise ValueError(
        f"{_LOAD}: state['model']={saved!r} has {problem}: expected a model this calibrator fits "
        f"(window_patches {' or '.join(map(str, sorted({0, window_patches})))}, per_frame_attention="
        f"{per_frame_attention}, and quadratic, linear or windowed > 0)."
    )


def _parse_history(saved: Any) -> list[np.ndarray]:
    """A saved state's window, checked: per step, rows of :data:`_ROW`'s columns as a calibrator
    makes them (sums >= 0, a whole number of images >= 1, one call, 1 <= smallest <= largest
    patches and a time of a microsecond or more)."""
    try:
        history = [np.asarray(rows, dtype=np.float64) for rows in saved]
    except (TypeError, ValueError) as error:
        raise ValueError(f"{_LOAD}: state['history'] holds no rows of numbers ({error!r}).") from None
    column = {name: k for k, name in enumerate(_ROW)}
    for step, rows in enumerate(history):
        if rows.ndim != 2 or rows.shape[0] == 0 or rows.shape[1] != len(_ROW):
            raise ValueError(
                f"{_LOAD}: state['history'][{step}] has shape {list(rows.shape)}: expected rows of "
                f"{len(_ROW)} columns {list(_ROW)}, at least one."
            )
        images, smallest = rows[:, column["constant"]], rows[:, column["smallest"]]
        valid = (
            np.isfinite(rows).all(axis=1)
            & (rows[:, : column["windowed"] + 1] >= 0).all(axis=1)
            & (images >= 1)
            & (images == np.floor(images))
            & (rows[:, column["overhead"]] == 1.0)
            & (smallest >= 1)
            & (smallest <= rows[:, column["largest"]])
            & (rows[:, column["ms"]] >= _SHORTEST_MS)
        )
        if not valid.all():
            bad = int(np.flatnonzero(~valid)[0])
            raise ValueError(
                f"{_LOAD}: state['history'][{step}][{bad}]={rows[bad].tolist()!r} is invalid: expected "
                f"a calibrator's row {list(_ROW)} (sums >= 0, a whole number of images >= 1, overhead 1, "
                f"1 <= smallest <= largest, a time of at least {_SHORTEST_MS} ms)."
            )
    return history


def _whole(value: Any) -> int:
    """``value`` as an int where it is one (Python's or NumPy's), else a TypeError: ``int()`` would
    cut 1.5 patches to 1 and fit the row on a count nobody passed."""
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is not an integer")
    return operator.index(value)  # a TypeError for floats, NumPy's included


def _whole_values(values: list[Any]) -> np.ndarray:
    """``values`` as int64, each checked by :func:`_whole`: in one conversion where all are Python's
    or NumPy's integers within int64 (one by one took 0.8 ms a call at 512 ranks x 8 images, in the
    forward); bools, floats and the rest go one by one, to be refused by name."""
    if values and all(kind is int or issubclass(kind, np.integer) for kind in set(map(type, values))):
        with contextlib.suppress(OverflowError):  # beyond every integer dtype
            array = np.asarray(values)
            if array.dtype.kind == "i" or (array.dtype.kind == "u" and array.max() <= _INT64_MAX):
                return array.astype(np.int64)
    return np.asarray([_whole(n) for n in values], dtype=np.int64)


def _int_rows(name: str, rows: Sequence[Sequence[int]], milliseconds: Sequence[float]) -> list[np.ndarray]:
    """``rows`` as one int64 array per rank, every value > 0, or a ValueError naming ``name``."""
    try:
        rows = [row if isinstance(row, (list, tuple)) else list(row) for row in rows]  # read twice
        sizes = [len(row) for row in rows]
        flat = _whole_values(list(itertools.chain.from_iterable(rows)))
    except (OverflowError, TypeError, ValueError) as error:
        raise ValueError(
            f"CostCalibrator.observe: expected {name} as one sequence of integers per rank and "
            f"milliseconds as one number per rank, got {rows!r} and {milliseconds!r} ({error})."
        ) from None
    # One array and one check for every rank: a thousand ranks' own took 2 ms per call.
    bounds = itertools.pairwise(itertools.accumulate(sizes, initial=0))
    arrays = [flat[start:end] for start, end in bounds]
    if flat.size and flat.min() <= 0:
        rank, values = next((r, v) for r, v in enumerate(arrays) if v.size and v.min() <= 0)
        raise ValueError(
            f"CostCalibrator.observe: {name}[{rank}]={values.tolist()!r} is invalid: "
            f"expected {'patch counts' if name == 'patch_counts' else 'temporal steps'} > 0."
        )
    return arrays


# Columns of a calibration row (one rank in one step): the model's terms summed over the rank's
# images (the first five; "overhead" is 1, one ViT call), then its image sizes and measured time.
_ROW = ("quadratic", "linear", "constant", "overhead", "windowed", "smallest", "largest", "ms")
#: :meth:`CostCalibrator.state_dict`'s layout; a state of another version is refused.
_STATE_VERSION = 1
_LOAD = "CostCalibrator.load_state_dict"
_INT64_MAX = np.iinfo(np.int64).max
#: The shortest time a row may hold (ms): the balancer measures whole microseconds, and no ViT call
#: takes less; a shorter one weighs its row (by its inverse) far above every measured one, and below
#: about 1e-160 ms its square overflows the normal equations.
_SHORTEST_MS = 1e-3
