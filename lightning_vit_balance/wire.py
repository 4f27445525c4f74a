"""The wire codec: several token outputs of several dtypes in one return buffer, exactly.

No communication here (that is :mod:`lightning_vit_balance.exchange`'s): what one rank's return
buffer holds and how it is read back.

* :func:`transit_dtype`, :func:`elements_per_row`, :func:`pack_rows`, :func:`unpack_rows`: one
  output's rows as transit values and back, bit for bit (integers through an integer carrier).
* :func:`pack_return` / :func:`unpack_return`: the whole buffer of a
  :class:`~lightning_vit_balance.exchange.ReturnLayout`, each way, with a one-pass backward.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch

from lightning_vit_balance.exchange import ReturnLayout, gradient_buffer

__all__ = [
    "elements_per_row",
    "pack_return",
    "pack_rows",
    "transit_dtype",
    "unpack_return",
    "unpack_rows",
]


# -- the wire codec -------------------------------------------------------------------------------


def _is_float(dtype: torch.dtype) -> bool:
    """Floating or complex: values that are cast, and carry gradients; the rest travel bit for bit."""
    return dtype.is_floating_point or dtype.is_complex


def transit_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """Dtype of the return-trip buffer: the common floating dtype of the outputs (widening casts
    only, so the trip is exact), or the common integer dtype when no output is floating."""
    floating = [d for d in dtypes if _is_float(d)]
    chosen = floating if floating else [d for d in dtypes if d != torch.bool] or [torch.uint8]
    common = chosen[0]
    for dtype in chosen[1:]:
        common = torch.promote_types(common, dtype)
    if common.is_floating_point and common.itemsize < 2:
        common = torch.float16  # float8 values are exact in float16
    return common


def _integer_carrier(dtype: torch.dtype, transit: torch.dtype) -> torch.dtype:
    """An integer dtype holding ``dtype`` exactly, at least as wide as ``transit``."""
    size = max(dtype.itemsize, transit.itemsize)
    if dtype.itemsize == size and dtype != torch.bool:
        return dtype
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]


def elements_per_row(leaf: torch.Tensor, transit: torch.dtype) -> int:
    """Transit elements one row of ``leaf`` takes (integers travel bit-for-bit, see :func:`pack_rows`)."""
    per_value = 1
    if not _is_float(leaf.dtype):
        per_value = _integer_carrier(leaf.dtype, transit).itemsize // transit.itemsize
    return math.prod(leaf.shape[1:]) * per_value


def pack_rows(rows: torch.Tensor, transit: torch.dtype) -> torch.Tensor:
    """Rows of an output as 1-D ``transit`` values, exactly.

    Floating outputs are cast (widening only, see :func:`transit_dtype`). Integer outputs, which
    carry no gradient, are reinterpreted bit for bit through an integer carrier as wide as the
    transit dtype, so they share the one buffer instead of costing a collective of their own.
    """
    if _is_float(rows.dtype):
        return rows.reshape(-1).to(transit)
    if not _is_float(transit) and rows.dtype == transit:
        return rows.reshape(-1)
    carrier = _integer_carrier(rows.dtype, transit)
    return rows.detach().to(carrier).contiguous().view(transit).reshape(-1)


def unpack_rows(chunk: torch.Tensor, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_rows`: ``[rows, *like.shape[1:]]`` in ``like.dtype``."""
    shape = (rows, *like.shape[1:])
    if _is_float(like.dtype):
        return chunk.view(shape).to(like.dtype)
    if not _is_float(chunk.dtype) and chunk.dtype == like.dtype:
        return chunk.detach().view(shape)
    carrier = _integer_carrier(like.dtype, chunk.dtype)
    # A fresh copy: the chunk's offset in the buffer need not be aligned for the wider carrier.
    return chunk.detach().clone().view(carrier).view(shape).to(like.dtype)


# -- the return trip's buffer, for autograd -------------------------------------------------------


