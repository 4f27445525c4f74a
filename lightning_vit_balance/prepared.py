"""A plan made before the forward: :class:`PreparedPlan`, the value ``ViTBalancer.prepare`` returns.

Grid sizes are known on the host before a batch reaches the device (the data loader made them), so
the metadata gather and the plan can run there, outside the step's forward. The balanced call then
uses the prepared plan: no metadata gather, no device-to-host sync and no planning in the forward,
and a step the plan skips costs nothing at all.

A prepared plan describes one batch. The call that uses it checks, without syncing, that its input
is that batch (image count, pixel rows, channels, the dtype it was prepared with; the
grid values too when ``grid_thw`` is on the CPU; the balancer adds that the rows are on a device
the group carries, which ``prepare``, reading a host copy, could not check); on an applied plan a
rank whose input does not match still takes part in every exchange, with zeros, and the status
gather after the ViT raises the same ``ValueError`` on every rank. A ``grid_thw`` on a device
cannot be read in the forward without waiting for the device, so its values are compared there
(:meth:`PreparedPlan.compare_on_device`) and the result is read at the rank's next metadata gather
(:class:`DeviceGridChecks`), where every rank raises the same ``ValueError``: one call late, but
never silent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

from lightning_vit_balance.caching import cached_value
from lightning_vit_balance.config import stable_digest
from lightning_vit_balance.exchange import RankMetadata, host_to_device
from lightning_vit_balance.planning import RebalancePlan
from lightning_vit_balance.problems import (
    GRID_DTYPE_NAMES,
    GRID_DTYPES,
    InputProblem,
    UncombinedInput,
    dense_problem,
    describe_problem,
    problem_details,
)

__all__ = ["DeviceGridChecks", "PreparedPlan", "batch_digest", "grid_gcd"]


@dataclass(frozen=True)
class PreparedPlan:
    """Every rank's grid rows and the plan for one batch, made before the forward.

    Attributes:
        plan: The plan, identical on every rank.
        metadata: Every rank's gathered metadata (grid rows, channels, dtype, previous ViT time).
        rank: The rank that prepared it.
        channels: ``C`` of the pixel rows every rank sends.
        dtype: The dtype pixel rows travel in (the prepared ``pixel_values``' dtype).
        pixels_require_grad: Whether any rank's prepared ``pixel_values`` required grad.
        gather_seconds: Host seconds the gather took (outside the forward).
        plan_seconds: Host seconds planning took (outside the forward).
        collectives: Collectives the preparation issued.
        call_grids: The grid rows the call passes, where they differ from the plan's items (with
            ``split_videos``, a video is one row there and one item per temporal step here);
            ``None``: the items' rows.
        source: Where the plan was made from, where not from the caller's own ``prepare`` (the
            Lightning mixin's ``plan_ahead``): named in :meth:`mismatch`'s reasons.
        grid_gcd: The greatest size dividing every rank's H and W (0 without images): a call checks
            its ViT's spatial merge size against it, the same on every rank, without reading the rows.
        encoded_counts: The patch counts every rank encodes in the planned call, and
            ``encoded_frames`` their temporal steps, where the cost model is fitted online: what the
            call's measured time pays for (``None`` otherwise).
        batch_digest: :func:`batch_digest` of :attr:`metadata`: the call compares it across ranks
            with the plan's own digest, so that a rank given a plan prepared for another call
            (plans taken in another order, or one passed twice) fails every rank. Also where the
            plan moves nothing but the cost model is fitted online: the next gather compares which
            batch each rank's call encoded (0 where neither).
        vit_ms: Every rank's previous ViT time as the gather carried it (what the call reports).
        check_skipped_calls: The setting of the plan's settings, which every rank's gather compared:
            whether the call gathers the status word where the plan skips. The call follows it, not
            the rank's settings at call time, which may have changed on some ranks only.
    """

    plan: RebalancePlan
    metadata: tuple[RankMetadata, ...]
    rank: int
    channels: int
    dtype: torch.dtype
    pixels_require_grad: bool
    gather_seconds: float
    plan_seconds: float
    collectives: int
    call_grids: tuple[tuple[int, int, int], ...] | None = None
    source: str = ""
    grid_gcd: int = 0
    encoded_counts: tuple[tuple[int, ...], ...] | None = None
    encoded_frames: tuple[tuple[int, ...], ...] | None = None
    batch_digest: int = 0
    vit_ms: tuple[float, ...] | None = None
    check_skipped_calls: bool = False

    @property
    def prepare_seconds(self) -> float:
        """Host seconds making it, the gather and the plan (outside the forward): what a call's
        ``BalanceStats.prepare_seconds`` counts."""
        return self.gather_seconds + self.plan_seconds

    @property
    def holds_images(self) -> bool:
        """Whether any rank has images: otherwise no pixel row travels, and a call's rows may have
        any width and dtype (a text-only step, where each rank makes its own empty rows)."""
        return any(m.grids for m in self.metadata)

    @property
    def call_grid_rows(self) -> tuple[tuple[int, int, int], ...]:
        """This rank's grid rows as the prepared call passes them, read on the host when prepared."""
        return self.call_grids if self.call_grids is not None else self.metadata[self.rank].grids

    def mismatch(self, pixel_values: Any, grid_thw: Any) -> str | None:
        """Why this call's input is not the prepared batch (naming :attr:`source`), or None when it is.

        Reads only shapes and dtypes, and the grid values when ``grid_thw`` is on the CPU, so it never
        waits for the device.
        """
        problem = self._mismatch(pixel_values, grid_thw)
        return f"{problem} ({self.source})" if problem is not None and self.source else problem

    def _other_batch(self, problem: str) -> str:
        """``problem``, a call given another batch than the plan's, with what to do about it: a plan
        made by the mixin was never the user's to pass (:attr:`source` names where it came from)."""
        return problem if self.source else f"{problem}: pass the plan prepared for this batch"

    def _mismatch(self, pixel_values: Any, grid_thw: Any) -> str | None:
        grids = self.call_grid_rows
        if isinstance(grid_thw, UncombinedInput):  # the status carries text: the cause itself
            return str(grid_thw)
        if not isinstance(pixel_values, torch.Tensor) or not isinstance(grid_thw, torch.Tensor):
            return "pixel_values and grid_thw must be tensors, as when the plan was prepared"
        dense = dense_problem(pixel_values, grid_thw)
        if dense is not None:  # the plan may be made from a host copy of another layout
            return describe_problem(InputProblem.LAYOUT, problem_details(InputProblem.LAYOUT, **dense))
        if grid_thw.dtype not in GRID_DTYPES:
            expected = f"expected {GRID_DTYPE_NAMES}, as when the plan was prepared"
            return f"grid_thw has dtype {grid_thw.dtype}: {expected}"
        if tuple(grid_thw.shape) != (len(grids), 3):
            return self._other_batch(
                f"grid_thw has shape {tuple(grid_thw.shape)} while the prepared plan holds "
                f"{len(grids)} image{'s' if len(grids) != 1 else ''} on this rank"
            )
        rows = sum(self.metadata[self.rank].patch_counts)
        # A rank without images sends no row and builds what it encodes in the plan's width and
        # dtype: its empty rows may have any, as in a call not prepared.
        free = rows == 0
        width = pixel_values.shape[1] if free and pixel_values.dim() == 2 else self.channels
        if pixel_values.dim() != 2 or pixel_values.shape[0] != rows or pixel_values.shape[1] != width:
            return self._other_batch(
                f"pixel_values has shape {tuple(pixel_values.shape)} while the prepared plan expects "
                f"[{rows}, {self.channels}] on this rank"
            )
        # Equal, not only held exactly: a rank that encodes another's images builds its batch in
        # the plan's dtype, which must be the dtype their owner's direct call would have passed.
        if not pixel_values.is_floating_point() or (not free and pixel_values.dtype != self.dtype):
            return (
                f"pixel_values has dtype {pixel_values.dtype} while the plan was prepared for {self.dtype}: "
                "prepare with pixel_values of the dtype the forward passes (cast the batch before the "
                "plan is made)"
            )
        if bool(pixel_values.requires_grad) and not self.pixels_require_grad:
            return "pixel_values requires grad, but did not when the plan was prepared"
        if _read_on_host(grid_thw) and not torch.equal(grid_thw.long(), self._call_grid_tensor):
            return self._other_batch("grid_thw holds other values than the prepared plan")
        return None

    @cached_value
    def _call_grid_tensor(self) -> torch.Tensor:
        """:attr:`call_grid_rows` as a ``[n, 3]`` int64 host tensor, made once for the calls'
        comparisons (building it took 0.1 ms a call at 256 images)."""
        return torch.tensor(self.call_grid_rows, dtype=torch.int64).reshape(-1, 3)

    def compare_on_device(self, grid_thw: torch.Tensor) -> torch.Tensor | None:
        """``[]`` bool on ``grid_thw``'s device: whether its values differ from the prepared grid rows.

        For a call whose :meth:`mismatch` found nothing: the shapes match, so one elementwise
        comparison, queued like a kernel. ``None`` when :meth:`mismatch` compared the values on the
        host already (a grid on the CPU), the rank has no images, or the grid has no values (the
        meta device: the ViT fails on it, and that failure reaches every rank).
        """
        grids = self.call_grid_rows
        if _read_on_host(grid_thw) or not grids or grid_thw.device.type == "meta":
            return None
        expected = host_to_device(self._call_grid_tensor, grid_thw.device, grid_thw.dtype)  # [n, 3]
        return (grid_thw != expected).any()


