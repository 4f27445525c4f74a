"""Hugging Face drop-in: balance a Qwen2-VL / 2.5-VL / 3-VL / 3.5 or GLM-4.xV model called as
``model(**batch)``.

:func:`balance_vision_tower` patches *instances*, nothing else: the base model (the module
holding the vision tower as ``.visual``, e.g. ``model.model``) and the tower get an instance
attribute ``forward`` (and, in transformers 5, the model an instance attribute for
``generate()``'s image encoding, see below; and the model one for ``forward`` once
:meth:`BalancedVisionTower.plan_ahead` made a collator). Classes, parameters, buffers, ``state_dict`` keys and
every attribute HF or PEFT/FSDP reads stay as they were; :meth:`BalancedVisionTower.remove`
deletes those attributes again.

**One exchange per forward.** In a balanced forward the base model's patched ``forward``
concatenates this rank's image rows and video rows (and their grids) and runs the tower once,
through :class:`~lightning_vit_balance.ViTBalancer`, so images and videos of every rank are
balanced together in one exchange. It then runs the model's own ``forward``, whose tower calls
(``get_image_features``, ``get_video_features``) the patched tower ``forward`` answers with the
rows of that one result, without computing or communicating anything. A rank with no images and
no videos still takes part (the engine's empty-rank path), and an exact zero built from zero-row
slices of every output of the balanced call is subtracted from the base model's
``last_hidden_state``. ``x - (+0.0)`` is ``x`` bit for bit for every float (signed zeros,
infinities and NaNs included), so nothing changes numerically, but the loss now depends on the
balanced call on every rank: its backward exchange runs on every rank, and DDP with
``find_unused_parameters=False`` sees the tower's parameters used on text-only ranks too. Where the
model projects the tower's outputs outside the tower (Kimi-K2.5's ``mm_projector``, MiniMax-M3-VL's
and LFM3-VL's ``multi_modal_projector``, PaddleOCR-VL's, HyperCLOVAX Vision V2's and Cosmos3-Edge's
``projector``, ERNIE-4.5-VL's ``resampler_model``, Muse Spark's and Muse-Glimmer's
``vision_adapter`` and ``vision_projection``: the base model's children named in
:data:`_PROJECTION_WORDS`), a text-only rank's model never calls that projection, so the zero also
holds its modules' outputs on inputs of zero rows: its parameters get an all-zero gradient there, as DDP
(and FSDP2's reduce-scatter) need every rank to give one, and as the plain model's gradient summed
over ranks has it. The touch is made when the model embeds its tokens, where the other ranks'
models project, so their gradients reach ZeRO-2's buckets in the same order
(:class:`_ProjectionTouch`). Parameters sharded outside their module's forward (ZeRO-3's, an FSDP2
unit of its own) are gathered only by a call of their module, which the model makes once per
modality a rank holds. There, when the ranks hold different modalities (a text-only rank, videos
on some ranks only; one gather of two flags per rank tells), a rank lacking a modality that another
holds adds a one-item dummy of it (zero pixels, the smallest grid its tower merges) to the balanced
call, and at the same point calls the model's own ``get_image_features`` / ``get_video_features``
on it, answered from the balanced result: every rank then calls the projection as often, and the
``+0.0`` of its zero-row slices keeps every value. A plan made ahead did not see the dummies, so
such a forward plans in the forward, on every rank (:attr:`BalancedVisionTower.projection`).

**Which forwards are balanced.** Those with ``base.training`` set and gradients enabled
(``torch.is_grad_enabled()``), when balancing is on and the group has more than one rank. Such a
forward is a collective: every rank of the group must make it, as with any training step.
Evaluation forwards (``model.eval()``, ``torch.no_grad()`` / ``torch.inference_mode()``) call
the tower directly, so ranks may make different numbers of them, unless the handle's
``evaluation`` is set (the Lightning mixin sets it, and balances them in the loops where every
rank makes the same calls). ``generate()``'s forwards call the tower directly: they carry its
cache (``past_key_values``, or ``cache`` in transformers 5), the first one included, and ranks
generate different numbers of tokens, or one rank generates alone (``generate(use_cache=False)``
passes no cache: with ``evaluation`` its forwards are balanced, and need ``synced_gpus=True``).
Under FSDP or ZeRO-3 an evaluation forward gathers parameters in the tower too, so evaluation
with ranks that differ in modalities needs ``evaluation`` (as it needs the drop-in in training).
So does ``generate()``: with ``evaluation`` and the tower's parameters sharded (FSDP2's
``DTensor``s, FSDP1 units, ZeRO-3's partitioned parameters), its image encoding is balanced,
where every rank generates together anyway (``synced_gpus=True``): in transformers 5 the step
that encodes images and videos before the first forward
(``_prepare_multimodal_encoder_kwargs_for_generation``, patched on the model's instance like the
two forwards), in transformers 4 the first forward (an empty cache).

**The contract relied on** (verified against transformers 5.24 and 4.57.6, ``modeling_qwen2_vl.py``,
``modeling_qwen2_5_vl.py``, ``modeling_qwen3_vl.py``, ``modeling_qwen3_vl_moe.py``,
``modeling_glm4v.py``, ``modeling_glm4v_moe.py``, and in 5.24 ``modeling_qwen3_5.py`` and
``modeling_qwen3_5_moe.py``, whose towers are Qwen3-VL's, GLM-4.6V's, GLM-OCR's, Qwen4-Exp's, the
Qwen2.5-Omni and Qwen3-Omni-MoE thinkers', EXAONE 4.5's, Cohere Compass's, Cosmos3-Omni's,
Cosmos3-Edge's, GLM-5-Next's, LFM3-VL's, ERNIE-4.5-VL's, Dots3-Note's, HyperCLOVAX Vision V2's,
Muse Spark's, Muse-Glimmer's, MiniMax-M3-VL's, PaddleOCR-VL's and Kimi-K2.5's, and in 5.25
LLaVA-OneVision-1.5's and Ovis2.5's; :func:`balance_vision_tower` checks the static part and names
what is missing):

1. Exactly one submodule of the model has a child module named ``visual`` (the tower; LFM3-VL,
   ERNIE-4.5-VL, Dots3-Note, Muse Spark, Muse-Glimmer, MiniMax-M3-VL, Kimi-K2.5 and Ovis2.5:
   ``vision_tower``;
   HyperCLOVAX Vision V2: ``vision_model``); that submodule is the base model. Its ``forward`` has
   parameters named ``pixel_values``, ``image_grid_thw``, ``pixel_values_videos`` and
   ``video_grid_thw``: image patch rows ``[sum(T*H*W), C]`` with their ``[n, 3]`` grid and the
   same for videos, ``None`` when absent. PaddleOCR-VL (:data:`_IMAGE_ONLY_MODEL_TYPES`) takes
   images only, no video parameter: its images alone are balanced; its rows are patch images
   ``[S, 3, patch, patch]``, moved flattened (Kimi-K2.5's image and video rows too). Any other
   model without both video parameters is refused.
2. The base ``forward`` encodes images only when ``pixel_values is not None`` and videos only
   when ``pixel_values_videos is not None``, each with one call ``visual(pixels, grid_thw=grid,
   **kwargs)`` where ``pixels`` is the whole modality's rows cast with
   ``pixels.type(visual.dtype)`` (or uncast, by a tower whose patch embedding casts them to its
   own dtype first, the same values: Dots3-Note's, HyperCLOVAX Vision V2's, Muse Spark's; Kimi-K2.5
   passes them uncast to a ``Conv2d``, which fails on any other dtype) and
   ``grid`` its whole grid (Qwen2/2.5-VL: ``get_image_features`` then ``get_video_features``;
   Qwen3-VL: both through ``get_image_features``, with ``return_dict=True``). Calls are matched to
   the modality by grid and row count, in any order.
   GLM-4.1V, GLM-4.5V, GLM-4.6V, GLM-OCR and GLM-5-Next (:data:`_VIDEO_STEPS_AS_IMAGES`) pass the
   tower a video grid with one row ``(1, H, W)`` per temporal step (GLM-4.xV's towers take no
   ``T > 1``): for those the drop-in encodes videos with that grid too
   (:attr:`BalancedVisionTower.step_grid_keys`).
3. The tower is called as ``visual(pixels, grid_thw, **kwargs)`` (Muse Spark, Muse-Glimmer,
   MiniMax-M3-VL, PaddleOCR-VL, Ovis2.5: ``pixel_values=pixels``) and returns tensors with one row per patch
   or per merged token, alone or in a tuple or ``ModelOutput`` (transformers 5:
   ``last_hidden_state`` per patch, ``pooler_output`` and each layer of Qwen3-VL's
   ``deepstack_features`` per merged token; 4.x: the merged tokens, and Qwen3-VL's deepstack list
   after them in a tuple); an image's rows depend on that image alone (attention never crosses
   images, Qwen2.5-VL's windows included). HF then splits the merged rows by
   ``grid.prod(-1) // spatial_merge_size**2`` (Muse Spark and Muse-Glimmer: ``config.merge_size``,
   their tower's ``spatial_merge_size`` being 1; see :func:`_output_merge`). Where a model's tower
   takes or gives a leading batch dimension of 1 (:data:`_TOWER_FORMS`: MiniMax-M3-VL returns
   ``[1, S, D]`` and a ``pooler_output`` ``[1, D]`` of the whole call, which the model replaces
   unread and the drop-in returns as None; PaddleOCR-VL is given ``[1, S, 3, patch, patch]``), the
   balanced call drops it for the engine and the served calls get it back. A video's rows for one
   temporal step depend on that step alone (attention within each step, no temporal position
   embedding), so the default configuration plans each step as an item of its own
   (``split_videos``; its cost model prices attention per step): ``CostModel.from_vit`` recognises
   the Qwen-VL towers by their type. MiniMax-M3-VL's and Kimi-K2.5's towers attend over a whole
   video with temporal positions (:data:`_WHOLE_CLIP_MODEL_TYPES`): their videos are planned whole,
   and ``split_videos=True`` raises a ``ValueError`` on every rank before any collective.
   Kimi-K2.5's tower also returns a ``pooler_output`` that pools each video's temporal steps into
   one ``[H*W/m**2, m*m, D]`` block (``m`` its square ``config.merge_kernel_size``), no rows the
   engine routes, which the model reads: the balanced call drops it and each modality gets the
   tower's own ``temporal_merge`` of its ``last_hidden_state`` rows (:attr:`_TowerForm.pooled_frames`;
   each pooled row reads one video's rows alone, so the values are the plain call's). Ovis2.5's
   model projects the last block's ``hidden_states`` (rows per patch, each image's in its window
   order): the balanced call asks the tower for them (:attr:`_TowerForm.keywords`). Its model
   projects before it embeds its tokens and embeds indicator tokens per modality after, so a rank
   touching or calling its projection without images does so at those places too
   (:attr:`_TowerForm.features_first`, :attr:`_TowerForm.late_call`).
4. The tower has ``dtype``, an int ``spatial_merge_size`` (PaddleOCR-VL's: its config's;
   Kimi-K2.5's: the side of its square ``config.merge_kernel_size``, and a ``temporal_merge``), and
   ``config.in_channels`` (or ``num_channels``), ``config.temporal_patch_size`` (1 when absent;
   Muse Spark and Muse-Glimmer: 3 channels and ``patch_temporal``; Kimi-K2.5: 3 channels) and
   ``config.patch_size`` (ints), which give ``C`` for the zero rows a rank without images sends.
   Where the merge HF splits by is not what the engine reads from the tower (Muse Spark,
   Muse-Glimmer, Kimi-K2.5), the balancer is built with it
   (:attr:`BalancedVisionTower.output_layout`); so is the Lightning mixin's module balancer, which
   its handle balances with.
5. The base ``forward`` returns a ``ModelOutput`` with a tensor ``last_hidden_state`` (or a tuple
   starting with it) that the loss depends on, as ``*ForConditionalGeneration`` computes logits
   from it. So the base takes no ``labels``: before 4.52, transformers kept the tower on the
   ``*ForConditionalGeneration``, which computes the loss itself.

Precomputed tower keyword arguments (``image_cu_seqlens``, ``video_position_ids``, ... and
``output_attentions`` / ``output_hidden_states`` of the tower) describe the local batch; the
balanced call never uses them (the tower recomputes what it needs from the balanced grid) and
the served calls ignore them. A tower call that matches no modality (contract broken at run time:
a model that encodes videos frame by frame, or image by image) is encoded directly on its rank,
as the plain model does, with a ``RuntimeWarning`` naming the call (once per handle): the same
outputs and gradients, that part unbalanced, and no rank left waiting. With the tower's parameters
sharded (FSDP2, FSDP1, ZeRO-3) that direct call would gather them on one rank only: it raises a
``RuntimeError`` instead. Bad inputs on any rank raise a ``ValueError`` on
every rank (the engine's metadata gather carries the problem; the rank at fault also says what
it found), never a hang.

**Sharded training.** Every rank runs each of the tower's blocks exactly once per balanced
forward (on its balanced batch, or the engine's dummy image), so FSDP / ZeRO-3 units around the
blocks (HF's ``_no_split_modules``) gather their parameters the same number of times on every
rank. The model's own tower calls (one per modality a rank has, so a different number on different
ranks) run none of the tower module's own hooks while the drop-in answers them, so hooks on the
tower run once per forward on every rank too: an FSDP2 unit around the tower gathers its
parameters once, and ZeRO-3, which hooks every module and requires the same module calls in the
same order on every rank, sees the tower called once everywhere. A forward hook on the tower
therefore runs once per balanced forward, for the balanced call. A wrapper module put in the
tower's place after :func:`balance_vision_tower` (FSDP1's) would run once per served call: it
raises a ``ValueError`` on every rank before any collective; wrap the tower's blocks with FSDP1
instead. ZeRO-3 gathers each submodule's parameters at each of its calls, and some towers call
one once per image in their blocks (LFM3-VL's convolution), so ranks encoding different numbers of
images would gather different numbers of times (the plain model aborts so too, wherever the ranks'
image counts differ): :func:`balance_vision_tower` makes the tower's blocks ZeRO-3 *leaves*
(DeepSpeed's ``_z3_leaf`` flag, as ``deepspeed.utils.set_z3_leaf_modules`` sets it), whose
parameters are gathered once per call of the block, and so is an image-only model's projection,
called once per forward (PaddleOCR-VL's projector, which projects each image apart). ZeRO-3
reduces a leaf's gradients when its inputs' gradients are computed, or, when none needs one, too
early (a frozen patch embedding before trained blocks, a frozen tower before a trained projection):
there each such leaf gets its input as a detached alias that requires grad. The flag is read by
``deepspeed.initialize``: install the drop-in before it (a model an engine holds already is left as
it is); :meth:`BalancedVisionTower.remove` clears the flags and hooks it set. DDP, FSDP2 (each
block and decoder layer a unit, also under Lightning's ``ModelParallelStrategy``, or the tower as
one unit) and DeepSpeed ZeRO-2 and ZeRO-3 (its CPU accelerator) are tested here (CPU, gloo).

**Compiling.** Compile the model as a whole (``torch.compile(model)``), the tower's blocks
(``block.compile()`` for each of ``visual.blocks``), or both: the plain model's losses and
gradients. In a compiled model the patched forwards run eagerly and the model's own forwards they
call are compiled (:mod:`lightning_vit_balance.eager`); the balanced call runs the blocks as they
are. A tower compiled as a whole (``visual.compile()`` or ``torch.compile(visual)``) would compile
the drop-in's own bookkeeping with it; it raises a ``ValueError`` instead.

For code that calls the tower itself, :func:`encode_visual` encodes a rank's images and videos in
one balanced call and returns the two outputs separately.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import math
import operator
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_vit_balance.balancer import (
    BalanceStats,
    PreparedPlan,
    ViTBalancer,
    checked_state,
    refuse_in_a_loader_worker,
)
from lightning_vit_balance.callsite import warn_at_user, warn_on_rank_zero
from lightning_vit_balance.config import ViTBalanceConfig, require_config, require_flag
from lightning_vit_balance.cost import CostModel, pixel_row_factors
from lightning_vit_balance.eager import eager, eager_frame
from lightning_vit_balance.encoding import INVALID_INPUT, gathered_per_call, parameters_sharded
from lightning_vit_balance.exchange import (
    current_group,
    gather_host_values,
    grid_rows,
    grid_steps,
    host_to_device,
    require_member,
    sharded_grads_all_zero,
)
from lightning_vit_balance.host_group import gathers_on, owned_host_group, release_host_group
from lightning_vit_balance.outputs import (
    OutputLayout,
    classify_outputs,
    describe_classification,
    flatten_output,
    merge_size_of,
    rebuild_output,
    unwrap_module,
    window_index_fn,
)
from lightning_vit_balance.problems import UncombinedInput
from lightning_vit_balance.recompute import in_backward_pass

__all__ = ["BalancedVisionTower", "balance_vision_tower", "encode_visual"]

#: The most balanced forwards' stats :meth:`BalancedVisionTower.pop_stats` keeps between reads.
KEPT_STATS = 1024

#: The base model's forward parameters the drop-in reads: (pixels, grid) per modality, in the
#: order the base model encodes them.
_MODALITIES: tuple[tuple[str, str, str], ...] = (
    ("images", "pixel_values", "image_grid_thw"),
    ("videos", "pixel_values_videos", "video_grid_thw"),
)
#: The batch keys a plan made ahead reads, (pixels, grid) per modality, in the encoding order.
_PREPARE_KEYS: tuple[tuple[str, str], ...] = tuple((pixels, grid) for _, pixels, grid in _MODALITIES)
#: A one-image input of a modality: ``(pixels, grid_thw)``.
_Dummy = tuple[torch.Tensor, torch.Tensor]
#: The base model's method that encodes and projects each modality (transformers 5).
_FEATURE_METHODS = {"images": "get_image_features", "videos": "get_video_features"}
#: The loop an eval-mode forward measures as (``ViTBalancer.measure_as``); training's is "train".
_EVALUATION_LOOP = "eval"
#: The batch key under which :meth:`BalancedVisionTower.plan_ahead`'s collator hands the model's
#: forward the batch's grids as collated, on the host.
GRIDS_KEY = "vit_balance_grids"
#: Named in the errors of a forward planned from the grids :meth:`BalancedVisionTower.plan_ahead`'s
#: collator carried: those grids, not the forward's, were planned.
_CARRIED_GRIDS = (
    f"the plan was made from the grids handle.plan_ahead's collator carried in the batch ({GRIDS_KEY}): "
    "a batch split or changed after collation does not match them; collate each micro-batch, or "
    "collate without plan_ahead"
)
#: The base model's forward parameters that carry ``generate()``'s cache (transformers 4.x, 5.x).
_CACHE_ARGUMENTS = ("past_key_values", "cache")
#: The ``generate()`` step of transformers 5 that encodes images and videos before the first
#: forward, through ``base_model.get_image_features`` / ``get_video_features``.
_GENERATION_ENCODE = "_prepare_multimodal_encoder_kwargs_for_generation"
#: The argument that hands ``generate()``'s first forward (and only that one) what
#: :data:`_GENERATION_ENCODE` encoded, a dict even where a rank encoded nothing (None otherwise).
_GENERATION_FEATURES = "mm_encoder_outputs"

#: Model types (the base model's ``config.model_type``) whose ``get_video_features`` calls the tower
#: with each temporal step of a video as a grid row ``(1, H, W)`` of its own, in order: GLM-4.1V,
#: GLM-4.5V (transformers 4.57 and 5.24), GLM-4.6V, GLM-OCR and GLM-5-Next (5.24). GLM-4.xV's towers
#: fail on a row with ``T > 1``.
_VIDEO_STEPS_AS_IMAGES = frozenset({"glm4v", "glm4v_moe", "glm46v", "glm_ocr", "glm5_next"})

Grid = tuple[int, int, int]


# -- contract checks -------------------------------------------------------------------------------


#: Model types (the base model's ``config.model_type``) whose tower is the child ``vision_tower``
#: and meets the contract otherwise (transformers 5.24): LFM3-VL, ERNIE-4.5-VL, Dots3-Note (its
#: tower's MoE blocks route each patch on its own, so a patch's rows do not depend on the batch),
#: Muse Spark and Muse-Glimmer (one tower; they pass the pixels by keyword, which
#: :meth:`BalancedVisionTower._serve` takes, and it merges its output by ``config.merge_size``, see
#: :func:`_output_merge`), MiniMax-M3-VL (its outputs carry a batch dimension:
#: :data:`_TOWER_FORMS`), Kimi-K2.5 (patch images, frames pooled in the tower: :data:`_TOWER_FORMS`)
#: and, in 5.25, Ovis2.5 (its projection reads the tower's last hidden states: :data:`_TOWER_FORMS`).
#: Other models with a ``vision_tower`` pass it differently (extra rows per merged row, 4-D pixels
#: packed without grids): not taken on trust; :func:`_other_tower_hint` says what to do instead.
_VISION_TOWER_MODEL_TYPES = frozenset(
    {
        "lfm3_vl",
        "ernie4_5_vl_moe",
        "dots3_note",
        "muse_spark",
        "muse_glimmer",
        "minimax_m3_vl",
        "kimi_k25",
        "ovis2_5",
    }
)
#: Model types whose tower is the child ``vision_model`` and meets the contract otherwise:
#: HyperCLOVAX-SEED Vision V2 (transformers 5.24), whose tower is Qwen2.5-VL's. Other models with a
#: ``vision_model`` (VideoLLaMA3: a merge size per image; Step3p7: fixed-size images, no grids) do
#: not meet it.
_VISION_MODEL_MODEL_TYPES = frozenset({"hyperclovax_vision_v2"})


@dataclass(frozen=True)
class _TowerForm:
    """How a tower takes its pixel rows and gives its outputs where it differs from the contract's
    ``visual(pixels [S, C], grid_thw)`` returning ``[rows, ...]`` tensors; the drop-in converts at
    the balanced call (the engine sees the contract's form) and back when it serves the model.

    Attributes:
        patch_rows: The base forward's pixel rows are ``[S, channels, patch, patch]``; the engine
            moves them flattened, ``[S, C]``.
        batched_input: The model passes the tower its rows with a leading batch dimension of 1.
        batched_output: Every tensor the tower returns has a leading batch dimension of 1.
        dropped: Outputs that are neither per patch nor per merged token and that the model
            overwrites unread; the balanced call returns None for them.
        pooled_frames: ``pooler_output`` pools each video's temporal steps into one block of
            ``H*W/m**2`` rows (``[rows, m*m, D]``), no kind the engine routes, yet the model reads
            it: dropped from the balanced call, each modality gets the tower's own
            ``temporal_merge`` of its ``last_hidden_state`` (:func:`_pool_frames`).
        keywords: ``(name, value)`` pairs the balanced call passes the tower, so that its outputs
            hold what the model's own calls read: Ovis2.5's ``get_image_features`` projects the
            last block's ``hidden_states`` (``output_hidden_states=-1``: that block's alone, one row
            per patch, the others None).
        features_first: The model projects its visual features before it embeds its tokens
            (Ovis2.5; Qwen-VL models embed first). A text-only rank's touch of the projection
            (:class:`_ProjectionTouch`) is then made before the embeddings, so that its backward
            hands the gradients over in the other ranks' order (ZeRO-2's buckets).
        late_call: The dotted path, from the base model, of a method of the projection that the
            model calls once per modality after embedding its tokens, with the device (Ovis2.5's
            ``multi_modal_projector.get_visual_indicator_features``): a rank that calls the
            projection on dummy items calls it there too, as often (ZeRO-3 gathers per call). In
            ``generate()``, whose encoding step embeds no tokens, it does so at the first forward,
            the one given :data:`_GENERATION_FEATURES`; any other forward drops those calls (a
            ``generate()`` that raised before its first forward left them armed).
    """

    patch_rows: bool = False
    batched_input: bool = False
    batched_output: bool = False
    dropped: tuple[str, ...] = ()
    pooled_frames: bool = False
    keywords: tuple[tuple[str, Any], ...] = ()
    features_first: bool = False
    late_call: str = ""


#: Base model types whose tower meets the contract up to its form (:class:`_TowerForm`), by the
#: model's code in transformers 5.24. MiniMax-M3-VL: ``last_hidden_state`` ``[1, S, D]`` and a
#: ``pooler_output`` ``[1, D]`` (the first patch of the whole call), which ``get_image_features``
#: replaces by the projected features unread. PaddleOCR-VL: pixel rows ``[S, 3, patch, patch]``
#: passed as ``[1, S, 3, patch, patch]``; its ``last_hidden_state`` is ``[S, D]``. Kimi-K2.5: pixel
#: rows ``[S, 3, patch, patch]``, ``last_hidden_state`` per patch and a ``pooler_output`` pooled over
#: each video's frames, which the projector reads.
_TOWER_FORMS: dict[str, _TowerForm] = {
    "minimax_m3_vl": _TowerForm(batched_output=True, dropped=("pooler_output",)),
    "paddleocr_vl": _TowerForm(patch_rows=True, batched_input=True),
    "kimi_k25": _TowerForm(patch_rows=True, dropped=("pooler_output",), pooled_frames=True),
    "ovis2_5": _TowerForm(
        keywords=(("output_hidden_states", -1),),
        features_first=True,
        late_call="multi_modal_projector.get_visual_indicator_features",
    ),
}
#: Base model types that take images only (no ``pixel_values_videos`` / ``video_grid_thw``) and meet
#: the contract otherwise: PaddleOCR-VL. Other image-only models are refused (GLM-Image gives its
#: tower a grid other than its forward's).
_IMAGE_ONLY_MODEL_TYPES = frozenset({"paddleocr_vl"})
#: A child of the base model (other than the tower) whose name holds one of these words projects
#: the tower's outputs into the language model: ``mm_projector``, ``multi_modal_projector``,
#: ``projector``, ``resampler_model``, ``vision_adapter``, ``vision_projection``. Other children
#: (``language_model``, ``audio_tower``) take no part in encoding images and videos.
_PROJECTION_WORDS = ("proj", "adapter", "resampler", "merger", "connector")
#: Tower config types without a ``spatial_merge_size`` attribute whose config's is the one HF splits
#: by: PaddleOCR-VL's (it merges in the projector, after the tower).
_MERGE_IN_CONFIG = frozenset({"paddleocr_vl_vision"})
#: Tower config types whose merge is the side of the square ``config.merge_kernel_size`` (no
#: ``spatial_merge_size`` anywhere): Kimi-K2.5's, which pools each ``m x m`` block in ``temporal_merge``.
_MERGE_BY_KERNEL = frozenset({"kimi_k25_vision"})
#: Base model types whose towers attend over a whole video with temporal positions (MiniMax-M3-VL:
#: one attention sequence per clip, 3-D rotary positions; Kimi-K2.5: one per video, a temporal
#: position embedding, frames pooled): ``split_videos`` would change their outputs, so a
#: configuration with it is refused.
_WHOLE_CLIP_MODEL_TYPES = frozenset({"minimax_m3_vl", "kimi_k25"})


def _model_type(module: Any) -> Any:
    """``module.config.model_type``, or None where it has none."""
    return getattr(getattr(module, "config", None), "model_type", None)


def _form_of(base: nn.Module) -> _TowerForm:
    """The tower form of ``base``'s model type (:data:`_TOWER_FORMS`), the contract's by default."""
    return _TOWER_FORMS.get(_model_type(base), _TowerForm())


def _tower_merge(tower: nn.Module) -> Any:
    """The tower's ``spatial_merge_size``, or its config's for :data:`_MERGE_IN_CONFIG`, or the side
    of its square ``config.merge_kernel_size`` for :data:`_MERGE_BY_KERNEL` (None when not square)."""
    if _model_type(tower) in _MERGE_IN_CONFIG and not hasattr(tower, "spatial_merge_size"):
        return getattr(tower.config, "spatial_merge_size", None)
    if _model_type(tower) in _MERGE_BY_KERNEL:
        kernel = getattr(tower.config, "merge_kernel_size", None)
        square = isinstance(kernel, (tuple, list)) and len(kernel) == 2 and kernel[0] == kernel[1]
        return kernel[0] if square else None
    return getattr(tower, "spatial_merge_size", None)


def _tower_name(module: nn.Module) -> str | None:
    """The name of ``module``'s vision tower child, or None: ``visual``, or ``vision_tower`` in a
    base model of :data:`_VISION_TOWER_MODEL_TYPES`, ``vision_model`` in one of
    :data:`_VISION_MODEL_MODEL_TYPES`."""
    if isinstance(module._modules.get("visual"), nn.Module):
        return "visual"
    model_type = _model_type(module)
    for name, allowed in (
        ("vision_tower", _VISION_TOWER_MODEL_TYPES),
        ("vision_model", _VISION_MODEL_MODEL_TYPES),
    ):
        if model_type in allowed and isinstance(module._modules.get(name), nn.Module):
            return name
    return None


#: Tower config types whose outputs are per merged token of ``config.merge_size`` while the tower's
#: own ``spatial_merge_size`` is 1: Muse Spark's (and Muse-Glimmer's, the same code), which runs its
#: windows and positions unmerged and merges each frame's ``merge x merge`` blocks at the end (a
#: pixel shuffle); HF splits its output by ``grid.prod(-1) // merge_size**2``.
_MERGED_BY_CONFIG = frozenset({"muse_spark_vision", "muse_glimmer_vision"})


def _output_merge(tower: Any, layout: OutputLayout | None = None) -> Any:
    """The spatial merge of the tower's per-merged-token outputs: the layout's when given, else
    ``config.merge_size`` for :data:`_MERGED_BY_CONFIG` (an int by :func:`_contract_problems`), the
    kernel's side for :data:`_MERGE_BY_KERNEL`, else the tower's ``spatial_merge_size``
    (:func:`~lightning_vit_balance.outputs.merge_size_of`)."""
    if layout is None and _model_type(tower) in _MERGED_BY_CONFIG:
        return getattr(tower.config, "merge_size", None)
    if layout is None and _model_type(tower) in _MERGE_BY_KERNEL:
        return _tower_merge(tower)
    return merge_size_of(tower, layout)


def _output_layout(tower: Any) -> OutputLayout | None:
    """The output layout a balancer of ``tower`` needs: its merge (:func:`_output_merge`) where the
    engine would read another from the tower (``merge_size_of``), else None (the engine's default)."""
    merge = _output_merge(tower)
    return OutputLayout(merge_size=merge) if merge != merge_size_of(tower) else None


def _find_base(model: Any) -> tuple[nn.Module, nn.Module]:
    """The submodule holding the vision tower (:func:`_tower_name`), and the tower."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"balance_vision_tower(model={type(model).__name__}) is invalid: expected a torch.nn.Module "
            "(a Hugging Face Qwen-VL or GLM-4.xV model)."
        )
    found = [(name, module) for name, module in model.named_modules() if _tower_name(module) is not None]
    if not found:
        raise ValueError(
            f"balance_vision_tower: {type(model).__name__} has no submodule with a child module named "
            "'visual' (looked for model.model.visual, model.visual and below; 'vision_tower' in "
            "LFM3-VL, ERNIE-4.5-VL, Dots3-Note, Muse Spark, Muse-Glimmer, MiniMax-M3-VL, Kimi-K2.5 "
            "and Ovis2.5, "
            "'vision_model' in HyperCLOVAX Vision V2): expected a Hugging Face Qwen-VL or GLM-4.xV model."
            f"{_other_tower_hint(model)}"
        )
    if len(found) > 1:
        names = ", ".join(f"{name or '<model>'}.{_tower_name(module)}" for name, module in found)
        raise ValueError(
            f"balance_vision_tower: {type(model).__name__} has several vision towers ({names}): expected "
            "exactly one; pass the submodule whose tower should be balanced."
        )
    base = found[0][1]
    return base, base._modules[_tower_name(base)]


#: Names other models give their vision encoder (HY-V4-VL, VideoLLaMA3, ...).
_OTHER_TOWER_NAMES = ("vision_tower", "vision_model")


def _other_tower_hint(model: nn.Module) -> str:
    """For a model whose vision encoder has another name: where it is, and how to balance it."""
    for name, module in model.named_modules():
        for child in _OTHER_TOWER_NAMES:
            if isinstance(module._modules.get(child), nn.Module):
                where = f"model.{name}.{child}" if name else f"model.{child}"
                return (
                    f" Its vision encoder is {where}, which the drop-in does not balance: if it "
                    "encodes each image on its own (attention within an image), call it through "
                    "ViTBalancer or ViTBalanceMixin.encode_images on every rank instead, as "
                    "vit(pixel_values [sum(T*H*W), C], grid_thw [n, 3]) returning one row per patch "
                    "or per merged token (wrap it to that form where it takes or returns a batch "
                    "dimension)."
                )
    return ""


def _generation_owner(model: nn.Module, base: nn.Module) -> nn.Module | None:
    """The module whose ``generate()`` encodes ``base``'s images and videos before the first forward
    (transformers 5: :data:`_GENERATION_ENCODE`, through ``base_model.get_image_features``), or None
    (transformers 4: the first forward encodes them)."""
    for module in model.modules():
        encodes = callable(getattr(type(module), _GENERATION_ENCODE, None))
        if encodes and getattr(module, "base_model", None) is base:
            return module
    return None


def _projection_names(base: nn.Module, tower: nn.Module) -> tuple[str, ...]:
    """The base model's children, other than the tower, that project its outputs (by name, see
    :data:`_PROJECTION_WORDS`) and hold parameters, in registration order."""
    return tuple(
        name
        for name, child in base.named_children()
        if child is not tower
        and any(word in name for word in _PROJECTION_WORDS)
        and any(True for _ in child.parameters())
    )


#: The attribute DeepSpeed reads to tell a ZeRO-3 *leaf* module (``deepspeed.utils.set_z3_leaf_modules``
#: sets it): ZeRO-3 gathers a leaf's parameters, its submodules' included, once per call of the leaf,
#: instead of once per call of each submodule. Read when ``deepspeed.initialize`` registers its hooks.
_ZERO3_LEAF = "_z3_leaf"


def _zero3_leaves(tower: nn.Module, projections: Iterable[nn.Module]) -> list[nn.Module]:
    """The modules made ZeRO-3 leaves: the tower's blocks (the elements of its outermost
    ``ModuleList``s) and ``projections``, projection modules called once per forward. Each runs
    once per forward on every rank, but some models call a submodule in them once per image:
    LFM3-VL's blocks convolve each image apart, PaddleOCR-VL's projector projects each image apart.
    ZeRO-3 gathers every module's parameters at each call, so ranks encoding different numbers of
    images (as balancing makes them) would gather different numbers of times: an abort or a hang.
    A leaf gathers once per call, the same on every rank. (ZeRO-3 reduces a leaf's gradients once
    per call of it: a module called more than once per forward, such as a projection called once
    per modality, cannot be one.)"""
    blocks: list[nn.Module] = []
    pending = [tower]
    while pending:
        module = pending.pop()
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                blocks.extend(child)
            else:
                pending.append(child)
    return [*blocks, *projections]


def _mark_zero3_leaves(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, Any]]:
    """Flag ``modules`` as ZeRO-3 leaves (see :data:`_ZERO3_LEAF`), each with the forward pre-hook
    :func:`_leaf_inputs_need_grad`, and return those flagged here (not leaves before) with their
    hook's handle, for :meth:`BalancedVisionTower.remove`. None where a DeepSpeed engine has
    registered its hooks on them already (it gave each module a ``ds_id``): the flag would come too
    late, so the model is left as it is."""
    modules = list(modules)
    if any(hasattr(module, "ds_id") for module in modules):
        return []
    marked = []
    for module in modules:
        if not getattr(module, _ZERO3_LEAF, False):
            setattr(module, _ZERO3_LEAF, True)
            marked.append((module, module.register_forward_pre_hook(_leaf_inputs_need_grad)))
    return marked


#: Base model types that call a submodule once per image (LFM3-VL's blocks convolve each image
#: apart, PaddleOCR-VL's projector projects each image apart): under ZeRO-3 they need the leaves
#: :func:`_mark_zero3_leaves` sets, or ranks holding different numbers of images gather a different
#: number of times.
_PER_IMAGE_CALL_MODEL_TYPES = frozenset({"lfm3_vl", "paddleocr_vl"})


def _defaults_dropped(config: ViTBalanceConfig, default: ViTBalanceConfig) -> dict[str, Any]:
    """The settings ``config`` leaves at ``ViTBalanceConfig()``'s values where the tower's
    ``default`` derives others, with the default's values (empty when it keeps or sets them)."""
    bare = ViTBalanceConfig()
    dropped: dict[str, Any] = {}
    if default.split_videos and not config.split_videos:
        dropped["split_videos"] = True
    seed_cost = CostModel.from_config(bare)
    if CostModel.from_config(config) == seed_cost != CostModel.from_config(default):
        for name in (f.name for f in fields(bare) if f.name.startswith("cost_")):
            if getattr(default, name) != getattr(bare, name):
                dropped[name] = getattr(default, name)
    return dropped