class _PackFunction(torch.autograd.Function):
    """:func:`pack_return` for autograd. Its backward puts each piece's gradient in place in one pass
    (slicing under autograd would zero-fill, then sum, a whole leaf-sized gradient per piece)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, layout: ReturnLayout, transit: torch.dtype, tie: torch.Tensor | None, *leaves: torch.Tensor
    ) -> torch.Tensor:
        places = [(k, a, b) for ranges in layout.send_rows for k, (a, b) in enumerate(ranges) if b > a]
        pieces = [pack_rows(leaves[k][a:b], transit) for k, a, b in places]
        ctx.places = [(k, a, b, piece.numel()) for (k, a, b), piece in zip(places, pieces)]
        ctx.leaves = [(leaf.shape, leaf.dtype, leaf.device) for leaf in leaves]
        ctx.tie = None if tie is None else (tie.shape, tie.dtype, tie.device)
        if not pieces:
            return torch.zeros(0, dtype=transit, device=leaves[0].device if leaves else None)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        covered = [0] * len(ctx.leaves)
        for k, a, b, _ in ctx.places:
            covered[k] += b - a
        grads = [
            gradient_buffer(shape, dtype, device, rows == shape[0]) if _is_float(dtype) else None
            for (shape, dtype, device), rows in zip(ctx.leaves, covered)
        ]
        at = 0
        for k, a, b, size in ctx.places:
            target = grads[k]
            if target is not None:
                target[a:b] = grad[at : at + size].view(b - a, *target.shape[1:])
            at += size
        tie = None
        if ctx.tie is not None:  # a zero gradient: the forward trip's backward exchange still runs
            shape, dtype, device = ctx.tie
            tie = torch.zeros((), dtype=dtype, device=device).expand(shape)
        return None, None, tie, *grads


def pack_return(
    leaves: Sequence[torch.Tensor],
    layout: ReturnLayout,
    transit: torch.dtype,
    tie: torch.Tensor | None = None,
) -> torch.Tensor:
    """The return buffer: for each home rank, each token output's rows of its images, packed
    (see :func:`pack_rows`); 1-D, ``transit`` values.

    Args:
        leaves: The token outputs of this rank's balanced batch.
        layout: Their return layout.
        transit: The buffer's dtype.
        tie: The pixel rows the forward trip delivered, when that trip is differentiable: the buffer
            then depends on them, so the trip's backward exchange runs on every rank, also where
            they fed no ViT (a dummy forward). Every leaf is attached likewise (even with no rows to
            send), so that the ViT's parameters take part in the return exchange's backward.
    """
    return _PackFunction.apply(layout, transit, tie, *leaves)


class _UnpackFunction(torch.autograd.Function):
    """:func:`unpack_return` for autograd; its backward writes every output's gradient into one
    buffer-sized gradient in one pass."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, back: torch.Tensor, layout: ReturnLayout, elements: Sequence[int], *likes: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        chunks: list[list[torch.Tensor]] = [[] for _ in likes]
        at = 0
        for rows_from_worker in layout.receive_rows:
            for k, rows in enumerate(rows_from_worker):
                if rows:
                    chunks[k].append(unpack_rows(back[at : at + rows * elements[k]], rows, likes[k]))
                    at += rows * elements[k]
        outputs = []
        for k, like in enumerate(likes):
            if not chunks[k]:
                outputs.append(unpack_rows(back[:0], 0, like).clone())
            elif layout.restore is None:
                outputs.append(torch.cat(chunks[k]))
            else:
                outputs.append(torch.cat(_pick_rows(chunks[k], layout.restore[k])))
        ctx.layout, ctx.elements, ctx.back = layout, elements, (back.shape, back.dtype, back.device)
        ctx.mark_non_differentiable(*(out for out in outputs if not _is_float(out.dtype)))
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        layout: ReturnLayout = ctx.layout
        ordered = [
            _arrival_order(grad, layout.restore[k] if layout.restore is not None else None)
            if grad is not None and _is_float(grad.dtype)
            else None
            for k, grad in enumerate(grads)
        ]
        shape, dtype, device = ctx.back
        # The pieces cover the whole buffer exactly when every output has a gradient.
        grad_back = gradient_buffer(shape, dtype, device, all(g is not None for g in ordered))
        at, first = 0, [0] * len(grads)
        for rows_from_worker in layout.receive_rows:
            for k, rows in enumerate(rows_from_worker):
                size = rows * ctx.elements[k]
                source = ordered[k]
                if rows and source is not None:
                    grad_back[at : at + size] = source[first[k] : first[k] + rows].reshape(-1)
                at, first[k] = at + size, first[k] + rows
        return grad_back, None, None, *(None for _ in grads)


def _arrival_order(grad: torch.Tensor, restore: Sequence[tuple[int, int]] | None) -> torch.Tensor:
    """An output's gradient with its rows back in the order they arrived in (the inverse of restore).

    The slices of ``restore`` tile the received rows, so sorting them by where they arrived gives
    the arrival order as one ``cat`` of views of ``grad`` (one copy, not one per slice).
    """
    if restore is None:
        return grad
    starts = list(accumulate((b - a for a, b in restore), initial=0))
    by_arrival = sorted(range(len(restore)), key=lambda j: restore[j][0])
    return torch.cat([grad[starts[j] : starts[j + 1]] for j in by_arrival])


def _pick_rows(chunks: Sequence[torch.Tensor], slices: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of rows ``[a, b)`` of ``chunks`` as if concatenated, for each slice in turn, adjacent
    rows of one chunk in one view: the restored order is then one ``cat`` away."""
    starts = [0]
    for chunk in chunks:
        starts.append(starts[-1] + chunk.shape[0])
    runs: list[tuple[int, int, int]] = []  # (chunk, first row, end row)
    for a, b in slices:
        while a < b:
            j = bisect.bisect_right(starts, a) - 1
            end = min(b, starts[j + 1])
            if runs and runs[-1][0] == j and runs[-1][2] == a - starts[j]:
                runs[-1] = (j, runs[-1][1], end - starts[j])
            else:
                runs.append((j, a - starts[j], end - starts[j]))
            a = end
    return [chunks[j][first:end] for j, first, end in runs]


def unpack_return(
    back: torch.Tensor, leaves: Sequence[torch.Tensor], layout: ReturnLayout, elements: Sequence[int]
) -> list[torch.Tensor]:
    """The inverse of :func:`pack_return` on the receiving side: each token output's rows of this
    rank's images, in their original order, from the received buffer ``back``.

    Every output is made from ``back`` (also with zero rows), so the rank's loss reaches the return
    exchange, whose backward is a collective every rank must join.

    Args:
        back: ``[sum(layout.receive_splits)]`` transit values, from worker rank 0 first.
        leaves: The token outputs this rank's ViT made (for their dtypes and trailing shapes).
        layout: The return layout.
        elements: Transit elements per row of each output (see :func:`elements_per_row`).
    """
    likes = [leaf.detach() for leaf in leaves]
    return list(_UnpackFunction.apply(back, layout, list(elements), *likes))