class DeviceGridChecks:
    """The comparisons :meth:`PreparedPlan.compare_on_device` queued, read without waiting.

    On CUDA each result is copied into pinned host memory behind its comparison and an event is
    recorded after the copy; :meth:`differed` reads only the results whose event has completed
    (``Event.query()`` does not block), so the host never waits for the device. The balancer asks
    at its next metadata gather, which carries the answer to every rank.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[torch.Tensor, Any]] = []  # ([] bool result, its CUDA event or None)

    def watch(self, differs: torch.Tensor) -> None:
        """Keep ``differs`` (a ``[]`` bool tensor) to read once its device has computed it."""
        if differs.device.type != "cuda":
            self._pending.append((differs, None))
            return
        on_host = torch.empty((), dtype=torch.bool, pin_memory=True)
        on_host.copy_(differs, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending.append((on_host, done))

    def wait(self) -> None:
        """Wait for the comparisons still running on their device (at the end of a loop, where
        no later call would read them)."""
        for _, done in self._pending:
            if done is not None:
                done.synchronize()

    def differed(self) -> bool:
        """Whether a comparison that has finished found other values. Each finished one is read once
        and forgotten; those still running stay for a later call."""
        running, found = [], False
        for differs, done in self._pending:
            if done is not None and not done.query():
                running.append((differs, done))
            else:
                found = found or bool(differs)
        self._pending = running
        return found


def batch_digest(metadata: Sequence[RankMetadata]) -> int:
    """A 62-bit digest of the gathered batch a plan is made from: every rank's grid rows (its image
    count included), channels and dtype, which the balanced batches are built from. Two plans can
    move images alike (the same patch counts) while the grids differ: a rank given another call's
    plan would then encode the other ranks' rows as the wrong grids, with no error (about 1 ms at
    1,024 ranks x 8 images, in ``prepare``)."""
    counts = [len(m.grids) for m in metadata]
    header = np.asarray([(n, m.channels, m.dtype_code) for n, m in zip(counts, metadata)], dtype="<i8")
    rows = chain.from_iterable(chain.from_iterable(m.grids for m in metadata))
    grids = np.fromiter(rows, dtype="<i8", count=3 * sum(counts))
    return stable_digest(header.tobytes() + grids.tobytes())


def grid_gcd(metadata: Sequence[RankMetadata]) -> int:
    """The greatest size dividing every rank's image heights and widths (0 without images): a merge
    size divides them all when it divides this (0.5 ms at 1,024 ranks x 8 images, in ``prepare``)."""
    divisor = 0
    for rank_metadata in metadata:
        for _, h, w in rank_metadata.grids:
            divisor = math.gcd(divisor, h, w)
            if divisor == 1:
                return 1
    return divisor


def _read_on_host(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor``'s values costs no wait for a device (it is on the CPU)."""
    return tensor.device.type == "cpu"