def _dropped_text(dropped: Mapping[str, Any]) -> str:
    """What :func:`_defaults_dropped` found, as the warning says it."""
    kept = []
    if "split_videos" in dropped:
        kept.append(
            "split_videos=False (the default plans each temporal step of a video as an item of its "
            "own, so that one long video does not bound the slowest rank)"
        )
    if any(name.startswith("cost_") for name in dropped):
        kept.append("cost model, the seed's l**2 (the default prices images by the tower's shape)")
    return " and ".join(kept)


def _warn_leaves_too_late(base: nn.Module, leaves: Sequence[nn.Module]) -> None:
    """Warn where a ZeRO-3 engine registered the modules of a model of
    :data:`_PER_IMAGE_CALL_MODEL_TYPES` before the drop-in could make its leaves (none set by the
    user either): its steps fail as soon as ranks hold different numbers of images."""
    if _model_type(base) not in _PER_IMAGE_CALL_MODEL_TYPES or not leaves:
        return
    if not any(hasattr(m, "ds_id") for m in leaves) or all(getattr(m, _ZERO3_LEAF, False) for m in leaves):
        return
    warn_on_rank_zero(
        f"balance_vision_tower: a DeepSpeed ZeRO-3 engine has registered {type(base).__name__}'s modules "
        "already, so the drop-in cannot make its tower's blocks (and an image-only model's projection) "
        "ZeRO-3 leaves. This model calls a submodule once per image: ranks holding different numbers "
        "of images then gather its parameters a different number of times (gloo aborts, NCCL hangs). "
        "Call balance_vision_tower before deepspeed.initialize (Hugging Face's Trainer and Lightning's "
        "DeepSpeed strategy initialize after it), or mark them with deepspeed.utils.set_z3_leaf_modules "
        "before it.",
    )


