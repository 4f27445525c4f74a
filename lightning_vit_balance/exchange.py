"""All torch.distributed communication of the balancer: the metadata gather and all_to_all trips.

One balanced ViT call talks to the other ranks at most three times (gather, forward trip, return
trip); a skipped call once (the gather). Everything the trips need (split sizes, the order of
images in the balanced batch) is derived from the gathered grid rows and the
:class:`~lightning_vit_balance.planning.RebalancePlan`, which every rank computes identically, so
no sizes are exchanged in between.

The metadata gather doubles as the error channel: each rank validates its own input first and
puts a status code and a few integers of detail in its header, so that bad input on one rank
raises the same ``ValueError`` on every rank instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from lightning_vit_balance.planning import RebalancePlan

__all__ = [
    "DTYPES",
    "HEADER_FIELDS",
    "ExchangeRoute",
    "InputProblem",
    "RankMetadata",
    "all_to_all",
    "collective_device",
    "describe_problem",
    "device_problem",
    "gather_metadata",
]

#: Floating and integer dtypes a rank can report in its header, by code (index in this tuple).
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)

#: Layout of the int64 header each rank contributes to the metadata gather; grid rows follow it.
HEADER_FIELDS: tuple[str, ...] = (
    "status",
    "num_images",
    "channels",
    "dtype_code",
    "requires_grad",
    "detail0",
    "detail1",
    "detail2",
    "detail3",
)
_HEADER_LEN = len(HEADER_FIELDS)
_NUM_DETAILS = 4
_DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda", "meta", "other")


class InputProblem(IntEnum):
    """Status codes of a rank's input, carried in the metadata gather (0 = valid)."""

    OK = 0
    GRID_NOT_TENSOR = 1
    GRID_SHAPE = 2
    GRID_DTYPE = 3
    GRID_VALUE = 4
    PIXELS_NOT_TENSOR = 5
    PIXELS_SHAPE = 6
    PIXELS_DTYPE = 7
    PIXEL_ROWS = 8
    NOT_DIVISIBLE = 9
    DEVICE = 10
    CHANNELS_MISMATCH = 11
    DTYPE_MISMATCH = 12


def _dtype_name(code: int) -> str:
    return str(DTYPES[code]) if 0 <= code < len(DTYPES) else "an unsupported dtype"


def _device_name(code: int) -> str:
    return _DEVICE_TYPES[code] if 0 <= code < len(_DEVICE_TYPES) else "unknown"


def describe_problem(code: int, details: Sequence[int]) -> str:
    """Human-readable text of a status code and its details; the same string on every rank."""
    d = list(details) + [0] * (_NUM_DETAILS - len(details))
    problem = InputProblem(code)
    if problem is InputProblem.GRID_NOT_TENSOR:
        return "grid_thw is not a torch.Tensor: expected an integer tensor of shape [n_images, 3]"
    if problem is InputProblem.GRID_SHAPE:
        shape = [s for s in d[1 : 1 + d[0]]] if 0 <= d[0] <= 3 else []
        more = "" if d[0] <= 3 else f" ({d[0]} dims)"
        return f"grid_thw has shape {tuple(shape)}{more}: expected [n_images, 3]"
    if problem is InputProblem.GRID_DTYPE:
        return f"grid_thw has dtype {_dtype_name(d[0])}: expected an integer dtype (int32 or int64)"
    if problem is InputProblem.GRID_VALUE:
        return (
            f"grid_thw[{d[0]}] = {[d[1], d[2], d[3]]}: expected positive integers (T, H, W) for every image"
        )
    if problem is InputProblem.PIXELS_NOT_TENSOR:
        return "pixel_values is not a torch.Tensor: expected a float tensor of shape [sum(T*H*W), C]"
    if problem is InputProblem.PIXELS_SHAPE:
        return f"pixel_values has {d[0]} dims: expected a 2-D tensor [sum(T*H*W), C]"
    if problem is InputProblem.PIXELS_DTYPE:
        return f"pixel_values has dtype {_dtype_name(d[0])}: expected a floating-point dtype"
    if problem is InputProblem.PIXEL_ROWS:
        return f"pixel_values has {d[0]} rows: expected sum(T*H*W) over grid_thw = {d[1]}"
    if problem is InputProblem.NOT_DIVISIBLE:
        return (
            f"grid_thw[{d[0]}] has H={d[1]}, W={d[2]}: expected both divisible by the ViT's "
            f"spatial merge size {d[3]}"
        )
    if problem is InputProblem.DEVICE:
        if d[0] == d[1]:
            return (
                f"pixel_values is on {_device_name(d[0])}:{d[2]}: expected the current device "
                f"{_device_name(d[0])}:{d[3]}, which the process group's backend communicates on"
            )
        return (
            f"pixel_values is on a {_device_name(d[0])} device: the process group's backend "
            f"carries {_device_name(d[1])} tensors"
        )
    if problem is InputProblem.CHANNELS_MISMATCH:
        return f"pixel_values has C={d[0]} channels while rank {d[1]} has C={d[2]}: expected the same C"
    if problem is InputProblem.DTYPE_MISMATCH:
        return (
            f"pixel_values has dtype {_dtype_name(d[0])} while rank {d[1]} has {_dtype_name(d[2])}: "
            "expected the same dtype on every rank with images"
        )
    return "valid input"


