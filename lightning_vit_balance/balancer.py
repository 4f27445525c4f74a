"""Balanced ViT encoding: validate -> gather -> plan -> send -> encode -> return.

:class:`ViTBalancer` wraps one call ``vit(pixel_values, grid_thw)`` on every data-parallel rank.
Each rank's images are encoded where the plan puts them and every output comes back to its own
rank, in the original order, with the same values and the same gradients as the direct call.

Per call and rank: one small all_gather of every rank's grid rows (plus a status code, so bad
input raises on every rank), then, when the plan moves images, one ``all_to_all_single`` of pixel
rows and one for all token-aligned outputs together (embeddings and every deepstack layer). A
skipped call costs the gather alone. The backward pass runs the return and (when ``pixel_values``
requires grad) the forward exchange in reverse: every rank must backpropagate through the
outputs it got (as a VLM does when it scatters them into its input embeddings, even with zero
rows), because those exchanges are collectives too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_vit_balance.config import ViTBalanceConfig
from lightning_vit_balance.exchange import (
    DTYPES,
    ExchangeRoute,
    InputProblem,
    RankMetadata,
    all_to_all,
    collective_device,
    describe_problem,
    device_problem,
    gather_metadata,
)
from lightning_vit_balance.outputs import (
    Classification,
    OutputLayout,
    classify_output,
    describe_output_problem,
    flatten_output,
    merge_size_of,
    rebuild_output,
    rows_per_image,
    window_index_fn,
)
from lightning_vit_balance.planning import RebalancePlan, plan_rebalance

__all__ = ["BalanceStats", "ViTBalancer", "balanced_encode"]

# Status block each return-trip segment carries: [code, leaf index, rows (8 hex digits),
# expected rows (8 hex digits)]. Hex digits stay exact in every transit dtype (bf16 included).
_STATUS_DIGITS = 8
_STATUS_LEN = 2 + 2 * _STATUS_DIGITS


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
        imbalance_before: ``max(load) / mean(load) - 1`` before.
        imbalance_after: The same under the plan.
        num_images: Images over all ranks (this rank's only when nothing was gathered).
        moved_images: Images encoded away from their own rank.
        moved_patches: Pixel rows sent to another rank.
        total_patches: Patches over all ranks (this rank's only when nothing was gathered).
        bytes_sent: Bytes this rank sent to other ranks in both trips (its own rows excluded).
        bytes_received: Bytes this rank received from other ranks in both trips.
        plan_seconds: Wall time computing the plan.
        exchange_seconds: Host wall time in the metadata gather and both trips, packing and
            unpacking included, the ViT forward excluded (the return trip includes waiting for the
            slowest rank's ViT). With NCCL the trips are timed up to the status check that ends
            the return trip, which waits for the data.
        collectives: Collectives this call issued in the forward pass (the backward pass repeats
            the trips that carry gradients).
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


def _layout_of(output_layout: OutputLayout | Mapping[str, str] | None) -> OutputLayout | None:
    if output_layout is None or isinstance(output_layout, OutputLayout):
        return output_layout
    if isinstance(output_layout, Mapping):
        return OutputLayout(kinds=dict(output_layout))
    raise ValueError(
        f"output_layout={output_layout!r} is invalid: expected None, an OutputLayout or a mapping "
        "from output path to kind."
    )


def _dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def _validate(pixel_values: Any, grid_thw: Any, merge_size: int, group: Any) -> RankMetadata:
    """Check this rank's input without communicating; the result travels in the metadata gather."""

    def bad(problem: InputProblem, *details: int) -> RankMetadata:
        channels = 0
        dtype_code = -1
        if isinstance(pixel_values, torch.Tensor) and pixel_values.dim() == 2:
            channels, dtype_code = int(pixel_values.shape[1]), _dtype_code(pixel_values.dtype)
        return RankMetadata(
            status=int(problem),
            details=tuple(int(d) for d in details),
            channels=channels,
            dtype_code=dtype_code,
            requires_grad=False,
            grids=(),
        )

    if not isinstance(grid_thw, torch.Tensor):
        return bad(InputProblem.GRID_NOT_TENSOR)
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        return bad(InputProblem.GRID_SHAPE, grid_thw.dim(), *list(grid_thw.shape)[:3])
    if grid_thw.is_floating_point() or grid_thw.is_complex() or grid_thw.dtype == torch.bool:
        return bad(InputProblem.GRID_DTYPE, _dtype_code(grid_thw.dtype))
    if not isinstance(pixel_values, torch.Tensor):
        return bad(InputProblem.PIXELS_NOT_TENSOR)
    if pixel_values.dim() != 2:
        return bad(InputProblem.PIXELS_SHAPE, pixel_values.dim())
    if not pixel_values.is_floating_point():
        return bad(InputProblem.PIXELS_DTYPE, _dtype_code(pixel_values.dtype))
    wrong_device = device_problem(group, pixel_values.device)
    if wrong_device is None and grid_thw.device.type == "meta":
        wrong_device = device_problem(group, grid_thw.device)
    if wrong_device is not None:
        return bad(InputProblem.DEVICE, *wrong_device)
    grids = tuple((int(t), int(h), int(w)) for t, h, w in grid_thw.tolist())
    for i, (t, h, w) in enumerate(grids):
        if t <= 0 or h <= 0 or w <= 0:
            return bad(InputProblem.GRID_VALUE, i, t, h, w)
    expected_rows = sum(t * h * w for t, h, w in grids)
    if pixel_values.shape[0] != expected_rows:
        return bad(InputProblem.PIXEL_ROWS, pixel_values.shape[0], expected_rows)
    for i, (_, h, w) in enumerate(grids):
        if h % merge_size or w % merge_size:
            return bad(InputProblem.NOT_DIVISIBLE, i, h, w, merge_size)
    return RankMetadata(
        status=0,
        details=(),
        channels=int(pixel_values.shape[1]),
        dtype_code=_dtype_code(pixel_values.dtype),
        requires_grad=bool(pixel_values.requires_grad),
        grids=grids,
    )


