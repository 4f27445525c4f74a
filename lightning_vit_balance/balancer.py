"""Balanced ViT encoding: gather -> plan -> dispatch -> encode -> status -> combine.

:class:`ViTBalancer` wraps one call ``vit(pixel_values, grid_thw)`` on every data-parallel rank.
Each rank's images are encoded where the plan puts them and every output comes back to its own
rank, in the original order, with the same values and the same gradients as the direct call.

Per call and rank: one small all_gather of every rank's grid rows (plus an input status and a
settings fingerprint, so bad input or differing settings raise on every rank), then, when the plan
moves images, one ``all_to_all_single`` of pixel rows (dispatch), the ViT, a tiny status
all_gather (so a ViT that raised or returned unusable outputs on one rank fails every rank at
once instead of leaving them waiting), and one ``all_to_all_single`` for all returned
outputs together (combine: embeddings and every deepstack layer). A skipped call costs the gather
alone (and the status gather after the ViT, with ``check_skipped_calls``). The backward pass runs
the combine and (when ``pixel_values`` requires grad) the dispatch in reverse: every rank must
backpropagate through the outputs it got (as a VLM does when it scatters them into its input
embeddings, even with zero rows), because those exchanges are collectives too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import math
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, ParamSpec, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from lightning_vit_balance.callsite import warn_at_user, warn_on_rank_zero
from lightning_vit_balance.config import ViTBalanceConfig, require_config, setting_digest
from lightning_vit_balance.cost import CostCalibrator, CostModel
from lightning_vit_balance.eager import eager
from lightning_vit_balance.encoding import (
    INVALID_INPUT,
    BalancedBatch,
    EncodedBatch,
    GatherFor,
    TripClock,
    ViTClock,
    called_module,
    encode,
    merge_problem,
    own_parameters,
    parameters_sharded,
    raise_for_gradients,
    raise_for_input,
    raise_for_merges,
    raise_for_other_vits,
    raise_for_plans,
    raise_for_vit,
    release_frames,
    splice_encoded,
    submodules,
    validate_input,
    vit_identity,
)
from lightning_vit_balance.exchange import (
    GATHER_CAPACITY,
    ExchangeRoute,
    PendingExchange,
    PixelTrip,
    RankMetadata,
    ReturnLayout,
    StatusReport,
    all_to_all,
    backend_errors_explained,
    collective_device,
    device_problem,
    exchange_status,
    gather_metadata,
    grid_rows,
    host_device,
    host_to_device,
    require_member,
    row_runs,
    start_pixel_trip,
    take_rows,
)
from lightning_vit_balance.outputs import (
    OutputLayout,
    describe_classification,
    merge_size_of,
    rebuild_output,
    unwrap_module,
    window_index_fn,
    without_dropped,
)
from lightning_vit_balance.planning import RebalancePlan, plan_rebalance
from lightning_vit_balance.prepared import DeviceGridChecks, PreparedPlan, batch_digest, grid_gcd
from lightning_vit_balance.problems import (
    DTYPES,
    InputProblem,
    UncombinedInput,
    dense_problem,
    describe_problem,
)
from lightning_vit_balance.recompute import PlanMemory, in_backward_pass
from lightning_vit_balance.routes import RouteCache
from lightning_vit_balance.wire import elements_per_row, pack_return, transit_dtype, unpack_return

__all__ = ["BalanceStats", "PreparedPlan", "ViTBalancer", "balanced_encode"]


@dataclass(frozen=True)
class BalanceStats:
    """Diagnostics of one balanced ViT call (the seed's ``--dp-balance-verbose`` figures).

    Attributes:
        applied: Whether images moved between ranks.
        reason: Why, one of :data:`~lightning_vit_balance.REASONS`.
        rank: This rank in the data-parallel group.
        num_ranks: Ranks in the group.
        loads_before: Cost per rank with every image at home. For ``"disabled"`` and
            ``"single-rank"`` calls (nothing gathered) only this rank's load.
        loads_after: Cost per rank under the plan.
        imbalance_before: ``max(load) / mean(load) - 1`` before; NaN for a ``"disabled"`` call on
            many ranks (nothing gathered, so unknown).
        imbalance_after: The same under the plan.
        num_images: Images over all ranks (this rank's only when nothing was gathered); with
            ``split_videos``, each temporal step of a video counts as an image.
        moved_images: Images (with ``split_videos``, video steps) encoded away from their own rank.
        moved_patches: Pixel rows sent to another rank.
        total_patches: Patches over all ranks (this rank's only when nothing was gathered).
        bytes_sent: Bytes this rank sent to other ranks in both trips (its own rows excluded).
        bytes_received: Bytes this rank received from other ranks in both trips.
        plan_seconds: Wall time computing the plan in this call (0.0 for a plan made before it:
            see ``prepare_seconds``).
        exchange_seconds: Host wall time in the metadata gather, both trips and the status gather,
            packing and unpacking included, the ViT forward excluded (the status gather includes
            waiting for the slowest rank's ViT): ``gather + dispatch + combine`` seconds.
        collectives: Collectives this call issued in the forward pass (the backward pass repeats
            the trips that carry gradients).
        gather_seconds: Host wall time of the metadata gather and the input checks.
        dispatch_seconds: Host wall time of the pixel trip (selecting rows included).
        encode_seconds: Host wall time of this rank's ViT forward.
        combine_seconds: Host wall time of the status gather, the return trip and unpacking.
        status_seconds: The part of ``combine_seconds`` spent packing the return buffer and in the
            status gather (waiting for the slowest rank's ViT included).
        vit_ms: Every rank's ViT milliseconds in its previous call, from this call's gather
            (empty when nothing was gathered; -1 for a rank with no earlier call).
        prepare_seconds: Host wall time of this call's plan made before it (:meth:`ViTBalancer.prepare`,
            ``plan_ahead``, the drop-in's collator): its metadata gather and its planning, spent
            outside this call; 0.0 for a call that gathered and planned itself.
        trip_ms: This rank's milliseconds in trips, one call late: the forward trips of the call
            before this one and the backward trips that ran before that call (those of earlier
            calls' gradients); -1.0 when there were none, or while their CUDA events still run.
            Forward: packing and sending the pixel rows, packing the return buffer, the return
            trip and unpacking it; backward: the exchanges that send the gradients back (the
            return trip's, and the pixel trip's when the pixels need gradients) and placing them.
            Device time on CUDA (events, read a call later so that nothing waits), host time on
            CPU. A trip is a collective: its time includes waiting for the other ranks to reach it
            (in the backward pass, for their work after the ViT). The status gather and its wait
            for the slowest rank's ViT are not in it, nor, with ``overlap_pixel_trip``, the wait
            for the pixel trip (that is in ``vit_ms``). Summed over calls, every trip counts once.
        cost_fits: With ``calibrate_cost``, the online cost fit's successful fits so far (0: still
            planning with the configuration's model); -1 without.
        cost_error: With ``calibrate_cost``, :attr:`CostCalibrator.last_error`: how far the fitted
            model was off on the latest measured call's per-rank ViT times, before refitting on
            them (the median relative error; ``0.05``: typically within 5%). NaN without
            ``calibrate_cost``, before the first fit, and where no time was measured.
        cost_model: With ``calibrate_cost``, the model the online fit plans with after this call
            (``cost_model.to_config(config)``, ``config`` without ``calibrate_cost``, pins it for a
            run without the fit); None without.
    """

    applied: bool
    reason: str
    rank: int
    num_ranks: int
    loads_before: tuple[float, ...]
    loads_after: tuple[float, ...]
    imbalance_before: float
    imbalance_after: float
    num_images: int
    moved_images: int
    moved_patches: int
    total_patches: int
    bytes_sent: int
    bytes_received: int
    plan_seconds: float
    exchange_seconds: float
    collectives: int
    gather_seconds: float = 0.0
    dispatch_seconds: float = 0.0
    encode_seconds: float = 0.0
    combine_seconds: float = 0.0
    vit_ms: tuple[float, ...] = ()
    status_seconds: float = 0.0
    prepare_seconds: float = 0.0
    trip_ms: float = -1.0
    cost_fits: int = -1
    cost_error: float = math.nan
    cost_model: CostModel | None = None

    @classmethod
    def of_direct_call(
        cls,
        config: ViTBalanceConfig,
        grid_thw: Any,
        *,
        pixel_rows: int = 0,
        reason: str = "single-rank",
        rank: int = 0,
        num_ranks: int = 1,
    ) -> BalanceStats:
        """The stats of a call that encoded its own batch directly, nothing gathered (one rank,
        balancing disabled): nothing moved; imbalance 0 on one rank, NaN on many (no rank knows the
        others' loads), left out of :class:`~lightning_vit_balance.BalanceMetrics`' means.

        The grid is read only on the CPU (reading one on a device would make the host wait for
        it): from a device grid, no loads, a grid row per image and a pixel row per patch. With
        ``split_videos`` each temporal step of a video read counts as an image, as when balanced.

        Args:
            config: The balancing settings (the cost model and ``split_videos``).
            grid_thw: The call's ``[n, 3]`` grid.
            pixel_rows: The call's pixel rows, the patches of a grid on a device.
            reason: ``"single-rank"`` or ``"disabled"``.
            rank: This rank in the data-parallel group.
            num_ranks: Ranks in the group.
        """
        grid = grid_thw if isinstance(grid_thw, torch.Tensor) and grid_thw.dim() == 2 else None
        counts, frames = _host_grid_items(grid)
        loads: tuple[float, ...] = ()
        images, patches = (int(grid.shape[0]), pixel_rows) if grid is not None else (0, 0)
        if grid is None or grid.device.type == "cpu":
            # A one-rank plan prices this rank's load.
            loads = plan_rebalance([counts], config, frames=[frames]).loads_before
            images = sum(frames) if config.split_videos else len(counts)
            patches = sum(counts)
        imbalance = math.nan if num_ranks > 1 else 0.0
        return cls(
            applied=False,
            reason=reason,
            rank=rank,
            num_ranks=num_ranks,
            loads_before=loads,
            loads_after=loads,
            imbalance_before=imbalance,
            imbalance_after=imbalance,
            num_images=images,
            moved_images=0,
            moved_patches=0,
            total_patches=patches,
            bytes_sent=0,
            bytes_received=0,
            plan_seconds=0.0,
            exchange_seconds=0.0,
            collectives=0,
        )


def _host_grid_items(grid: torch.Tensor | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(patch counts, temporal steps)`` per image of a valid ``[n, 3]`` grid on the CPU; empty
    for any other (a grid on a device is not read)."""
    if grid is None or grid.shape[1] != 3 or grid.device.type != "cpu":
        return (), ()
    rows = grid_rows(grid)
    counts = tuple(t * h * w for t, h, w in rows)
    frames = tuple(t for t, _, _ in rows)
    return ((), ()) if any(n <= 0 for n in (*counts, *frames)) else (counts, frames)


_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")
_Read = TypeVar("_Read")


@dataclasses.dataclass(frozen=True)
class _Encoded:
    """What every rank encoded in a call, in the order it encodes them: what the call's measured
    time, carried in the gather after it, pays for in the online cost fit.

    Attributes:
        counts: ``counts[r]``: the patch counts rank ``r`` encodes (``None``: not fitting online).
        frames: ``frames[r]``: their temporal steps.
        batch: The ``batch_digest`` of the plan made ahead that said so (0 where the call gathered:
            then every rank holds the same): compared in the next gather, since a rank given
            another call's plan that moved nothing would feed its fit other figures unnoticed.
    """

    counts: tuple[tuple[int, ...], ...] | None = None
    frames: tuple[tuple[int, ...], ...] | None = None
    batch: int = 0


#: A loop's clocks and what they pay for (:meth:`ViTBalancer.measure_as`).
_LoopClocks = tuple[ViTClock, TripClock, _Encoded]


def _fresh_clocks() -> _LoopClocks:
    """A loop's clocks before its first call: its first call reports no figures."""
    return ViTClock(), TripClock(), _Encoded()


def _collector_paused(method: Callable[_Params, _Result]) -> Callable[_Params, _Result]:
    """``method`` with Python's cyclic garbage collector paused while it runs (if it was running).

    A balanced call's host work allocates thousands of small objects on many ranks (a tuple per
    image and per rank when reading the gathered rows, the plan's lists), nearly all freed by
    reference counting before the call ends. With the collector running, those allocations set off
    collections in the middle of the call, and what is alive at that moment is promoted, until a
    full collection over the training process's whole heap (tens of milliseconds) runs inside a
    balanced call: a straggler on that rank, which every rank then waits for. Paused, the call's
    objects die unseen; the collector goes on after the call as before (BENCHMARKS.md, "Host work
    under the garbage collector"). The ViT's forward runs inside it too, for as long as it takes.
    """

    @functools.wraps(method)
    def paused(*args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        if not gc.isenabled():
            return method(*args, **kwargs)
        gc.disable()
        try:
            return method(*args, **kwargs)
        finally:
            gc.enable()

    return paused


@dataclass
class _Call:
    """What one balanced call knows and has measured so far."""

    group: Any
    rank: int
    merge: int
    device: torch.device
    vit: int = 0  # the ViT's vit_identity, compared in the status gather (0: none told, or prepare)
    host: Any = None  # the group for the small host-side gathers (metadata, status)
    seconds: dict[str, float] = field(default_factory=dict)
    collectives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    # A prepared call's PreparedPlan.batch_digest, compared with the plan's digest in the status
    # gather (None: the plan was made in this call, from the gather every rank took part in).
    batch_digest: int | None = None

    def timed(self, step: str, started: float, *within: str) -> None:
        """Add the time since ``started`` to ``step`` and to the steps it is part of (``within``)."""
        elapsed = time.perf_counter() - started
        for name in (step, *within):
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed

    @contextlib.contextmanager
    def first_trip(self) -> Iterator[None]:
        """Around the pixel trip. In a call given a plan made before it, the trip is the call's
        first collective: a rank out of step there (another rank called without the plan, and
        gathers) fails with gloo's or NCCL's text, which names neither the call nor the cause."""
        if self.batch_digest is None:
            yield
            return
        what = "the pixel trip of a call given a plan made before it"
        with backend_errors_explained(
            what,
            "every rank must pass the plan made for its call (prepared=), or none, and take the "
            "plans in the order they were made (a plan taken twice, or another batch's, sends other "
            "sizes than the other ranks await); ",
        ):
            yield


@dataclass(frozen=True)
class _Reference:
    """``C`` and dtype every rank's pixel rows share (from the first rank with images)."""

    channels: int
    dtype: torch.dtype
    pixels_differentiable: bool


def _refuse_images_split(config: ViTBalanceConfig, layout: OutputLayout | None) -> None:
    """An ``"image"`` output has a row per grid row the ViT sees: with ``split_videos`` a video
    reaches it as its temporal steps, so it would return a row per step, not the video's one."""
    image_paths = [path for path, kind in (layout.kinds.items() if layout else ()) if kind == "image"]
    if config.split_videos and image_paths:
        raise ValueError(
            f'output_layout names {image_paths} as "image" outputs, which split_videos=True cannot '
            "return: the ViT would see each temporal step of a video as an image and return a row "
            "per step. Expected split_videos=False with outputs of a row per image."
        )


def _advise_host_group(group: Any) -> None:
    """Warn (on the group's rank 0) where ``group`` carries CUDA tensors alone (NCCL) and no host
    group was given: every balanced call's small gathers then go through CUDA buffers, and reading
    them makes the host wait for the GPU in the forward."""
    if host_device(group).type != "cuda" or dist.get_rank(group) != 0:
        return
    warn_at_user(
        "ViTBalancer: group is an NCCL group and no host_group was given, so every balanced call "
        "gathers its metadata and status words through CUDA buffers: a device-to-host copy each, "
        "which makes the host wait for the GPU in the forward (and prepare() wait for it). Expected "
        "host_group=make_host_group(group), made once on every process at the same point (or "
        "host_group=group to gather there knowingly)."
    )


def _vit_requires_grad(vit: Any) -> bool:
    """Whether ``vit``'s outputs may require grad from its weights. A module that lists no
    parameters may still hold trained weights: FSDP1 (``use_orig_params=False``) flattens those of
    a tower inside an outer unit into that unit's parameter, and its forward sets them on the
    modules as plain tensors, views of it that require grad. (Buffers, as frozen or quantized
    towers hold their weights, do not.)"""
    if not isinstance(vit, torch.nn.Module):
        return True
    modules = list(submodules(vit))
    has_parameters = False
    for parameter in own_parameters(modules):
        if parameter.requires_grad:
            return True
        has_parameters = True
    if has_parameters:
        return False
    return any(
        isinstance(value, torch.Tensor) and value.requires_grad
        for module in modules
        for value in vars(module).values()
    )


#: The keys of :meth:`ViTBalancer.state_dict` (the cost fit, where there is one).
STATE_KEYS = ("cost_calibrator",)


def checked_state(state: Any, where: str) -> dict[str, Any]:
    """A copy of ``state``, given to ``where`` (a ``load_state_dict``), checked to be a mapping of
    :data:`STATE_KEYS` only: a key misspelled, or a mapping of another level (a whole checkpoint,
    a callback's entry), was taken without a word, its cost fit lost and the mapping saved again."""
    if not isinstance(state, Mapping):
        raise ValueError(
            f"{where}: state={state!r} is invalid: expected a mapping (a state_dict() of a balancer)."
        )
    unknown = [key for key in state if key not in STATE_KEYS]
    if unknown:
        raise ValueError(
            f"{where}: state has the keys {unknown!r}, which no balancer's state_dict() holds: expected "
            f"a mapping of {list(STATE_KEYS)} only (empty without a cost fit), as state_dict() returns it."
        )
    return dict(state)


class ViTBalancer:
    """Encode images with a ViT, balancing the work across data-parallel ranks.

    ``balancer(vit, pixel_values, grid_thw)`` returns what ``vit(pixel_values, grid_thw)`` returns
    on this rank (same type and structure, same values, images in the original order), with
    gradients flowing back to the ViT exactly as in the direct call. Every rank of the group
    must make the call, also ranks with no images (``grid_thw`` of shape ``[0, 3]``).

    What comes back: outputs with a row per patch or per merged token are exchanged back to
    their images' ranks (integers bit for bit); a window index (of a ViT with ``get_window_index``:
    its one integer output with a row per merged token, or among several the one named
    ``window_index``) is regenerated from this rank's ``grid_thw`` (element 0 when
    ``get_window_index`` returns a tuple), in the dtype, device and row shape of the tower's own
    (``[N, 1]`` stays so); other values (``None``, numbers, 0-d tensors, outputs
    named ``"passthrough"``) are those of the batch this rank encoded. The ViT is never called on
    an empty batch: a rank that encodes nothing runs it on one dummy ``(1, m, m)`` image and
    returns zero-row slices of the result (see ``ViTBalanceConfig.empty_rank_forward``). NaN or
    Inf values travel as they are: a NaN that one rank's ViT makes for another rank's image lands
    on that image's own rank, exactly where an unbalanced run would have made it.

    Python's cyclic garbage collector is paused while a balanced call or :meth:`prepare` runs (the
    ViT's forward included) and restored after it: the call's host work allocates many small
    objects, which would otherwise set off collections inside the call, up to a full one over the
    process's heap, a straggler that every rank waits for.

    Errors, the same on every rank and before anything waits on the failing rank:

    * invalid input on any rank (grid shape, dtype or values, pixel rows, merge divisibility,
      device, ``C`` or dtype differing between ranks) and settings that differ between ranks
      (the :class:`~lightning_vit_balance.ViTBalanceConfig`, the package version) raise a
      ``ValueError`` before anything moves;
    * when the ViT raises on some rank during an applied call (or a skipped one, with
      ``config.check_skipped_calls``), that rank re-raises its own exception and every other rank
      raises a ``RuntimeError`` naming the rank and the exception (a ``torch.OutOfMemoryError``,
      a ``RuntimeError`` too, when every failing rank ran out of memory, so that a loop skipping
      such batches skips them on every rank);
    * an output whose rows fit no kind, or outputs whose dtype or trailing shape differ between
      ranks, raise a ``ValueError`` after the ViT, before the return trip;
    * so do ranks that differ in whether the call carries gradients back (a ViT frozen on some
      ranks only, a call under ``torch.no_grad()`` on some) in a call that moves images: the
      others' backward pass would wait for them in the trips.

    Args:
        config: Balancing options; default ``ViTBalanceConfig()``.
        group: The data-parallel process group; ``None`` is the default group. Without an
            initialised process group, or with one rank, the ViT is called directly. A group this
            process is not in (``new_group``'s placeholder on the ranks it leaves out) raises a
            ``ValueError`` here.
        output_layout: Kinds of the ViT's outputs where their rows do not tell (an
            :class:`~lightning_vit_balance.outputs.OutputLayout`, or a mapping from output
            path to kind: ``"image"`` for a row per image, such as pooled vectors), and the merge
            size where the ViT does not expose ``spatial_merge_size``.
        report: Where ``config.verbose`` reports go, one line per call on DP rank 0; default
            ``print`` (the mixin passes Lightning's ``rank_zero_info``).
        host_group: A group over the same ranks, in the same order, whose backend carries CPU
            tensors (gloo), for the metadata and status gathers: with an NCCL ``group`` they then
            cost no device-to-host copy. :func:`~lightning_vit_balance.make_host_group` makes one
            (as ``ViTBalanceMixin`` and the Hugging Face drop-in do). Default: ``group`` itself,
            with a warning on its rank 0 at the first call where ``group`` is NCCL's alone (pass
            ``group`` itself to gather there knowingly).

    Attributes:
        last_stats: :class:`BalanceStats` of the last call, ``None`` before the first.
        calls: Calls made (a recomputation by activation checkpointing counts as its forward call).
        applied_calls: Calls where images moved.
    """

    def __init__(
        self,
        config: ViTBalanceConfig | None = None,
        group: dist.ProcessGroup | None = None,
        *,
        output_layout: OutputLayout | Mapping[str, str] | None = None,
        report: Callable[[str], None] | None = None,
        host_group: dist.ProcessGroup | None = None,
    ) -> None:
        require_config("ViTBalancer", config)
        if report is not None and not callable(report):
            # Called with the first verbose line, after a call's collectives: on every rank alike
            # only if refused here.
            raise TypeError(
                f"report={report!r} is invalid: expected a callable taking one line of text (print, "
                "a logger's info method) or None."
            )
        require_member(group, "group")
        require_member(host_group, "host_group")
        self._calibrator: CostCalibrator | None = None
        self.config = config if config is not None else ViTBalanceConfig()
        self.group = group
        self.host_group = host_group
        self._host_checked = host_group is None
        self._host_advised = host_group is not None
        self.output_layout = output_layout
        self.last_stats: BalanceStats | None = None
        self.calls = 0
        self.applied_calls = 0
        self._warned_sharded_overlap = False
        # The tower the cost fit measures (see _note_fitted_tower): a weak reference, so that a
        # tower rebuilt in its place (a reloaded model) takes over its fit without a warning.
        self._fitted_tower: Callable[[], Any] | None = None
        # What a call reads of its ViT module once: whether it is sharded (of the module the call
        # names: an FSDP1 wrapper is what shards it), its identity (of the module inside wrappers).
        self._sharded_vits: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
        self._vit_identities: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
        # Plans for activation checkpointing's recomputations, where refits may change the plan.
        self._plan_memory = PlanMemory()
        # Routes, trips and return layouts of recent plans: made once per plan, ahead where it is.
        self._routes = RouteCache()
        # This loop's clocks, and what every rank encoded in the previous call: what its measured
        # ViT time paid for.
        self._clock, self._trips, self._encoded = _fresh_clocks()
        # The loop the clocks and encoded counts above measure, and the other loops' (measure_as).
        self._loop = ""
        self._other_loops: dict[str, _LoopClocks] = {}
        # Prepared calls' grids on a device, compared there; read at the next metadata gather.
        self._grid_checks = DeviceGridChecks()
        # A prepared call the plan skipped whose input did not match the plan: told at the next gather.
        self._skipped_mismatch = False
        # Whether a call given a prepared plan ran since the last check_pending (a comparison of its
        # may still run after the next gathers): every rank makes that call, so all hold one answer.
        self._prepared_since_check = False
        # Whether the failure of the call in progress reached every rank (the status gather's).
        self._failed_everywhere = False
        # The reason of the plan the call in progress took, once it has one (None before).
        self._planned_reason: str | None = None
        self._print = report if report is not None else _print_line

    def measure_as(self, loop: str) -> None:
        """Measure the calls from now on as ``loop``'s (a training loop's, an evaluation's), apart
        from other loops' calls.

        A call's measured ViT time reaches the stats (``vit_ms``) and the online cost fit in the
        next call's gather, and its trips' time (``trip_ms``) at the next call, after its backward
        pass: calls of the loop before would give the first calls of the next loop their figures
        (a training step after a validation reported the validation's ViT time). Each loop keeps
        its own clocks: a loop's first call carries its own previous call's figures, or none.
        Call it on every rank alike (the Lightning mixin does, from the Trainer's stage), before
        the loop's :meth:`prepare` and calls.
        """
        if loop == self._loop:
            return
        self._other_loops[self._loop] = (self._clock, self._trips, self._encoded)
        kept = self._other_loops.pop(loop, None)
        if kept is None:
            kept = _fresh_clocks()
        self._clock, self._trips, self._encoded = kept
        self._loop = loop

    def forget_loop(self, loop: str) -> None:
        """Forget ``loop``'s clocks (see :meth:`measure_as`): its next call reports none of the
        figures of the calls before, as a loop's first call. For a loop run again apart (an
        evaluation of another dataset, a prediction, then an evaluation): its first call would
        report the last run's last call as its own. Call it on every rank alike."""
        if loop == self._loop:
            self._clock, self._trips, self._encoded = _fresh_clocks()
        else:
            self._other_loops.pop(loop, None)

    # -- entry point -------------------------------------------------------------------------

    @eager
    def __call__(
        self,
        vit: Any,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        *,
        prepared: PreparedPlan | None = None,
    ) -> Any:
        """Balanced ``vit(pixel_values, grid_thw)``; see the class docstring.

        Args:
            vit: Called as ``vit(pixel_values, grid_thw)``.
            pixel_values: ``[sum(T*H*W), C]`` patch rows of this rank's images.
            grid_thw: ``[n_images, 3]`` ``(T, H, W)`` of each image.
            prepared: The plan :meth:`prepare` made for this batch before the forward: then the call
                makes no metadata gather and no plan. When the plan skips, it makes no collective
                but the status gather after the ViT, and that only where the plan was made with
                ``check_skipped_calls`` or no rank has images.

        Inside a compiled model (``torch.compile``) the call runs eagerly, a graph break, and calls
        ``vit`` as it is passed (compile it, or its blocks, to have it compiled).
        """
        if prepared is not None and not isinstance(prepared, PreparedPlan):
            raise TypeError(
                f"prepared={prepared!r} is invalid: expected the PreparedPlan ViTBalancer.prepare "
                "returned for this batch, or None."
            )
        # A recomputation (activation checkpointing) is the forward's call again: not counted.
        self.calls += int(not in_backward_pass())
        remembered = self._plan_memory.remembered
        self._failed_everywhere, self._planned_reason = False, None
        try:
            return self._call(vit, pixel_values, grid_thw, prepared)
        except BaseException as error:
            # No figure of a failed call may reach the cost fit (a rank's time up to its error, or
            # an earlier call's), and the error must not keep the call's buffers alive. Where every
            # rank raises (the status gather told them), no recomputation of the call will come:
            # its plan goes. A failure of this rank alone keeps it, as the other ranks do.
            self._clock.forget()
            if self._failed_everywhere:
                self._plan_memory.forget_since(remembered)
                self._forget_encoded()
            release_frames(error)
            raise

    def _forget_encoded(self) -> None:
        """After a call or gather that failed on every rank: none feeds its fit the figures of the
        call before, which the ranks may hold apart (``previous_call_plan``: plans made ahead for
        other batches), so that the next call agrees again. Not in a recomputation (activation
        checkpointing), which torch may end early by an error: its forward's figures stand."""
        if not in_backward_pass():
            self._encoded = _Encoded()

    def _reason_counted_elsewhere(self) -> str | None:
        """After a call that raised here: its plan's reason where the other ranks may have finished
        it (this rank's failure reached no status gather: the ViT of a skipped call, unchecked),
        else None (every rank raised, or the call had no plan yet)."""
        return None if self._failed_everywhere else self._planned_reason

    def _call(
        self, vit: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor, prepared: PreparedPlan | None
    ) -> Any:
        distributed = dist.is_available() and dist.is_initialized()
        if prepared is not None and distributed and self.config.enabled:
            return self._balanced_prepared(vit, pixel_values, grid_thw, prepared)
        if not self.config.enabled:
            output = self._direct(vit, pixel_values, grid_thw)  # the same outputs as when enabled
            rank = dist.get_rank(self.group) if distributed else 0
            world = dist.get_world_size(self.group) if distributed else 1
            self._record_local("disabled", rank, world, pixel_values, grid_thw)
            return output
        if not distributed or dist.get_world_size(self.group) == 1:
            merge = merge_size_of(vit, self.output_layout)
            empty = isinstance(grid_thw, torch.Tensor) and grid_thw.dim() == 2 and grid_thw.shape[0] == 0
            # Rows the dummy image could take their width from; other input goes to the ViT as it is.
            if empty and isinstance(pixel_values, torch.Tensor) and pixel_values.dim() == 2:
                reference = _Reference(int(pixel_values.shape[1]), pixel_values.dtype, False)
                output = self._empty_output(vit, pixel_values, grid_thw, merge, reference)
            else:
                output = self._direct(vit, pixel_values, grid_thw)
            self._record_local("single-rank", 0, 1, pixel_values, grid_thw)
            return output
        return self._balanced(vit, pixel_values, grid_thw)

    @eager
    @_collector_paused
    def prepare(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, vit: Any = None
    ) -> PreparedPlan | None:
        """Gather every rank's grid rows and plan the next call, before its forward.

        Call it on every rank of the group, as early as the batch is known on the host (e.g. in
        Lightning's ``on_before_batch_transfer``), then pass the result as ``prepared=`` to the
        call that encodes that batch. It gathers over the group, so it runs in the training
        process, not in a DataLoader worker (a ``collate_fn`` with ``num_workers > 0``). Only
        shapes and dtypes of ``pixel_values`` are read, so a host copy (or the batch before it
        moves to the device) will do; ``grid_thw`` should be on the CPU so that reading it does not
        wait for a device.

        Args:
            pixel_values: ``[sum(T*H*W), C]`` (its rows, ``C``, dtype and ``requires_grad``).
            grid_thw: ``[n_images, 3]``.
            vit: The ViT, for its merge size (divisibility is checked then); optional: without it,
                the call checks its ViT's merge size against every rank's rows, before anything
                moves (the plan holds their greatest common divisor: no host work in the forward).

        Returns:
            The prepared plan; ``None`` when nothing would be balanced (disabled, no process
            group, one rank), in which case the call needs none either.

        Raises:
            ValueError: On every rank, for invalid input or settings on any rank.
            RuntimeError: In a DataLoader worker process (where a forked worker's copy of the group
                would wait forever, past its timeout).
        """
        refuse_in_a_loader_worker("ViTBalancer.prepare")
        call = self._call_before_forward(vit)
        if call is None:
            return None
        metadata, reference = self._gather(call, pixel_values, grid_thw, GatherFor.PREPARE)
        plan, encoded = self._plan(call, metadata, remember=False)
        # The plan's routes, trips and return layout too, so that its call only looks them up.
        started = time.perf_counter()
        self._routes.warm(plan, call.rank, homes=(True, False) if self.config.overlap_pixel_trip else (True,))
        call.timed("plan", started)
        return PreparedPlan(
            plan=plan,
            metadata=metadata,
            rank=call.rank,
            channels=reference.channels,
            dtype=reference.dtype,
            # The rows' own flag, not prepare's grad mode (the call applies its own): a plan made
            # under no_grad (a collator's thread) for pixels that require grad is theirs.
            pixels_require_grad=any(m.requires_grad for m in metadata),
            gather_seconds=call.seconds.get("gather", 0.0),
            plan_seconds=call.seconds.get("plan", 0.0),
            collectives=call.collectives,
            call_grids=self._call_grids(grid_thw, metadata[call.rank]),
            grid_gcd=grid_gcd(metadata),
            encoded_counts=encoded.counts,
            encoded_frames=encoded.frames,
            # Compared by a call that moves images, and by the next gather of a fit (_Encoded.batch).
            batch_digest=batch_digest(metadata) if plan.applied or encoded.counts is not None else 0,
            vit_ms=_vit_ms(metadata),
            check_skipped_calls=self.config.check_skipped_calls,
        )

    def check_pending(self) -> None:
        """Report now what the latest calls given a prepared plan left for the next call's gather.

        A call given a prepared plan compares its grid values with the plan's on their device
        (read a call later, so that the forward never waits for the device), and a call the plan
        skipped whose input did not match it encodes its own batch and warns on its rank: the next
        gather tells every rank. Where no balanced call follows (the end of a loop), call this on
        every rank of the group instead: one small gather, after waiting for the comparisons still
        running. The Lightning mixin does it when a run ends, ``ViTBalanceTrainerCallback`` when
        training ends. Nothing to do (no collective) where no call given a prepared plan ran since
        the last check (on every rank alike: every rank makes that call), or calls are not balanced.

        Raises:
            ValueError: On every rank, when a rank's earlier call did not match its prepared plan.
        """
        call = self._call_before_forward(None) if self._prepared_since_check else None
        if call is None:
            return
        self._prepared_since_check = False
        self._grid_checks.wait()
        # No rows: only what the earlier calls left, and the settings, go into the gather; the last
        # call's measured time stays for the next call's gather (read, not consumed).
        self._gather(call, torch.empty((0, 1)), torch.empty((0, 3), dtype=torch.long), GatherFor.CHECK)

    def _take_pending(self, previous: ViTBalancer) -> None:
        """Take what ``previous`` (a balancer this one replaces: another configuration or layout)
        left for its next gather to tell (see :meth:`check_pending`): this one's next gather tells it."""
        self._grid_checks, previous._grid_checks = previous._grid_checks, DeviceGridChecks()
        self._skipped_mismatch = self._skipped_mismatch or previous._skipped_mismatch
        self._prepared_since_check = self._prepared_since_check or previous._prepared_since_check
        previous._skipped_mismatch = previous._prepared_since_check = False

    def _go_on_from(self, previous: ViTBalancer, loop: str, every_loop: bool = False) -> bool:
        """Go on from ``previous``, a balancer of the same tower that this one stands in for, in
        this process, with another configuration, for ``loop``'s calls (:meth:`measure_as`): from
        its cost fit as it stands (no warm-up again, as where one balancer's ``config`` changes)
        and its clocks of ``loop``, so that its last call's measured times there reach this one's
        first gather (the fit and the stats). A checkpoint's state (``load_state_dict``) restarts
        the warm-up and carries no clock: with a configuration new at every step (a schedule), no
        call was ever fitted or reported. ``previous`` keeps its other loops' clocks (its training
        calls go on measured after an evaluation's configuration took its evaluation clocks), but
        with ``every_loop``, for a ``previous`` let go, where they all come along. What it left to
        tell is :meth:`_take_pending`'s.

        Returns:
            False, taking nothing, where both fit and the fit's terms differ (another window or
            per-frame attention): the fit cannot go on as it stands.
        """
        fitted = previous._calibrator
        if fitted is not None and self._calibrator is not None:
            if not _same_cost_terms(previous.config, self.config):
                return False
            self._calibrator = copy.deepcopy(fitted)
        self.measure_as(loop)
        previous.measure_as(loop)  # its clocks of `loop` in hand (new ones where it had none)
        self._clock, self._trips, self._encoded = previous._clock, previous._trips, previous._encoded
        previous._clock, previous._trips, previous._encoded = _fresh_clocks()
        if every_loop:
            self._other_loops, previous._other_loops = previous._other_loops, {}
        return True

    def _call_before_forward(self, vit: Any) -> _Call | None:
        """The call :meth:`prepare` and :meth:`check_pending` gather in (on the host group, merge 1
        without ``vit``), or None where calls are not balanced."""
        if not self.config.enabled or not dist.is_available() or not dist.is_initialized():
            return None
        if dist.get_world_size(self.group) == 1:
            return None
        return _Call(
            group=self.group,
            rank=dist.get_rank(self.group),
            merge=merge_size_of(vit, self.output_layout) if vit is not None else 1,
            device=collective_device(self.group, torch.device("cpu")),
            host=self._host(),
        )

    def _call_grids(self, grid_thw: Any, planned: RankMetadata) -> tuple[tuple[int, int, int], ...] | None:
        """The grid rows a prepared call passes, where they differ from the plan's items: with
        ``split_videos`` the items are temporal steps, and the call passes the videos whole."""
        call_grids = grid_rows(grid_thw) if self.config.split_videos else None
        return None if call_grids == planned.grids else call_grids

    @property
    def config(self) -> ViTBalanceConfig:
        """The balancing options. Set it on every rank alike, between calls: the settings every
        rank sends its gathers (compared there) and the online cost fit follow it. A fit goes on
        while ``calibrate_cost`` stays on (afresh, with a warning, where its terms changed:
        another window or per-frame attention); it ends when it is turned off."""
        return self._config

    @config.setter
    def config(self, config: ViTBalanceConfig) -> None:
        if not isinstance(config, ViTBalanceConfig):
            raise TypeError(f"config={config!r} is invalid: expected a ViTBalanceConfig.")
        _refuse_images_split(config, getattr(self, "_output_layout", None))
        fitted, previous = self._calibrator, getattr(self, "_config", None)
        self._config = config
        self._fingerprint = config.fingerprint()
        if fitted is not None and config.calibrate_cost and _same_cost_terms(previous, config):
            return  # the fit goes on as it is (a reload would restart its warm-up)
        self._calibrator = _calibrator_for(config)
        if fitted is not None and self._calibrator is not None:
            try:
                self._calibrator.load_state_dict(fitted.state_dict())
            except ValueError as error:
                warn_on_rank_zero(
                    f"ViTBalancer.config: the cost fit so far is not used ({error}); it starts afresh.",
                )

    @property
    def output_layout(self) -> OutputLayout | None:
        """Kinds of the ViT's outputs where their rows do not tell, and its merge size (see the
        ``output_layout`` argument). Set it on every rank alike, between calls; a mapping from
        output path to kind is taken as an :class:`~lightning_vit_balance.OutputLayout`."""
        return self._output_layout

    @output_layout.setter
    def output_layout(self, output_layout: OutputLayout | Mapping[str, str] | None) -> None:
        layout = OutputLayout.of(output_layout)
        _refuse_images_split(self._config, layout)
        self._output_layout = layout

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this balancer: with ``config.calibrate_cost``, the online
        cost fit (:meth:`CostCalibrator.state_dict`), so a resumed run plans with the fitted
        model from its first step; otherwise nothing (an empty dict). Plain Python values, the
        same on every rank."""
        if self._calibrator is None:
            return {}
        return {"cost_calibrator": self._calibrator.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from :meth:`state_dict` (call it on every rank with the same state, before the
        first call). A state without a cost fit, or a balancer that does not calibrate, changes
        nothing: turning ``calibrate_cost`` on or off between runs is allowed.

        Raises:
            ValueError: ``state`` is not a mapping of :data:`STATE_KEYS` only, or the saved cost fit
                cannot continue here (see :meth:`CostCalibrator.load_state_dict`); nothing changes
                then.
        """
        saved = checked_state(state, "ViTBalancer.load_state_dict").get("cost_calibrator")
        if self._calibrator is not None and saved is not None:
            self._calibrator.load_state_dict(saved)

    # -- the balanced call -------------------------------------------------------------------

    @_collector_paused
    def _balanced_prepared(
        self, vit: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor, prepared: PreparedPlan
    ) -> Any:
        """The balanced call on a plan made before the forward: no gather, no planning here."""
        call = self._start(vit, pixel_values)
        # The status gather follows a skipped call as the plan's settings say, the same on every
        # rank (this rank's config may have changed since, and the others would not gather with it).
        check = prepared.check_skipped_calls or not prepared.holds_images
        merge_text = None
        if prepared.grid_gcd % call.merge:  # prepared without this ViT
            merge_text = merge_problem(prepared.metadata, call.merge, steps=self.config.split_videos)
            if not (prepared.plan.applied or self._status_follows(call, check)):
                # Nothing tells the others: ranks whose ViTs merge alike raise alike here.
                raise ValueError(f"{INVALID_INPUT} ({len(prepared.metadata)} ranks): {merge_text}.")
        if not in_backward_pass():
            # What this call's measured time pays for, whenever the plan was made; and its plan, for
            # its recomputation, as built in this call's grad mode (a call under no_grad, a frozen
            # teacher's, builds no graph that a recomputation could come from).
            self._encoded = _Encoded(prepared.encoded_counts, prepared.encoded_frames, prepared.batch_digest)
            self._prepared_since_check = True
            if self._calibrator is not None:
                self._plan_memory.remember(prepared.metadata, prepared.plan)
        problem = (
            prepared.mismatch(pixel_values, grid_thw) or _device_mismatch(call, pixel_values) or merge_text
        )
        given_grid = grid_thw
        if problem is not None and not isinstance(grid_thw, torch.Tensor):
            # Only its device and dtype are read, for the zero rows that stand in for the input
            # until the status gather reports the problem to every rank.
            grid_thw = torch.empty((0, 3), dtype=torch.long, device=call.device)
        differs = prepared.compare_on_device(grid_thw) if problem is None else None
        if differs is not None:
            self._grid_checks.watch(differs)
        plan = prepared.plan
        self._planned_reason = plan.reason
        differentiable = prepared.pixels_require_grad and torch.is_grad_enabled()
        reference = _Reference(prepared.channels, prepared.dtype, differentiable)
        if problem is None and not prepared.holds_images:
            # No rank has images: each makes its dummy image from its own rows (unprepared, every
            # rank takes rank 0's, which the forward's gather brings), and the status gather
            # follows, so that rows the ViT cannot take fail every rank, not that one alone.
            reference = _Reference(int(pixel_values.shape[1]), pixel_values.dtype, differentiable)
        if plan.applied:
            call.batch_digest = prepared.batch_digest
            output = self._exchange_and_encode(
                call, vit, pixel_values, grid_thw, plan, prepared.metadata, reference, problem
            )
        else:
            has_images = bool(prepared.metadata[call.rank].grids)
            output = self._at_home(call, vit, pixel_values, given_grid, has_images, reference, check, problem)
        self._record(
            plan, call, prepared.metadata, prepare_seconds=prepared.prepare_seconds, vit_ms=prepared.vit_ms
        )
        return output

    @_collector_paused
    def _balanced(self, vit: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        call = self._start(vit, pixel_values)
        metadata, reference = self._gather(call, pixel_values, grid_thw)
        plan, encoded = self._plan(call, metadata)
        self._planned_reason = plan.reason
        if not in_backward_pass():  # a recomputation's plan is its forward's: counted there
            self._encoded = encoded
        if plan.applied:
            output = self._exchange_and_encode(call, vit, pixel_values, grid_thw, plan, metadata, reference)
        else:
            has_images = bool(metadata[call.rank].grids)
            check = self.config.check_skipped_calls
            output = self._at_home(call, vit, pixel_values, grid_thw, has_images, reference, check)
        self._record(plan, call, metadata)
        return output

    def _exchange_and_encode(
        self,
        call: _Call,
        vit: Any,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        plan: RebalancePlan,
        metadata: Sequence[RankMetadata],
        reference: _Reference,
        problem: str | None = None,
    ) -> Any:
        """Dispatch the pixel rows, encode the balanced batch, check every rank's ViT, combine.

        ``problem`` (a prepared call whose input does not match its plan) is reported to every rank
        by the status gather instead of the ViT's outcome; the trip still runs with zero rows of
        the planned sizes, so no rank waits.
        """
        if self.config.overlap_pixel_trip and problem is None and self._may_overlap(vit):
            batch, encoded = self._overlapped(call, vit, pixel_values, grid_thw, plan, metadata, reference)
        else:
            batch = self._dispatch(
                call, pixel_values, grid_thw, plan, metadata, reference, problem is not None
            )
            self._clock.start(batch.pixels.device)
            if problem is not None:
                self._call_as_the_others(call, vit, reference, batch.grid)
            encoded = self._encode(
                call.merge, vit, batch, ValueError(problem) if problem is not None else None
            )
        self._clock.stop()
        call.seconds["encode"] = encoded.seconds
        returned = self._combine(call, vit, encoded, plan, batch, reference)
        return self._rebuild(vit, encoded, returned, grid_thw, plan.patch_counts[call.rank])

    def _may_overlap(self, vit: Any) -> bool:
        """Whether ``vit`` may run twice in the call (``overlap_pixel_trip``): not when its
        parameters are sharded, where each call gathers them and a rank with only its own images,
        or only others', would make one gather fewer than the rest (a mismatch, or a hang on NCCL).
        The same on every rank: the model is sharded alike on all of them."""
        if not self._sharded(vit):
            return True
        if not self._warned_sharded_overlap:
            self._warned_sharded_overlap = True
            warn_on_rank_zero(
                "ViTBalanceConfig.overlap_pixel_trip=True: the ViT's parameters are sharded (FSDP, "
                "ZeRO-3), so each of its calls gathers them and every rank must call it as often as "
                "the others; its balanced calls encode in one ViT call, without the overlap.",
            )
        return False

    def _note_fitted_tower(self, vit: Any) -> None:
        """Warn once (group rank 0) when the online cost fit, which measures the calls of one
        balancer, is fed a second tower module's calls while the first one lives: one fit of two towers
        of different costs (an image ViT and a video encoder) plans both worse than a fit of each."""
        tower = unwrap_module(vit)
        if self._fitted_tower is _told or not isinstance(tower, torch.nn.Module):
            return  # a plain callable may be made anew for each call (a lambda around the tower)
        fitted = self._fitted_tower() if self._fitted_tower is not None else None
        if fitted is None:
            self._fitted_tower = weakref.ref(tower)
            return
        if fitted is tower:
            return
        self._fitted_tower = _told
        if dist.get_rank(self.group) == 0:
            warn_at_user(
                f"ViTBalancer: calibrate_cost fits one cost model per balancer, and this one encodes "
                f"for {_tower_name(tower)} after {_tower_name(fitted)}: their measured times are "
                "fitted together, which plans both towers worse than a fit of each. Expected one "
                "ViTBalancer per tower (under ViTBalanceMixin, encode_images keeps one balancer for "
                "every tower: call a second tower through a ViTBalancer of its own)."
            )

    def _sharded(self, vit: Any) -> bool:
        """Whether ``vit``'s parameters are sharded (FSDP, ZeRO-3): each of its calls gathers them,
        a collective. The same on every rank: the model is sharded alike on all of them."""
        if not isinstance(vit, torch.nn.Module):
            return False
        # Read once per ViT (a walk of its modules, in the forward): models are sharded when the run
        # sets up, before their first balanced call.
        return _read_once(self._sharded_vits, vit, parameters_sharded)

    def _identity(self, vit: Any) -> int:
        """:func:`vit_identity` of the module ``vit`` calls, read once per module (a walk of its
        parameters), also where ``vit`` is a callable made anew for each call around it; 0 (not
        compared) where no module can be told (a lambda around the tower)."""
        module = called_module(vit)
        return 0 if module is None else _read_once(self._vit_identities, module, vit_identity)

    def _call_as_the_others(self, call: _Call, vit: Any, reference: _Reference, like_grid: Any) -> None:
        """On a rank whose input does not match its prepared plan (it encodes nothing, and reports
        the problem in the status gather): where ``vit``'s parameters are sharded, call it once on a
        dummy image, without gradients, so that its parameter gathers meet the other ranks' in
        their ViT calls (not their status gather: an abort on gloo, a hang on NCCL)."""
        if not self._sharded(vit):
            return
        if not isinstance(like_grid, torch.Tensor):
            like_grid = torch.empty((0, 3), dtype=torch.long, device=call.device)
        batch = BalancedBatch.dummy(call.merge, reference.channels, reference.dtype, like_grid, call.device)
        # A failure here is not reported: the input's problem is what every rank raises.
        with torch.no_grad(), contextlib.suppress(Exception):
            vit(batch.pixels, batch.grid)

    def _encode(
        self,
        merge: int,
        vit: Any,
        batch: BalancedBatch,
        skip_with: Exception | None = None,
        routed: bool = True,
    ) -> EncodedBatch:
        return encode(
            vit,
            batch,
            merge=merge,
            layout=self.output_layout,
            no_grad_dummy=self.config.empty_rank_forward == "no_grad",
            skip_with=skip_with,
            routed=routed,
        )

    def _overlapped(
        self,
        call: _Call,
        vit: Any,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        plan: RebalancePlan,
        metadata: Sequence[RankMetadata],
        reference: _Reference,
    ) -> tuple[BalancedBatch, EncodedBatch]:
        """The pixel trip in flight while this rank encodes its own images, then the arrivals."""
        started = time.perf_counter()
        mine = metadata[call.rank].patch_counts
        route = self._routes.route(plan, call.rank)
        # Only the trip's start is its own: waiting for it falls within the ViT clock's bracket.
        self._trips.start(pixel_values.device)
        trip = self._routes.trip(plan, call.rank, home=False)
        with call.first_trip():
            pending = self._start_pixel_trip(call, pixel_values, trip, route, metadata, reference, False)
        self._trips.stop()
        home = [i for src, i in route.arrivals if src == call.rank]
        call.timed("dispatch", started)
        home_encoded = None
        # The clock brackets both forwards (and the wait between them, where the trip outlasts
        # the home images).
        self._clock.start(pixel_values.device)
        if home:
            rows = take_rows(pixel_values, row_runs(mine, home))
            home_encoded = self._encode(
                call.merge, vit, self._batch(rows, rows, [(call.rank, i) for i in home], metadata, grid_thw)
            )
        started = time.perf_counter()
        with call.first_trip():
            received = pending.wait()  # [rows from other ranks, C], in arrival order
        call.timed("dispatch", started)
        away = [(src, i) for src, i in route.arrivals if src != call.rank]
        if home_encoded is not None and (not away or home_encoded.error is not None):
            # A home forward that failed ends this rank's encoding: its error is the one reported
            # (an interrupt must not run the ViT again, nor give way to the arrivals' error).
            return self._batch(received, received, away, metadata, grid_thw), home_encoded
        batch = self._batch(received, received, away, metadata, grid_thw)  # the owners' dtype
        if not away:
            batch = BalancedBatch.dummy(
                call.merge, reference.channels, reference.dtype, grid_thw, received.device
            )
            batch = dataclasses.replace(batch, received=received)
        encoded = self._encode(call.merge, vit, batch)
        if home_encoded is not None:
            before = [metadata[src].patch_counts[i] for src, i in away if src < call.rank]
            encoded = splice_encoded(encoded, home_encoded, before, call.merge)
        return dataclasses.replace(batch, received=received), encoded

    @staticmethod
    def _batch(
        pixels: torch.Tensor,
        received: torch.Tensor,
        images: Sequence[tuple[int, int]],
        metadata: Sequence[RankMetadata],
        grid_thw: torch.Tensor,
    ) -> BalancedBatch:
        """The batch of ``images`` (``(rank, index)`` each), grid rows from the gather, not the wire."""
        rows = np.asarray([metadata[src].grids[i] for src, i in images], dtype=np.int64).reshape(-1, 3)
        grid = host_to_device(torch.from_numpy(rows), grid_thw.device, grid_thw.dtype)
        counts = tuple(metadata[src].patch_counts[i] for src, i in images)
        return BalancedBatch(pixels, grid, counts, False, received)

    def _start(self, vit: Any, pixel_values: Any) -> _Call:
        if self._calibrator is not None:
            self._note_fitted_tower(vit)
        preferred = pixel_values.device if isinstance(pixel_values, torch.Tensor) else None
        return _Call(
            group=self.group,
            rank=dist.get_rank(self.group),
            merge=merge_size_of(vit, self.output_layout),
            device=collective_device(self.group, preferred),
            vit=self._identity(vit),
            host=self._host(),
        )

    def _host(self) -> Any:
        """The group for host-side gathers, checked once to hold the same ranks as ``group``."""
        if not self._host_advised:
            self._host_advised = True
            _advise_host_group(self.group)
        if not self._host_checked:
            ranks = dist.get_process_group_ranks(self.group) if self.group is not None else None
            try:
                host = dist.get_process_group_ranks(self.host_group)
            except (RuntimeError, ValueError, AttributeError) as error:
                raise ValueError(
                    f"host_group={self.host_group!r} is not a process group this rank belongs to: "
                    "expected a group over the ranks of group, in the same order."
                ) from error
            if ranks is None:
                ranks = list(range(dist.get_world_size()))
            if list(host) != list(ranks):
                raise ValueError(
                    f"host_group holds ranks {list(host)}: expected the ranks of group, {list(ranks)}, "
                    "in the same order."
                )
            self._host_checked = True
        return self.host_group if self.host_group is not None else self.group

    def _gather(
        self, call: _Call, pixel_values: Any, grid_thw: Any, gather_for: GatherFor = GatherFor.CALL
    ) -> tuple[tuple[RankMetadata, ...], _Reference]:
        """Validate locally, gather every rank's metadata, raise the same error on every rank."""
        started = time.perf_counter()
        # The merge size sizes every rank's output rows of the images it encodes for others.
        fingerprint = (
            ("gather", int(gather_for)),
            *self._settings_fingerprint(),
            ("spatial_merge_size", call.merge),
        )
        local = validate_input(
            pixel_values,
            grid_thw,
            call.merge,
            call.group,
            fingerprint=tuple(value for _, value in fingerprint),
            vit_us=self._clock.read(),
            # Only a call's own gather holds the device's grid (a plan made ahead reads the host's).
            check_device=gather_for is GatherFor.CALL,
        )
        if self._grid_checks.differed():
            local = dataclasses.replace(local, status=InputProblem.PREPARED_GRID_VALUES, details=(), grids=())
        elif self._skipped_mismatch:
            problem = InputProblem.PREPARED_SKIPPED_MISMATCH
            local = dataclasses.replace(local, status=problem, details=(), grids=())
        self._skipped_mismatch = False
        metadata, collectives = _gathered_metadata(local, call.host)
        if self.config.split_videos:
            # After the gather, on every rank alike: a video travels as one grid row, not one per
            # temporal step (hundreds would overflow the gather's capacity: a second collective).
            metadata = tuple(m.frames_as_items() for m in metadata)
        call.collectives += collectives
        call.timed("gather", started)
        try:
            ref = raise_for_input(metadata, [name for name, _ in fingerprint])
        except ValueError:
            self._forget_encoded()
            raise
        differentiable = torch.is_grad_enabled() and any(m.requires_grad for m in metadata)
        if ref is None:
            # No rank has images: every rank encodes a dummy image, all of rank 0's width and dtype,
            # so that a rank whose empty rows the ViT cannot take fails on every rank alike, not alone.
            ref = 0
        code = metadata[ref].dtype_code
        dtype = DTYPES[code] if code >= 0 else pixel_values.dtype
        return metadata, _Reference(metadata[ref].channels, dtype, differentiable)

    def _plan(
        self, call: _Call, metadata: Sequence[RankMetadata], remember: bool = True
    ) -> tuple[RebalancePlan, _Encoded]:
        """The plan of ``metadata``, and what every rank encodes in the call that runs it (see
        :meth:`_encoded_by`). ``remember``: for its call's recomputation, in the call's grad mode
        (a plan made ahead is remembered when its call runs, see :meth:`_balanced_prepared`)."""
        started = time.perf_counter()
        if self._calibrator is not None and in_backward_pass():
            # Activation checkpointing's recomputation: the forward's plan, whatever was fitted
            # since; its figures were observed by the forward's gather.
            plan = self._plan_memory.recall(metadata)
            call.timed("plan", started)
            return plan, _Encoded()
        frames = [[t for t, _, _ in m.grids] for m in metadata]
        plan = self._planned(metadata, frames, self._calibrated(metadata))
        if self._calibrator is not None and remember:
            self._plan_memory.remember(metadata, plan)
        # The gather carried the previous call's time: read once (the next gather, made ahead of
        # this plan's call or not, must not carry it again).
        self._clock.forget()
        encoded = self._encoded_by(plan, frames)
        call.timed("plan", started)
        return plan, encoded

    def _encoded_by(self, plan: RebalancePlan, frames: list[list[int]]) -> _Encoded:
        """Every rank's patch counts and temporal steps (``frames``: each rank's images' ``T``) in
        the call that runs ``plan``: what its measured ViT time, carried in the gather after it,
        pays for (empty where the cost model is not fitted online)."""
        if self._calibrator is None:
            return _Encoded()
        arrivals = plan.arrivals_of_every_rank() if plan.applied else None
        counts, steps = (
            tuple(
                tuple(rows[src][i] for src, i in arrivals[r]) if arrivals is not None else tuple(rows[r])
                for r in range(plan.num_ranks)
            )
            for rows in (plan.patch_counts, frames)
        )
        return _Encoded(counts, steps)

    def _planned(
        self, metadata: Sequence[RankMetadata], frames: list[list[int]], cost_model: CostModel | None
    ) -> RebalancePlan:
        counts = [m.patch_counts for m in metadata]
        plan = plan_rebalance(counts, self.config, cost_model=cost_model, frames=frames)
        if plan.applied:
            # Compared across ranks before the return trip: made with the plan, so that a plan
            # made ahead has it before the forward (0.1 ms at 1,024 ranks x 8 images).
            _ = plan.digest
        plan.warm_figures()  # what the call's stats report, before the forward too
        return plan

    def _calibrated(self, metadata: Sequence[RankMetadata]) -> CostModel | None:
        """The online cost model after the previous call's measured times (None: not calibrating).

        Every rank feeds the calibrator the same gathered figures, so every rank gets the same
        coefficients; the fingerprint each rank sent covers the calibrator's state before them.
        """
        if self._calibrator is None:
            return None
        encoded = self._encoded
        if encoded.counts is not None and len(encoded.counts) == len(metadata):
            milliseconds = [m.vit_us / 1000.0 if m.vit_us >= 0 else math.nan for m in metadata]
            self._calibrator.observe(encoded.counts, milliseconds, encoded.frames)
        return self._calibrator.model

    def _settings_fingerprint(self) -> tuple[tuple[str, int], ...]:
        # The settings' part is fixed; only the fitted model changes between calls (rehashing the
        # whole config took 21 us per call, in the forward). "cost_fit" is there without a
        # calibrator too: a rank calibrating and one not then differ in named settings, not in
        # the length of their gather rows (gloo aborts on that, NCCL would hang).
        calibrator = self._calibrator
        fit = 0 if calibrator is None else setting_digest(calibrator.state_fingerprint())
        # And what the fit is fed next: the previous call's batch, where a plan made ahead named it.
        previous = 0 if calibrator is None else self._encoded.batch
        return (*self._fingerprint, ("cost_fit", fit), ("previous_call_plan", previous))

    def _dispatch(
        self,
        call: _Call,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        plan: RebalancePlan,
        metadata: Sequence[RankMetadata],
        reference: _Reference,
        zeros: bool = False,
    ) -> BalancedBatch:
        """The forward trip: pixel rows to the rank that encodes each image (``zeros``: rows of the
        planned sizes standing in for input that does not match a prepared plan)."""
        started = time.perf_counter()
        route, trip = self._routes.route(plan, call.rank), self._routes.trip(plan, call.rank)
        # Zero rows stand in for input that may not be a tensor at all: the call's device then.
        self._trips.start(pixel_values.device if isinstance(pixel_values, torch.Tensor) else call.device)
        with call.first_trip():
            pending = self._start_pixel_trip(call, pixel_values, trip, route, metadata, reference, zeros)
            received = pending.wait()  # [sum(receive_patches), C], images in arrival order
        self._trips.stop()
        call.timed("dispatch", started)
        if not route.arrivals:
            batch = BalancedBatch.dummy(
                call.merge, reference.channels, reference.dtype, grid_thw, received.device
            )
            # Keeps the forward trip in the graph, so its backward exchange runs on this rank too.
            return dataclasses.replace(batch, received=received)
        # In the rows' owners' dtype (the wire's), as their direct calls would pass them, also on a
        # rank without images of its own whose empty rows have another (a prepared call's are equal).
        return self._batch(received, received, route.arrivals, metadata, grid_thw)

    def _start_pixel_trip(
        self,
        call: _Call,
        pixel_values: torch.Tensor,
        trip: PixelTrip,
        route: ExchangeRoute,
        metadata: Sequence[RankMetadata],
        reference: _Reference,
        zeros: bool,
    ) -> PendingExchange:
        """Start ``trip`` (``zeros``: zero rows of the planned sizes stand in for the pixels).
        Counts its collective and bytes."""
        mine = metadata[call.rank].patch_counts
        pixels = pixel_values
        if zeros or not mine:
            # Zeros stand in for rows that may be on a device the group cannot carry: the group's.
            own_device = isinstance(pixel_values, torch.Tensor) and not zeros
            device = pixel_values.device if own_device else call.device
            pixels = torch.zeros((sum(mine), reference.channels), dtype=reference.dtype, device=device)
            if own_device and reference.pixels_differentiable and pixel_values.requires_grad:
                # This rank's own (empty) rows stay in the graph: a gradient asked of them alone
                # (torch.autograd.grad) then runs the exchanges' backward here too, as elsewhere.
                pixels = pixels + pixel_values.sum().to(pixels.dtype) * 0
        # The wire dtype is the plan's: every image owner's (checked at the gather, or by a prepared call).
        pending = start_pixel_trip(
            pixels,
            trip,
            reference.dtype,
            call.group,
            differentiable=reference.pixels_differentiable,
            timer=self._trips,
        )
        call.collectives += 1
        row_bytes = reference.channels * reference.dtype.itemsize
        call.bytes_sent += row_bytes * (sum(route.send_patches) - route.send_patches[call.rank])
        call.bytes_received += row_bytes * (sum(route.receive_patches) - route.receive_patches[call.rank])
        return pending

    def _combine(
        self,
        call: _Call,
        vit: Any,
        encoded: EncodedBatch,
        plan: RebalancePlan,
        batch: BalancedBatch,
        reference: _Reference,
    ) -> list[torch.Tensor]:
        """The status gather, then the return trip: each token output's rows back to their images'
        ranks, in their order. The return buffer is packed first (where this rank's own outputs can
        travel: when they cannot, the gather raises anyway), so that a failure to pack it travels
        in the status word like the ViT's own: packed while the gather was in flight, an out of
        memory there ended this rank alone and left the others waiting in the return trip."""
        started = time.perf_counter()
        self._trips.start(batch.pixels.device)
        encoded, packed = self._packed(call, encoded, plan, batch, reference)
        self._trips.stop()
        grad_wanted = torch.is_grad_enabled() and (reference.pixels_differentiable or _vit_requires_grad(vit))
        # XOR keeps 62 bits: equal across ranks where both the plans and their batches are.
        digest = plan.digest if call.batch_digest is None else plan.digest ^ call.batch_digest
        report = exchange_status(encoded.status(), call.host, digest, grad_wanted, call.merge, call.vit)
        call.collectives += report.collectives
        call.timed("status", started, "combine")
        self._raise_where_any_failed(report, encoded, call.merge, prepared=call.batch_digest is not None)
        assert packed is not None  # every rank's status was fine, this rank's too
        started = time.perf_counter()
        self._trips.start(packed.buffer.device)
        leaves, layout, transit, elements, buffer, arrivals = packed
        back = all_to_all(
            buffer,
            layout.send_splits,
            layout.receive_splits,
            call.group,
            differentiable=grad_wanted and (transit.is_floating_point or transit.is_complex),
            out=arrivals,
            timer=self._trips,
        )  # [sum(receive_splits)] transit values, from worker rank 0 first
        call.collectives += 1
        call.bytes_sent += transit.itemsize * (sum(layout.send_splits) - layout.send_splits[call.rank])
        call.bytes_received += transit.itemsize * (
            sum(layout.receive_splits) - layout.receive_splits[call.rank]
        )
        returned = unpack_return(back, leaves, layout, elements)
        # An output no rank's ViT made with autograd history (computed under no_grad, or detached)
        # comes back without it, as from the direct call: the return buffer carries the others'
        # gradients. Decided from every rank's, so that a rank whose own batch made one without
        # history (a dummy, home images alone) still joins the trip's backward pass through it.
        returned = [
            rows.detach() if report.made_without_history(k) else rows for k, rows in enumerate(returned)
        ]
        self._trips.stop()
        call.timed("combine", started)
        return returned

    def _packed(
        self,
        call: _Call,
        encoded: EncodedBatch,
        plan: RebalancePlan,
        batch: BalancedBatch,
        reference: _Reference,
    ) -> tuple[EncodedBatch, _ReturnBuffer | None]:
        """The outputs that travel back, their return layout and codec, the packed return buffer and
        the one the rows come back in (both allocated here, before the status gather: see
        :meth:`_combine`), when every output of this rank can travel. A packing that raises comes
        back as this rank's error, for the status gather to report (and this rank to re-raise)."""
        if encoded.status().flag != 0:
            return encoded, None
        try:
            tokens = encoded.returned_indices
            leaves = [encoded.leaves[k][1] for k in tokens]
            transit = transit_dtype([leaf.dtype for leaf in leaves])
            elements = [elements_per_row(leaf, transit) for leaf in leaves]
            kinds = [encoded.kinds[k].kind for k in tokens]
            layout = self._routes.layout(plan, call.rank, (tuple(kinds), call.merge, tuple(elements)))
            tie = batch.received if reference.pixels_differentiable else None
            buffer = pack_return(leaves, layout, transit, tie)
            arrivals = buffer.new_empty(sum(layout.receive_splits))
        except BaseException as caught:  # every rank must hear of it before this one re-raises
            return dataclasses.replace(encoded, error=caught, packing_problem=True), None
        return encoded, _ReturnBuffer(leaves, layout, transit, elements, buffer, arrivals)

    def _rebuild(
        self,
        vit: Any,
        encoded: EncodedBatch,
        returned: list[torch.Tensor],
        grid_thw: torch.Tensor,
        my_counts: Sequence[int],
    ) -> Any:
        """The ViT's output structure around this rank's rows; window indices from its own grid."""
        by_leaf = dict(zip(encoded.returned_indices, returned))
        window_index: Any = None
        result: list[Any] = []
        for k, (_, leaf) in enumerate(encoded.leaves):
            kind = encoded.kinds[k].kind
            if k in by_leaf:
                result.append(by_leaf[k])
            elif kind == "window_index" and my_counts:
                if window_index is None:
                    window_index = _window_index(vit, grid_thw)
                result.append(_like_the_towers(window_index, leaf))
            elif kind == "window_index":
                result.append(leaf[:0])
            else:
                result.append(None if kind == "drop" else leaf)
        assert encoded.structure is not None
        return rebuild_output(encoded.structure, result)

    # -- calls that encode at home -----------------------------------------------------------

    def _at_home(
        self,
        call: _Call,
        vit: Any,
        pixel_values: torch.Tensor,
        grid_thw: Any,
        has_images: bool,
        reference: _Reference,
        check: bool,
        problem: str | None = None,
    ) -> Any:
        """A call the plan skips: this rank encodes its own images (a dummy one when it has none).
        ``grid_thw`` is a tensor unless ``problem`` says why not.

        With ``check`` (``check_skipped_calls`` of the settings the plan was made with, or a
        prepared call where no rank has images; and a host-side group for the word), the status
        gather follows, so that a ViT that raised, or a prepared call whose input does not match its
        plan (``problem``), fails every rank at once, as in a call that moves images.
        """

        def encode(images: bool) -> Any:
            if images:
                return self._timed_direct(call, vit, pixel_values, grid_thw)
            return self._empty_output(vit, pixel_values, grid_thw, call.merge, reference)

        if not self._status_follows(call, check):
            if problem is None:
                return encode(has_images)
            self._defer_mismatch(call, pixel_values, grid_thw, problem)
            # Its own input, not the prepared one: nothing moves, so the plan plays no part in it.
            return encode(grid_thw.dim() == 2 and grid_thw.shape[0] > 0)
        error: BaseException | None = ValueError(problem) if problem is not None else None
        output = None
        if error is not None:
            self._call_as_the_others(call, vit, reference, grid_thw)
        else:
            try:
                output = encode(has_images)
            except BaseException as caught:  # every rank must hear of it before this one re-raises
                error = caught
        started = time.perf_counter()
        encoded = EncodedBatch([], None, [], error, 0.0, input_problem=problem is not None)
        report = exchange_status(encoded.status(), call.host, vit=call.vit)
        call.collectives += report.collectives
        call.timed("status", started, "combine")
        self._raise_where_any_failed(report, encoded, call.merge)
        return output

    @staticmethod
    def _status_follows(call: _Call, check: bool) -> bool:
        """Whether a skipped call gathers the status after the ViT: where ``check`` asks, and the
        status word travels on the host (reading it from a device would make the host wait)."""
        return check and host_device(call.host).type == "cpu"

    def _raise_where_any_failed(
        self, report: StatusReport, encoded: EncodedBatch, merge: int, prepared: bool = False
    ) -> None:
        """The status gather's verdict: raise on every rank alike where any rank's plan, ViT,
        outputs or gradients differ from the others' (then the call's plan is forgotten).
        ``prepared``: the call was given a plan made before it."""
        self._failed_everywhere = True
        raise_for_plans(report, prepared)
        raise_for_other_vits(report)
        raise_for_merges(report)
        raise_for_vit(report, encoded, merge)
        raise_for_gradients(report)
        self._failed_everywhere = False

    def _defer_mismatch(self, call: _Call, pixel_values: Any, grid_thw: Any, problem: str) -> None:
        """A prepared call the plan skipped, unchecked, whose input is not the prepared batch: no
        collective follows, so raising here would leave the other ranks waiting at their next one.
        This rank warns and reports the problem at its next gather, where every rank raises; the
        caller encodes its own input directly (no image moves). Input the ViT cannot take as it is
        (not tensors, or not dense ones) still raises here, saying why, as the ViT would."""
        message = f"Invalid prepared balanced ViT call on rank {call.rank}: {problem}."
        tensors = isinstance(pixel_values, torch.Tensor) and isinstance(grid_thw, torch.Tensor)
        if not tensors or dense_problem(pixel_values, grid_thw) is not None:
            raise ValueError(message)
        warn_at_user(
            f"{message} The plan moved no image, so this rank encodes its own batch directly; every rank "
            "raises at the next gather.",
            UserWarning,
        )
        self._skipped_mismatch = True

    def _timed_direct(self, call: _Call, vit: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        started = time.perf_counter()
        self._clock.start(pixel_values.device)
        output = self._direct(vit, pixel_values, grid_thw)
        self._clock.stop()
        call.timed("encode", started)
        return output

    def _direct(self, vit: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        """``vit(pixel_values, grid_thw)``, with outputs the layout names ``"drop"`` set to None."""
        if isinstance(grid_thw, UncombinedInput):  # a caller's inputs that it could not join: no call
            raise ValueError(f"{grid_thw}.")
        return without_dropped(vit(pixel_values, grid_thw), self.output_layout)

    def _empty_output(
        self, vit: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor, merge: int, reference: _Reference
    ) -> Any:
        """The ViT's output structure with zero rows, from a dummy forward (never an empty batch)."""
        batch = BalancedBatch.dummy(merge, reference.channels, reference.dtype, grid_thw, pixel_values.device)
        self._clock.start(batch.pixels.device)
        # A skipped call: the other ranks' direct calls check nothing, so neither does this one.
        encoded = self._encode(merge, vit, batch, routed=False)
        self._clock.stop()
        if encoded.error is not None:
            raise encoded.error
        result = []
        for (path, leaf), found in zip(encoded.leaves, encoded.kinds):
            if found.problem:
                raise ValueError(describe_classification(path, found, merge))
            if found.kind == "drop":
                result.append(None)
            else:
                result.append(leaf if found.kind == "passthrough" else leaf[:0])
        assert encoded.structure is not None
        return rebuild_output(encoded.structure, result)

    # -- diagnostics -------------------------------------------------------------------------

    def _record(
        self,
        plan: RebalancePlan,
        call: _Call,
        metadata: Sequence[RankMetadata],
        *,
        prepare_seconds: float = 0.0,
        vit_ms: tuple[float, ...] | None = None,
    ) -> None:
        """Keep ``plan``'s figures and ``call``'s measurements as :attr:`last_stats`;
        ``prepare_seconds``: what making a prepared plan took before the call. A recomputation
        (activation checkpointing) keeps its forward call's figures."""
        if in_backward_pass():
            return
        if plan.applied:
            self.applied_calls += 1
        seconds = call.seconds
        exchange = sum(seconds.get(step, 0.0) for step in ("gather", "dispatch", "combine"))
        self.last_stats = BalanceStats(
            applied=plan.applied,
            reason=plan.reason,
            rank=call.rank,
            num_ranks=plan.num_ranks,
            loads_before=plan.loads_before,
            loads_after=plan.loads_after,
            imbalance_before=plan.imbalance_before,
            imbalance_after=plan.imbalance_after,
            num_images=plan.num_images,
            moved_images=plan.moved_images,
            moved_patches=plan.moved_patches,
            total_patches=plan.total_patches,
            bytes_sent=call.bytes_sent,
            bytes_received=call.bytes_received,
            plan_seconds=seconds.get("plan", 0.0),
            exchange_seconds=exchange,
            collectives=call.collectives,
            gather_seconds=seconds.get("gather", 0.0),
            dispatch_seconds=seconds.get("dispatch", 0.0),
            encode_seconds=seconds.get("encode", 0.0),
            combine_seconds=seconds.get("combine", 0.0),
            vit_ms=_vit_ms(metadata) if vit_ms is None else vit_ms,
            status_seconds=seconds.get("status", 0.0),
            prepare_seconds=prepare_seconds,
            trip_ms=self._trips.end_call(),
            **self._cost_fit_figures(),
        )
        self._report()

    def _cost_fit_figures(self) -> dict[str, Any]:
        """The online cost fit's :class:`BalanceStats` fields (none without ``calibrate_cost``)."""
        fitted = self._calibrator
        if fitted is None:
            return {}
        return {"cost_fits": fitted.fits, "cost_error": fitted.last_error, "cost_model": fitted.model}

    def _record_local(self, reason: str, rank: int, world: int, pixel_values: Any, grid_thw: Any) -> None:
        if in_backward_pass():
            return
        tensor = isinstance(pixel_values, torch.Tensor) and pixel_values.dim() > 0
        rows = int(pixel_values.shape[0]) if tensor else 0
        stats = BalanceStats.of_direct_call(
            self.config, grid_thw, pixel_rows=rows, reason=reason, rank=rank, num_ranks=world
        )
        # Nothing measured in such a call: no error of its own to report.
        fit = {**self._cost_fit_figures(), "cost_error": math.nan}
        self.last_stats = dataclasses.replace(stats, trip_ms=self._trips.end_call(), **fit)
        self._report()

    def _report(self) -> None:
        stats = self.last_stats
        if not self.config.verbose or stats is None or stats.rank != 0:
            return
        decision = "APPLY" if stats.applied else "SKIP"
        loads = ", ".join(f"{v:.4g}" for v in stats.loads_before)
        after = ", ".join(f"{v:.4g}" for v in stats.loads_after)
        self._print(
            f"[vit-balance] {decision} ({stats.reason}) imbalance {stats.imbalance_before:.3f} -> "
            f"{stats.imbalance_after:.3f}; load per rank [{loads}] -> [{after}]; moved "
            f"{stats.moved_images} images / {stats.moved_patches} patches; applied "
            f"{self.applied_calls}/{self.calls}"
        )


def _vit_ms(metadata: Sequence[RankMetadata]) -> tuple[float, ...]:
    """Every rank's previous ViT time in ms (-1.0: none), as a call's stats report them."""
    return tuple(m.vit_us / 1000.0 if m.vit_us >= 0 else -1.0 for m in metadata)


def _same_cost_terms(old: ViTBalanceConfig | None, new: ViTBalanceConfig) -> bool:
    """Whether two configurations start a cost fit alike (its initial model and window)."""
    return old is not None and (CostModel.from_config(old), old.cost_window_patches) == (
        CostModel.from_config(new),
        new.cost_window_patches,
    )


def _calibrator_for(config: ViTBalanceConfig) -> CostCalibrator | None:
    if not config.calibrate_cost:
        return None
    initial = CostModel.from_config(config)
    return CostCalibrator(initial, window_patches=config.cost_window_patches)


class _ReturnBuffer(NamedTuple):
    """What the return trip sends: the outputs that travel back, their layout, the wire codec's dtype and
    elements per row, the packed buffer (``[sum(layout.send_splits)]`` transit values) and the one
    the rows arrive in (``[sum(layout.receive_splits)]``)."""

    leaves: list[torch.Tensor]
    layout: ReturnLayout
    transit: torch.dtype
    elements: list[int]
    buffer: torch.Tensor
    arrivals: torch.Tensor


def _read_once(
    cache: weakref.WeakKeyDictionary[torch.nn.Module, _Read],
    module: torch.nn.Module,
    read: Callable[[torch.nn.Module], _Read],
) -> _Read:
    """``read(module)``, kept in ``cache`` for the module's life; read again at each call for a
    module that cannot be a weak key (its class defines ``__eq__`` without ``__hash__``)."""
    try:
        value = cache.get(module)
    except TypeError:
        return read(module)
    if value is None:
        value = cache[module] = read(module)
    return value


def _gathered_metadata(local: RankMetadata, group: Any) -> tuple[tuple[RankMetadata, ...], int]:
    """:func:`gather_metadata` of a call's first collective. A timeout (a rank never joined), a
    closed connection (a rank stopped) or a size mismatch (a rank in another collective) raises
    gloo's or NCCL's text, which names neither the call nor the cause: say both."""
    with backend_errors_explained("the gather that starts a balanced call"):
        return gather_metadata(local, capacity=GATHER_CAPACITY, device=host_device(group), group=group)


def _print_line(line: str) -> None:
    print(line, flush=True)


def refuse_in_a_loader_worker(what: str) -> None:
    """Raise in a DataLoader worker, naming ``what`` ran there: a forked worker inherits the
    process group without its threads, and a gather started there waits forever (also the one that
    makes a gloo twin); a spawned one has no group at all, and would plan nothing, silently."""
    info = torch.utils.data.get_worker_info()
    if info is not None:
        raise RuntimeError(
            f"{what} ran in DataLoader worker {info.id} (of {info.num_workers}): it "
            "gathers over the process group, which only the training process can. Expected it in "
            "the training process, before the forward: Lightning's on_before_batch_transfer, or the "
            "loop after the batch is loaded (a collate_fn runs in the workers when num_workers > 0; "
            "there, the drop-in's handle.plan_ahead(collate) is what may run)."
        )


def _told() -> None:
    """The fitted tower once :meth:`ViTBalancer._note_fitted_tower` has warned: none to compare."""


def _tower_name(tower: Any) -> str:
    return f"{type(tower).__name__} (id {id(tower):#x})"


def _window_index(vit: Any, grid_thw: torch.Tensor) -> Any:
    window_fn = window_index_fn(vit)
    assert window_fn is not None
    window_index = window_fn(grid_thw)
    # get_window_index may return (window_index, cu_window_seqlens).
    return window_index[0] if isinstance(window_index, (tuple, list)) else window_index


def _like_the_towers(window_index: Any, leaf: torch.Tensor) -> Any:
    """The regenerated window index as the tower returned its own: ``get_window_index`` gives one
    value per merged token, which a tower may hand on as ``[N, 1]``, in another integer dtype or on
    its own device (the direct call's). An index of another kind is left as it is."""
    one_per_row = math.prod(leaf.shape[1:]) == 1
    if not isinstance(window_index, torch.Tensor) or window_index.dim() != 1 or not one_per_row:
        return window_index
    fitted = window_index.to(device=leaf.device, dtype=leaf.dtype)
    return fitted if leaf.dim() == 1 else fitted.view(-1, *leaf.shape[1:])


@eager
def balanced_encode(
    vit: Any,
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    config: ViTBalanceConfig | None = None,
) -> Any:
    """One balanced call ``vit(pixel_values, grid_thw)``, by a :class:`ViTBalancer` made for it.

    Without an initialised process group or with one rank it calls the ViT directly. Nothing
    carries over from call to call: no online cost fit (``calibrate_cost`` warns and fits nothing,
    as each fit needs the previous call's measured times), no ``last_stats``, no plan made ahead.
    For those keep a ``ViTBalancer(config, group)`` and call it each step.

    Args:
        vit: The vision tower, called as ``vit(pixel_values, grid_thw)``.
        pixel_values: ``[sum of patches, C]`` patch rows of this rank's images.
        grid_thw: ``[n_images, 3]`` ``(t, h, w)`` of each image.
        group: The data-parallel process group (default: the whole world).
        config: Balancing settings (default: ``ViTBalanceConfig()``).
    """
    if isinstance(config, ViTBalanceConfig) and config.calibrate_cost:
        warn_on_rank_zero(
            "balanced_encode(config=...calibrate_cost=True) fits nothing: each call makes its own "
            "ViTBalancer, and a fit needs the previous call's measured times. Keep a "
            "ViTBalancer(config, group) and call it each step.",
        )
    return ViTBalancer(config, group)(vit, pixel_values, grid_thw)


def _device_mismatch(call: _Call, pixel_values: torch.Tensor) -> str | None:
    """Why a prepared call's pixel rows cannot travel on the group, or None. An unprepared call's
    metadata gather checks this; ``prepare`` reads a host copy of the batch, so the call checks
    here, without communicating, and the status gather reports it to every rank (an exchange of
    rows on the wrong device would fail on this rank alone and leave the others waiting)."""
    wrong = device_problem(call.group, pixel_values.device)
    return None if wrong is None else describe_problem(InputProblem.DEVICE, wrong)