def _leaf_inputs_need_grad(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Forward pre-hook of a ZeRO-3 leaf the drop-in made. ZeRO-3 reduces a leaf's gradients in a
    full backward hook, which fires once the gradients of the leaf's positional tensor inputs are
    computed, but, when none of them requires grad, as soon as its outputs' are: before its own
    parameters' (a frozen patch embedding before trained blocks, a frozen tower before a trained
    projection), so ZeRO-3 would reduce them before they exist (zeros, or a crash in the backward
    as it frees the gathered parameters the backward still needs). Where an engine registered the
    leaf (``ds_id``) and it has trainable parameters, its first floating-point input is therefore
    made to require grad (a detached alias: the same values); the hook then fires after the
    parameters' gradients. A leaf given no such input raises instead, the same on every rank."""
    if not torch.is_grad_enabled() or not hasattr(module, "ds_id"):
        return None
    floating = [k for k, arg in enumerate(args) if isinstance(arg, torch.Tensor) and arg.is_floating_point()]
    if any(args[k].requires_grad for k in floating) or not any(p.requires_grad for p in module.parameters()):
        return None
    if not floating:
        raise RuntimeError(
            f"balance_vision_tower: the ZeRO-3 leaf {type(module).__name__} (one of the tower's blocks or "
            "an image-only model's projection, which the drop-in makes leaves) got no positional "
            "floating-point tensor, so ZeRO-3 would reduce its trainable parameters' gradients before "
            "they are computed; expected the hidden states as its first positional argument."
        )
    first = floating[0]
    return (*args[:first], args[first].detach().requires_grad_(), *args[first + 1 :])


#: Handles with training forwards since their tower's last optimizer step (or drop): the next
#: optimizer step asks each first (:func:`_before_optimizer_step`).
_STEP_WATCH: weakref.WeakSet[BalancedVisionTower] = weakref.WeakSet()
#: The one optimizer-step pre-hook of the process, registered with the first handle.
_STEP_HOOK: list[Any] = []
#: Handles in the order they were made (or reset), the same on every rank: several watched handles
#: end their steps in it, as a drop of sharded gradients is a collective.
_HANDLE_ORDER = itertools.count()


def _hook_optimizer_steps() -> None:
    """Register :func:`_before_optimizer_step` on torch optimizers' steps, once per process: loops
    of one's own, Fabric's and accelerate's step without a hook of ours between the backward and
    the step. Kept once registered (removing it within a step would change the hooks while torch
    runs them); it does nothing while no handle is watched."""
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_before_optimizer_step))


@eager  # a compiled optimizer step calls it as it is
def _before_optimizer_step(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Before ``optimizer`` steps: each watched handle's end of its step. A step given a closure
    (Lightning's, L-BFGS's) runs its forward and backward in the closure, after this hook: the
    handles are asked after each call of the closure instead, which the hook wraps."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        _end_watched_steps(optimizer)
        return None

    def closure_then_end() -> Any:
        loss = closure()
        _end_watched_steps(optimizer)
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_end}
    return (args[0], closure_then_end, *args[2:]), kwargs


def _end_watched_steps(optimizer: torch.optim.Optimizer) -> None:
    # Not the WeakSet's order, which follows object ids and so differs between ranks.
    for handle in sorted(_STEP_WATCH, key=operator.attrgetter("_order")):
        handle._before_optimizer_step(optimizer)


def _touchable(param: nn.Parameter) -> bool:
    """Whether a text-only rank's touch (:func:`_touch_zero`) gives ``param`` a gradient this rank
    can reduce like any other: not one gathered per call, where the touch would reach a placeholder
    or a shard."""
    return param.requires_grad and not gathered_per_call(param)


def _touch_zero(modules: Iterable[nn.Module]) -> torch.Tensor | None:
    """``+0.0`` through each submodule of ``modules`` with touchable parameters of its own (None
    for none): its backward gives each such parameter an all-zero gradient (``x - (+0.0)`` stays
    ``x``, see the module docstring) in the order the model's backward hands them over. Each
    submodule runs on an input of zero rows (:func:`_zero_rows_through`), so its own backward
    orders its parameters as the model's does (a LayerNorm's weight before its bias, a Linear's
    bias before its weight), and the submodules registered last come first, as in a backward
    through them in their forward order. ZeRO-2 places each gradient in its bucket in the order
    they arrive: zero-element slices of the parameters, last registered first, put a LayerNorm's
    weight and bias the other way round, and the ranks' buckets then held other gradients at the
    same places."""
    touched = [
        _zero_rows_through(sub, own)
        for module in modules
        for sub in module.modules()
        if (own := [param for param in sub.parameters(recurse=False) if _touchable(param)])
    ]
    if not touched:
        return None
    return torch.stack([t.to(touched[0].device) for t in touched]).sum()


def _zero_rows_through(module: nn.Module, own: list[nn.Parameter]) -> torch.Tensor:
    """``+0.0`` from ``module`` run on zero rows of the input its kind takes (:func:`_zero_rows`);
    from zero-element slices of ``own``, its parameters, where the kind is unknown, the call fails
    or its output does not depend on them (every rank's model is the same: the same way on all)."""
    rows = _zero_rows(module, own[0])
    if rows is not None:
        try:
            out = module(rows)
        except Exception:  # a module that takes no such rows: the slices below instead
            out = None
        if isinstance(out, torch.Tensor) and out.requires_grad and out.numel() == 0:
            return out.sum().float()
    return torch.stack([param.reshape(-1)[:0].sum().float() for param in own]).sum()


def _zero_rows(module: nn.Module, param: nn.Parameter) -> torch.Tensor | None:
    """An input of zero rows for ``module``: a Linear's ``[0, in_features]``, an embedding's
    ``[0]`` indices, a convolution's ``[0, in_channels, *kernel_size]``, a LayerNorm's
    ``[0, *normalized_shape]``, ``[0, d]`` for another module with a 1-d ``weight`` of ``d`` (an
    RMSNorm); None for any other module."""
    like = {"dtype": param.dtype, "device": param.device}
    if isinstance(module, nn.Linear):
        return torch.zeros((0, module.in_features), **like)
    if isinstance(module, nn.Embedding):
        return torch.zeros((0,), dtype=torch.long, device=param.device)
    if isinstance(module, nn.modules.conv._ConvNd):
        return torch.zeros((0, module.in_channels, *module.kernel_size), **like)
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and all(_positive_int(n) for n in shape):
        return torch.zeros((0, *shape), **like)
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return torch.zeros((0, weight.numel()), **like)
    return None


def _plus(zero: torch.Tensor | None, more: torch.Tensor | None) -> torch.Tensor | None:
    """``zero + more``, either None when nothing differentiable gave one (on ``zero``'s device)."""
    if zero is None or more is None:
        return more if zero is None else zero
    return zero + more.to(zero.device)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _contract_problems(base: nn.Module, tower: nn.Module) -> list[str]:
    """What ``base`` and ``tower`` lack of the module docstring's contract (empty when nothing)."""
    base_name, tower_name = type(base).__name__, type(tower).__name__
    problems = []
    parameters = inspect.signature(type(base).forward).parameters
    for modality, pixels, grid in _MODALITIES:
        image_only = modality == "videos" and _model_type(base) in _IMAGE_ONLY_MODEL_TYPES
        if image_only and pixels not in parameters and grid not in parameters:
            continue  # an image-only model: no video to encode (one that takes either is checked)
        for name in (pixels, grid):
            if name not in parameters:
                problems.append(f"{base_name}.forward has no parameter {name!r}")
    if "labels" in parameters:
        # The loss is computed inside, before the drop-in can tie it to the balanced call (a
        # *ForConditionalGeneration holding the tower itself: transformers before 4.52).
        problems.append(
            f"{base_name}.forward takes 'labels', so it computes the loss itself: the tower must sit in a "
            "base model whose output the loss is computed from (transformers >= 4.57)"
        )
    if "grid_thw" not in inspect.signature(type(tower).forward).parameters:
        problems.append(f"{tower_name}.forward has no parameter 'grid_thw'")
    if not isinstance(getattr(tower, "dtype", None), torch.dtype):
        problems.append(f"{tower_name} has no attribute 'dtype' (a torch.dtype)")
    if not _positive_int(_tower_merge(tower)):
        if _model_type(tower) in _MERGE_BY_KERNEL:
            problems.append(f"{tower_name}.config has no square 'merge_kernel_size' (two equal ints)")
        else:
            problems.append(f"{tower_name} has no int attribute 'spatial_merge_size'")
    elif not _positive_int(_output_merge(tower)):
        problems.append(f"{tower_name}.config has no int 'merge_size'")
    for name, value in pixel_row_factors(getattr(tower, "config", None)).items():
        if not _positive_int(value):
            problems.append(f"{tower_name}.config has no int {name!r}")
    if _form_of(base).pooled_frames and not callable(getattr(tower, "temporal_merge", None)):
        problems.append(f"{tower_name} has no method 'temporal_merge' to pool its frames with")
    return problems


def _wrapping_problem(base: nn.Module, tower: nn.Module) -> str | None:
    """Why the tower, as wrapped, cannot answer the model's own tower calls (or None).

    The model calls ``base.visual`` once per modality present on the rank. The drop-in answers
    those calls through the tower's patched ``forward``, with the tower's own hooks held back
    (:func:`_hold_hooks`), so hooks that gather parameters (FSDP2, ZeRO-3) run once per
    forward on every rank. A wrapper put in the tower's place after :func:`balance_vision_tower`
    (FSDP1 wraps the tower in a new module, ``torch.compile`` returns one) would run its own
    machinery once per call, a different number of times on different ranks (then ranks hang). A
    tower compiled as a whole would compile the drop-in's own bookkeeping, which fails; its blocks
    compile fine.
    """
    tower_name = type(tower).__name__
    name = _tower_name(base) or "visual"
    if base._modules.get(name) is not tower:
        replaced = type(base._modules.get(name)).__name__
        return (
            f"{type(base).__name__}.{name} was replaced by a {replaced} after balance_vision_tower; "
            f"apply the wrapper to the blocks of the {tower_name} instead (FSDP: shard each block; "
            "torch.compile: compile each block)"
        )
    # visual.compile() sets _compiled_call_impl; torch.compile(visual) returns a module wrapping _orig_mod.
    in_place = getattr(tower, "_compiled_call_impl", None) is not None
    if in_place or isinstance(getattr(tower, "_orig_mod", None), nn.Module):
        return (
            f"the vision tower {tower_name} is compiled as a whole (visual.compile() or "
            "torch.compile(visual)); compile each of its blocks instead (block.compile() for block in "
            "visual.blocks), which the balanced call runs as they are"
        )
    return None


def _step_grid_keys(base: nn.Module) -> tuple[str, ...]:
    """The base forward's grid arguments whose grids the model passes its tower one temporal step
    per row (:data:`_VIDEO_STEPS_AS_IMAGES`): the video grid, or none."""
    if _model_type(base) not in _VIDEO_STEPS_AS_IMAGES:
        return ()
    return tuple(grid for name, _, grid in _MODALITIES if name == "videos")