def _raise_for_input(metadata: Sequence[RankMetadata]) -> int | None:
    """Raise the same ValueError on every rank for any invalid input; return the reference rank.

    The reference rank is the first rank with images; every rank with images must agree with it
    on ``C`` and dtype.
    """
    world = len(metadata)
    problems = [
        f"rank {r}: {describe_problem(m.status, m.details)}" for r, m in enumerate(metadata) if m.status
    ]
    if not problems:
        with_images = [r for r, m in enumerate(metadata) if m.grids]
        if not with_images:
            return None
        ref = with_images[0]
        for r in with_images[1:]:
            if metadata[r].channels != metadata[ref].channels:
                details = (metadata[r].channels, ref, metadata[ref].channels)
                problems.append(f"rank {r}: {describe_problem(InputProblem.CHANNELS_MISMATCH, details)}")
                break
            if metadata[r].dtype_code != metadata[ref].dtype_code:
                details = (metadata[r].dtype_code, ref, metadata[ref].dtype_code)
                problems.append(f"rank {r}: {describe_problem(InputProblem.DTYPE_MISMATCH, details)}")
                break
        if not problems:
            return ref
    raise ValueError(f"Invalid balanced ViT input ({world} ranks): " + "; ".join(problems) + ".")


def _hex_digits(value: int) -> list[int]:
    value = max(0, min(int(value), 16**_STATUS_DIGITS - 1))
    return [(value >> (4 * k)) & 15 for k in range(_STATUS_DIGITS)]


def _from_hex_digits(digits: Sequence[float]) -> int:
    return sum(round(d) << (4 * k) for k, d in enumerate(digits))


def _transit_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """Dtype of the return-trip buffer: the common floating dtype of the outputs (widening casts
    only, so the trip is exact), or the common integer dtype when no output is floating."""
    floating = [d for d in dtypes if d.is_floating_point or d.is_complex]
    chosen = floating if floating else [d for d in dtypes if d != torch.bool] or [torch.uint8]
    common = chosen[0]
    for dtype in chosen[1:]:
        common = torch.promote_types(common, dtype)
    if common.is_floating_point and common.itemsize < 2:
        common = torch.float16  # float8 values are exact in float16, and so are the status digits
    return common


