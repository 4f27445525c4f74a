"""The wire codec: several outputs of several dtypes in one return buffer, exactly.

No communication here (that is :mod:`lightning_vit_balance.exchange`'s): what one rank's return
buffer holds and how it is read back.

* :func:`transit_dtype`, :func:`elements_per_row`, :func:`pack_rows`, :func:`unpack_rows`: one
  output's rows as transit values and back, bit for bit (integers through an integer carrier).
* :func:`pack_return` / :func:`unpack_return`: the whole buffer of a
  :class:`~lightning_vit_balance.exchange.ReturnLayout`, each way, with a one-pass backward.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_vit_balance.exchange import ReceivePieces, ReturnLayout, SendPieces, fill_rows, split_rows

__all__ = [
    "autocast_off",
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
    only, so the trip is exact), or, when no output is floating, an integer dtype as wide as their
    widest that every backend's collectives carry (``uint8``, ``int32`` or ``int64``: gloo and
    NCCL carry no ``int16``)."""
    floating = [_exactly_in(d) for d in dtypes if _is_float(d)]
    if not floating:
        widest = max((d.itemsize for d in dtypes if d != torch.bool), default=1)
        return _INTEGER_TRANSIT[min(widest, 8)]
    common = floating[0]
    for dtype in floating[1:]:
        common = torch.promote_types(common, dtype)
    return common


#: The integer transit dtype for outputs whose widest is this many bytes.
_INTEGER_TRANSIT = {1: torch.uint8, 2: torch.int32, 4: torch.int32, 8: torch.int64}


def _exactly_in(dtype: torch.dtype) -> torch.dtype:
    """A floating dtype of 2 bytes or more that holds every ``dtype`` value exactly (``torch``
    promotes no float8 dtype): float16 for float8 values, float32 for ``float8_e8m0fnu``'s powers
    of two down to ``2**-127``."""
    if dtype.is_complex or dtype.itemsize >= 2:
        return dtype
    return torch.float32 if "e8m0" in str(dtype) else torch.float16


def _integer_carrier(dtype: torch.dtype, transit: torch.dtype) -> torch.dtype:
    """An integer dtype holding ``dtype`` exactly, at least as wide as ``transit`` (``int64`` for a
    ``complex128`` transit, whose values then carry one integer each: see :func:`_pairs`)."""
    size = min(max(dtype.itemsize, transit.itemsize), 8)
    if dtype.itemsize == size and dtype != torch.bool:
        return dtype
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]


def _pairs(transit: torch.dtype) -> bool:
    """Whether integers travel in ``transit`` as (value, 0) pairs: 16-byte values have no integer
    dtype as wide, so each carries one ``int64``."""
    return transit.itemsize > 8


def elements_per_row(leaf: torch.Tensor, transit: torch.dtype) -> int:
    """Transit elements one row of ``leaf`` takes (integers travel bit-for-bit, see :func:`pack_rows`)."""
    per_value = 1
    if not _is_float(leaf.dtype) and not _pairs(transit):
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
    if _pairs(transit):
        paired = rows.new_zeros((*rows.shape, 2), dtype=carrier)
        paired[..., 0] = rows.detach()
        return paired.view(transit).reshape(-1)
    return rows.detach().to(carrier).contiguous().view(transit).reshape(-1)