def _any_keyword(parameters: Mapping[str, inspect.Parameter]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _grid_problem(grid_name: str, grid: Any) -> str | None:
    """What is wrong with ``grid``, the forward's argument ``grid_name``, unless it is an integer
    tensor ``[n, 3]`` (None)."""
    if not isinstance(grid, torch.Tensor) or grid.dim() != 2 or grid.shape[1] != 3:
        return f"{grid_name} is {_describe(grid)}: expected an integer tensor [n, 3]"
    if grid.is_floating_point() or grid.is_complex() or grid.dtype == torch.bool:
        return f"{grid_name} has dtype {grid.dtype}: expected an integer tensor [n, 3]"
    return None


def _tower_channels(tower: Any) -> int | None:
    """``C`` of a pixel row from a Hugging Face tower's config, or None when it does not say."""
    shape = _patch_row_shape(tower)
    return math.prod(shape) if shape else None


def _patch_row_shape(tower: Any) -> tuple[int, ...]:
    """``(channels, patch, patch)`` of a patch image row (:attr:`_TowerForm.patch_rows`; flattened,
    a pixel row of any tower): the channels times the temporal patch, as the processor stacks them;
    ``()`` when the config does not tell (then :func:`_contract_problems` has refused the tower)."""
    values = list(pixel_row_factors(getattr(unwrap_module(tower), "config", None)).values())
    if not all(_positive_int(v) for v in values):
        return ()
    in_channels, temporal, patch = values
    return (in_channels * temporal, patch, patch)


def _served_rows(pixels: Any, batched: bool) -> int | None:
    """The patch rows of pixels the model passes its tower (``[1, S, ...]`` when ``batched``), or
    None when they are not of that form (the call then matches no modality)."""
    if not isinstance(pixels, torch.Tensor) or pixels.dim() == 0:
        return None
    if not batched:
        return int(pixels.shape[0])
    return int(pixels.shape[1]) if pixels.dim() >= 2 and pixels.shape[0] == 1 else None


def _placement(vit: Any) -> tuple[torch.device, torch.dtype]:
    """Device and dtype for the zero rows of a rank without images: the ViT's own."""
    inner = unwrap_module(vit)
    params = inner.parameters() if isinstance(inner, nn.Module) else iter(())
    param = next((p for p in params if p.is_floating_point()), None)
    dtype = getattr(inner, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = param.dtype if param is not None else torch.get_default_dtype()
    return (param.device if param is not None else torch.device("cpu")), dtype


# -- combining a rank's modalities and splitting the result -----------------------------------------


@dataclass(frozen=True)
class _Part:
    """One modality's rows in the combined batch: patch rows ``[start, stop)``."""

    name: str
    grid: tuple[Grid, ...]
    start: int
    stop: int
    #: The grid tensor the tower call got for this modality: the model passing that very tensor to
    #: its tower is answered without reading the grid's values back from the device.
    source: Any = field(default=None, compare=False, repr=False)


@dataclass
class _Combined:
    """A rank's images and videos as one tower input, or what is wrong with them."""

    pixels: torch.Tensor
    grid: torch.Tensor | None  # None when ``problems``: the engine then fails on every rank
    parts: list[_Part] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def encoded(self) -> tuple[int, int]:
        """``(patch rows, images)`` a tower call over this input covers (what :func:`_split` cuts)."""
        return int(self.pixels.shape[0]), sum(len(part.grid) for part in self.parts)


def _combine(
    inputs: Sequence[tuple[str, str, Any, str, Any]],
    vit: Any,
    cast: bool,
    row_shape: tuple[int, ...] = (),
    known: Mapping[str, tuple[Grid, ...]] | None = None,
) -> _Combined:
    """Concatenate the given modalities' rows and grids (``(name, pixels_name, pixels, grid_name,
    grid)`` each, ``pixels`` None when absent), rows cast to ``vit.dtype`` when ``cast``; rows
    ``[S, *row_shape]`` when ``row_shape`` is given (patch images, :class:`_TowerForm`), flattened.
    ``known``: grid rows per grid name, read on the host before the forward (a plan made ahead), used
    for a grid of as many rows instead of reading its values from the device; the prepared call
    compares the values on the device (``PreparedPlan.compare_on_device``).

    With no rows at all, ``pixels`` is ``[0, C]`` on the ViT's device, in its dtype (``C`` from the
    rows of an empty modality, else from the ViT's config).
    """
    device, dtype = _placement(vit)
    pixels: list[torch.Tensor] = []
    grids: list[torch.Tensor] = []
    parts: list[_Part] = []
    problems: list[str] = []
    start = 0
    for name, pixels_name, rows, grid_name, grid in inputs:
        if rows is None:
            continue
        checked = _modality_rows(pixels_name, rows, grid_name, grid, row_shape, (known or {}).get(grid_name))
        if isinstance(checked, str):
            problems.append(checked)
            continue
        rows, found = checked
        expected = int(rows.shape[0])
        pixels.append(rows.type(dtype) if cast else rows)
        grids.append(grid.to(torch.long))
        parts.append(_Part(name, found, start, start + expected, source=grid))
        start += expected
    if len({p.shape[1] for p in pixels}) > 1:
        widths = ", ".join(f"{part.name} C={p.shape[1]}" for part, p in zip(parts, pixels))
        problems.append(f"images and videos must have the same row width to be encoded together ({widths})")
    width = pixels[0].shape[1] if pixels else _tower_channels(vit)
    if width is None and not problems:  # rows were given where a modality was refused
        problems.append(
            "no rows were given and the ViT's config does not tell C: pass (pixel_values [0, C], "
            "grid_thw [0, 3]) for an absent modality"
        )
    if problems:
        return _Combined(torch.empty((0, width or 1), dtype=dtype, device=device), None, [], problems)
    if not pixels:
        empty_grid = torch.empty((0, 3), dtype=torch.long, device=device)
        return _Combined(torch.empty((0, width), dtype=dtype, device=device), empty_grid)
    return _Combined(torch.cat(pixels), torch.cat(grids), parts)


def _modality_rows(
    pixels_name: str,
    rows: Any,
    grid_name: str,
    grid: Any,
    row_shape: tuple[int, ...],
    known: tuple[Grid, ...] | None,
) -> tuple[torch.Tensor, tuple[Grid, ...]] | str:
    """A modality's pixel rows as ``[S, C]`` and its grid rows (``known`` when it has as many, else
    read from ``grid``), or what is wrong with them."""
    wrong_shape = _patch_rows_problem(pixels_name, rows, row_shape)
    if wrong_shape is not None:
        return wrong_shape
    if row_shape:
        rows = rows.flatten(1)  # a view: the engine moves [S, C] rows
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        return f"{pixels_name} is {_describe(rows)}: expected a 2-D tensor [sum(T*H*W), C]"
    problem = _grid_problem(grid_name, grid)
    if problem is not None:
        return problem
    planned = known is not None and len(known) == grid.shape[0]
    found = known if planned else grid_rows(grid)
    expected = sum(t * h * w for t, h, w in found)
    if rows.shape[0] == expected:
        return rows, found
    given = rows.shape[0]
    if not planned:
        return f"{pixels_name} has {given} rows: {grid_name} says {expected}"
    if grid.device.type == "meta":  # no values to read: the plan's count alone
        return f"{pixels_name} has {given} rows: the prepared plan holds {expected}"
    # The call's own grid tells which side is off (read now: the call fails anyway).
    said = sum(t * h * w for t, h, w in grid_rows(grid))
    own = (
        f"{pixels_name} has {given} rows, as {grid_name} says"
        if said == given
        else (f"{pixels_name} has {given} rows: {grid_name} says {said}")
    )
    return own if said == expected else f"{own}; the prepared plan holds {expected}"


def _patch_rows_problem(pixels_name: str, rows: Any, row_shape: tuple[int, ...]) -> str | None:
    """What is wrong with a modality's pixel rows for a tower taking patch images ``[S, *row_shape]``
    (:attr:`_TowerForm.patch_rows`), or None (also for any other tower: ``row_shape`` empty)."""
    if not row_shape or (isinstance(rows, torch.Tensor) and tuple(rows.shape[1:]) == row_shape):
        return None
    shape = ", ".join(map(str, row_shape))
    return f"{pixels_name} is {_describe(rows)}: expected a tensor [S, {shape}]"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return "None" if value is None else f"a {type(value).__name__}"


def _split(
    output: Any,
    parts: Sequence[_Part],
    encoded: tuple[int, int],
    merge: int,
    vit: Any,
    layout: OutputLayout | None = None,
) -> list[Any]:
    """``output`` of a tower call that encoded ``encoded = (patch rows, images)``, cut into one
    output per part (the parts in the call's order; a dummy call's have none of its rows);
    ``layout``: the call's, whose ``"image"`` outputs have a row per grid row of the call and whose
    ``"drop"`` outputs come back as None."""
    leaves, structure = flatten_output(output)
    has_window = window_index_fn(vit) is not None
    total, images = encoded
    found = classify_outputs(
        leaves,
        total_patches=total,
        images=images,
        merge_size=merge,
        has_window_index=has_window,
        layout=layout,
    )
    for (path, _), classification in zip(leaves, found):
        if classification.problem:
            raise ValueError(describe_classification(path, classification, merge))
    kinds = [classification.kind for classification in found]
    image_ends = itertools.accumulate(len(part.grid) for part in parts)
    pieces = []
    for part, image_end in zip(parts, image_ends):
        new: list[Any] = []
        for (_, leaf), kind in zip(leaves, kinds):
            if kind == "patch":
                new.append(leaf[part.start : part.stop])
            elif kind in ("merged", "window_index"):
                a, b = part.start // merge**2, part.stop // merge**2
                # A window index numbers the merged tokens of the whole call: renumber from 0.
                new.append(leaf[a:b] if kind == "merged" else leaf[a:b] - a)
            elif kind == "image":
                new.append(leaf[image_end - len(part.grid) : image_end])
            else:
                new.append(None if kind == "drop" else leaf)
        pieces.append(rebuild_output(structure, new))
    return pieces


def _pool_frames(tower: Any, parts: Sequence[_Part], outputs: Sequence[Any]) -> None:
    """Give each part's output the ``pooler_output`` a :attr:`_TowerForm.pooled_frames` tower makes
    for that part's rows alone: its own ``temporal_merge`` of the part's ``last_hidden_state``. Each
    pooled row sums one video's rows in a fixed order, so the values are the plain call's."""
    kernel = tower.config.merge_kernel_size
    for part, output in zip(parts, outputs):
        hidden = output["last_hidden_state"]
        grid = host_to_device(torch.tensor(part.grid, dtype=torch.long).reshape(-1, 3), hidden.device)
        output["pooler_output"] = tower.temporal_merge(hidden, grid, *kernel)


def _flat_parameter_view(param: torch.Tensor) -> bool:
    """Whether ``param`` is an FSDP1 unit's original parameter (``use_orig_params=True``): a view
    into the unit's ``FlatParameter``, marked as flattened, but not one itself."""
    if not getattr(param, "_fsdp_flattened", False):
        return False
    try:
        from torch.distributed.fsdp._flat_param import FlatParameter
    except ImportError:  # torch's layout moved: take it for a view, whose zeros then stay
        return True
    return not isinstance(param, FlatParameter)


def _zero_grads(grads: Sequence[torch.Tensor]) -> list[bool]:
    """Whether each of ``grads`` holds zeros only: one read from each device that holds some."""
    zero = [True] * len(grads)
    by_device: dict[torch.device, list[int]] = {}
    for index, grad in enumerate(grads):
        if grad.numel() > 0:
            by_device.setdefault(grad.device, []).append(index)
    for indices in by_device.values():
        peaks = torch.stack([grads[i].detach().abs().amax().float() for i in indices]).tolist()
        for index, peak in zip(indices, peaks):
            zero[index] = peak == 0.0
    return zero


def _exact_zero(output: Any) -> torch.Tensor | None:
    """``+0.0`` depending on every differentiable tensor of ``output`` (zero-row slices summed)."""
    leaves, _ = flatten_output(output)
    zeros = [
        leaf[:0].sum()
        for _, leaf in leaves
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.requires_grad
    ]
    if not zeros:
        return None
    return torch.stack([z.float() for z in zeros]).sum()


# -- the engine-level helper ------------------------------------------------------------------------


def encode_visual(
    vit: Any,
    images: tuple[torch.Tensor, torch.Tensor] | None = None,
    videos: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    balancer: ViTBalancer | None = None,
    prepared: PreparedPlan | None = None,
    output_layout: OutputLayout | Mapping[str, str] | None = None,
) -> tuple[Any, Any]:
    """Encode a rank's images and videos with one ViT call (one balanced exchange); split the result.

    For code that calls the ViT itself: instead of one call for images and one for videos (two
    exchanges, and a hang when ranks make different numbers of calls), both modalities go through
    one call of ``balancer(vit, pixel_values, grid_thw)`` (``vit(...)`` without one), images first.

    Args:
        vit: Called as ``vit(pixel_values, grid_thw)``; see :class:`~lightning_vit_balance.ViTBalancer`.
        images: ``(pixel_values [sum(T*H*W), C], grid_thw [n, 3])`` of this rank's images, or None.
        videos: The same for videos (same ``C``), or None.
        balancer: Balances the call across its group; every rank of the group must call
            :func:`encode_visual` (with or without images and videos: a rank with neither passes
            ``None`` for both where the tower's config tells the row width ``C``, else zero rows
            ``(pixel_values [0, C], grid_thw [0, 3])``). None calls ``vit`` directly.
        prepared: The plan ``balancer.prepare`` made before the forward for the images' rows
            followed by the videos' (then the call makes no metadata gather).
        output_layout: Kinds of the ViT's outputs where their rows do not tell (see
            :class:`~lightning_vit_balance.OutputLayout`), by which the output is cut between
            images and videos: ``{"pooled": "image"}`` for a row per image or video. Default: the
            balancer's ``output_layout``; given with a balancer, it must be the balancer's.

    Returns:
        ``(image_output, video_output)``: each what ``vit`` returns for that modality's rows alone
        (same structure, tensors of rows cut to the modality's; None for outputs named
        ``"drop"``), with zero rows for an absent modality. Backpropagate through both on every
        rank, zero rows included (as a VLM does when it scatters them into its input embeddings):
        the balanced call's backward pass is a collective.

    Raises:
        ValueError: On every rank of the group, when some rank's input is invalid; on this rank,
            when ``output_layout`` is not the balancer's.
    """
    _check_visual_arguments(images, videos, balancer, prepared)
    layout = _visual_layout(balancer, output_layout)
    given = []
    for name, value in (("images", images), ("videos", videos)):
        rows, grid = value if value is not None else (None, None)
        given.append((name, f"{name}[0]", rows, f"{name}[1]", grid))
    # With a plan made ahead, its grid rows: none is read back from the device.
    combined = _combine(given, vit, cast=False, known=_prepared_rows(prepared, given))
    merge = _output_merge(vit, layout)
    output, encoded = _encode_combined(vit, combined, balancer, merge, prepared)
    parts = {part.name: part for part in combined.parts}
    # An absent modality gets zero rows (rows [0, 0) of every token output).
    wanted = [parts.get(name) or _Part(name, (), 0, 0) for name in ("images", "videos")]
    image_output, video_output = _split(output, wanted, encoded, merge, vit, layout)
    return image_output, video_output


def _check_visual_arguments(images: Any, videos: Any, balancer: Any, prepared: Any) -> None:
    for name, value in (("images", images), ("videos", videos)):
        if value is not None and not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise TypeError(
                f"encode_visual({name}={_describe(value)}) is invalid: expected (pixel_values, grid_thw) "
                "or None."
            )
    for name, value, kind in (("balancer", balancer, ViTBalancer), ("prepared", prepared, PreparedPlan)):
        if value is not None and not isinstance(value, kind):
            raise TypeError(
                f"encode_visual({name}={_describe(value)}) is invalid: expected a {kind.__name__} or None."
            )


def _visual_layout(
    balancer: ViTBalancer | None, output_layout: OutputLayout | Mapping[str, str] | None
) -> OutputLayout | None:
    """The layout :func:`encode_visual` cuts its output by: ``output_layout``, else the balancer's."""
    layout = OutputLayout.of(output_layout)
    if balancer is None or layout is None:
        return layout if balancer is None else balancer.output_layout
    if layout != balancer.output_layout:
        raise ValueError(
            f"encode_visual(output_layout={layout!r}) is invalid: the balancer's is "
            f"{balancer.output_layout!r}. Expected the balancer's (or none, which takes it): its "
            "outputs are routed by it."
        )
    return layout


def _prepared_rows(
    prepared: PreparedPlan | None, given: Sequence[tuple[str, str, Any, str, Any]]
) -> dict[str, tuple[Grid, ...]] | None:
    """The grid rows of ``prepared``'s call (images' then videos'), per grid name of ``given``, cut
    by each grid's row count; None without a plan, or where the counts do not add up (the rows are
    then read, and the call's checks report the difference)."""
    if prepared is None:
        return None
    rows, start, known = prepared.call_grid_rows, 0, {}
    for _, _, pixels, grid_name, grid in given:
        if pixels is not None and isinstance(grid, torch.Tensor) and grid.dim() == 2:
            known[grid_name] = rows[start : start + grid.shape[0]]
            start += grid.shape[0]
    return known if start == len(rows) else None


def _balanced_call(
    balancer: ViTBalancer, vit: Any, combined: _Combined, caller: str, prepared: PreparedPlan | None = None
) -> Any:
    """``balancer(vit, ...)`` on the combined rows; a rank whose modalities could not be combined
    sends no grid, so the engine raises on every rank, and this rank says why. ``prepared``: the
    plan made for these rows before the forward (see ``ViTBalancer.prepare``)."""
    grid = UncombinedInput(tuple(combined.problems)) if combined.problems else combined.grid
    try:
        return balancer(vit, combined.pixels, grid, prepared=prepared)
    except ValueError as err:
        # Where a plan was made ahead, the shared text names the cause already (the status carries it).
        told = all(problem in str(err) for problem in combined.problems)
        detail = f" On this rank: {'; '.join(combined.problems)}." if not told else ""
        raise ValueError(f"{caller}: this rank's images and videos, encoded together: {err}{detail}") from err


def _encode_combined(
    vit: Any,
    combined: _Combined,
    balancer: ViTBalancer | None,
    merge: int,
    prepared: PreparedPlan | None = None,
) -> tuple[Any, tuple[int, int]]:
    """The one ViT call over ``combined``, and the patch rows and images its output covers."""
    if balancer is not None:
        return _balanced_call(balancer, vit, combined, "encode_visual", prepared), combined.encoded
    if combined.problems:
        raise ValueError(f"encode_visual: {'; '.join(combined.problems)}.")
    if combined.pixels.shape[0]:
        return vit(combined.pixels, combined.grid), combined.encoded
    # Nothing to encode: a one-image dummy call gives the output's structure (cut to zero rows).
    pixels = combined.pixels.new_zeros((merge * merge, combined.pixels.shape[1]))
    grid = torch.tensor([[1, merge, merge]], device=combined.pixels.device)
    return vit(pixels, grid), (merge * merge, 1)


# -- the drop-in -------------------------------------------------------------------------------------


class _Forward:
    """The instance-level ``forward`` of the base model or tower (or ``generate()``'s encoding step
    of the model): calls the handle's method.

    A plain picklable object (not a closure), so the patched model pickles (``ddp_spawn``) and
    deep-copies with its handle. ``inspect.signature`` sees the original forward's signature.

    The handle's :meth:`~BalancedVisionTower._route` picks what to run (:class:`_Route`): this
    frame runs it, so that ``torch.compile`` of the whole model compiles the model's own forwards
    and leaves the drop-in's bookkeeping eager (see :mod:`lightning_vit_balance.eager`).
    """

    def __init__(self, handle: BalancedVisionTower, which: str) -> None:
        self.handle = handle
        self.which = which

    @eager_frame
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # In a compiled model this frame and the handle's routing run eagerly; the forward the
        # route names (the model's own, most often) is compiled with the model.
        route = self.handle._route(self.which, args, kwargs)
        try:
            output = route.forward(*route.args, **route.kwargs)
        finally:
            if route.done is not None:
                route.done()
        return output if route.finish is None else route.finish(output)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.handle._original(self.which))


class _Route(NamedTuple):
    """What a patched forward runs: ``forward(*args, **kwargs)``, then ``done()`` whether it raised
    or not, and ``finish(output)`` when it did not. ``done`` and ``finish`` run eagerly."""

    forward: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    done: Callable[[], None] | None = None
    finish: Callable[[Any], Any] | None = None


class _HostGrids:
    """A batch's grids as its collator made them, under :data:`GRIDS_KEY`: ``(grid key, value)``
    pairs. Neither a tensor, a collection nor a dataclass, so what moves a batch's tensors to the
    device (accelerate, the ``Trainer``, Lightning's and Fabric's ``apply_to_collection``, which
    rebuilds dataclasses) passes it on as it is, on the host; its ``to``, ``cpu`` and ``cuda``
    return it as it is, for loops that move every value (``{k: v.to(device) for k, v in ...}``)."""

    __slots__ = ("grids",)

    def __init__(self, grids: tuple[tuple[str, Any], ...]) -> None:
        self.grids = grids

    def to(self, *args: Any, **kwargs: Any) -> _HostGrids:
        """This object: the grids stay on the host, where the plan is made."""
        return self

    cpu = cuda = to

    def __repr__(self) -> str:
        return f"_HostGrids({self.grids!r})"


class _GridsOnHost:
    """The collator :meth:`BalancedVisionTower.plan_ahead` returns: ``collate_fn``, then the batch's
    grids as :class:`_HostGrids` under :data:`GRIDS_KEY`. A plain object, so DataLoader workers
    can take it (it holds no model)."""

    def __init__(self, collate_fn: Callable[[Any], Any], grid_keys: tuple[str, ...]) -> None:
        self.collate_fn = collate_fn
        self.grid_keys = grid_keys

    def __call__(self, features: Any) -> Any:
        batch = self.collate_fn(features)
        if not isinstance(batch, MutableMapping):
            raise TypeError(
                f"BalancedVisionTower.plan_ahead: the collator returned a {type(batch).__name__}: "
                "expected a mutable mapping (a dict or a BatchFeature) of the model's keyword arguments."
            )
        batch[GRIDS_KEY] = _HostGrids(tuple((key, batch.get(key)) for key in self.grid_keys))
        return batch


def _take_grids(kwargs: dict[str, Any]) -> _HostGrids | None:
    """The grids :meth:`BalancedVisionTower.plan_ahead`'s collator put in a forward's keyword
    arguments, taken out of them; None (and ``kwargs`` as they were) when there are none."""
    if not isinstance(kwargs.get(GRIDS_KEY), _HostGrids):
        return None
    return kwargs.pop(GRIDS_KEY)


@dataclass
class _Pending:
    """The balanced result of one forward, waiting to answer the model's own tower calls.

    Attributes:
        parts: Where each modality's rows are in the balanced call's output.
        outputs: The output cut to each part.
        served: Which parts the model's tower calls took.
        zero: ``+0.0`` depending on every differentiable output of the call (None: none is).
    """

    parts: list[_Part]
    outputs: list[Any]
    served: list[bool]
    zero: torch.Tensor | None
    touch: _ProjectionTouch | None = None
    #: While a dummy image's feature call runs: the only modality a tower call may take (a real
    #: image of the dummy's grid must not answer it).
    only: str | None = None


class _ProjectionTouch:
    """A text-only rank's touch of the projection's parameters (see the module docstring), made
    when the model embeds its tokens: where the other ranks' models project the tower's outputs
    too, just after embedding them (or, in a model that projects first, just before). So their
    backward reaches those parameters in the same order as on every other rank, next to the token
    embeddings: ZeRO-2 reduces gradients in buckets filled in the order they arrive, and a touch
    made anywhere else put them in other places.

    A forward hook on the input embeddings, for one forward: it subtracts the touch's ``+0.0``
    from their output (bit for bit the same values); with ``early``, the touch is made in a
    pre-hook, before the embeddings, and subtracted after them. ``late_of`` gives more ``+0.0``
    made after the embeddings (calls the model makes there, see :class:`_TowerForm`). A forward
    that embeds nothing (given ``inputs_embeds``) is touched when it ends instead (:meth:`finish`).
    """

    def __init__(
        self,
        zero_of: Callable[[], torch.Tensor | None],
        embeddings: nn.Module | None,
        early: bool = False,
        late_of: Callable[[], torch.Tensor | None] | None = None,
    ) -> None:
        self.zero_of, self.late_of = zero_of, late_of
        self.done = False
        self._zero: tuple[torch.Tensor | None] | None = None
        self._hooks: list[Any] = []
        if embeddings is not None:
            if early:
                # Before any other pre-hook: ZeRO-3's gathers the embeddings' parameters in one, and
                # the other ranks gather the projection's first.
                self._hooks.append(embeddings.register_forward_pre_hook(self._before, prepend=True))
            self._hooks.append(embeddings.register_forward_hook(self._touched))

    @classmethod
    def arm(
        cls,
        zero_of: Callable[[], torch.Tensor | None],
        base: nn.Module,
        early: bool = False,
        late_of: Callable[[], torch.Tensor | None] | None = None,
    ) -> _ProjectionTouch:
        """A touch that subtracts ``zero_of()`` (and ``late_of()``) from ``base``'s next token
        embeddings, ``zero_of()`` made before them when ``early``."""
        try:
            embeddings = base.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            embeddings = None
        return cls(zero_of, embeddings if isinstance(embeddings, nn.Module) else None, early, late_of)

    def _first(self) -> torch.Tensor | None:
        if self._zero is None:
            self._zero = (self.zero_of(),)
        return self._zero[0]

    def _all(self) -> torch.Tensor | None:
        zero = self._first()
        return zero if self.late_of is None else _plus(zero, self.late_of())

    def _before(self, module: nn.Module, args: Any) -> None:
        if not self.done:
            self._first()

    def _touched(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.done or not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        self.done = True
        self.release()  # once: later embeddings of this forward are left alone
        zero = self._all()
        return output if zero is None else output - zero.to(device=output.device, dtype=output.dtype)

    def release(self) -> None:
        """Remove the hooks (the forward is over, whether it raised or not)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def finish(self, zero: torch.Tensor | None, late: bool = True) -> torch.Tensor | None:
        """``zero``, plus the touch when the forward embedded no tokens (without ``late_of`` when
        not ``late``: :meth:`later` makes it); the hooks are removed."""
        self.release()
        if self.done:
            return zero
        self.done = True
        return _plus(zero, self._all() if late else self._first())

    def later(self, base: nn.Module) -> _ProjectionTouch | None:
        """A touch of ``late_of`` alone at ``base``'s next token embeddings, or None without one:
        for ``generate()``, whose encoding step embeds no tokens and whose first forward does."""
        return None if self.late_of is None else _ProjectionTouch.arm(self.late_of, base)


def _then_touched(forward: Callable[..., Any], touch: _ProjectionTouch, *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)``, then ``touch``'s feature calls on its dummy images, while the
    balanced result still answers tower calls (``generate()``'s encoding step: no backward, so the
    zero is dropped)."""
    output = forward(*args, **kwargs)
    touch.finish(None, late=False)
    return output


class BalancedVisionTower:
    """The handle :func:`balance_vision_tower` returns; see the module docstring for the contract.

    Attributes:
        model: The model passed in.
        base: The submodule holding the tower (``model.model`` for ``*ForConditionalGeneration``).
        tower: ``base.visual`` (``vision_tower`` or ``vision_model`` for the families the README lists).
        config: Balancing settings (``None``: :meth:`default_config`, ``ViTBalanceConfig()`` with
            the cost model of the tower, ``CostModel.from_vit(tower)``: its FLOPs, attention within
            each temporal step, and ``split_videos`` where the tower attends within each step).
        group: The data-parallel process group (``None``: the default group).
        evaluation: Whether evaluation forwards are balanced too (see the module docstring).
        step_grid_keys: The base forward's grid arguments (``"video_grid_thw"``, or none) whose
            videos the model passes its tower one temporal step per grid row, and the drop-in
            encodes so (GLM-4.xV). A plan made ahead of the forward must be made from those rows.
        projection: The base model's children that project the tower's outputs outside the tower
            (e.g. ``("mm_projector",)`` in Kimi-K2.5; none in Qwen-VL, whose merger is in the
            tower). In a training forward a text-only rank gives their parameters all-zero
            gradients, as DDP without ``find_unused_parameters`` and FSDP2 need; where their
            parameters are gathered per call (ZeRO-3), a rank lacking a modality calls them on a
            dummy item (see the module docstring). A tuple of attribute names of ``base``; set it
            for a model whose projection is named otherwise.
        last_stats: Diagnostics of the latest balanced forward (``None`` before the first).
        calls: Balanced forwards so far (one exchange each).
        applied_calls: Those in which images moved between ranks.
        unmatched_calls: The model's own tower calls that matched no modality of the balanced call
            (contract broken at run time), which this rank encoded directly, as the plain model
            does (with sharded tower parameters such a call raises instead); and tower calls in a
            training forward outside the base forward (a model that calls its tower itself),
            encoded directly too. Both warn once.

    Subclasses may override :meth:`settings` (where the configuration and group come from at each
    forward) and :meth:`record` (what happens to each forward's stats), as the Lightning mixin does.
    Pickling or deep-copying the model copies the handle without its process group and balancer:
    the copy balances over the default group unless its ``group`` is set again.
    """

    def __init__(
        self,
        model: nn.Module,
        config: ViTBalanceConfig | None = None,
        group: dist.ProcessGroup | None = None,
        *,
        evaluation: bool = False,
    ) -> None:
        _check_arguments(config, group, evaluation)
        base, tower = _find_base(model)
        problems = _contract_problems(base, tower)
        wrapping = _wrapping_problem(base, tower)
        problems += [wrapping] if wrapping is not None else []
        if problems:
            raise ValueError(
                f"balance_vision_tower: {type(model).__name__} does not meet the drop-in's contract: "
                + "; ".join(problems)
                + " (see lightning_vit_balance.hf for what a Qwen-VL model must provide"
                + f"{_transformers_note()})."
            )
        for module in (base, tower):
            if isinstance(module.__dict__.get("forward"), _Forward):
                raise ValueError(
                    f"balance_vision_tower: {type(model).__name__} is already balanced: call remove() on "
                    "its handle (BalancedVisionTower.of(model)) first."
                )
        self.model, self.base, self.tower = model, base, tower
        self.step_grid_keys = _step_grid_keys(base)
        self._projection = _projection_names(base, tower)
        self._form = _form_of(base)
        self._row_shape = _patch_row_shape(tower) if self._form.patch_rows else ()
        # transformers 5's towers return a ModelOutput when asked; 4.57's GLM tower takes no keyword.
        takes = inspect.signature(type(tower).forward).parameters
        self._tower_keywords = {"return_dict": True} if "return_dict" in takes or _any_keyword(takes) else {}
        self._tower_keywords.update(self._form.keywords)
        self.config = config
        self.group = group
        self.evaluation = evaluation
        self._derived: ViTBalanceConfig | None = None
        self.last_stats: BalanceStats | None = None
        self.calls = 0
        self.applied_calls = 0
        self.unmatched_calls = 0
        self._reset_runtime()
        # The patched methods, (module, attribute name) by role, and what they replaced (_patch).
        self._patched: dict[str, tuple[Any, str]] = {}
        self._saved: dict[str, Any] = {}
        self._patch("base", base, "forward")
        self._patch("tower", tower, "forward")
        leaves = _zero3_leaves(tower, self._projections_called_once())
        self._leaves = _mark_zero3_leaves(leaves)
        _warn_leaves_too_late(base, leaves)
        owner = _generation_owner(model, base)
        if owner is not None:
            self._patch("generation", owner, _GENERATION_ENCODE)

    @property
    def pixel_dtype(self) -> torch.dtype:
        """The dtype pixel rows are encoded in: the tower's, as the model casts them
        (``pixels.type(visual.dtype)``); a plan made ahead of the forward is made for it."""
        return _placement(self.tower)[1]

    @classmethod
    def of(cls, model: nn.Module) -> BalancedVisionTower | None:
        """The handle balancing ``model``'s vision tower, or None."""
        base, _ = _find_base(model)
        patched = base.__dict__.get("forward")
        return patched.handle if isinstance(patched, _Forward) else None

    @property
    def projection(self) -> tuple[str, ...]:
        """The base model's children that project the tower's outputs (see the class docstring)."""
        return self._projection

    @projection.setter
    def projection(self, names: Sequence[str]) -> None:
        # Checked here, the same on every rank: at a forward only text-only ranks would read them.
        children = dict(self.base.named_children())
        base = type(self.base).__name__
        expected = f"expected a sequence of names of {base}'s children ({', '.join(children)})"
        if isinstance(names, str):
            raise ValueError(
                f"BalancedVisionTower.projection = {names!r} is invalid: {expected}, not a string "
                f"(a one-name projection is ({names!r},))."
            )
        unknown = [name for name in names if not isinstance(name, str) or name not in children]
        if unknown:
            raise ValueError(
                f"BalancedVisionTower.projection = {names!r} is invalid: {expected}; not children: {unknown}."
            )
        self._projection = tuple(names)
        self._leaves += _mark_zero3_leaves(self._projections_called_once())

    def _projections_called_once(self) -> list[nn.Module]:
        """:attr:`projection`'s modules where the model calls them once per forward (an image-only
        model); none where it calls them once per modality, which ZeRO-3's leaves do not allow."""
        if _model_type(self.base) not in _IMAGE_ONLY_MODEL_TYPES:
            return []
        return self._projection_modules()

    def _projection_modules(self) -> list[nn.Module]:
        """:attr:`projection`'s modules, as they are now (PEFT or a wrapper may have replaced their
        parameters since the drop-in was installed)."""
        return [getattr(self.base, name) for name in self._projection]

    @property
    def installed(self) -> bool:
        """Whether this handle still balances its model's tower (not removed, nor replaced by a
        later :func:`balance_vision_tower`, which patches the same base model). Read from the base
        model this handle patched: walking a 7B model's modules as :meth:`of` does took 1.2 ms, and
        a step with a plan made ahead asks a few times."""
        patched = self.base.__dict__.get("forward")
        return isinstance(patched, _Forward) and patched.handle is self

    def _reset_runtime(self) -> None:
        self._balancer: ViTBalancer | None = None
        self._balancer_key: tuple[Any, ...] | None = None
        self._pending: _Pending | None = None
        self._encoding = False
        self._ticket: PreparedPlan | None = None
        #: The rows of the :attr:`step_grid_keys` grids of the batch :attr:`_ticket` was prepared for,
        #: read on the host: the per-step grid is indexed from them (:meth:`_tower_grid`).
        self._ticket_rows: dict[str, tuple[Grid, ...]] | None = None
        #: A loaded state the next balancer starts from (plain values: kept by pickling too).
        self._carried: dict[str, Any] | None = getattr(self, "_carried", None)
        self._twin: Any = None
        #: The group (the default group itself for None) the twin was made for, or _NO_GROUP.
        self._twin_of: Any = _NO_GROUP
        #: Stats kept for :meth:`pop_stats`, once it was called (None: nobody reads them).
        # Each kept forward's stats, with whether it was a training forward (pop_stats).
        self._kept: collections.deque[tuple[bool, BalanceStats]] | None = None
        if hasattr(self, "_late_touch"):  # a reset, not the first: its hooks go
            self._release_late_touch()
        #: ``generate()``'s calls for dummy items after the first forward's embeddings (``late_call``).
        self._late_touch: _ProjectionTouch | None = None
        #: Since the tower's last optimizer step or :meth:`drop_text_only_grads`: None before a
        #: training forward, else whether every one held no images on any rank.
        self._text_only_since: bool | None = None
        _STEP_WATCH.discard(self)
        self._order = next(_HANDLE_ORDER)
        _hook_optimizer_steps()
        #: The optimizers seen stepping that hold the tower's or projection's trained parameters.
        self._stepping: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        runtime = (
            "_balancer",
            "_balancer_key",
            "_pending",
            "_encoding",
            "_ticket",
            "_ticket_rows",
            "_twin",
            "_twin_of",
            "_kept",
            "_late_touch",
            "_stepping",
        )
        for name in (*runtime, "last_stats"):
            state.pop(name, None)
        state["group"] = None  # a process group belongs to one run of processes
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.last_stats = None
        self._reset_runtime()

    # -- overridable ---------------------------------------------------------------------------

    def settings(self) -> tuple[ViTBalanceConfig, Any] | None:
        """``(config, group)`` to balance a training forward with, or None to call the tower directly.

        Called at every training forward. The default: ``config`` (or ``ViTBalanceConfig()``) and
        ``group``, None when balancing is disabled, ``torch.distributed`` is not initialised or the
        group has one rank.
        """
        config = self._effective_config()
        if not config.enabled or not (dist.is_available() and dist.is_initialized()):
            return None
        require_member(self.group, "group")
        if dist.get_world_size(self.group) < 2:
            return None
        return config, self.group

    def record(self, stats: BalanceStats) -> None:
        """Called with each balanced forward's stats (after :attr:`last_stats` is set)."""

    def encoded_directly(self, parts: tuple[tuple[Any, Any], ...]) -> None:
        """Called for a forward that would balance but that :meth:`settings` sends directly (one
        rank, balancing disabled), with its ``(pixels, grid)`` per modality (``None`` where absent).

        The default keeps the stats of a forward sent directly because the group has one rank, as
        ``ViTBalancer`` records its own ``"single-rank"`` calls (:meth:`pop_stats`, and a
        ``Trainer``'s callback, then see one device as many); with balancing disabled, none.
        """
        config = self._effective_config()
        distributed = dist.is_available() and dist.is_initialized()
        if not config.enabled or (distributed and dist.get_world_size(self.group) > 1) or in_backward_pass():
            return
        self._count(direct_call_stats(config, parts), None)

    def pop_stats(self, *, training: bool | None = None) -> list[BalanceStats]:
        """Return and forget the stats of the balanced forwards since the previous call, oldest
        first (for :class:`~lightning_vit_balance.BalanceMetrics`).

        Forwards are kept from the first call on (a reader that drains them), the latest
        :data:`KEPT_STATS` at most; the first call returns an empty list.

        Args:
            training: ``True``: only the training forwards' (the model in train mode), ``False``:
                only the others' (evaluation, prediction); the rest stay kept for their reader (an
                evaluation run from a callback before a training step's figures were read).
                ``None`` (default): all.

        Raises:
            ValueError: If ``training`` is neither a bool nor None.
        """
        training = require_flag("BalancedVisionTower.pop_stats", "training", training, optional=True)
        kept = list(self._kept) if self._kept is not None else []
        taken = [stats for was_training, stats in kept if training is None or was_training == training]
        left = [entry for entry in kept if training is not None and entry[0] != training]
        self._kept = collections.deque(left, maxlen=KEPT_STATS)
        return taken

    def _effective_config(self) -> ViTBalanceConfig:
        """What balances: :attr:`config`, or :meth:`default_config` where it is None."""
        return self._own_config(self.config) if self.config is not None else self.default_config()

    #: Whether :meth:`_own_config` has said so, and the configuration it looked at last.
    _own_config_told = False
    _own_config_seen: ViTBalanceConfig | None = None

    def _own_config(self, config: ViTBalanceConfig) -> ViTBalanceConfig:
        """``config``, a configuration of the user's own, which replaces :meth:`default_config`
        whole. Said once where it keeps ``ViTBalanceConfig()``'s values of what the default derives
        from the tower: most often one built as ``ViTBalanceConfig(plan_ahead=True)`` to change one
        setting, which then also drops splitting videos and the tower's cost model, silently (not
        while it disables balancing; each configuration is looked at until one is told)."""
        # By value: a module's mapping configuration (hparams, YAML) is a new object each forward.
        if config.enabled and not self._own_config_told and config != self._own_config_seen:
            self._own_config_seen = config
            dropped = _defaults_dropped(config, self.default_config())
            if dropped:
                self._own_config_told = True
                values = ", ".join(
                    f"{name}: {str(value).lower() if isinstance(value, bool) else value}"
                    for name, value in dropped.items()
                )
                warn_on_rank_zero(
                    f"balance_vision_tower: the configuration given for {type(self.model).__name__}'s "
                    f"tower replaces the drop-in's default whole, and keeps ViTBalanceConfig()'s "
                    f"{_dropped_text(dropped)}. To change a setting and keep the rest, start from the "
                    "default, as in dataclasses.replace(handle.default_config(), plan_ahead=True) (in a "
                    "LightningModule, as self.vit_balance_config; in a YAML configuration, add "
                    f"{values}). Said once.",
                )
        return config

    def default_config(self) -> ViTBalanceConfig:
        """``ViTBalanceConfig()`` priced by the tower's own shape (the same on every rank: the same
        model), with ``split_videos`` for Hugging Face's Qwen-VL towers, which encode each temporal
        step of a video on its own (what ``CostModel.from_vit`` reads from their type): what
        balances where :attr:`config` is None. A configuration of one's own replaces it whole, so
        start from it to change a setting and keep the rest::

            handle.config = dataclasses.replace(handle.default_config(), trigger_threshold=0.1)
        """
        if self._derived is None:
            try:
                model = CostModel.from_vit(self.tower)
                self._derived = model.to_config(ViTBalanceConfig(split_videos=model.per_frame_attention))
            except ValueError:  # a tower whose shape cannot be read: the seed's l**2
                self._derived = ViTBalanceConfig()
        return self._derived

    def prepared_plan(self) -> PreparedPlan | None:
        """The plan made before this forward for its images' rows followed by its videos' (see
        ``ViTBalancer.prepare``), or None to gather and plan in the forward: the plan
        :meth:`prepare` made, once. A recomputation (activation checkpointing) takes none: it plans
        as its forward call did."""
        if in_backward_pass():
            return None
        ticket, self._ticket = self._ticket, None
        return ticket

    def plan_waiting(self) -> bool:
        """Whether a plan made ahead waits for the next forward (:meth:`prepared_plan` would give
        it): a forward given the collator's grids (:meth:`plan_ahead`) then plans nothing more."""
        return self._ticket is not None

    def _named(self, ticket: PreparedPlan, source: str) -> PreparedPlan:
        """``ticket``, the plan waiting for the next forward, naming ``source`` in its errors."""
        self._ticket = replace(ticket, source=source)
        return self._ticket

    @eager
    def prepare(self, batch: Mapping[str, Any]) -> PreparedPlan | None:
        """Plan the next balanced forward from its batch while the batch is still on the host.

        Call it on every rank with the batch of its next ``model(**batch)`` (its
        ``pixel_values``/``image_grid_thw`` and ``pixel_values_videos``/``video_grid_thw``; a
        text-only batch too), before the batch moves to the device. That forward then makes no
        metadata gather and no plan, and reads no grid from the device. It must encode exactly
        those rows; anything else fails with a clear error, on every rank where the plan moves
        images (or with ``check_skipped_calls``), else on this rank. ``prepare`` is itself a
        collective (the gather of every rank's grid rows). (GLM-4.xV models build their videos'
        per-step grid in the forward; the drop-in reads that one to match the model's tower call.)

        The next balanced forward takes the plan: a forward that is not balanced (one under
        ``no_grad`` in train mode without :attr:`evaluation`, a step of ``generate()`` where the
        tower is not sharded) leaves it to the next one, which raises if its batch is another.

        Returns:
            The plan (the next forward takes it), or None when forwards are not balanced now
            (balancing disabled, no process group, one rank, or eval mode without
            :attr:`evaluation`): no gather then.

        Raises:
            ValueError: On every rank, for invalid input or settings on any rank.
            RuntimeError: In a DataLoader worker process (it gathers over the group).
        """
        refuse_in_a_loader_worker("handle.prepare")
        self._ticket = None
        # In eval mode without `evaluation` the forwards encode directly: a plan would wait for a
        # forward of another batch (the next training step's), which would fail on it.
        settings = self.settings() if self.base.training or self.evaluation else None
        if settings is None:
            return None
        self._keep_host_rows(batch)
        pixels, grid = rows_to_plan(batch, _PREPARE_KEYS, (self,))
        try:
            self._ticket = self._balancer_for(*settings).prepare(pixels, grid, self.tower)
        except ValueError as err:
            mine = self._pixel_problems(batch)
            if not mine:
                raise
            raise ValueError(f"{err} On this rank: {'; '.join(mine)}.") from err
        return self._ticket

    def _keep_host_rows(self, batch: Any) -> None:
        """Keep the rows of ``batch``'s :attr:`step_grid_keys` grids as read on the host, for the
        next forward given a plan made ahead from ``batch`` (here, or by a LightningModule for its
        towers): its per-step grid is then indexed from them, not read from the device."""
        self._ticket_rows = _host_grid_rows(batch, self.step_grid_keys)

    def _pixel_problems(self, batch: Any) -> list[str]:
        """This rank's pixel rows that are not the patch images the tower takes (none for a tower
        of ``[S, C]`` rows): :func:`rows_to_plan` hands the plan such rows as no tensor, so every
        rank raises, and the rank at fault adds these."""
        if not isinstance(batch, Mapping):
            return [unreadable_batch(batch, _PREPARE_KEYS)]
        if not self._row_shape:
            return []
        found = [(key, batch.get(key)) for key, _ in _PREPARE_KEYS]
        problems = [
            _patch_rows_problem(key, rows, self._row_shape) for key, rows in found if rows is not None
        ]
        return [problem for problem in problems if problem is not None]

    def plan_ahead(self, collate_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``collate_fn`` made to carry each batch's grids, as collated on the host, to the model's
        forward, which plans from them: for Hugging Face's ``Trainer`` and other loops built on
        accelerate, which hand the model batches already on the device, where :meth:`prepare`
        would have to read the grids back (a device-to-host sync in every forward).

        The collator returned calls ``collate_fn`` and adds the batch's ``image_grid_thw`` and
        ``video_grid_thw``, as they are, under :data:`GRIDS_KEY`, in an object that accelerate and
        the ``Trainer`` pass on without moving it. DataLoader workers can run it (it holds no model).
        The model's forward takes that entry out and, when the forward is balanced, plans from it
        first, as :meth:`prepare` does (one gather over the host group, then the plan): the balanced
        call then makes no metadata gather and reads no grid from the device. Every rank's batches
        must come from this collator. Not for ``generate()``, which rejects the extra key.

        Example::

            handle = balance_vision_tower(model)
            trainer = Trainer(model=model, args=args, train_dataset=data,
                              data_collator=handle.plan_ahead(collate))

        Raises:
            TypeError: ``collate_fn`` is not callable; and from the collator, when ``collate_fn``
                returns something other than a mutable mapping.
        """
        if not callable(collate_fn):
            raise TypeError(
                f"BalancedVisionTower.plan_ahead(collate_fn={collate_fn!r}) is invalid: expected the "
                "batch collator (a callable from a list of samples to the model's keyword arguments)."
            )
        if self.model is not self.base and "model" not in self._patched:
            # The model's own forward takes the grids out; a base model given alone does itself.
            self._patch("model", self.model, "forward")
        return _GridsOnHost(collate_fn, tuple(grid for _, grid in _PREPARE_KEYS))

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the balancing: with ``calibrate_cost``, the online cost fit
        (``ViTBalancer.state_dict``), so a resumed run plans with the fitted model from its first
        step; an empty dict otherwise, or before the first balanced forward unless a state was
        loaded. Plain Python values (JSON and ``torch.load(weights_only=True)`` alike take them),
        the same on every rank. Hugging Face's ``Trainer`` saves it with
        ``ViTBalanceTrainerCallback``."""
        if self._balancer is not None:
            return self._balancer.state_dict()
        return dict(self._carried) if self._carried else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from :meth:`state_dict`: call it on every rank with the same state, before the
        next balanced forward, which then plans with the saved cost fit. A state without a cost
        fit, or a configuration without ``calibrate_cost``, changes nothing.

        Raises:
            ValueError: ``state`` is not a mapping, or holds keys no balancer's ``state_dict()``
                holds, or its cost fit cannot continue under this handle's configuration (another
                window or per-frame attention); nothing changes.
        """
        state = checked_state(state, "BalancedVisionTower.load_state_dict")
        if self._balancer is not None:
            self._balancer.load_state_dict(state)
            return
        # Checked now against the configuration; the next forward's balancer starts from it.
        config = self._effective_config()
        ViTBalancer(config).load_state_dict(state)
        self._carried = state if config.calibrate_cost else None

    # -- end of a run, removal ------------------------------------------------------------------

    def release(self) -> None:
        """End of a training run: destroy the gloo twin (``make_host_group``) and forget the
        balancer, keeping its state (:meth:`state_dict`) for the next balanced forward, which makes
        them again (at the same point on every rank, as the first one did). A process that goes on
        to other runs with new models (a sweep's trials) then holds no twin per run, ``P + 3``
        open files each. ``ViTBalanceTrainerCallback`` calls it when training ends. Local: no
        collective. Forwards after it are kept for :meth:`pop_stats` again from its next call."""
        if self._balancer is not None:
            self._carried = self._balancer.state_dict()
        self._balancer, self._balancer_key = None, None
        release_host_group(self._twin)
        self._twin, self._twin_of = None, _NO_GROUP
        self._kept = None  # the run's reader is done (kept again from its next pop_stats)
        self._text_only_since = None  # a step the run left unfinished (it raised) is not the next run's
        _STEP_WATCH.discard(self)

    def check_pending(self) -> None:
        """Report what the last forwards given a plan made ahead (:meth:`prepare`, the
        :meth:`plan_ahead` collator) left for the next forward's gather: a grid compared on the
        device that differed from its plan's (see :meth:`ViTBalancer.check_pending`). Collective:
        call it on every rank where no balanced forward follows (the end of a loop that plans
        ahead); ``ViTBalanceTrainerCallback`` calls it when training, an evaluation or a
        prediction ends. Nothing to do where no forward took a plan made ahead since (a
        LightningModule's handle: the module reports).

        Raises:
            ValueError: On every rank, when a rank's forward did not match the plan made for it.
        """
        if self._balancer is not None:
            self._balancer.check_pending()

    def end_evaluation(self) -> None:
        """Forget the evaluation forwards' clocks: the next evaluation's (or prediction's) first
        forward reports none of this one's ViT times as its own (a dataset's evaluation after
        another's, an evaluation after a prediction). Call it on every rank alike where an
        evaluation or a prediction ends; ``ViTBalanceTrainerCallback`` does."""
        if self._balancer is not None:
            self._balancer.forget_loop(_EVALUATION_LOOP)

    def remove(self) -> None:
        """Undo :func:`balance_vision_tower`: the patched instance attributes go (or the ones found
        at install time come back). Calling it again does nothing."""
        for which, (module, name) in self._patched.items():
            current = module.__dict__.get(name)
            if not (isinstance(current, _Forward) and current.handle is self):
                continue
            saved = self._saved[which]
            if saved is None:
                delattr(module, name)
            else:
                setattr(module, name, saved)
        for module, hook in self._leaves:
            module.__dict__.pop(_ZERO3_LEAF, None)
            hook.remove()
        self._leaves = []
        release_host_group(self._twin)
        self._reset_runtime()

    # -- the patched forwards ------------------------------------------------------------------

    def _patch(self, which: str, module: nn.Module, name: str) -> None:
        """Put :class:`_Forward` for ``which`` at ``module.name``, an instance attribute that
        :meth:`remove` deletes. One set before us (e.g. accelerate's forward hooks) is kept and called."""
        self._patched[which] = (module, name)
        self._saved[which] = module.__dict__.get(name)
        setattr(module, name, _Forward(self, which))

    def _original(self, which: str) -> Any:
        module, name = self._patched[which]
        saved = self._saved[which]
        return saved if saved is not None else getattr(type(module), name).__get__(module)

    @eager
    def _route(self, which: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Route:
        """What the patched ``forward`` of ``which`` runs for a call with ``args`` and ``kwargs``
        (those of the call: the host grids are taken out of them), balanced calls made first."""
        if which == "base":
            return self._base_route(args, kwargs)
        if which == "model":
            return self._model_route(args, kwargs)
        if which == "generation":
            return self._generation_route(args, kwargs)
        return self._tower_route(args, kwargs)

    def _model_route(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Route:
        """The model's forward, once :meth:`plan_ahead` made a collator: plans from the batch's host
        grids first."""
        original = self._original("model")
        grids = _take_grids(kwargs)
        if grids is None:
            return _Route(original, args, kwargs)
        return self._planned_from(grids, original, args, kwargs)

    def _planned_from(
        self, grids: _HostGrids, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _Route:
        """``forward(*args, **kwargs)``, planned from ``grids`` (see :meth:`plan_ahead`) when it is
        balanced and no plan is waiting already; a plan it leaves untaken is dropped with it. Not in
        a recomputation (activation checkpointing), which plans as its forward call did."""
        if self.plan_waiting() or in_backward_pass() or not self._balances(kwargs):
            return _Route(forward, args, kwargs)
        if self.settings() is None:
            # This forward is direct (a LightningModule's hook on one rank, logging samples): a
            # plan here would be a gather on this rank alone.
            return _Route(forward, args, kwargs)
        view = {pixels: kwargs.get(pixels) for pixels, _ in _PREPARE_KEYS}
        try:
            ticket = self.prepare({**view, **dict(grids.grids)})
        except ValueError as err:  # every rank's, alike
            if str(err).startswith(INVALID_INPUT):  # the batch's rows and grids, not the settings
                raise ValueError(f"{err} ({_CARRIED_GRIDS})") from err
            raise
        if ticket is not None:  # its mismatch errors name the carried grids, not a plan of the user's
            ticket = self._named(ticket, _CARRIED_GRIDS)
        return _Route(forward, args, kwargs, done=functools.partial(self._drop_ticket, ticket))

    @eager
    def _drop_ticket(self, ticket: PreparedPlan) -> None:
        if self._ticket is ticket:
            self._ticket = None

    def _balances(self, arguments: Mapping[str, Any]) -> bool:
        """Whether a base forward with ``arguments`` (by name) is balanced, settings aside: in
        training, or in evaluation with :attr:`evaluation` (see :meth:`_balances_evaluation_forward`)."""
        if self._pending is not None:
            return False
        if self.base.training and torch.is_grad_enabled():
            return True
        return self.evaluation and self._balances_evaluation_forward(arguments)

    def _base_route(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Route:
        if kwargs.get(_GENERATION_FEATURES) is None:
            # Not generate()'s first forward: a touch armed for that one (it raised in between)
            # would call the projection here on this rank alone.
            self._release_late_touch()
        original = self._original("base")
        grids = _take_grids(kwargs)
        if grids is not None:  # the base model given to balance_vision_tower itself
            return self._planned_from(grids, _Forward(self, "base"), args, kwargs)
        training = self.base.training and torch.is_grad_enabled()
        if self._pending is not None or not (training or self.evaluation):
            return _Route(original, args, kwargs)
        # Bind to the class's signature: a forward patched in before us may take (*args, **kwargs).
        signature = inspect.signature(type(self.base).forward)
        bound = signature.bind_partial(self.base, *args, **kwargs).arguments
        balances = self._balances(bound)
        settings = self.settings() if balances else None
        if settings is None:
            if balances:
                self.encoded_directly(tuple((bound.get(p), bound.get(g)) for p, g in _PREPARE_KEYS))
            return _Route(original, args, kwargs)
        pending = self._encode(bound, *settings)
        finish = functools.partial(self._zero_added, pending)
        return self._answering(pending, _Route(original, args, kwargs, finish=finish))

    @eager
    def _zero_added(self, pending: _Pending, output: Any) -> Any:
        zero = pending.touch.finish(pending.zero) if pending.touch is not None else pending.zero
        return _add_zero(output, zero, type(self.base).__name__)

    def _balances_evaluation_forward(self, bound: Mapping[str, Any]) -> bool:
        """Whether an evaluation forward is balanced: yes, unless it is a step of ``generate()``.

        ``generate()`` hands its cache to every step, the first included, and ranks generate
        different numbers of steps: those stay direct. Except the first (an empty cache) where
        the tower is sharded and the first forward encodes the images (transformers 4): then
        every rank generates together anyway (``synced_gpus``) and a text-only rank must run the
        tower too.
        """
        caches = [bound.get(name) for name in _CACHE_ARGUMENTS if bound.get(name) is not None]
        if not caches:
            return True
        if "generation" in self._patched:
            return False
        length = getattr(caches[0], "get_seq_length", None)
        return callable(length) and length() == 0 and parameters_sharded(self.tower)

    def _release_late_touch(self) -> None:
        """Remove the hooks of the touch :meth:`_generation_route` armed for ``generate()``'s first
        forward, if one is armed."""
        if self._late_touch is not None:
            self._late_touch.release()
            self._late_touch = None

    def _generation_route(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Route:
        """``generate()``'s encoding of images and videos before the first forward (transformers 5),
        balanced where the tower is sharded and evaluation forwards are balanced.

        It calls ``get_image_features`` and ``get_video_features`` for the modalities a rank has
        (so a different number of tower calls on different ranks): with sharded parameters every
        rank must run the tower once, as in a balanced forward. Unsharded, it stays direct, so one
        rank may generate alone (sample logging on rank 0).
        """
        original = self._original("generation")
        if self._pending is not None or not self.evaluation or not parameters_sharded(self.tower):
            return _Route(original, args, kwargs)
        settings = self.settings()
        if settings is None:
            return _Route(original, args, kwargs)
        model_kwargs = args[0] if args else kwargs["model_kwargs"]  # the pixels and grids, by name
        pending = self._encode(model_kwargs, *settings)
        if pending.touch is not None:  # dummy images to project: this step embeds no tokens
            original = functools.partial(_then_touched, original, pending.touch)
            # What the other ranks' first forward calls after embedding its tokens (late_call).
            self._release_late_touch()
            self._late_touch = pending.touch.later(self.base)
        return self._answering(pending, _Route(original, args, kwargs))

    def _answering(self, pending: _Pending, route: _Route) -> _Route:
        """``route`` with its forward's tower calls answered from ``pending``, the tower's own hooks
        held back until it is done (see :func:`_hold_hooks`)."""
        self._pending = pending
        held = _hold_hooks(self.tower)
        return route._replace(done=functools.partial(self._answered, held, pending.touch))

    @eager
    def _answered(self, held: dict[str, Any], touch: _ProjectionTouch | None) -> None:
        _restore_hooks(self.tower, held)
        if touch is not None:  # a forward that raised leaves no hook behind
            touch.release()
        self._pending = None

    def _tower_route(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Route:
        original = self._original("tower")
        if self._encoding:
            # The balanced call itself (or the engine's dummy forward on a rank with no images), in
            # the tower's own form, its outputs given to the engine in the contract's.
            finish = self._unbatched if self._form.batched_output or self._form.dropped else None
            return _Route(original, self._tower_form_args(args), self._tower_keywords, finish=finish)
        if self._pending is None:
            if torch.is_grad_enabled() and self.base.training and self.settings() is not None:
                self._warn_outside()
            return _Route(original, args, kwargs)
        return _Route(self._serve, args, kwargs)

    def _tower_form_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The engine's ``(pixels [S, C], grid)`` in the form the model passes its tower
        (:class:`_TowerForm`): patch images ``[S, *row_shape]``, a batch dimension of 1."""
        if not (self._row_shape or self._form.batched_input) or not args:
            return args
        pixels, *rest = args
        if self._row_shape:
            pixels = pixels.reshape(pixels.shape[0], *self._row_shape)
        return (pixels.unsqueeze(0) if self._form.batched_input else pixels, *rest)

    @eager
    def _unbatched(self, output: Any) -> Any:
        """The balanced call's output without its batch dimension of 1 and with its dropped outputs
        None (:class:`_TowerForm`), for the engine to route by rows."""
        leaves, structure = flatten_output(output)
        new = []
        for path, leaf in leaves:
            if path in self._form.dropped:
                new.append(None)
            elif not (self._form.batched_output and isinstance(leaf, torch.Tensor)):
                new.append(leaf)
            elif leaf.dim() >= 2 and leaf.shape[0] == 1:
                new.append(leaf[0])
            else:
                # The same model code on every rank: every rank raises here alike.
                raise ValueError(
                    f"balance_vision_tower: {type(self.tower).__name__} output {path!r} has shape "
                    f"{tuple(leaf.shape)}: expected a leading batch dimension of 1 [1, rows, ...]."
                )
        return rebuild_output(structure, new)

    def _rebatched(self, output: Any) -> Any:
        """A served output with the batch dimension of 1 the tower gives (:meth:`_unbatched` undone)."""
        if not self._form.batched_output:
            return output
        leaves, structure = flatten_output(output)
        batched = [leaf.unsqueeze(0) if isinstance(leaf, torch.Tensor) else leaf for _, leaf in leaves]
        return rebuild_output(structure, batched)

    def _warn_outside(self) -> None:
        """A training call of the tower outside the base forward (ColQwen2, say, calls the tower
        itself, then the base forward with the embeddings): nothing balances it. It is encoded as
        the plain model does. Said once: otherwise the base forward's balanced call, empty at every
        step, would look like balancing at work."""
        self.unmatched_calls += 1
        if self.unmatched_calls == 1:
            warn_at_user(
                f"balance_vision_tower: {type(self.model).__name__} called its vision tower outside "
                f"{type(self.base).__name__}.forward in a training forward: that call is encoded "
                "directly, unbalanced (warned once). The drop-in balances the tower calls the base "
                "forward makes from its pixel_values and pixel_values_videos; to balance a tower you "
                "call yourself, use ViTBalancer or ViTBalanceMixin.encode_images."
            )

    def _balancer_for(self, config: ViTBalanceConfig, group: Any) -> ViTBalancer:
        """The balancer for ``config`` and ``group`` (:meth:`_layout_balancer`, with the tower's
        output layout), once ``config`` is known to keep the tower's outputs the plain model's."""
        if config.split_videos and _model_type(self.base) in _WHOLE_CLIP_MODEL_TYPES:
            # The same model and settings on every rank: all raise here, before any collective.
            raise ValueError(
                f"balance_vision_tower: ViTBalanceConfig(split_videos=True) is invalid for "
                f"{type(self.base).__name__}: its tower attends over a whole video with temporal "
                "positions, so encoding a video's temporal steps apart would change its outputs; "
                "expected split_videos=False."
            )
        return self._layout_balancer(config, group, self.output_layout)

    @property
    def output_layout(self) -> OutputLayout | None:
        """The output layout a balancer of this tower needs: the merge HF splits its outputs by where
        the engine would read another from the tower (Muse Spark, Muse-Glimmer, Kimi-K2.5); None
        when the engine's default fits."""
        return _output_layout(self.tower)

    def _layout_balancer(
        self, config: ViTBalanceConfig, group: Any, layout: OutputLayout | None
    ) -> ViTBalancer:
        """The balancer for ``config``, ``group`` and ``layout``: built at the first balanced forward
        (or :meth:`prepare`) and again when one changes, going on from the cost fit before. The
        Lightning mixin's handle takes its module's balancer instead (built with ``layout`` too)."""
        # The group itself, not its id: a destroyed group's id may come back as a new group's, and
        # None stands for whatever default group exists now (a sweep re-initialises it).
        key = (config, current_group(group), layout)
        # Training and evaluation forwards measure apart (ViTBalancer.measure_as): every rank's
        # model is in the same mode.
        loop = "train" if self.base.training else _EVALUATION_LOOP
        if self._balancer is None or self._balancer_key != key:
            previous, previous_key = self._balancer, self._balancer_key
            host = gathers_on(self._host_group(group), group)
            self._balancer = ViTBalancer(config, group, output_layout=layout, host_group=host)
            carried = self._carried
            if previous is not None:
                self._balancer._take_pending(previous)
                same_group = previous_key is not None and previous_key[1] is key[1]
                # The previous balancer is let go: every loop's clocks come along.
                live = same_group and self._balancer._go_on_from(previous, loop, every_loop=True)
                # Its saved state (its window's rows as plain numbers) only where the fit goes on from it.
                carried = None if live else previous.state_dict()
            self._balancer_key, self._carried = key, None
            if carried:
                source = "balance_vision_tower: the cost fit of the previous configuration"
                continue_fit(self._balancer.load_state_dict, carried, source, warn_on_rank_zero)
        self._balancer.measure_as(loop)
        return self._balancer

    def _host_group(self, group: Any) -> Any:
        """The gloo twin of an NCCL ``group`` (see ``make_host_group``), made once per group, at a
        balanced forward or a :meth:`prepare`, which every rank makes alike."""
        made_for = current_group(group)
        if self._twin_of is not made_for:
            release_host_group(self._twin)
            self._twin, self._twin_of = owned_host_group(group, self), made_for
        return self._twin

    def _encode(self, bound: Mapping[str, Any], config: ViTBalanceConfig, group: Any) -> _Pending:
        """The forward's one balanced tower call over this rank's images and videos."""
        wrapping = _wrapping_problem(self.base, self.tower)
        if wrapping is not None:  # the same on every rank: all raise before any collective
            raise ValueError(f"balance_vision_tower: {wrapping}.")
        tower = self.tower
        prepared = self.prepared_plan()
        # With a plan made ahead, the grids' rows as read on the host then: none is read back here.
        steps = self._ticket_rows if prepared is not None else None
        inputs = [
            (name, pixels, bound.get(pixels), grid, self._tower_grid(grid, bound.get(grid), steps))
            for name, pixels, grid in _MODALITIES
        ]
        known = _prepared_rows(prepared, inputs)
        # The cast HF applies (pixels.type(visual.dtype)); patch images flattened to rows.
        combined = _combine(inputs, tower, cast=True, row_shape=self._row_shape, known=known)
        dummies = self._dummy_modalities(combined, group)
        dropped = None
        if dummies is not None:  # the same on every rank (this rank may add none)
            for k, (name, pixels_key, _, grid_key, _) in enumerate(inputs):
                if name in dummies:
                    inputs[k] = (name, pixels_key, dummies[name][0], grid_key, dummies[name][1])
            # A plan made ahead did not see the dummy images: every rank plans here, from the grids'
            # values on the device, which the parts then read too.
            combined = _combine(inputs, tower, cast=True, row_shape=self._row_shape)
            prepared, dropped = None, prepared
        balancer = self._balancer_for(config, group)
        self._encoding = True
        try:
            output = _balanced_call(balancer, tower, combined, "balance_vision_tower", prepared)
        except BaseException:
            self._count_failed(balancer)
            raise
        finally:
            self._encoding = False
        if not in_backward_pass():  # a recomputation (activation checkpointing) is counted once
            self.calls += 1
            if balancer.last_stats is not None:
                self._count(balancer.last_stats, dropped)
        outputs = _split(output, combined.parts, combined.encoded, _output_merge(tower), tower)
        if self._form.pooled_frames:
            _pool_frames(tower, combined.parts, outputs)
        touch = None
        if dummies:
            # This rank's model calls its projection on the dummy images too (module docstring).
            late = functools.partial(self._late_calls, dummies) if self._form.late_call else None
            touch = _ProjectionTouch.arm(
                functools.partial(self._dummy_calls, dummies), self.base, self._form.features_first, late
            )
        elif not combined.parts and torch.is_grad_enabled():
            # A text-only rank: the model will not call its projection (module docstring).
            modules = self._projection_modules()
            if any(_touchable(param) for module in modules for param in module.parameters()):
                zero_of = functools.partial(_touch_zero, modules)
                touch = _ProjectionTouch.arm(zero_of, self.base, self._form.features_first)
        return _Pending(combined.parts, outputs, [False] * len(combined.parts), _exact_zero(output), touch)

    def _count(self, stats: BalanceStats, dropped: PreparedPlan | None) -> None:
        """Keep a balanced call's stats. A plan made ahead that the call dropped for dummy images
        adds its preparation's time: its gather and plan ran before the forward, as a used one's."""
        if dropped is not None:
            stats = replace(stats, prepare_seconds=stats.prepare_seconds + dropped.prepare_seconds)
        self.applied_calls += int(stats.applied)
        self.last_stats = stats
        self.record(stats)
        if self._kept is not None:
            self._kept.append((self.base.training, stats))
        self._note_text_only(stats.reason)

    def _count_failed(self, balancer: ViTBalancer) -> None:
        """A training forward whose balanced call raised on this rank alone (the ViT of a skipped
        call, unchecked: no collective told the others): they finished it and counted its plan
        toward :meth:`drop_text_only_grads`, so this rank counts it too, and every rank drops
        alike at the step's end (a loop that skips the failed step would otherwise step the
        towers apart, AdamW's momentum and weight decay on one rank's zero gradients only)."""
        reason = balancer._reason_counted_elsewhere()
        if reason is not None and not in_backward_pass():
            self._note_text_only(reason)

    def _note_text_only(self, reason: str) -> None:
        """Count a training forward (an optimizer step follows; other forwards are not counted) for
        :meth:`drop_text_only_grads`: its step's gradients held no images on any rank while every
        one since the step began had none (the plan's ``reason``, the same on every rank). A step
        begins after an optimizer step of the tower or a drop (not at ``zero_grad``: a step of
        several forwards before one backward zeroes before the first)."""
        if not (self.base.training and torch.is_grad_enabled()):
            return
        if reason != "no-images":
            self._text_only_since = False
        elif self._text_only_since is None:
            self._text_only_since = True
        _STEP_WATCH.add(self)  # the step that ends this one may come without a drop

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer is about to step after this handle's training forwards (the module's
        ``_before_optimizer_step`` hook): where it holds the tower's parameters, the step ends
        theirs, so :meth:`drop_text_only_grads` first where none of them had images on any rank
        and the loop did not call it. Another model's optimizer (a GAN's discriminator, which may
        step between the forward and its backward) neither drops nor ends the step."""
        if self._steps_the_tower(optimizer):
            self.drop_text_only_grads()  # which ends the step, with or without anything to drop

    def _steps_the_tower(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` holds any of the tower's or projection's trained parameters: read
        until it does (0.5 ms with a 392-parameter tower and 1,407 to step; a tower unfrozen later
        is held from then on), then known."""
        if optimizer in self._stepping:
            return True
        whole, sharded = self._touched_parameters()
        touched = {id(param) for param in (*whole, *sharded)}
        holds = any(id(param) in touched for group in optimizer.param_groups for param in group["params"])
        if holds:
            self._stepping.add(optimizer)
        return holds

    def _touched_parameters(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """The trained parameters a balanced forward gives a gradient on every rank, the tower's
        and :attr:`projection`'s, whose gradient the plain model leaves unset when it does not
        call them: those every rank holds whole, then FSDP2's (``DTensor`` shards, whose zeros
        only the whole mesh can tell). Not an FSDP1 unit's original parameters
        (``use_orig_params``), which share their unit's flat gradient with other modules' (zeros
        there, for the plain model too); not ZeRO-3's, whose gradients DeepSpeed keeps."""
        whole: list[nn.Parameter] = []
        sharded: list[nn.Parameter] = []
        for module in (self.tower, *self._projection_modules()):
            for param in module.parameters():
                if not param.requires_grad or _flat_parameter_view(param) or hasattr(param, "ds_id"):
                    continue
                (sharded if gathered_per_call(param) else whole).append(param)
        return whole, sharded

    def drop_text_only_grads(self) -> bool:
        """Unset the tower's and :attr:`projection`'s gradients (``None``) that hold zeros only,
        where every training forward since the last call held no images on any rank: what the
        plain model leaves there (it never called the tower, and optimizers' ``zero_grad`` unsets
        gradients), where the balanced forwards gave them all-zero gradients (the ``+0.0`` every
        rank's loss depends on, see the module docstring). An optimizer skips a parameter without
        a gradient, but steps one with a zero gradient (AdamW: its momentum and weight decay), so
        the towers would drift apart. Gradients from elsewhere stay (a call of the tower outside
        the balanced forward, ColQwen2's own or ``get_image_features``; a loss term on a weight),
        unless exactly zero. With ``zero_grad(set_to_none=False)`` the plain model steps zeros
        there. FSDP2's sharded gradients are unset where they are zero on every rank of their mesh
        (one all-reduce of a peak per parameter first, so that every rank unsets the same ones);
        ZeRO-3's and FSDP1's (``use_orig_params``) keep their zeros.

        It runs once per optimizer step, after the backward (DDP's reduction) and before the step,
        on every rank, and decides alike there (the plans' reason and the reduced gradients). The
        drop-in calls it itself: at the start of each step of a ``torch.optim.Optimizer`` that holds
        the tower's parameters (a pre-hook on optimizer steps, which a loop of your own, Fabric and
        accelerate reach too, after gradient clipping and a ``GradScaler``'s unscaling), or after
        the step's closure where it is given one (Lightning, L-BFGS). ``ViTBalanceTrainerCallback``
        calls it before each of the Trainer's optimizer steps, the Lightning mixin in
        ``on_before_optimizer_step``. Call it yourself between the backward and the step where the
        optimizer is no ``torch.optim.Optimizer``; a second call in a step does nothing. A step's
        forwards are those since the tower's last optimizer step or drop: in a loop of your own, a
        step a ``GradScaler`` skipped counts into the next (the hooks of the mixin and
        ``ViTBalanceTrainerCallback`` end it before the skip). After a step without
        images it reads the gradients' peaks once from the device (zeros only?). Where the
        optimizer shards the gradients itself (DeepSpeed's ZeRO), its own zeros stay, as the plain
        model's do there.

        Returns:
            Whether any gradient was unset.
        """
        text_only = self._text_only_since is True
        self._text_only_since = None
        _STEP_WATCH.discard(self)
        if not text_only:
            return False
        whole, sharded = self._touched_parameters()
        whole = [param for param in whole if param.grad is not None]
        # Only the zeros the balanced forwards gave: a gradient from elsewhere (a loss term on a
        # tower weight) stays. One read of the device, in a step without images only; for FSDP2's
        # shards one all-reduce first, so every rank unsets the same ones (a later clipping's
        # collectives then match) and only where the whole gradient is zero.
        params = [*whole, *sharded]
        zero = [*_zero_grads([param.grad for param in whole]), *sharded_grads_all_zero(sharded)]
        unset = [param for param, empty in zip(params, zero) if empty and param.grad is not None]
        for param in unset:
            param.grad = None
        return bool(unset)

    def _dummy_modalities(self, combined: _Combined, group: Any) -> dict[str, _Dummy] | None:
        """Where :attr:`projection` has parameters that only a call of it gathers (ZeRO-3, an FSDP2
        unit of its own) and the ranks hold different modalities: a one-image dummy
        ``(pixels, grid)`` for each modality some rank holds and this one lacks (maybe none), else
        None. The model calls its projection once per modality a rank holds, so without them the
        ranks' parameter gathers would differ (an abort, a hang or, on NCCL, undefined behaviour).
        One gather of two flags per rank, made only in that case, which is the same on every rank
        (the same model)."""
        gathered = any(
            gathered_per_call(p) for module in self._projection_modules() for p in module.parameters()
        )
        if not gathered:
            return None
        names = [name for name, _, _ in _MODALITIES]
        held = {part.name for part in combined.parts}
        host = gathers_on(self._host_group(group), group)  # the group's twin, or the group itself
        flags = gather_host_values([name in held for name in names], host)
        if (flags == flags[0]).all():
            return None
        wanted = [name for k, name in enumerate(names) if flags[:, k].any() and name not in held]
        return {name: self._dummy_input(steps=2 if name == "videos" else 1) for name in wanted}

    def _dummy_input(self, steps: int) -> _Dummy:
        """A one-item input of the smallest grid the tower and its outputs merge, ``[steps, m, m]``
        (two steps for a video: ERNIE-4.5-VL's resampler merges a video's steps in pairs): zero
        pixel rows in the form the model passes its tower (patch images or flat rows), its grid."""
        merges = [m for m in (_tower_merge(self.tower), _output_merge(self.tower)) if _positive_int(m)]
        merge = math.lcm(*merges) if merges else 1
        device = _placement(self.tower)[0]
        row_shape = self._row_shape or (_tower_channels(self.tower) or 1,)
        pixels = torch.zeros((steps * merge * merge, *row_shape), device=device)
        return pixels, torch.tensor([[steps, merge, merge]], device=device)

    def _dummy_calls(self, dummies: dict[str, _Dummy]) -> torch.Tensor | None:
        """The model's own feature method on each dummy image (its tower call answered from the
        balanced result), in the model's order (images, then videos): ``+0.0`` from zero-row
        slices of what it returns, so the projection is called, and its backward runs, as on the
        ranks that hold the modality."""
        zero = None
        for name, pixels_key, grid_key in _MODALITIES:
            if name in dummies:
                features = getattr(self.base, _FEATURE_METHODS[name])
                pixels, grid = dummies[name]
                pending = self._pending
                assert pending is not None
                pending.only = name
                try:
                    found = _exact_zero(features(**{pixels_key: pixels, grid_key: grid}))
                finally:
                    pending.only = None
                zero = _plus(zero, found)
        return zero

    def _late_calls(self, dummies: dict[str, _Dummy]) -> torch.Tensor | None:
        """The method :attr:`_TowerForm.late_call` names, once per dummy modality, as the model calls
        it after embedding its tokens for each modality a rank holds: ``+0.0`` from it."""
        method = operator.attrgetter(self._form.late_call)(self.base)
        zero = None
        for modality, _, _ in _MODALITIES:
            if modality in dummies:
                zero = _plus(zero, _exact_zero(method(dummies[modality][0].device)))
        return zero

    def _tower_grid(self, key: str, grid: Any, known: Mapping[str, tuple[Grid, ...]] | None = None) -> Any:
        """The grid the model passes its tower for its forward's grid argument ``key``: each
        temporal step a row of its own for :attr:`step_grid_keys` (a valid grid only: the input
        checks name the caller's own). Where ``known`` holds the grid's rows as read on the host,
        the rows are repeated by an index made there, so nothing waits for the device."""
        if key not in self.step_grid_keys or _grid_problem(key, grid) is not None:
            return grid
        rows = (known or {}).get(key)
        if rows is None or len(rows) != grid.shape[0]:
            return grid_steps(grid)
        index = torch.tensor([k for k, (t, _, _) in enumerate(rows) for _ in range(t)], dtype=torch.long)
        steps = grid.index_select(0, host_to_device(index, grid.device))
        steps[:, 0] = 1
        return steps

    @eager
    def _serve(self, pixels: Any = None, grid_thw: Any = None, **kwargs: Any) -> Any:
        """Answer one of the model's own tower calls from the pending balanced result (the pixels
        positional, or by keyword ``pixel_values`` as Muse Spark and Muse-Glimmer pass them)."""
        pending = self._pending
        assert pending is not None
        if pixels is None:
            pixels = kwargs.pop("pixel_values", None)
        rows = _served_rows(pixels, self._form.batched_input)
        open_parts = [
            k
            for k, part in enumerate(pending.parts)
            if not pending.served[k] and pending.only in (None, part.name) and rows == part.stop - part.start
        ]
        # The very grid tensor the balanced call got needs no reading; another is read and compared.
        found = next((k for k in open_parts if pending.parts[k].source is grid_thw), None)
        grid = None
        if found is None:
            grid = grid_rows(grid_thw) if isinstance(grid_thw, torch.Tensor) and grid_thw.dim() == 2 else None
            found = next((k for k in open_parts if pending.parts[k].grid == grid), None)
        if found is not None:
            pending.served[found] = True
            output = self._rebatched(pending.outputs[found])
            return output.to_tuple() if kwargs.get("return_dict") is False else output
        expected = [
            f"{part.name} with grid {list(part.grid)}"
            for part, served in zip(pending.parts, pending.served)
            if not served
        ]
        problem = (
            f"balance_vision_tower: {type(self.base).__name__} called its vision tower with "
            f"{rows} rows and grid {grid}, which is none of this forward's modalities still to encode "
            f"({', '.join(expected) or 'none left'}): the model does not encode each modality's "
            "pixel_values/grid in one tower call, as the drop-in's contract requires"
        )
        if parameters_sharded(self.tower):
            # Encoding here would gather the tower's parameters on this rank alone.
            raise RuntimeError(problem + "; with sharded parameters it cannot be encoded apart either.")
        # Unsharded, this rank encodes the call itself, as the plain model would: the same outputs
        # and gradients, no collective (the balanced call's backward still runs on every rank).
        self.unmatched_calls += 1
        if self.unmatched_calls == 1:
            message = problem + ": encoded directly, unbalanced (warned once)."
            warn_at_user(message)
        return self._original("tower")(pixels, grid_thw=grid_thw, **kwargs)


def direct_call_stats(config: ViTBalanceConfig, parts: tuple[tuple[Any, Any], ...]) -> BalanceStats:
    """:meth:`BalanceStats.of_direct_call` of a one-rank call of ``parts``, its ``(pixels, grid)``
    per modality (``None`` where absent): the grids are read only where all are on the CPU."""
    grids = [grid for _, grid in parts if isinstance(grid, torch.Tensor) and grid.dim() == 2]
    grid: torch.Tensor | None = None
    if grids and all(found.device.type == "cpu" for found in grids):
        grid = torch.cat(grids)
    elif grids:  # not read: its rows stand for the images
        grid = torch.empty((sum(int(found.shape[0]) for found in grids), 3), dtype=torch.long, device="meta")
    rows = sum(
        int(pixels.shape[0]) for pixels, _ in parts if isinstance(pixels, torch.Tensor) and pixels.dim()
    )
    return BalanceStats.of_direct_call(config, grid, pixel_rows=rows)


def key_names(keys: tuple[tuple[str, str], ...]) -> str:
    """``(pixels, grid)`` batch keys as a message names them: ``'a'/'b', 'c'/'d'``."""
    return ", ".join(f"{pixels!r}/{grid!r}" for pixels, grid in keys)


def unreadable_batch(batch: Any, keys: tuple[tuple[str, str], ...]) -> str:
    """Why a plan cannot be made from ``batch`` (not a mapping), naming the keys it is read by."""
    return (
        f"the batch is a {type(batch).__name__}, not a mapping: a plan made ahead reads the pixel "
        f"rows and grids of a batch by name ({key_names(keys)}); collate batches into a dict with "
        "those keys"
    )


def _check_arguments(config: object, group: object, evaluation: object) -> None:
    """Raise for an argument of ``balance_vision_tower`` of another kind, before anything is patched."""
    require_config("balance_vision_tower", config)
    require_flag("balance_vision_tower", "evaluation", evaluation)
    if dist.is_available() and dist.is_initialized():
        require_member(group, "group")


def rows_to_plan(
    batch: Any,
    keys: tuple[tuple[str, str], ...],
    towers: tuple[BalancedVisionTower, ...] = (),
) -> tuple[Any, Any]:
    """What ``ViTBalancer.prepare`` needs of a host batch: a meta tensor of the pixel rows' shape and
    dtype (nothing is read or copied) and the grid rows, for the keys present, in order. The first
    modality whose rows are not a 2-D tensor, or whose grid is not an integer tensor ``[n, 3]`` (or
    rows that make one), comes back as it was found, for ``prepare``'s checks to report on every rank.

    With drop-in ``towers`` (those still installed), the rows their forwards pass the tower: the
    grids of their ``step_grid_keys`` one temporal step per row (GLM-4.xV), and the pixels in the
    towers' dtype when they share one (the model casts them to it; a bf16 tower's rows then travel
    as bf16), and of the towers' width when the batch has no pixels (a text-only batch)."""
    if not isinstance(batch, Mapping):
        # Nothing to read by name: handed on as no tensor, for the prepare's checks to report on
        # every rank (model(**batch) could not take it; the mixin plans it as having no images).
        return batch, None
    towers = tuple(tower for tower in towers if tower.installed)
    step_keys = {key for tower in towers for key in tower.step_grid_keys}
    tower_dtypes = {tower.pixel_dtype for tower in towers}
    row_shapes = {tower._row_shape for tower in towers if tower._row_shape}
    rows, width, dtype, grids = 0, 1, torch.float32, []
    for pixel_key, grid_key in keys:
        pixels = batch.get(pixel_key) if isinstance(batch, Mapping) else None
        if pixels is None:
            continue
        if isinstance(pixels, torch.Tensor) and tuple(pixels.shape[1:]) in row_shapes:
            pixels = pixels.flatten(1)  # patch images (PaddleOCR-VL, Kimi-K2.5), moved as rows
        elif row_shapes:
            # Rows that are no patch images of these towers (flat [S, C] rows would plan, and the
            # forward then refuse them on one rank): handed on as no tensor, which the prepare's
            # checks report on every rank.
            return None, _as_grid(batch.get(grid_key))
        grid = _as_grid(batch.get(grid_key))
        if not (isinstance(pixels, torch.Tensor) and pixels.dim() == 2) or _grid_problem(grid_key, grid):
            # As found: the prepare's checks report them on every rank. Raising here would leave
            # the other ranks waiting in its gather.
            return pixels, grid
        rows, width, dtype = rows + int(pixels.shape[0]), int(pixels.shape[1]), pixels.dtype
        grid = grid.to("cpu", torch.long)
        grids.append(grid_steps(grid) if grid_key in step_keys else grid)
    grid = torch.cat(grids) if grids else torch.empty((0, 3), dtype=torch.long)
    dtype = tower_dtypes.pop() if len(tower_dtypes) == 1 else dtype
    widths = {_tower_channels(tower.tower) for tower in towers}
    if not grids and len(widths) == 1 and None not in widths:
        # No rows at all: a drop-in's call then passes [0, C] rows of its tower's width.
        width = widths.pop()
    return torch.empty((rows, width), dtype=dtype, device="meta"), grid


#: The transformers releases the drop-in's model families are tested with (the newest families in
#: the later one): an older release may hold an older form of a model, which the contract refuses.
_TESTED_TRANSFORMERS = "4.57 and 5.25"


def _transformers_note() -> str:
    """``"; transformers X is installed ..."`` when transformers is imported, else ``""``: a model's
    form changes between releases (transformers 5.17's Kimi-K2.5 pools its frames in another way)."""
    version = getattr(sys.modules.get("transformers"), "__version__", None)
    if version is None:
        return ""
    return f"; transformers {version} is installed, the drop-in is tested with {_TESTED_TRANSFORMERS}"


def _host_grid_rows(batch: Any, grid_keys: Iterable[str]) -> dict[str, tuple[Grid, ...]] | None:
    """The rows of ``batch``'s grids under ``grid_keys`` that are integer tensors ``[n, 3]`` on the
    CPU (or lists of rows), per grid key of a modality present; None for a batch that is no mapping."""
    if not isinstance(batch, Mapping):
        return None
    rows = {}
    for pixels_key, grid_key in _PREPARE_KEYS:
        grid = _as_grid(batch.get(grid_key))
        if (
            grid_key in grid_keys
            and batch.get(pixels_key) is not None
            and _grid_problem(grid_key, grid) is None
            and grid.device.type == "cpu"
        ):
            rows[grid_key] = grid_rows(grid)
    return rows


def _as_grid(value: Any) -> Any:
    """``value`` as a tensor (a list of grid rows becomes one), or as it is when it is none."""
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return value


def continue_fit(load: Callable[[Any], None], saved: Any, source: str, warn: Callable[[str], None]) -> None:
    """Go on from a saved cost fit: ``load(saved)`` (a ``load_state_dict`` of a ``ViTBalancer``, a
    handle or the mixin). A fit that cannot go on here (of other terms: another window or per-frame
    attention), or a state that is no balancer's (not a mapping, or of other keys), is left behind,
    ``warn`` says so (``source`` names where it came from), and the fit starts afresh. Every rank
    holds the same state and configuration, so all decide alike."""
    try:
        load(saved)
    except ValueError as error:
        warn(f"{source} is not used ({error}); the cost fit starts afresh.")


#: No group yet: what :attr:`BalancedVisionTower._twin_of` holds before a twin was made.
_NO_GROUP = object()


#: A module's own hook registries, as ``nn.Module.__call__`` reads them.
_HOOK_REGISTRIES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _hold_hooks(tower: nn.Module) -> dict[str, Any]:
    """Hold the tower's own hooks back until :func:`_restore_hooks`: the model's per-modality
    tower calls, which the drop-in answers from the balanced call, then run no hooks on any rank.

    Those calls differ in number between ranks (one per modality a rank has), while the balanced
    call runs the hooks once on every rank. ZeRO-3 records the order of module calls in the first
    step and requires it identical on every rank; hooks that gather parameters per call would issue
    a different number of collectives. Hooks registered in between are kept.

    Returns:
        The held hooks, by registry.
    """
    held = {name: getattr(tower, name) for name in _HOOK_REGISTRIES}
    for name in _HOOK_REGISTRIES:
        setattr(tower, name, OrderedDict())
    return held


def _restore_hooks(tower: nn.Module, held: dict[str, Any]) -> None:
    """Put back the hooks :func:`_hold_hooks` held, after those registered in between."""
    for name, hooks in held.items():
        hooks.update(getattr(tower, name))
        setattr(tower, name, hooks)


def _add_zero(output: Any, zero: torch.Tensor | None, base_name: str) -> Any:
    """``output`` with ``last_hidden_state - zero`` (bit-for-bit the same values, see the module doc)."""
    if zero is None:
        return output
    hidden = getattr(output, "last_hidden_state", None)
    if isinstance(hidden, torch.Tensor):
        output.last_hidden_state = hidden - zero.to(hidden.dtype)
        if "hidden_states" in output:
            output.hidden_states = _last_replaced(output.hidden_states, hidden, output.last_hidden_state)
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        replaced = output[0] - zero.to(output[0].dtype)
        return (replaced, *(_last_replaced(field, output[0], replaced) for field in output[1:]))
    raise TypeError(
        f"balance_vision_tower: {base_name}.forward returned {type(output).__name__} without a tensor "
        "last_hidden_state: the drop-in needs it to make every rank's loss reach the balanced call."
    )


def _last_replaced(field: Any, hidden: torch.Tensor, replaced: torch.Tensor) -> Any:
    """``field`` with ``replaced`` for its last entry when ``field`` is the layers' hidden states
    ending in ``hidden`` itself (``output_hidden_states=True``: the models' last entry is their
    ``last_hidden_state``), so that a loss on ``hidden_states[-1]`` reaches the balanced call too;
    any other field as it is."""
    if isinstance(field, tuple) and field and field[-1] is hidden:
        return (*field[:-1], replaced)
    return field


def balance_vision_tower(
    model: nn.Module,
    config: ViTBalanceConfig | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    evaluation: bool = False,
) -> BalancedVisionTower:
    """Balance the vision tower of a Hugging Face Qwen2-VL / 2.5-VL / 3-VL / 3.5 or GLM-4.xV model.

    After the call, ``model(**batch)`` in training (``model.training`` and gradients enabled)
    encodes every rank's images and videos in one balanced exchange across ``group``; losses,
    logits and gradients stay those of the plain model. Ranks with text only take part, so
    nothing hangs and DDP needs no ``find_unused_parameters``. Evaluation forwards call the tower
    directly unless ``evaluation``; ``generate()`` does too, unless ``evaluation`` is set and the
    tower's parameters are sharded (FSDP2, FSDP1, ZeRO-3). See :mod:`lightning_vit_balance.hf` for
    the contract.

    Example::

        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(...)
        handle = balance_vision_tower(model)          # after init_process_group
        loss = model(**batch).loss                    # on every rank, with or without images
        loss.backward()
        print(handle.last_stats)

    Args:
        model: The model (or any module containing exactly one ``visual`` tower, or ``vision_tower``
            / ``vision_model`` for the families the README lists).
        config: Balancing settings; None: ``ViTBalanceConfig()`` priced by
            ``CostModel.from_vit(tower)``, with ``split_videos`` for towers that attend within each
            temporal step (``handle.default_config()``). A configuration given replaces that whole:
            to change one setting, ``dataclasses.replace(handle.default_config(), ...)``.
        group: The data-parallel process group; None: the default group.
        evaluation: Balance evaluation forwards too (``model.eval()`` or no gradients; not
            ``generate()``'s, but its image encoding where the tower's parameters are sharded).
            Then every rank must make the same evaluation forwards and ``generate()`` calls, as in
            a validation loop over a ``DistributedSampler`` (``synced_gpus=True`` when sharded).
            Needed for evaluation and generation under FSDP or ZeRO-3 when ranks differ in
            modalities: their tower calls gather parameters.

    Returns:
        The handle: ``last_stats``, ``calls``, ``applied_calls``, ``remove()``, ``prepare(batch)``
        to plan the next forward while its batch is on the host, ``plan_ahead(collate)`` for a
        collator whose batches' forwards plan from grids kept on the host (Hugging Face's
        ``Trainer``, accelerate), and ``state_dict()`` /
        ``load_state_dict()`` for checkpoints (with ``calibrate_cost``, the online cost fit;
        Hugging Face's ``Trainer`` keeps it with ``ViTBalanceTrainerCallback``).

    Raises:
        ValueError: ``model`` breaks the contract (the message names what is missing) or is already
            balanced.
    """
    return BalancedVisionTower(model, config, group, evaluation=evaluation)