def _integer_carrier(dtype: torch.dtype, transit: torch.dtype) -> torch.dtype:
    """An integer dtype holding ``dtype`` exactly, at least as wide as ``transit``."""
    size = max(dtype.itemsize, transit.itemsize)
    if dtype.itemsize == size and dtype != torch.bool:
        return dtype
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]


def _elements_per_row(leaf: torch.Tensor, transit: torch.dtype) -> int:
    """Transit elements one row of ``leaf`` takes (integers travel bit-for-bit, see :func:`_pack`)."""
    per_value = 1
    if not (leaf.is_floating_point() or leaf.is_complex()):
        per_value = _integer_carrier(leaf.dtype, transit).itemsize // transit.itemsize
    return math.prod(leaf.shape[1:]) * per_value


def _pack(rows: torch.Tensor, transit: torch.dtype) -> torch.Tensor:
    """Rows of an output as 1-D ``transit`` values, exactly.

    Floating outputs are cast (widening only, see :func:`_transit_dtype`). Integer outputs, which
    carry no gradient, are reinterpreted bit for bit through an integer carrier as wide as the
    transit dtype, so they share the one buffer instead of costing a collective of their own.
    """
    if rows.is_floating_point() or rows.is_complex():
        return rows.reshape(-1).to(transit)
    if not (transit.is_floating_point or transit.is_complex) and rows.dtype == transit:
        return rows.reshape(-1)
    carrier = _integer_carrier(rows.dtype, transit)
    return rows.detach().to(carrier).contiguous().view(transit).reshape(-1)