def unpack_rows(chunk: torch.Tensor, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_rows`: ``[rows, *like.shape[1:]]`` in ``like.dtype``."""
    shape = (rows, *like.shape[1:])
    if _is_float(like.dtype):
        return _cast(chunk.view(shape), like.dtype)
    if not _is_float(chunk.dtype) and chunk.dtype == like.dtype:
        return chunk.detach().view(shape)
    carrier = _integer_carrier(like.dtype, chunk.dtype)
    # A fresh copy: the chunk's offset in the buffer need not be aligned for the wider carrier.
    values = chunk.detach().clone().view(carrier)
    if _pairs(chunk.dtype):
        return values.view(*shape, 2)[..., 0].to(like.dtype).contiguous()
    return values.view(shape).to(like.dtype)


def _cast(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (floats carried wider) in ``dtype``: a real output carried in a complex transit
    is its real part (the imaginary part is 0: torch's cast would warn that it discards it)."""
    if values.is_complex() and not dtype.is_complex:  # every other value of the real view
        return values.real.contiguous().to(dtype)
    return values.to(dtype)


# -- the return trip's buffer, for autograd -------------------------------------------------------


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The caller's autocast, off while the ViT's outputs are moved: under ``float16`` autocast
    ``torch.cat`` refuses ``bfloat16`` rows (and the reverse), which the ViT returned as they are
    and the direct call hands on unchanged. Moving rows casts nothing, so nothing else changes."""
    try:
        enabled = torch.is_autocast_enabled(device.type)
    except TypeError:  # torch < 2.4: no device argument
        enabled = torch.is_autocast_cpu_enabled() if device.type == "cpu" else torch.is_autocast_enabled()
    except RuntimeError:  # a device without autocast (meta)
        enabled = False
    return torch.autocast(device.type, enabled=False) if enabled else contextlib.nullcontext()


def _row_sizes(rows: Sequence[int], elements: int) -> list[int]:
    return [n * elements for n in rows]


class _PackFunction(torch.autograd.Function):
    """:func:`pack_return` for autograd: each output packed whole, split at the layout's cuts in one
    call, the pieces concatenated in the buffer's order; the backward the same way back. Python work
    per piece is then a list lookup, not a slice (hundreds of pieces on hundreds of ranks)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, layout: ReturnLayout, transit: torch.dtype, tie: torch.Tensor | None, *leaves: torch.Tensor
    ) -> torch.Tensor:
        pieces = layout.send_pieces
        elements = [elements_per_row(leaf, transit) for leaf in leaves]
        split = [
            split_rows(pack_rows(leaf, transit), _row_sizes(cuts, per_row))  # 1-D: rows are values
            for leaf, cuts, per_row in zip(leaves, pieces.cuts, elements)
        ]
        ctx.pieces, ctx.elements = pieces, elements
        ctx.leaves = [(leaf.shape, leaf.dtype, leaf.device) for leaf in leaves]
        ctx.tie = None if tie is None else (tie.shape, tie.dtype, tie.device)
        if not pieces.order:
            return torch.zeros(0, dtype=transit, device=leaves[0].device if leaves else None)
        with autocast_off(leaves[0].device):
            return torch.cat([split[k][j] for k, j in pieces.order])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        pieces: SendPieces = ctx.pieces
        sizes = [ctx.elements[k] * pieces.cuts[k][j] for k, j in pieces.order]
        placed: list[dict[int, torch.Tensor]] = [{} for _ in ctx.leaves]
        for (k, j), part in zip(pieces.order, torch.split(grad, sizes)):
            placed[k][j] = part
        # Each output's gradient in transit values, zeros where its rows went nowhere.
        grads = [
            _cast(fill_rows(placed[k], _row_sizes(cuts, per_row), math.prod(shape), grad).view(shape), dtype)
            if _is_float(dtype)
            else None
            for k, (cuts, per_row, (shape, dtype, _)) in enumerate(zip(pieces.cuts, ctx.elements, ctx.leaves))
        ]
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
        leaves: The outputs that travel back of this rank's balanced batch.
        layout: Their return layout.
        transit: The buffer's dtype.
        tie: The pixel rows the forward trip delivered, when that trip is differentiable: the buffer
            then depends on them, so the trip's backward exchange runs on every rank, also where
            they fed no ViT (a dummy forward). Every leaf is attached likewise (even with no rows to
            send), so that the ViT's parameters take part in the return exchange's backward.
    """
    return _PackFunction.apply(layout, transit, tie, *leaves)


class _UnpackFunction(torch.autograd.Function):
    """:func:`unpack_return` for autograd: the received buffer split at the layout's pieces in one
    call, each output one ``cat`` of its pieces in its images' order; the backward the same way
    back, one ``cat`` for the whole buffer's gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, back: torch.Tensor, layout: ReturnLayout, elements: Sequence[int], *likes: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        pieces = layout.receive_pieces
        sizes = [rows * elements[k] for rows, k in zip(pieces.rows, pieces.outputs)]
        split = torch.split(back, sizes)
        outputs = []
        with autocast_off(back.device):
            for k, like in enumerate(likes):
                picks = pieces.picks[k] if k < len(pieces.picks) else ()
                if not picks:
                    outputs.append(unpack_rows(back[:0], 0, like).clone())
                    continue
                outputs.append(
                    _joined_output([split[i] for i in picks], [pieces.rows[i] for i in picks], like)
                )
        ctx.pieces, ctx.sizes, ctx.back = pieces, sizes, (back.shape, back.dtype, back.device)
        ctx.mark_non_differentiable(*(out for out in outputs if not _is_float(out.dtype)))
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        pieces: ReceivePieces = ctx.pieces
        shape, dtype, device = ctx.back
        placed: dict[int, torch.Tensor] = {}
        for k, grad in enumerate(grads):
            if grad is None or not _is_float(grad.dtype) or k >= len(pieces.picks) or not pieces.picks[k]:
                continue
            picks = pieces.picks[k]
            flat = grad.reshape(-1).to(dtype)
            placed.update(zip(picks, torch.split(flat, [ctx.sizes[i] for i in picks])))
        # Zeros where an output had no gradient.
        like = torch.empty(0, dtype=dtype, device=device)
        return fill_rows(placed, ctx.sizes, shape[0], like), None, None, *(None for _ in grads)


def _joined_output(chunks: Sequence[torch.Tensor], rows: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """One output from its pieces of the received buffer, in order: ``[sum(rows), *like.shape[1:]]``.

    Never a view: autograd refuses in-place changes of a custom Function's outputs that are views,
    and the direct call's outputs take them (``image_embeds *= scale``). An output that travels as
    elements of its own width (floats; integers in their own dtype) is the ``cat`` of its flat
    pieces into it (a view of each piece at the output's shape first cost 0.5 ms an output of 239
    pieces, this 0.08-0.10); a float carried wider is cast from their ``cat``, an integer carried
    wider unpacked from it and copied once more.
    """
    if chunks[0].dtype == like.dtype:  # joined straight into the output: a view of it would be one
        output = like.new_empty((sum(rows), *like.shape[1:]))
        torch.cat(list(chunks), out=output.view(-1))
        return output
    if _is_float(like.dtype):  # floats carried wider: the cast is the copy
        joined = _cast(torch.cat(list(chunks)).view(sum(rows), *like.shape[1:]), like.dtype)
        return joined.clone() if joined._is_view() else joined
    unpacked = unpack_rows(torch.cat(list(chunks)), sum(rows), like)
    return unpacked.clone() if unpacked._is_view() else unpacked


def unpack_return(
    back: torch.Tensor, leaves: Sequence[torch.Tensor], layout: ReturnLayout, elements: Sequence[int]
) -> list[torch.Tensor]:
    """The inverse of :func:`pack_return` on the receiving side: each token output's rows of this
    rank's images, in their original order, from the received buffer ``back``.

    Every output is made from ``back`` (also with zero rows), so the rank's loss reaches the return
    exchange, whose backward is a collective every rank must join.

    Args:
        back: ``[sum(layout.receive_splits)]`` transit values, from worker rank 0 first.
        leaves: The outputs that travel back this rank's ViT made (for their dtypes and trailing shapes).
        layout: The return layout.
        elements: Transit elements per row of each output (see :func:`elements_per_row`).
    """
    likes = [leaf.detach() for leaf in leaves]
    return list(_UnpackFunction.apply(back, layout, list(elements), *likes))