@dataclass(frozen=True)
class RankMetadata:
    """What the metadata gather says about one rank's input.

    Attributes:
        status: An :class:`InputProblem` code, 0 when the input is valid.
        details: Integers describing the problem (see :func:`describe_problem`).
        channels: ``C`` of ``pixel_values``.
        dtype_code: Index of ``pixel_values.dtype`` in :data:`DTYPES` (-1: not a listed dtype).
        requires_grad: Whether ``pixel_values`` requires grad.
        grids: ``(T, H, W)`` of every image, in the rank's order (empty when the input is invalid).
    """

    status: int
    details: tuple[int, ...]
    channels: int
    dtype_code: int
    requires_grad: bool
    grids: tuple[tuple[int, int, int], ...]

    @property
    def patch_counts(self) -> tuple[int, ...]:
        """``T*H*W`` of every image."""
        return tuple(t * h * w for t, h, w in self.grids)


def _backend_device_type(group: Any) -> str | None:
    """The device type the group's backend carries for our tensors, or None when any will do."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:  # e.g. "cpu:gloo,cuda:nccl": several backends, each device type is carried
        return None
    if backend == "nccl":
        return "cuda"
    if backend == "gloo":
        return "cpu"
    return None


def collective_device(group: Any, preferred: torch.device | None) -> torch.device:
    """Device for this group's collective buffers: ``preferred`` when the backend carries it.

    NCCL communicates CUDA tensors of the current device and gloo's all_to_all CPU tensors; other
    backends take the preferred device (the device of ``pixel_values``).
    """
    wanted = _backend_device_type(group)
    if wanted == "cuda":
        # Pixels on another device are reported by device_problem; the gather must still work.
        return torch.device("cuda", torch.cuda.current_device())
    if preferred is not None and preferred.type != "meta" and (wanted is None or preferred.type == wanted):
        return preferred
    return torch.device("cpu")


def device_problem(group: Any, device: torch.device) -> tuple[int, ...] | None:
    """Details for :attr:`InputProblem.DEVICE` when ``device`` cannot be exchanged, else None."""
    wanted = _backend_device_type(group)
    code = _DEVICE_TYPES.index(device.type) if device.type in _DEVICE_TYPES else 3
    if device.type == "meta" or (wanted is not None and device.type != wanted):
        wanted_code = _DEVICE_TYPES.index(wanted) if wanted in _DEVICE_TYPES else 3
        return (code, wanted_code)
    if wanted == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return (code, code, device.index, torch.cuda.current_device())
    return None


def gather_metadata(
    local: RankMetadata,
    *,
    capacity: int,
    device: torch.device,
    group: Any,
) -> tuple[tuple[RankMetadata, ...], int]:
    """All-gather every rank's header and grid rows.

    One all_gather of ``HEADER + capacity * 3`` int64 values per rank; when some rank has more
    than ``capacity`` images, one more all_gather sized to the largest image count.

    Args:
        local: This rank's metadata, as validated locally (``grids`` empty when ``status`` is
            not OK; up to four ``details``).
        capacity: Grid rows per rank carried by the first all_gather.
        device: Where to put the buffers (see :func:`collective_device`).
        group: The process group.

    Returns:
        Every rank's metadata in rank order (``details`` padded to four), and the number of
        collectives issued (1 or 2).
    """
    world = dist.get_world_size(group)
    grids = local.grids
    detail_values = [int(v) for v in local.details][:_NUM_DETAILS]
    detail_values += [0] * (_NUM_DETAILS - len(detail_values))
    header = [
        int(local.status),
        len(grids),
        int(local.channels),
        int(local.dtype_code),
        int(local.requires_grad),
        *detail_values,
    ]
    flat_grids = [int(v) for row in grids for v in row]
    first = torch.zeros(_HEADER_LEN + 3 * capacity, dtype=torch.int64)
    first[:_HEADER_LEN] = torch.tensor(header, dtype=torch.int64)
    carried = min(len(grids), capacity)
    if carried:
        first[_HEADER_LEN : _HEADER_LEN + 3 * carried] = torch.tensor(flat_grids[: 3 * carried])
    first = first.to(device)
    gathered = [torch.empty_like(first) for _ in range(world)]
    dist.all_gather(gathered, first, group=group)
    rows = torch.stack(gathered).cpu().tolist()
    collectives = 1
    counts = [row[1] for row in rows]
    if max(counts) > capacity:
        # Rare: some rank has more images than the first gather carries; gather them all once more.
        largest = max(counts)
        second = torch.zeros(3 * largest, dtype=torch.int64)
        if flat_grids:
            second[: len(flat_grids)] = torch.tensor(flat_grids)
        second = second.to(device)
        more = [torch.empty_like(second) for _ in range(world)]
        dist.all_gather(more, second, group=group)
        grid_values = [row for row in torch.stack(more).cpu().tolist()]
        collectives += 1
    else:
        grid_values = [row[_HEADER_LEN:] for row in rows]
    metadata = []
    for row, values in zip(rows, grid_values):
        n = row[1] if row[0] == InputProblem.OK else 0
        metadata.append(
            RankMetadata(
                status=row[0],
                details=tuple(row[5 : 5 + _NUM_DETAILS]),
                channels=row[2],
                dtype_code=row[3],
                requires_grad=bool(row[4]),
                grids=tuple((values[3 * i], values[3 * i + 1], values[3 * i + 2]) for i in range(n)),
            )
        )
    return tuple(metadata), collectives


class _AllToAllFunction(torch.autograd.Function):
    """``all_to_all_single`` along dim 0; its backward is the inverse exchange (splits swapped)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        tensor: torch.Tensor,
        send_splits: list[int],
        receive_splits: list[int],
        group: Any,
    ) -> torch.Tensor:
        ctx.send_splits = send_splits
        ctx.receive_splits = receive_splits
        ctx.group = group
        return _exchange(tensor, send_splits, receive_splits, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        grad = _exchange(grad_output, ctx.receive_splits, ctx.send_splits, ctx.group)
        return grad, None, None, None


def _exchange(
    tensor: torch.Tensor, send_splits: list[int], receive_splits: list[int], group: Any
) -> torch.Tensor:
    tensor = tensor.contiguous()
    output = tensor.new_empty((sum(receive_splits), *tensor.shape[1:]))
    dist.all_to_all_single(
        output, tensor, output_split_sizes=receive_splits, input_split_sizes=send_splits, group=group
    )
    return output


def all_to_all(
    tensor: torch.Tensor,
    send_splits: Sequence[int],
    receive_splits: Sequence[int],
    group: Any,
    *,
    differentiable: bool,
) -> torch.Tensor:
    """Exchange rows of ``tensor`` with every rank in one ``all_to_all_single``.

    Args:
        tensor: ``[sum(send_splits), ...]``: rows for rank 0 first, then rank 1, ...
        send_splits: Rows this rank sends to each rank (its own included).
        receive_splits: Rows this rank receives from each rank.
        group: The process group.
        differentiable: Record the exchange for autograd, so that the backward pass sends the
            gradients back along the inverse route. Must be the same on every rank, because the
            backward exchange is a collective too: a tensor that does not require grad is then
            replaced by an (equal-valued) leaf that does, so every rank takes part.

    Returns:
        ``[sum(receive_splits), ...]``, rows from rank 0 first, then rank 1, ... on ``tensor``'s device.
    """
    send = [int(s) for s in send_splits]
    receive = [int(s) for s in receive_splits]
    if not differentiable:
        with torch.no_grad():
            return _exchange(tensor, send, receive, group)
    if not tensor.requires_grad:
        tensor = tensor.detach().requires_grad_(True)
    return _AllToAllFunction.apply(tensor, send, receive, group)


@dataclass(frozen=True)
class ExchangeRoute:
    """Where this rank's images go and which images it encodes, from a plan.

    Attributes:
        rank: This rank.
        send_order: Indices of this rank's images in sending order (by destination rank, then index).
        destinations: Destination rank of each of this rank's images, in the rank's order.
        arrivals: ``(source_rank, image_index)`` of each image this rank encodes (balanced-batch order).
        send_patches: Pixel rows sent to each rank.
        receive_patches: Pixel rows received from each rank.
    """

    rank: int
    send_order: tuple[int, ...]
    destinations: tuple[int, ...]
    arrivals: tuple[tuple[int, int], ...]
    send_patches: tuple[int, ...]
    receive_patches: tuple[int, ...]

    @classmethod
    def from_plan(cls, plan: RebalancePlan, rank: int) -> ExchangeRoute:
        """This rank's route under ``plan``."""
        destinations = plan.destinations[rank]
        return cls(
            rank=rank,
            send_order=tuple(sorted(range(len(destinations)), key=lambda i: (destinations[i], i))),
            destinations=tuple(destinations),
            arrivals=plan.arrivals(rank),
            send_patches=plan.send_patches(rank),
            receive_patches=plan.receive_patches(rank),
        )