def _unpack(chunk: torch.Tensor, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_pack`: ``[rows, *like.shape[1:]]`` in ``like.dtype``."""
    shape = (rows, *like.shape[1:])
    if like.is_floating_point() or like.is_complex():
        return chunk.view(shape).to(like.dtype)
    if not (chunk.is_floating_point() or chunk.is_complex()) and chunk.dtype == like.dtype:
        return chunk.detach().view(shape)
    carrier = _integer_carrier(like.dtype, chunk.dtype)
    # A fresh copy: the chunk's offset in the buffer need not be aligned for the wider carrier.
    return chunk.detach().clone().view(carrier).view(shape).to(like.dtype)


def _row_slices(counts: Sequence[int], order: Sequence[int]) -> list[tuple[int, int]]:
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    return [(offsets[i], offsets[i + 1]) for i in order]


def _gather_rows(tensor: torch.Tensor, slices: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Rows ``[a, b)`` of ``tensor`` for each slice, concatenated (a view when nothing moves)."""
    start = slices[0][0] if slices else 0
    contiguous = all(a == (slices[k - 1][1] if k else start) for k, (a, _) in enumerate(slices))
    if contiguous:
        end = slices[-1][1] if slices else start
        return tensor[start:end]
    return torch.cat([tensor[a:b] for a, b in slices])


def _vit_requires_grad(vit: Any) -> bool:
    if isinstance(vit, torch.nn.Module):
        return any(p.requires_grad for p in vit.parameters())
    return True


class ViTBalancer:
    """Encode images with a ViT, balancing the work across data-parallel ranks.

    ``balancer(vit, pixel_values, grid_thw)`` returns what ``vit(pixel_values, grid_thw)`` returns
    on this rank (same type and structure, same values, images in the original order), with
    gradients flowing back to the ViT exactly as in the direct call. Every rank of the group
    must make the call, also ranks with no images (``grid_thw`` of shape ``[0, 3]``).

    What comes back: outputs with a row per patch or per merged token are exchanged back to
    their images' ranks; a window index (an integer output of a ViT with ``get_window_index``) is
    regenerated from this rank's ``grid_thw`` (element 0 when ``get_window_index`` returns a
    tuple); other values (``None``, numbers, 0-d tensors, outputs named ``"passthrough"``) are
    those of the batch this rank encoded. The ViT is never called on an empty batch: a rank that
    encodes nothing runs it on one dummy ``(1, m, m)`` image and returns zero-row slices of the
    result (see ``ViTBalanceConfig.empty_rank_forward``).

    Errors: invalid input on any rank (grid shape, dtype or values, pixel rows, merge
    divisibility, device, ``C`` or dtype differing between ranks) raises the same ``ValueError``
    on every rank before anything moves. An output whose rows fit no kind raises the same
    ``ValueError`` on every rank after the return trip (the rank carries a status block in it),
    provided its nearest kind is what the other ranks made of that output, as for a few missing
    or extra rows; otherwise the trip's sizes disagree and the backend reports it.

    Args:
        config: Balancing options; default ``ViTBalanceConfig()``.
        group: The data-parallel process group; ``None`` is the default group. Without an
            initialised process group, or with one rank, the ViT is called directly.
        output_layout: Kinds of the ViT's outputs where their rows do not tell (an
            :class:`~lightning_vit_balance.outputs.OutputLayout`, or a mapping from output
            path to kind), and the merge size where the ViT does not expose ``spatial_merge_size``.

    Attributes:
        last_stats: :class:`BalanceStats` of the last call, ``None`` before the first.
        calls: Calls made.
        applied_calls: Calls where images moved.
    """

    def __init__(
        self,
        config: ViTBalanceConfig | None = None,
        group: Any = None,
        *,
        output_layout: OutputLayout | Mapping[str, str] | None = None,
    ) -> None:
        if config is not None and not isinstance(config, ViTBalanceConfig):
            raise ValueError(f"config={config!r} is invalid: expected a ViTBalanceConfig or None.")
        self.config = config if config is not None else ViTBalanceConfig()
        self.group = group
        self.output_layout = _layout_of(output_layout)
        self.last_stats: BalanceStats | None = None
        self.calls = 0
        self.applied_calls = 0

    # -- entry point -------------------------------------------------------------------------

    def __call__(self, vit: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        """Balanced ``vit(pixel_values, grid_thw)``; see the class docstring."""
        self.calls += 1
        distributed = dist.is_available() and dist.is_initialized()
        if not self.config.enabled:
            output = vit(pixel_values, grid_thw)
            rank = dist.get_rank(self.group) if distributed else 0
            world = dist.get_world_size(self.group) if distributed else 1
            self._record_local("disabled", rank, world, grid_thw)
            return output
        if not distributed or dist.get_world_size(self.group) == 1:
            merge = merge_size_of(vit, self.output_layout)
            if isinstance(grid_thw, torch.Tensor) and grid_thw.dim() == 2 and grid_thw.shape[0] == 0:
                output = self._empty_output(vit, pixel_values, grid_thw, merge, None, None)
            else:
                output = self._direct(vit, pixel_values, grid_thw)
            self._record_local("single-rank", 0, 1, grid_thw)
            return output
        return self._balanced(vit, pixel_values, grid_thw)

    # -- the balanced call -------------------------------------------------------------------

    def _balanced(self, vit: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        group = self.group
        rank = dist.get_rank(group)
        merge = merge_size_of(vit, self.output_layout)
        local = _validate(pixel_values, grid_thw, merge, group)
        preferred = pixel_values.device if isinstance(pixel_values, torch.Tensor) else None
        device = collective_device(group, preferred)

        started = time.perf_counter()
        metadata, collectives = gather_metadata(
            local,
            capacity=self.config.gather_capacity,
            device=device,
            group=group,
        )
        exchange_seconds = time.perf_counter() - started
        ref = _raise_for_input(metadata)

        started = time.perf_counter()
        plan = plan_rebalance([m.patch_counts for m in metadata], self.config)
        plan_seconds = time.perf_counter() - started

        if ref is None:
            ref_dtype, ref_channels = pixel_values.dtype, int(pixel_values.shape[1])
        else:
            code = metadata[ref].dtype_code
            ref_dtype = DTYPES[code] if code >= 0 else pixel_values.dtype
            ref_channels = metadata[ref].channels

        bytes_sent = bytes_received = 0
        if not plan.applied:
            if metadata[rank].grids:
                output = self._direct(vit, pixel_values, grid_thw)
            else:
                output = self._empty_output(vit, pixel_values, grid_thw, merge, ref_dtype, ref_channels)
        else:
            started = time.perf_counter()
            output, trip_collectives, bytes_sent, bytes_received, encode_seconds = self._exchange_and_encode(
                vit, pixel_values, grid_thw, plan, metadata, merge, ref_dtype, ref_channels
            )
            collectives += trip_collectives
            exchange_seconds += time.perf_counter() - started - encode_seconds

        self._record(
            plan,
            rank,
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
            plan_seconds=plan_seconds,
            exchange_seconds=exchange_seconds,
            collectives=collectives,
        )
        return output

    def _run_vit(
        self,
        vit: Any,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        merge: int,
        dtype: torch.dtype,
        channels: int,
    ) -> tuple[Any, bool]:
        """``vit`` on the batch, or on one dummy image when the batch is empty; (output, is_dummy)."""
        if grid_thw.shape[0] > 0:
            return vit(pixel_values, grid_thw), False
        dummy_pixels = torch.zeros((merge * merge, channels), dtype=dtype, device=pixel_values.device)
        dummy_grid = torch.tensor([[1, merge, merge]], dtype=grid_thw.dtype, device=grid_thw.device)
        if self.config.empty_rank_forward == "no_grad":
            with torch.no_grad():
                return vit(dummy_pixels, dummy_grid), True
        return vit(dummy_pixels, dummy_grid), True

    def _empty_output(
        self,
        vit: Any,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        merge: int,
        dtype: torch.dtype | None,
        channels: int | None,
    ) -> Any:
        """The ViT's output structure with zero rows, from a dummy forward (never an empty batch)."""
        dtype = dtype if dtype is not None else pixel_values.dtype
        channels = channels if channels is not None else int(pixel_values.shape[1])
        output, _ = self._run_vit(vit, pixel_values, grid_thw, merge, dtype, channels)
        leaves, structure = flatten_output(output)
        has_window = window_index_fn(vit) is not None
        result = []
        for path, leaf in leaves:
            found = classify_output(
                path,
                leaf,
                total_patches=merge * merge,
                merge_size=merge,
                has_window_index=has_window,
                layout=self.output_layout,
            )
            if found.problem:
                raise ValueError(
                    describe_output_problem(path, found.problem, found.rows, found.expected, merge)
                )
            if found.kind == "drop":
                result.append(None)
            else:
                result.append(leaf if found.kind == "passthrough" else leaf[:0])
        return rebuild_output(structure, result)

    def _direct(self, vit: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        """``vit(pixel_values, grid_thw)``, with outputs the layout names ``"drop"`` set to None."""
        output = vit(pixel_values, grid_thw)
        layout = self.output_layout
        if layout is None or "drop" not in layout.kinds.values():
            return output
        leaves, structure = flatten_output(output)
        return rebuild_output(structure, [None if layout.kind_of(p) == "drop" else v for p, v in leaves])

    def _exchange_and_encode(
        self,
        vit: Any,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        plan: RebalancePlan,
        metadata: Sequence[RankMetadata],
        merge: int,
        ref_dtype: torch.dtype,
        ref_channels: int,
    ) -> tuple[Any, int, int, int, float]:
        """Forward trip, encode, return trip.

        Returns:
            The output, collectives issued, bytes sent and received, seconds spent in the ViT.
        """
        group = self.group
        rank = dist.get_rank(group)
        world = plan.num_ranks
        route = ExchangeRoute.from_plan(plan, rank)
        my_counts = metadata[rank].patch_counts
        grad_wanted = torch.is_grad_enabled()
        pixels_differentiable = grad_wanted and any(m.requires_grad for m in metadata)
        outputs_differentiable = grad_wanted and (pixels_differentiable or _vit_requires_grad(vit))

        # Forward trip: pixel rows grouped by destination rank. [sum(l_i), C]
        if my_counts:
            send_pixels = _gather_rows(pixel_values, _row_slices(my_counts, route.send_order))
        else:
            send_pixels = torch.empty((0, ref_channels), dtype=ref_dtype, device=pixel_values.device)
        received_pixels = all_to_all(
            send_pixels,
            route.send_patches,
            route.receive_patches,
            group,
            differentiable=pixels_differentiable,
        )  # [sum(receive_patches), C], images in arrival order
        row_bytes = ref_channels * ref_dtype.itemsize
        bytes_sent = row_bytes * sum(n for d, n in enumerate(route.send_patches) if d != rank)
        bytes_received = row_bytes * sum(n for s, n in enumerate(route.receive_patches) if s != rank)

        # Encode the balanced batch; the grid rows come from the gather, not from the wire.
        balanced_grid = torch.tensor(
            [metadata[src].grids[i] for src, i in route.arrivals],
            dtype=grid_thw.dtype,
            device=grid_thw.device,
        ).reshape(-1, 3)
        encode_started = time.perf_counter()
        output, is_dummy = self._run_vit(vit, received_pixels, balanced_grid, merge, ref_dtype, ref_channels)
        encode_seconds = time.perf_counter() - encode_started
        arrival_counts = [metadata[src].patch_counts[i] for src, i in route.arrivals]
        batch_patches = merge * merge if is_dummy else sum(arrival_counts)

        leaves, structure = flatten_output(output)
        window_fn = window_index_fn(vit)
        kinds: list[Classification] = [
            classify_output(
                path,
                leaf,
                total_patches=batch_patches,
                merge_size=merge,
                has_window_index=window_fn is not None,
                layout=self.output_layout,
            )
            for path, leaf in leaves
        ]
        token_leaves = [k for k, c in enumerate(kinds) if c.kind in ("patch", "merged")]
        status = [0] * _STATUS_LEN
        for k in token_leaves:
            if kinds[k].problem:
                status = [kinds[k].problem, k, *_hex_digits(kinds[k].rows), *_hex_digits(kinds[k].expected)]
                break

        # Return trip: one buffer, segmented by the images' home rank, each segment
        # [status block, leaf 0 rows, leaf 1 rows, ...] in the transit dtype.
        transit = _transit_dtype([leaves[k][1].dtype for k in token_leaves])
        device = leaves[token_leaves[0]][1].device if token_leaves else received_pixels.device
        per_row = {k: _elements_per_row(leaves[k][1], transit) for k in token_leaves}
        # Which arrivals come from each home rank (consecutive in the balanced batch), and which of
        # my images each worker rank encoded.
        arrivals_by_home: list[list[int]] = [[] for _ in range(world)]
        for position, (src, _) in enumerate(route.arrivals):
            arrivals_by_home[src].append(position)
        mine_by_worker: list[list[int]] = [[] for _ in range(world)]
        for i, d in enumerate(route.destinations):
            mine_by_worker[d].append(i)
        # Rows [a, b) of each token leaf that belong to each home rank.
        home_rows: dict[int, list[tuple[int, int]]] = {}
        for k in token_leaves:
            offsets = [0]
            for n in arrival_counts:
                offsets.append(offsets[-1] + rows_per_image(kinds[k].kind, n, merge))
            home_rows[k] = [
                (offsets[positions[0]], offsets[positions[-1] + 1]) if positions else (0, 0)
                for positions in arrivals_by_home
            ]

        # Segments of home ranks that encoded none of their images here are the status block
        # alone; runs of them become one piece, so the work grows with the images, not the ranks.
        status_block = torch.tensor(status, dtype=transit, device=device)
        pieces: list[torch.Tensor] = []
        send_splits: list[int] = []
        status_run = 0
        for home in range(world):
            send_splits.append(_STATUS_LEN)
            if not arrivals_by_home[home]:
                status_run += 1
                continue
            pieces.append(status_block.expand(status_run + 1, _STATUS_LEN).reshape(-1))
            status_run = 0
            for k in token_leaves:
                a, b = home_rows[k][home]
                if kinds[k].problem:
                    # Zeros of the size the home rank expects keep the exchange consistent; the
                    # status block tells it (and every rank) to raise.
                    pieces.append(torch.zeros((b - a) * per_row[k], dtype=transit, device=device))
                else:
                    pieces.append(_pack(leaves[k][1][a:b], transit))
                send_splits[home] += (b - a) * per_row[k]
        if status_run:
            pieces.append(status_block.expand(status_run, _STATUS_LEN).reshape(-1))
        # The dummy outputs of a rank that encodes nothing join through zero-row slices: they keep
        # the buffer attached to the ViT's parameters ("attached" policy).
        pieces.extend(_pack(leaves[k][1][:0], transit) for k in token_leaves if not kinds[k].problem)
        if pixels_differentiable:
            # Ties the forward trip into this buffer's graph, so its backward exchange runs on every
            # rank, also where the received pixels fed no ViT (dummy forward).
            pieces.append(received_pixels[:0].reshape(-1).to(transit))
        my_rows = {
            k: [rows_per_image(kinds[k].kind, n, merge) for n in my_counts] for k in token_leaves
        }  # rows of each of my images in each token output
        receive_splits = [
            _STATUS_LEN + sum(per_row[k] * sum(my_rows[k][i] for i in mine) for k in token_leaves)
            for mine in mine_by_worker
        ]
        coming_back = all_to_all(
            torch.cat(pieces),
            send_splits,
            receive_splits,
            group,
            differentiable=outputs_differentiable and (transit.is_floating_point or transit.is_complex),
        )  # [sum(receive_splits)]
        collectives = 2
        bytes_sent += transit.itemsize * sum(n for d, n in enumerate(send_splits) if d != rank)
        bytes_received += transit.itemsize * sum(n for s, n in enumerate(receive_splits) if s != rank)

        # Unpack: from each worker rank, its status block, then the rows of my images it encoded.
        status_starts: list[int] = []
        received: dict[int, list[torch.Tensor]] = {k: [] for k in token_leaves}
        start = 0
        for mine in mine_by_worker:
            status_starts.append(start)
            start += _STATUS_LEN
            for k in token_leaves if mine else ():
                rows = sum(my_rows[k][i] for i in mine)
                received[k].append(
                    _unpack(coming_back[start : start + rows * per_row[k]], rows, leaves[k][1])
                )
                start += rows * per_row[k]
        if token_leaves:
            index = torch.tensor(status_starts).unsqueeze(1) + torch.arange(_STATUS_LEN)
            statuses = coming_back.detach()[index.reshape(-1).to(coming_back.device)]
            self._raise_for_outputs(statuses.reshape(world, _STATUS_LEN).tolist(), leaves, merge)

        # Back to the original image order: received rows are ordered by (worker rank, index),
        # which is this rank's send order.
        identity = list(route.send_order) == sorted(route.send_order)
        inverse = sorted(range(len(route.send_order)), key=lambda p: route.send_order[p])
        window_index: Any = None
        result: list[Any] = []
        for k, (_, leaf) in enumerate(leaves):
            kind = kinds[k].kind
            if kind in ("patch", "merged"):
                # Zero rows still come from the received buffer: the rank's loss then reaches the
                # return exchange, whose backward is a collective every rank must join.
                rows = torch.cat(received[k]) if received[k] else _unpack(coming_back[:0], 0, leaf)
                if not identity:
                    counts = [rows_per_image(kind, my_counts[i], merge) for i in route.send_order]
                    rows = _gather_rows(rows, _row_slices(counts, inverse))
                result.append(rows)
            elif kind == "window_index":
                if not my_counts:
                    result.append(leaf[:0])
                else:
                    if window_index is None:
                        assert window_fn is not None
                        window_index = window_fn(grid_thw)
                        # get_window_index may return (window_index, cu_window_seqlens).
                        if isinstance(window_index, (tuple, list)):
                            window_index = window_index[0]
                    result.append(window_index)
            elif kind == "drop":
                result.append(None)
            else:
                result.append(leaf)
        return rebuild_output(structure, result), collectives, bytes_sent, bytes_received, encode_seconds

    @staticmethod
    def _raise_for_outputs(
        statuses: list[list[float]], leaves: Sequence[tuple[str, Any]], merge: int
    ) -> None:
        """Raise the same ValueError on every rank when some rank's ViT output had bad rows."""
        problems = []
        for worker, block in enumerate(statuses):
            code = round(block[0])
            if code:
                k = round(block[1])
                rows = _from_hex_digits(block[2 : 2 + _STATUS_DIGITS])
                expected = _from_hex_digits(block[2 + _STATUS_DIGITS :])
                path = leaves[k][0] if 0 <= k < len(leaves) else str(k)
                problems.append(
                    f"rank {worker}: {describe_output_problem(path, code, rows, expected, merge)}"
                )
        if problems:
            raise ValueError("Unexpected ViT output in the balanced call: " + "; ".join(problems) + ".")

    # -- diagnostics -------------------------------------------------------------------------

    def _record(
        self,
        plan: RebalancePlan,
        rank: int,
        *,
        num_ranks: int | None = None,
        reason: str | None = None,
        bytes_sent: int = 0,
        bytes_received: int = 0,
        plan_seconds: float = 0.0,
        exchange_seconds: float = 0.0,
        collectives: int = 0,
    ) -> None:
        """Keep ``plan``'s figures as :attr:`last_stats`; ``num_ranks`` and ``reason`` override the
        plan's for calls that planned over this rank alone."""
        if plan.applied:
            self.applied_calls += 1
        self.last_stats = BalanceStats(
            applied=plan.applied,
            reason=reason if reason is not None else plan.reason,
            rank=rank,
            num_ranks=num_ranks if num_ranks is not None else plan.num_ranks,
            loads_before=plan.loads_before,
            loads_after=plan.loads_after,
            imbalance_before=plan.imbalance_before,
            imbalance_after=plan.imbalance_after,
            num_images=sum(len(c) for c in plan.patch_counts),
            moved_images=plan.moved_images,
            moved_patches=plan.moved_patches,
            total_patches=plan.total_patches,
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
            plan_seconds=plan_seconds,
            exchange_seconds=exchange_seconds,
            collectives=collectives,
        )
        self._report()

    def _record_local(self, reason: str, rank: int, world: int, grid_thw: Any) -> None:
        counts: tuple[int, ...] = ()
        if isinstance(grid_thw, torch.Tensor) and grid_thw.dim() == 2 and grid_thw.shape[1] == 3:
            counts = tuple(int(t) * int(h) * int(w) for t, h, w in grid_thw.tolist())
        if any(n <= 0 for n in counts):
            counts = ()
        # A one-rank plan gives this rank's load, imbalance 0 and nothing moved.
        self._record(plan_rebalance([counts], self.config), rank, num_ranks=world, reason=reason)

    def _report(self) -> None:
        stats = self.last_stats
        if not self.config.verbose or stats is None or stats.rank != 0:
            return
        decision = "APPLY" if stats.applied else "SKIP"
        loads = ", ".join(f"{v:.4g}" for v in stats.loads_before)
        after = ", ".join(f"{v:.4g}" for v in stats.loads_after)
        print(
            f"[vit-balance] {decision} ({stats.reason}) imbalance {stats.imbalance_before:.3f} -> "
            f"{stats.imbalance_after:.3f}; load per rank [{loads}] -> [{after}]; moved "
            f"{stats.moved_images} images / {stats.moved_patches} patches; applied "
            f"{self.applied_calls}/{self.calls}",
            flush=True,
        )


def balanced_encode(
    vit: Any,
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    *,
    group: Any = None,
    config: ViTBalanceConfig | None = None,
) -> Any:
    """One balanced call ``vit(pixel_values, grid_thw)``; see :class:`ViTBalancer`.

    Without an initialised process group or with one rank it calls the ViT directly.
    """
    return ViTBalancer(config, group)(vit, pixel_values, grid_thw)
