"""All torch.distributed communication of the balancer, and the values that size it.

One applied balanced call talks to the other ranks four times: the metadata gather, the forward
(pixel) trip, a tiny status gather after the ViT, and the return trip; a skipped call once (the
gather). Everything the trips need (split sizes, the order of images in the balanced batch, where
each output row goes) is derived from the gathered grid rows and the
:class:`~lightning_vit_balance.planning.RebalancePlan`, which every rank computes identically, so
no sizes are exchanged in between. The pieces:

* :func:`gather_metadata`: every rank's grid rows, input status and configuration fingerprint.
* :func:`start_pixel_trip`: the forward trip, straight into the balanced batch (rows that stay home
  skip the collective); :func:`all_to_all`: the autograd-aware exchange of the return trip.
* :class:`ExchangeRoute` / :class:`PixelTrip` / :class:`ReturnLayout`: pure values saying what goes
  where, each way.
* The return buffer's contents (which outputs, in which dtype, packed how) are
  :mod:`lightning_vit_balance.wire`'s: no communication there.
* :func:`exchange_status`: after the ViT, every rank learns whether any
  rank's ViT raised or made outputs that do not fit, before anything waits on those outputs.
* :func:`start_row_gather`: the small gathers' one collective, in ``ceil(log2 P)`` rounds of
  messages for host rows on many ranks.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, groupby, pairwise
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from lightning_vit_balance.caching import cached_value
from lightning_vit_balance.config import stable_digest
from lightning_vit_balance.planning import RebalancePlan
from lightning_vit_balance.problems import DEVICE_TYPES, MAX_DETAILS, InputProblem

__all__ = [
    "DOUBLING_FROM_RANKS",
    "GATHER_CAPACITY",
    "HISTORY_BITS",
    "OUT_OF_STEP",
    "STATUS_WORD",
    "ExchangeRoute",
    "LeafSignature",
    "PendingExchange",
    "PixelTrip",
    "RankMetadata",
    "ReceivePieces",
    "ReturnLayout",
    "SendPieces",
    "StatusReport",
    "TripPieces",
    "TripTimer",
    "ViTStatus",
    "all_to_all",
    "backend_device_type",
    "backend_errors_explained",
    "collective_device",
    "current_group",
    "device_problem",
    "exchange_status",
    "fill_rows",
    "forget_finished_gathers",
    "gather_host_values",
    "gather_metadata",
    "gather_objects",
    "grid_rows",
    "grid_runs",
    "grid_steps",
    "host_device",
    "host_to_device",
    "metadata_of_rows",
    "metadata_row",
    "require_member",
    "row_runs",
    "rows_per_image",
    "sharded_grads_all_zero",
    "split_rows",
    "start_pixel_trip",
    "start_row_gather",
    "take_rows",
]

#: Runs of equal grid rows per rank the metadata gather carries (see :func:`grid_runs`); a rank with
#: more costs one more gather. A package constant, not a setting: ranks whose settings differ must
#: still meet in a gather of one size, to learn that they differ.
GATHER_CAPACITY = 64
#: From this many ranks, gathers of host (CPU) rows take ``ceil(log2 P)`` rounds of messages instead
#: of gloo's ring of ``P - 1`` hops (:func:`start_row_gather`). Modelled, not measured on a cluster:
#: a hop costs 10-30 us of network latency, a round that plus 40-80 us of Python (80 measured on the
#: slow 2-core development machine), so the two tie at about 10-30 ranks, and at 512 ranks the rounds
#: wait for 9 latencies instead of 511. On that machine the rounds took 1.8-2.9x less wall time from 4
#: to 32 ranks, its cores shared by every rank (BENCHMARKS.md, "Host gathers on many ranks").
DOUBLING_FROM_RANKS = 16
#: Tags of the doubling rounds' messages (plus the round's distance): apart from a user's own.
_DOUBLING_TAG = 0x56425400
#: The input status codes a metadata row may hold (:func:`_refuse_rows_of_other_gathers`).
_PROBLEM_CODES = np.asarray([int(problem) for problem in InputProblem], dtype=np.int64)
#: Fixed header fields before the fingerprint and the grid runs in each rank's gather row.
_HEADER_FIELDS = ("status", "num_runs", "channels", "dtype_code", "requires_grad", "vit_us")
_DETAILS_AT = len(_HEADER_FIELDS)
_FINGERPRINT_AT = _DETAILS_AT + MAX_DETAILS
#: Bytes of one rank's detailed status, gathered only when some rank's ViT failed.
_DETAIL_BYTES = 2048
_MESSAGE_CHARS = 600
#: Characters of an output's path in a status with more outputs than fit (see ``ViTStatus.encode``).
_PATH_CHARS = 200


@dataclass(frozen=True)
class RankMetadata:
    """What the metadata gather says about one rank's input.

    Attributes:
        status: An :class:`~lightning_vit_balance.problems.InputProblem` code, 0 when valid.
        details: The problem's detail integers (see :data:`~lightning_vit_balance.problems.PROBLEMS`).
        channels: ``C`` of ``pixel_values``.
        dtype_code: Index of ``pixel_values.dtype`` in ``DTYPES`` (-1: not a listed dtype).
        requires_grad: Whether ``pixel_values`` requires grad.
        grids: ``(T, H, W)`` of every image, in the rank's order (empty when the input is invalid).
        fingerprint: One integer per setting that shapes the plan or the exchange (see
            ``ViTBalanceConfig.fingerprint``); every rank must send the same.
        vit_us: Microseconds this rank's ViT took in its previous applied call (-1: none yet).
    """

    status: int
    details: tuple[int, ...]
    channels: int
    dtype_code: int
    requires_grad: bool
    grids: tuple[tuple[int, int, int], ...]
    fingerprint: tuple[int, ...] = ()
    vit_us: int = -1

    @cached_value
    def patch_counts(self) -> tuple[int, ...]:
        """``T*H*W`` of every image (computed once: the balancer reads it per arriving image)."""
        return tuple(t * h * w for t, h, w in self.grids)

    @classmethod
    def read(cls, values: tuple[Any, ...], patch_counts: tuple[int, ...]) -> RankMetadata:
        """A rank's metadata as :func:`metadata_of_rows` read it: ``values`` in field order, of the
        fields' types, and its ``patch_counts``. It sets the fields at once, where the frozen
        dataclass's ``__init__`` sets them one by one through ``object.__setattr__``: a third of
        the time, a millisecond per call on 1,024 ranks."""
        metadata = object.__new__(cls)
        metadata.__dict__.update(zip(_FIELD_NAMES, values))
        # The cached value's slot (see caching.cached_value).
        metadata.__dict__["patch_counts"] = patch_counts
        return metadata

    def frames_as_items(self) -> RankMetadata:
        """The same rows with each video's temporal steps as images of their own: a grid row
        ``(T, H, W)`` becomes ``T`` rows ``(1, H, W)``, in order (a video's patch rows run step by
        step, so each step's rows stay contiguous). See ``ViTBalanceConfig.split_videos``."""
        if all(t == 1 for t, _, _ in self.grids):
            return self
        items: list[tuple[int, int, int]] = []
        for t, h, w in self.grids:
            items += [(1, h, w)] * t  # one tuple shared by the steps: copies of a pointer, in C
        return dataclasses.replace(self, grids=tuple(items))


#: :class:`RankMetadata`'s fields, in order (what :meth:`RankMetadata.read` takes).
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(RankMetadata))


def grid_rows(grid_thw: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """A ``[n, 3]`` integer ``grid_thw`` as ``(T, H, W)`` tuples, the form :attr:`RankMetadata.grids`
    holds (reads the values: a device-to-host copy for a grid on a device)."""
    return tuple((int(t), int(h), int(w)) for t, h, w in grid_thw.tolist())


def grid_steps(grid_thw: torch.Tensor) -> torch.Tensor:
    """A ``[n, 3]`` integer ``grid_thw`` with each temporal step as a row of its own: ``(T, H, W)``
    becomes ``T`` rows ``(1, H, W)``, in order, on the grid's device (the tensor form of
    :meth:`RankMetadata.frames_as_items`; what GLM-4.xV models pass their towers for videos).
    A grid with a ``T < 1`` comes back as it is, for the input checks to name."""
    if bool((grid_thw[:, 0] < 1).any()):
        return grid_thw
    steps = grid_thw.repeat_interleave(grid_thw[:, 0], dim=0)
    steps[:, 0] = 1
    return steps


_Count = TypeVar("_Count", int, np.ndarray)


def rows_per_image(kind: str, patch_count: _Count, merge_size: int) -> _Count:
    """Rows an image of ``patch_count`` patches has in an output of ``kind`` ("patch", "merged" or
    "image"); elementwise for an ``[n]`` int64 array of patch counts."""
    if kind == "image":
        return np.ones_like(patch_count) if isinstance(patch_count, np.ndarray) else 1
    return patch_count if kind == "patch" else patch_count // (merge_size * merge_size)


# -- devices --------------------------------------------------------------------------------------


def current_group(group: Any = None) -> Any:
    """``group``, or for ``None`` the default group that exists now (``None`` where none does). A
    default group destroyed and initialised again is another object: what keeps state per group
    tells them apart by it."""
    if group is not None or not dist.is_available():
        return group
    return dist.group.WORLD


def require_member(group: Any, argument: str) -> None:
    """Raise where ``group`` is not a process group that holds this process (None, the default
    group, passes): ``dist.new_group`` returns a placeholder (``GroupMember.NON_GROUP_MEMBER``) on
    the ranks it leaves out, which torch's collectives refuse with a message that names neither the
    argument nor the cause."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{argument} is a group that does not hold this process (global rank {dist.get_rank()}): "
            "dist.new_group returns that placeholder on the ranks it leaves out. Expected the "
            "data-parallel group this rank belongs to, on every rank (each rank passes its own)."
        )
    raise TypeError(
        f"{argument}={group!r} is invalid: expected a torch.distributed ProcessGroup (the "
        "data-parallel group, the same on every rank) or None for the default group."
    )


def backend_device_type(group: Any) -> str | None:
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
    wanted = backend_device_type(group)
    if wanted == "cuda":
        # Pixels on another device are reported by device_problem; the gather must still work.
        return torch.device("cuda", torch.cuda.current_device())
    if preferred is not None and preferred.type != "meta" and (wanted is None or preferred.type == wanted):
        return preferred
    return torch.device("cpu")


def host_device(group: Any) -> torch.device:
    """Where small host-side values (status words) travel: CPU unless the backend carries only CUDA."""
    if backend_device_type(group) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def host_to_device(
    values: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A small host tensor (``dtype``: cast first) on ``device``, without making the host wait.

    A plain ``.to("cuda")`` of pageable memory waits for every kernel already queued on the stream
    before it copies, so the host stops running ahead of the GPU in the middle of the forward.
    Staged in pinned memory the copy is queued like a kernel; the caching host allocator keeps the
    pinned buffer alive until the copy has run.
    """
    values = values if dtype is None else values.to(dtype)
    if device.type != "cuda" or values.device.type != "cpu":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def device_problem(group: Any, device: torch.device) -> tuple[int, ...] | None:
    """Detail integers of a device problem when ``device`` cannot be exchanged, else None.

    The details are ``(have_device, want_device, have_index, want_index)``.
    """
    wanted = backend_device_type(group)
    code = DEVICE_TYPES.index(device.type) if device.type in DEVICE_TYPES else 3
    if device.type == "meta" or (wanted is not None and device.type != wanted):
        wanted_code = DEVICE_TYPES.index(wanted) if wanted in DEVICE_TYPES else 3
        return (code, wanted_code, 0, 0)
    if wanted == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return (code, code, device.index, torch.cuda.current_device())
    return None


# -- the metadata gather --------------------------------------------------------------------------


def grid_runs(grids: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """``grids`` as runs ``(count, T, H, W)`` of equal rows one after another: the metadata
    gather's form. A video passed one row per temporal step, or pages of one size, are one run."""
    return [(sum(1 for _ in alike), *row) for row, alike in groupby(grids)]


def metadata_row(
    local: RankMetadata, runs: Sequence[tuple[int, int, int, int]], capacity: int
) -> torch.Tensor:
    """One rank's row of the metadata gather (``[header + fingerprint + 4 * capacity]`` int64): the
    header fields, the details padded to four, the fingerprint, then up to ``capacity`` of
    ``runs`` (:func:`grid_runs` of ``local.grids``), zero padded. :func:`metadata_of_rows` reads
    every rank's back."""
    details = [int(v) for v in local.details][:MAX_DETAILS]
    details += [0] * (MAX_DETAILS - len(details))
    header = [
        int(local.status),
        len(runs),
        int(local.channels),
        int(local.dtype_code),
        int(local.requires_grad),
        int(local.vit_us),
        *details,
        *(int(v) for v in local.fingerprint),
    ]
    row = torch.zeros(len(header) + 4 * capacity, dtype=torch.int64)
    row[: len(header)] = torch.tensor(header, dtype=torch.int64)
    carried = min(len(runs), capacity)
    if carried:
        row[len(header) : len(header) + 4 * carried] = _run_tensor(runs[:carried])
    return row


def _run_tensor(runs: Sequence[tuple[int, int, int, int]]) -> torch.Tensor:
    """``[4 * len(runs)]`` int64 values (through numpy: much faster than torch.tensor on tuples)."""
    return torch.from_numpy(np.asarray(runs, dtype=np.int64).reshape(-1))


#: The latest row gathers, their works and buffers with them (see :func:`_kept_until_later`).
_RECENT_GATHERS: collections.deque[Any] = collections.deque(maxlen=2)


def _kept_until_later(gather: Any) -> None:
    """Keep a finished ``gather`` (its works and buffers) until later ones push it out.

    Gloo's worker thread lets go of a work a moment after ``wait()`` returns. Where Python has let
    go of the work and its tensors first, the worker frees them, which takes the GIL: if the
    interpreter is exiting by then (a gather the last collective, as ``check_pending`` makes at a
    loop's end) the process aborts ("terminate called without an active exception", torch 2.13:
    8 of 59 runs of a loop ending so). Kept here, Python frees them later (a few KB each).
    """
    _RECENT_GATHERS.append(gather)


def _top_saved_tensor_hooks() -> Any:
    """The top of torch's (private) saved-tensor hook stack, None when it is empty; later releases
    take ``ignore_is_tracing``."""
    top = torch._C._autograd._top_saved_tensors_default_hooks
    try:
        return top(False)
    except TypeError:
        return top()


@contextlib.contextmanager
def _saved_tensor_hooks_set_aside() -> Iterator[None]:
    """Start collectives here that :func:`_kept_until_later` keeps: a work captures the thread's
    autograd state, and the saved-tensor hooks in it (non-reentrant activation checkpointing's)
    hold the checkpointed call's inputs, which a kept work then held into the next step (a skipped
    call's pixel rows: a whole batch). Through torch's private hook stack, where it is as this
    torch has it; elsewhere the works are started as they are."""
    autograd = torch._C._autograd
    held: list[Any] = []
    try:
        # Disabled (disable_saved_tensors_hooks): nothing could be put back, and the stack is empty.
        if autograd._saved_tensors_hooks_get_disabled_error_message() is None:
            while (top := _top_saved_tensor_hooks()) is not None:
                held.append(top)
                autograd._pop_saved_tensors_default_hooks()
    except (AttributeError, TypeError, RuntimeError):
        pass  # another torch's private API: the hooks taken so far go back
    try:
        yield
    finally:
        for pack, unpack in reversed(held):
            autograd._push_saved_tensors_default_hooks(pack, unpack)


def forget_finished_gathers() -> None:
    """Let go of the gathers :func:`_kept_until_later` keeps: before a group is destroyed, whose
    works would keep its connections open (a gloo twin's sockets, ``P + 3`` files)."""
    _RECENT_GATHERS.clear()


class _RingRows:
    """``dist.all_gather`` of one row per rank, started asynchronously (NCCL's or gloo's ring)."""

    def __init__(self, row: torch.Tensor, group: Any) -> None:
        self._gathered = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
        with _saved_tensor_hooks_set_aside():
            self._work = dist.all_gather(self._gathered, row, group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        self._work.wait()
        _kept_until_later(self)
        return torch.stack(self._gathered)


class _DoublingRows:
    """Bruck's all-gather of one row per rank, from point-to-point messages: ``ceil(log2 P)`` rounds.

    After round ``r`` a rank holds the rows of ranks ``rank, rank + 1, ... rank + 2**(r+1) - 1``
    (mod ``P``): in each round it sends the rows it holds (as many as the others still lack) to
    ``rank - 2**r`` and receives as many from ``rank + 2**r``. The first round is posted at once,
    so :meth:`wait` can come later, as with an asynchronous ``all_gather``.
    """

    def __init__(self, row: torch.Tensor, group: Any) -> None:
        self._group = current_group(group)
        self._world, self._rank = dist.get_world_size(group), dist.get_rank(group)
        self._rows = row.new_empty((self._world, *row.shape))  # [P, *row.shape], this rank's first
        self._rows[0] = row
        self._held = 1
        self._round = self._post_round() if self._world > 1 else ([], 0)

    def _post_round(self) -> tuple[list[Any], int]:
        held, world = self._held, self._world
        count = min(held, world - held)
        to_rank = dist.get_global_rank(self._group, (self._rank - held) % world)
        from_rank = dist.get_global_rank(self._group, (self._rank + held) % world)
        tag = _DOUBLING_TAG + held
        with _saved_tensor_hooks_set_aside():
            requests = [
                dist.isend(self._rows[:count], to_rank, group=self._group, tag=tag),
                dist.irecv(self._rows[held : held + count], from_rank, group=self._group, tag=tag),
            ]
        return requests, count

    def wait(self) -> torch.Tensor:
        while self._held < self._world:
            requests, count = self._round
            for request in requests:
                request.wait()
            self._held += count
            if self._held < self._world:
                self._round = self._post_round()
        _kept_until_later(self)
        # Row i holds rank (rank + i) mod P's: put them in rank order.
        return torch.roll(self._rows, self._rank, 0)


def start_row_gather(row: torch.Tensor, group: Any) -> _RingRows | _DoublingRows:
    """Start gathering one equal-shaped ``row`` from every rank of ``group``; ``wait()`` returns
    them stacked in rank order (``[P, *row.shape]``).

    Host (CPU) rows on :data:`DOUBLING_FROM_RANKS` ranks or more take Bruck's doubling rounds
    (:class:`_DoublingRows`); others one ``all_gather``. Gloo's all_gather is a ring: each of its
    ``P - 1`` hops waits for the one before, so on 512 ranks a gather of a few bytes waits for 511
    network latencies, twice per balanced call (metadata and status). NCCL's gathers stay as they
    are (device buffers; its own algorithms).
    """
    if row.device.type == "cpu" and dist.get_world_size(group) >= DOUBLING_FROM_RANKS:
        return _DoublingRows(row, group)
    return _RingRows(row, group)


def gather_metadata(
    local: RankMetadata,
    *,
    capacity: int = GATHER_CAPACITY,
    device: torch.device,
    group: Any,
) -> tuple[tuple[RankMetadata, ...], int]:
    """All-gather every rank's header, fingerprint and grid rows (as runs of equal rows, see
    :func:`grid_runs`).

    One all_gather of ``header + fingerprint + capacity * 4`` int64 values per rank; when some rank
    has more than ``capacity`` runs, one more all_gather sized to the most runs. Every rank must
    pass the same ``capacity`` and a fingerprint of the same length.

    Args:
        local: This rank's metadata, as validated locally (``grids`` empty when ``status`` is
            not OK; up to four ``details``).
        capacity: Runs of grid rows per rank carried by the first all_gather.
        device: Where to put the buffers (see :func:`collective_device`).
        group: The process group.

    Returns:
        Every rank's metadata in rank order (``details`` padded to four), and the number of
        collectives issued (1 or 2).
    """
    runs = grid_runs(local.grids)
    gathered = _gathered_array(metadata_row(local, runs, capacity), device, group)
    _refuse_rows_of_other_gathers(gathered)
    grids_at = _FINGERPRINT_AT + len(local.fingerprint)
    most_runs = int(gathered[:, 1].max())
    collectives = 1
    if most_runs > capacity:
        # Rare: some rank has more runs than the first gather carries; gather them all once more.
        second = torch.zeros(4 * most_runs, dtype=torch.int64)
        if runs:
            second[: 4 * len(runs)] = _run_tensor(runs)
        grid_values = _gathered_array(second, device, group)
        collectives += 1
    else:
        grid_values = gathered[:, grids_at:]
    return metadata_of_rows(gathered[:, :grids_at], grid_values), collectives


def _refuse_rows_of_other_gathers(gathered: np.ndarray) -> None:
    """Raise where a gathered row is no :func:`metadata_row`: a rank in another gather of the group
    (the status gather of a call given a plan made before it, while this rank starts a call), whose
    row gloo delivered into this gather's. Before the runs are read: a status word's output digest
    read as a count of runs made a second gather of billions of values."""
    statuses, runs = gathered[:, 0], gathered[:, 1]
    other = ~np.isin(statuses, _PROBLEM_CODES) | (runs < 0) | (runs >= 2**31)
    if other.any():
        raise RuntimeError(
            f"ranks {np.flatnonzero(other).tolist()} sent rows that are no balanced call's metadata: "
            "they were in another gather of the group (the status gather of a call given a plan made "
            "before it, or the gather of another balancer on the same group)"
        )


def gather_host_values(values: Sequence[int], group: Any) -> np.ndarray:
    """Every rank's ``values`` (ints, as many on every rank) as a ``[P, len(values)]`` array in
    rank order: one gather of host values over ``group`` (a gloo group, or its twin)."""
    return _gathered_array(torch.tensor(list(values), dtype=torch.int64), host_device(group), group)


def gather_objects(value: Any) -> list[Any]:
    """Every process's picklable ``value`` over the whole world, in rank order: the agreement of
    setup code (which twins to make, which failed), never a step's (it pickles, and syncs)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def sharded_grads_all_zero(params: Sequence[torch.Tensor]) -> list[bool]:
    """Whether the gradient of each of ``params`` (``DTensor`` parameters, FSDP2's shards) holds
    zeros only on every rank of the parameter's device mesh (no gradient counts as zeros): the
    same answers on every rank of it.

    Every rank of each mesh must call this with the same parameters in the same order. Per mesh, in
    the order of first appearance, one all-reduce (max) of a peak per gradient over each mesh
    dimension's group, then one read of the peaks from the device.
    """
    zero = [True] * len(params)
    meshes: dict[Any, list[int]] = {}
    for index, param in enumerate(params):
        meshes.setdefault(param.device_mesh, []).append(index)  # type: ignore[attr-defined]
    for mesh, indices in meshes.items():
        peaks = _local_peaks([params[i] for i in indices])
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            # Where the backend does not carry the shards' device (FSDP2's CPU offload under NCCL).
            peaks = peaks.to(collective_device(group, peaks.device))
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
        for index, peak in zip(indices, peaks.tolist()):
            zero[index] = peak == 0.0
    return zero


@torch.no_grad()  # a DTensor's to_local outside autograd: 10-20x cheaper on the host
def _local_peaks(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The largest magnitude in this rank's shard of each of ``params``' gradients (``[n]``
    float32, on their device; zero for no gradient or an empty shard)."""
    none = torch.zeros((), dtype=torch.float32, device=params[0].device)
    peaks = []
    for param in params:
        grad = param.grad
        if hasattr(grad, "to_local"):  # a DTensor, as FSDP2 leaves it
            grad = grad.to_local()
        peaks.append(grad.abs().amax().float() if grad is not None and grad.numel() else none)
    # A NaN as infinity: a max all-reduce (gloo's) may drop a NaN from another rank.
    return torch.stack(peaks).nan_to_num(nan=math.inf)


def _gathered_array(row: torch.Tensor, device: torch.device, group: Any) -> np.ndarray:
    """Every rank's ``row`` as a ``[P, len(row)]`` array, in rank order."""
    return start_row_gather(row.to(device), group).wait().cpu().numpy()


def _shared_tuples(values: np.ndarray) -> list[tuple[int, ...]]:
    """Each row of ``values`` (``[P, n]``) as a tuple; rows equal to the first share its tuple (the
    settings fingerprint, the zero details: the same on every rank as a rule)."""
    if not len(values):
        return []
    first = tuple(values[0].tolist())
    same = (values == values[0]).all(axis=1)
    if same.all():
        return [first] * len(values)
    return [first if alike else tuple(row) for alike, row in zip(same.tolist(), values.tolist())]


def metadata_of_rows(headers: np.ndarray, grid_values: np.ndarray) -> tuple[RankMetadata, ...]:
    """Every rank's :class:`RankMetadata` from its gathered row: ``headers`` ``[P, header +
    fingerprint]`` and ``grid_values`` ``[P, 4 * runs]`` (flat ``count, T, H, W`` runs, zero
    padded).

    The runs are expanded and the patch counts multiplied out for every rank at once, in numpy;
    only the values ranks sent become Python objects. On 1,024 ranks converting the padding of
    the default capacity (seven values in eight) and expanding rank by rank took most of a
    balanced call's host work (BENCHMARKS.md, "Host work per call on many ranks").
    """
    runs = np.where(headers[:, 0] == InputProblem.OK, headers[:, 1], 0)  # [P] runs to read
    sent = np.arange(grid_values.shape[1]) < 4 * runs[:, None]  # [P, 4 * runs] values to read
    quads = grid_values[sent].reshape(-1, 4)  # [all runs, 4]: count, T, H, W, rank by rank
    grids = np.repeat(quads[:, 1:], quads[:, 0], axis=0)  # [all images, 3]
    image_ends = np.concatenate(([0], np.cumsum(quads[:, 0])))[np.cumsum(runs)]
    rows = tuple(map(tuple, grids.tolist()))  # a tuple: each rank's slice of it is one too
    patches = tuple(grids.prod(axis=1).tolist())
    starts = [0, *image_ends.tolist()]
    details = _shared_tuples(headers[:, _DETAILS_AT:_FINGERPRINT_AT])
    fingerprints = _shared_tuples(headers[:, _FINGERPRINT_AT:])
    columns = (headers[:, k].tolist() for k in range(_DETAILS_AT))  # status ... vit_us, in field order
    return tuple(
        RankMetadata.read(
            (status, detail, channels, dtype_code, bool(requires_grad), rows[start:end], fingerprint, vit_us),
            patches[start:end],
        )
        for status, _, channels, dtype_code, requires_grad, vit_us, detail, fingerprint, start, end in zip(
            *columns, details, fingerprints, starts, starts[1:]
        )
    )


# -- the autograd all_to_all ----------------------------------------------------------------------


class TripTimer(Protocol):
    """Times the trips' backward exchanges: :class:`~lightning_vit_balance.encoding.TripClock`."""

    def start(self, device: torch.device) -> None: ...

    def stop(self) -> None: ...


@contextlib.contextmanager
def _timed(timer: TripTimer | None, device: torch.device) -> Iterator[None]:
    """Brackets a backward exchange with ``timer`` (none: nothing)."""
    if timer is None:
        yield
        return
    timer.start(device)
    yield
    timer.stop()  # not reached when the exchange raised: the bracket stays open, and is dropped


#: Raised by a backward pass through the gradients of a balanced call's exchanges.
SECOND_DERIVATIVE_MESSAGE = (
    "lightning_vit_balance: a balanced ViT call has no second derivative. A gradient computed with "
    "create_graph=True (a gradient penalty on the pixel values or on the ViT's parameters) went "
    "through its exchanges, whose backward passes autograd does not record, so differentiating that "
    "gradient again would give wrong values. Compute such a penalty with the ViT called directly."
)


class _RefuseSecondDerivative(torch.autograd.Function):
    """Passes gradients on; differentiating through them raises :data:`SECOND_DERIVATIVE_MESSAGE`."""

    @staticmethod
    def forward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(grad.view_as(grad) for grad in grads)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        raise RuntimeError(SECOND_DERIVATIVE_MESSAGE)


def first_order_only(backward: Callable[..., tuple[Any, ...]]) -> Callable[..., tuple[Any, ...]]:
    """``backward`` (a raw collective autograd does not see), run without autograd; when asked to
    build a graph of it (``create_graph=True``), its gradients come back attached to a node that
    raises a clear error if differentiated: as ``torch.autograd.function.once_differentiable``
    does, on every rank alike, with a message that names the cause."""

    @functools.wraps(backward)
    def first_order(ctx: Any, *grad_outputs: Any) -> tuple[Any, ...]:
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        # Grad mode is on in a backward pass exactly with create_graph=True. Whether this rank's
        # own gradients need a graph does not tell: what arrives depends on the other ranks'.
        if not torch.is_grad_enabled():
            return grads
        at = [k for k, grad in enumerate(grads) if isinstance(grad, torch.Tensor)]
        marked = _RefuseSecondDerivative.apply(*(grads[k].detach().requires_grad_() for k in at))
        refused = list(grads)
        for k, grad in zip(at, marked):
            refused[k] = grad
        return tuple(refused)

    return first_order


class _AllToAllFunction(torch.autograd.Function):
    """``all_to_all_single`` along dim 0; its backward is the inverse exchange (splits swapped)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        tensor: torch.Tensor,
        send_splits: list[int],
        receive_splits: list[int],
        group: Any,
        out: torch.Tensor | None,
        timer: TripTimer | None,
    ) -> torch.Tensor:
        ctx.send_splits = send_splits
        ctx.receive_splits = receive_splits
        ctx.group, ctx.timer = group, timer
        return _exchange(tensor, send_splits, receive_splits, group, out)

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        with _timed(ctx.timer, grad_output.device):
            grad = _exchange_back(grad_output, ctx.receive_splits, ctx.send_splits, ctx.group)
        return grad, None, None, None, None, None


#: What the ranks are told when a balanced call's collective failed: they were out of step.
OUT_OF_STEP = (
    "every rank of the group must make the same balanced calls, in the same order, including "
    "ranks without images (zero rows and a [0, 3] grid). The usual cause is a rank that skipped "
    "the call (a text-only batch behind an `if`), called the ViT directly (a configuration with "
    "enabled=False on some ranks only), made it alone (evaluation or sample logging on one rank), "
    "started a validation after other training batches than the rest (Lightning "
    "validates at each rank's own epoch position: training loaders of different lengths per rank; "
    "validate every N batches of the fit instead, val_check_interval=N with "
    "check_val_every_n_epoch=None), ran more evaluation batches than the rest (a DistributedSampler "
    "over a dataset of another length on each rank: give every rank the same dataset, or no "
    "DistributedSampler, which the Lightning mixin encodes directly), or stopped (look for a rank "
    "that raised first)"
)


@contextlib.contextmanager
def backend_errors_explained(what: str, advice: str = "") -> Iterator[None]:
    """Around a collective a rank out of step meets first (``what``): gloo's or NCCL's error for a
    collective that failed (a timeout, a closed connection, a size mismatch: a plain
    ``RuntimeError`` or a ``DistError``) raised again, of its type for loops that catch the
    backend's errors, with ``advice`` and the usual causes (also this package's own
    ``RuntimeError`` for rows of another gather, :func:`gather_metadata`'s). Others (out of memory,
    a device's ``AcceleratorError``, ``NotImplementedError``) are not the collective's: they pass
    as they are."""
    try:
        yield
    except RuntimeError as error:
        if type(error) is not RuntimeError and not isinstance(error, dist.DistError):
            raise
        raise type(error)(
            f"ViTBalancer: {what} failed on this rank ({error}): {advice}{OUT_OF_STEP}."
        ) from error


def _exchange_back(
    grad: torch.Tensor, send_splits: list[int], receive_splits: list[int], group: Any
) -> torch.Tensor:
    """A backward pass's exchange of gradients: where it fails (a rank's backward met another
    collective, or none), the rank stuck in it is told why as the ranks that failed first are."""
    with backend_errors_explained(
        "the backward pass of a balanced call",
        "a rank that ran it while the others made another call, or that skipped it, leaves them waiting; ",
    ):
        return _exchange(grad, send_splits, receive_splits, group)


def _exchange(
    tensor: torch.Tensor,
    send_splits: list[int],
    receive_splits: list[int],
    group: Any,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    tensor = tensor.contiguous()
    output = out if out is not None else tensor.new_empty((sum(receive_splits), *tensor.shape[1:]))
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
    out: torch.Tensor | None = None,
    timer: TripTimer | None = None,
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
        out: Where the rows arrive, ``[sum(receive_splits), ...]`` like ``tensor`` (allocated ahead,
            so that running out of memory for it can be reported before the exchange); ``None``: a
            new tensor.
        timer: Brackets the backward exchange (``differentiable`` only); ``None``: untimed.

    Returns:
        ``[sum(receive_splits), ...]``, rows from rank 0 first, then rank 1, ... on ``tensor``'s device
        (``out`` when given).
    """
    send = list(map(int, send_splits))
    receive = list(map(int, receive_splits))
    if not differentiable:
        with torch.no_grad():
            return _exchange(tensor, send, receive, group, out)
    if not tensor.requires_grad:
        tensor = tensor.detach().requires_grad_(True)
    return _AllToAllFunction.apply(tensor, send, receive, group, out, timer)


class PendingExchange:
    """A trip in flight (see :func:`start_pixel_trip`); its rows are valid only after :meth:`wait`."""

    def __init__(self, output: torch.Tensor, work: Any) -> None:
        self._output = output
        self._work = work

    def wait(self) -> torch.Tensor:
        """Block until the rows have arrived; return the tensor they arrive in."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._output


# -- routes: what goes where, each way ------------------------------------------------------------


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
            send_order=tuple(np.argsort(np.asarray(destinations, dtype=np.int64), kind="stable").tolist()),
            destinations=tuple(destinations),
            arrivals=plan.arrivals(rank),
            send_patches=plan.send_patches(rank),
            receive_patches=plan.receive_patches(rank),
        )


def row_runs(
    counts: Sequence[int] | np.ndarray, order: Sequence[int] | np.ndarray
) -> tuple[tuple[int, int], ...]:
    """Rows ``[a, b)`` of the items in ``order`` (item ``i`` has ``counts[i]`` rows, stored in
    index order), adjacent ones merged (``[a, b)`` then ``[b, c)`` is ``[a, c)``: the frames of a
    video are one run), items without rows left out. In numpy: one pass for thousands of items."""
    sizes = np.asarray(counts, dtype=np.int64).reshape(-1)
    picked = np.asarray(order, dtype=np.int64).reshape(-1)
    ends = np.cumsum(sizes)
    starts, stops = (ends - sizes)[picked], ends[picked]
    kept = stops > starts
    starts, stops = starts[kept], stops[kept]
    if not starts.size:
        return ()
    # A run starts where an item does not begin where the one before it ended.
    first = np.flatnonzero(np.concatenate(([True], starts[1:] != stops[:-1])))
    last = np.concatenate((first[1:], [starts.size])) - 1
    return tuple(zip(starts[first].tolist(), stops[last].tolist()))


def take_rows(tensor: torch.Tensor, slices: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Rows ``[a, b)`` of ``tensor`` for each slice, concatenated (a view when they are in order)."""
    start = slices[0][0] if slices else 0
    contiguous = all(a == (slices[k - 1][1] if k else start) for k, (a, _) in enumerate(slices))
    if contiguous:
        return tensor[start : slices[-1][1] if slices else start]
    return torch.cat([tensor[a:b] for a, b in slices])


@dataclass(frozen=True)
class PixelTrip:
    """How one rank's pixel rows become its balanced batch in the forward trip. A pure value.

    The rows of the images that stay home are copied straight into the batch, while the trip is in
    flight, instead of travelling through the collective: its self split would copy them once more,
    after the copy that grouped every row by destination. The received rows land in the batch
    itself (a contiguous run of it), so nothing is copied after the trip. Where this rank's own
    images sit between arrivals from lower and from higher ranks (more than two ranks), the
    received rows are not contiguous in the batch, and the collective carries the home rows too.

    Attributes:
        rows: Rows of the balanced batch.
        local: Row runs of ``pixel_values`` copied straight into the batch, in batch order.
        local_at: Batch row where the first of them goes.
        sent: Row runs of ``pixel_values`` the collective carries, in sending order.
        send_splits: Rows sent to each rank.
        receive_splits: Rows received from each rank.
        received_at: Batch row where the received rows start.
    """

    rows: int
    local: tuple[tuple[int, int], ...]
    local_at: int
    sent: tuple[tuple[int, int], ...]
    send_splits: tuple[int, ...]
    receive_splits: tuple[int, ...]
    received_at: int

    @classmethod
    def from_route(cls, route: ExchangeRoute, counts: Sequence[int], *, home: bool = True) -> PixelTrip:
        """The trip of ``route``'s rank, whose images have ``counts`` patch rows each.

        Args:
            route: This rank's route.
            counts: ``T*H*W`` of this rank's images, in its order.
            home: Whether the batch holds this rank's own images; ``False``: only the arrivals from
                other ranks (the overlapped trip encodes the home images apart).
        """
        rank = route.rank
        order = np.asarray(route.send_order, dtype=np.int64)
        stays = np.asarray(route.destinations, dtype=np.int64)[order] == rank
        lower, home_rows = sum(route.receive_patches[:rank]), route.receive_patches[rank]
        higher = sum(route.receive_patches[rank + 1 :])
        send, receive = list(route.send_patches), list(route.receive_patches)
        send[rank] = receive[rank] = 0
        if not home:
            return cls(lower + higher, (), 0, row_runs(counts, order[~stays]), tuple(send), tuple(receive), 0)
        if home_rows and lower and higher:
            return cls(
                lower + home_rows + higher, (), 0, row_runs(counts, order),
                route.send_patches, route.receive_patches, 0,
            )  # fmt: skip
        received_at = home_rows if lower == 0 else 0
        rows = lower + home_rows + higher
        stay_runs, away_runs = row_runs(counts, order[stays]), row_runs(counts, order[~stays])
        return cls(rows, stay_runs, lower, away_runs, tuple(send), tuple(receive), received_at)

    @property
    def received_rows(self) -> tuple[int, int]:
        """Rows ``[a, b)`` of the batch the collective fills."""
        return self.received_at, self.received_at + sum(self.receive_splits)

    @cached_value
    def pieces(self) -> TripPieces:
        """The pixel rows cut at every run's bounds (see :class:`TripPieces`): the trip then takes
        its runs with one ``torch.split``, not a slice each. Made once per trip."""
        bounds = sorted({0, *(row for run in (*self.local, *self.sent) for row in run)})
        index = {start: k for k, start in enumerate(bounds)}
        cuts = tuple(b - a for a, b in pairwise(bounds))
        return TripPieces(cuts, tuple(index[a] for a, _ in self.sent), tuple(index[a] for a, _ in self.local))


class TripPieces(NamedTuple):
    """A :class:`PixelTrip`'s runs as pieces of the pixel rows.

    Attributes:
        cuts: Rows of consecutive pieces of the pixel rows from row 0, cut where a run begins or
            ends (rows in no run are pieces too); rows past the last cut are in no run.
        sent: The piece of each run the collective carries, in sending order.
        local: The piece of each run copied straight into the batch, in batch order.
    """

    cuts: tuple[int, ...]
    sent: tuple[int, ...]
    local: tuple[int, ...]


def split_rows(tensor: torch.Tensor, cuts: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Views of ``tensor``'s rows in pieces of ``cuts`` rows, the rest one more piece (one call)."""
    return torch.split(tensor, [*cuts, tensor.shape[0] - sum(cuts)])


def fill_rows(
    placed: Mapping[int, torch.Tensor], cuts: Sequence[int], rows: int, like: torch.Tensor
) -> torch.Tensor:
    """The inverse of :func:`split_rows`: ``rows`` rows whose piece ``j`` (of ``cuts[j]`` rows) is
    ``placed[j]``, zeros for the pieces not placed and the rows past the last cut, in one ``cat``.
    ``like`` gives the zeros' dtype, device and row shape."""
    zero, width = like.new_zeros(()), like.shape[1:]
    parts = [placed[j] if j in placed else zero.expand(n, *width) for j, n in enumerate(cuts)]
    if rows > sum(cuts):
        parts.append(zero.expand(rows - sum(cuts), *width))
    return torch.cat(parts) if parts else like.new_zeros((0, *width))


def _trip_forward(
    pixels: torch.Tensor, trip: PixelTrip, dtype: torch.dtype, group: Any, *, may_view: bool = False
) -> tuple[torch.Tensor, Any]:
    """Start the trip, copy the home rows while it is in flight; the batch is valid after ``wait()``.

    With ``may_view`` (no autograd), a batch that is one run of ``pixels`` (nothing received) is
    that run itself, as the direct call would pass it, not a copy.
    """
    pieces = split_rows(pixels, trip.pieces.cuts)
    sent = _joined([pieces[k] for k in trip.pieces.sent], pixels).to(dtype).contiguous()
    a, b = trip.received_rows
    if may_view and a == b and len(trip.local) == 1 and trip.local[0][1] - trip.local[0][0] == trip.rows:
        start, stop = trip.local[0]
        batch = pixels[start:stop].to(dtype)
        trip = dataclasses.replace(trip, local=())
    else:
        batch = pixels.new_empty((trip.rows, *pixels.shape[1:]), dtype=dtype)
    work = dist.all_to_all_single(
        batch[a:b],
        sent,
        output_split_sizes=list(trip.receive_splits),
        input_split_sizes=list(trip.send_splits),
        group=group,
        async_op=True,
    )
    if trip.local:
        home = [pieces[k] for k in trip.pieces.local]
        torch.cat(home, out=batch[trip.local_at : trip.local_at + sum(p.shape[0] for p in home)])
    return batch, work


def _joined(pieces: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``pieces`` as one tensor: a view of the only one, no copy; ``like``'s zero rows for none."""
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if pieces else like[:0]


class _PixelTripFunction(torch.autograd.Function):
    """The forward trip for autograd: its backward sends the received rows' gradients back along the
    inverse route and puts the home rows' gradients in place."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        pixels: torch.Tensor,
        trip: PixelTrip,
        dtype: torch.dtype,
        group: Any,
        works: list[Any],
        timer: TripTimer | None,
    ) -> torch.Tensor:
        ctx.trip, ctx.group, ctx.timer = trip, group, timer
        ctx.pixel_shape, ctx.pixel_dtype = pixels.shape, pixels.dtype
        batch, work = _trip_forward(pixels, trip, dtype, group)
        works.append(work)
        return batch

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_batch: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        with _timed(ctx.timer, grad_batch.device):
            return _PixelTripFunction._backward(ctx, grad_batch), None, None, None, None, None

    @staticmethod
    def _backward(ctx: Any, grad_batch: torch.Tensor) -> torch.Tensor:
        """The pixels' gradient: the received rows' gradients sent home, the home rows' in place."""
        trip: PixelTrip = ctx.trip
        grad_batch = grad_batch.contiguous()
        a, b = trip.received_rows
        back = _exchange_back(grad_batch[a:b], list(trip.receive_splits), list(trip.send_splits), ctx.group)
        pieces = trip.pieces
        placed = dict(zip(pieces.sent, split_rows(back, [b - a for a, b in trip.sent])))
        local = grad_batch[trip.local_at :]
        placed.update(zip(pieces.local, split_rows(local, [b - a for a, b in trip.local])))
        # Rows in no run (the home images of an overlapped trip) get a zero gradient.
        return fill_rows(placed, pieces.cuts, ctx.pixel_shape[0], grad_batch).to(ctx.pixel_dtype)


def start_pixel_trip(
    pixels: torch.Tensor,
    trip: PixelTrip,
    dtype: torch.dtype,
    group: Any,
    *,
    differentiable: bool,
    timer: TripTimer | None = None,
) -> PendingExchange:
    """Start the forward trip of ``trip``; ``wait()`` gives the balanced batch ``[trip.rows, C]``.

    Args:
        pixels: This rank's ``[sum(T*H*W), C]`` pixel rows.
        trip: What goes where (see :class:`PixelTrip`).
        dtype: The wire dtype (the batch's).
        group: The process group.
        differentiable: As in :func:`all_to_all`: the same on every rank; the backward exchange
            (synchronous) then runs on every rank.
        timer: Brackets the backward trip (``differentiable`` only); ``None``: untimed.
    """
    if not differentiable:
        with torch.no_grad():
            return PendingExchange(*_trip_forward(pixels, trip, dtype, group, may_view=True))
    if not pixels.requires_grad:
        pixels = pixels.detach().requires_grad_(True)
    works: list[Any] = []
    batch = _PixelTripFunction.apply(pixels, trip, dtype, group, works, timer)
    return PendingExchange(batch, works[0])


@dataclass(frozen=True)
class ReturnLayout:
    """Where each row of the outputs that travel back goes on the return trip. A pure value.

    The return buffer holds, for each home rank in rank order, each token output's rows of that
    home's images (consecutive in the balanced batch), packed in the transit dtype.

    Attributes:
        send_rows: ``send_rows[home][k]``: rows ``[a, b)`` of output ``k`` of the balanced batch that
            belong to ``home``'s images.
        send_splits: Transit elements sent to each home rank.
        receive_rows: ``receive_rows[worker][k]``: rows of output ``k`` of this rank's images that
            ``worker`` encoded.
        receive_splits: Transit elements received from each worker rank.
        restore: ``restore[k]``: row slices of the received rows of output ``k`` that put this rank's
            images back in their original order, adjacent ones merged (images that came back one
            after the other from one worker: one slice, e.g. a video's temporal steps); ``None``
            when they already are in order.
    """

    send_rows: tuple[tuple[tuple[int, int], ...], ...]
    send_splits: tuple[int, ...]
    receive_rows: tuple[tuple[int, ...], ...]
    receive_splits: tuple[int, ...]
    restore: tuple[tuple[tuple[int, int], ...], ...] | None

    @classmethod
    def from_plan(
        cls,
        plan: RebalancePlan,
        rank: int,
        kinds: Sequence[str],
        merge_size: int,
        row_elements: Sequence[int],
    ) -> ReturnLayout:
        """The layout for this rank under ``plan``.

        Args:
            plan: The applied plan.
            rank: This rank.
            kinds: ``"patch"``, ``"merged"`` or ``"image"`` for each output that travels back, in
                output order.
            merge_size: The ViT's spatial merge size.
            row_elements: Transit elements one row of each output takes (see :func:`elements_per_row`).
        """
        return cls.from_route(plan, ExchangeRoute.from_plan(plan, rank), kinds, merge_size, row_elements)

    @classmethod
    def from_route(
        cls,
        plan: RebalancePlan,
        route: ExchangeRoute,
        kinds: Sequence[str],
        merge_size: int,
        row_elements: Sequence[int],
    ) -> ReturnLayout:
        """:meth:`from_plan` for a rank whose :class:`ExchangeRoute` under ``plan`` is at hand."""
        elements = np.asarray(row_elements, dtype=np.int64)  # [K]
        ranks = len(route.send_patches)
        # Images (not patches) per peer, for outputs with a row per image.
        encoded_for = np.bincount([source for source, _ in route.arrivals], minlength=ranks)
        sent_to = np.bincount(np.asarray(route.destinations, dtype=np.int64), minlength=ranks)
        sent = _rows_by_rank(route.receive_patches, encoded_for, kinds, merge_size)  # [P, K]
        send_rows = _send_rows(np.asarray(route.receive_patches) > 0, sent)
        send_splits = tuple((sent @ elements).tolist())
        received = _rows_by_rank(route.send_patches, sent_to, kinds, merge_size)  # [P, K]
        receive_rows = tuple(map(tuple, received.tolist()))
        receive_splits = tuple((received @ elements).tolist())
        restore = None
        order = np.asarray(route.send_order, dtype=np.int64)
        if bool((order[1:] < order[:-1]).any()):
            # The rows come back in sending order; image i's are at its place in it.
            position = np.empty_like(order)
            position[order] = np.arange(order.size)
            mine = np.asarray(plan.patch_counts[route.rank], dtype=np.int64)
            image_rows = {kind: rows_per_image(kind, mine, merge_size) for kind in dict.fromkeys(kinds)}
            runs = {kind: row_runs(rows[order], position) for kind, rows in image_rows.items()}
            restore = tuple(runs[kind] for kind in kinds)
        return cls(send_rows, send_splits, receive_rows, receive_splits, restore)

    @cached_value
    def send_pieces(self) -> SendPieces:
        """How the return buffer is cut from the outputs: see :class:`SendPieces`. Computed once
        per layout, so that a call reusing its layout only splits and concatenates.

        Raises:
            ValueError: An output's rows for a home start before the previous home's end: the
                balanced batch holds its images home by home, in rank order.
        """
        outputs = len(self.send_rows[0]) if self.send_rows else 0
        cuts: list[list[int]] = [[] for _ in range(outputs)]
        ends = [0] * outputs
        order = []
        for home, ranges in enumerate(self.send_rows):
            for k, (start, end) in enumerate(ranges):
                if end <= start:
                    continue
                if start < ends[k]:
                    raise ValueError(
                        f"send_rows[{home}][{k}] = {(start, end)} starts before row {ends[k]}, where the "
                        "previous home's rows end: expected each output's rows home by home, in rank order."
                    )
                if start > ends[k]:
                    cuts[k].append(start - ends[k])  # rows sent nowhere
                order.append((k, len(cuts[k])))
                cuts[k].append(end - start)
                ends[k] = end
        return SendPieces(tuple(map(tuple, cuts)), tuple(order))

    @cached_value
    def receive_pieces(self) -> ReceivePieces:
        """How the outputs are read from the received buffer: see :class:`ReceivePieces`. Computed
        once per layout, every output at once; a piece is a run of rows of one worker's block of one
        output that stays together in the restored order."""
        received = np.asarray(self.receive_rows, dtype=np.int64).reshape(len(self.receive_rows), -1)  # [P, K]
        outputs = received.shape[1]
        if self.restore is None:  # in order: a piece per worker's block, taken in the buffer's order
            workers, ks = np.nonzero(received)
            picks = tuple(tuple(np.flatnonzero(ks == k).tolist()) for k in range(outputs))
            return ReceivePieces(tuple(received[workers, ks].tolist()), tuple(ks.tolist()), picks)
        ends = np.cumsum(received, axis=0)  # [P, K]: where each worker's block of output k ends
        totals = ends[-1] if ends.size else np.zeros(outputs, dtype=np.int64)
        slices = list(self.restore)
        slice_output = np.repeat(np.arange(outputs), [len(s) for s in slices])
        slice_rows = np.asarray([r for s in slices for r in s], dtype=np.int64).reshape(-1, 2)
        # Every output's cuts in one sorted array, keyed ``k * span + row`` (``span``: more rows than any
        # output has), so that one sort and one search serve every output.
        span = int(totals.max(initial=0)) + 1
        base = np.arange(outputs) * span
        block_ends = (ends + base).T.reshape(-1)  # sorted: output-major, then worker
        slice_starts = slice_output * span + slice_rows[:, 0]
        cut = np.unique(
            np.concatenate((base, block_ends, slice_starts, slice_output * span + slice_rows[:, 1]))
        )
        output, start = cut // span, cut % span
        length = np.diff(cut, append=outputs * span)
        # Each output's last cut ends its rows: what follows up to the next output is no piece.
        kept = (length > 0) & np.append(output[1:] == output[:-1], False)
        output, start, length, keyed = output[kept], start[kept], length[kept], cut[kept]
        worker = np.searchsorted(block_ends, keyed, side="right") - output * received.shape[0]
        by_start = np.argsort(slice_starts, kind="stable")
        inside = by_start[np.searchsorted(slice_starts[by_start], keyed, side="right") - 1]
        order = np.lexsort((start, output, worker))  # the buffer's order: worker, then output, then row
        position = np.empty_like(order)
        position[order] = np.arange(order.size)
        restored = np.lexsort((start, inside))  # slices are numbered output by output, in restore order
        picks_of = position[restored]
        bounds = np.searchsorted(output[restored], np.arange(outputs + 1))
        picks = tuple(tuple(picks_of[i:j].tolist()) for i, j in pairwise(bounds))
        return ReceivePieces(tuple(length[order].tolist()), tuple(output[order].tolist()), picks)


class SendPieces(NamedTuple):
    """The return buffer as pieces of the returned outputs (the sending side of :class:`ReturnLayout`).

    Attributes:
        cuts: ``cuts[k]``: rows of consecutive pieces of output ``k`` from its first row, cut where
            a home's rows begin or end (rows sent nowhere are pieces too); rows past the last cut
            are sent nowhere.
        order: ``(k, j)``: piece ``j`` of output ``k``, for each piece of the buffer in order.
    """

    cuts: tuple[tuple[int, ...], ...]
    order: tuple[tuple[int, int], ...]


class ReceivePieces(NamedTuple):
    """The received buffer as pieces of the returned outputs (the receiving side of :class:`ReturnLayout`).

    Attributes:
        rows: Rows of each piece, in the buffer's order (they tile it).
        outputs: The output each piece belongs to.
        picks: ``picks[k]``: the pieces of output ``k`` in its rows' original order.
    """

    rows: tuple[int, ...]
    outputs: tuple[int, ...]
    picks: tuple[tuple[int, ...], ...]


def _rows_by_rank(
    patches: Sequence[int], images: np.ndarray, kinds: Sequence[str], merge_size: int
) -> np.ndarray:
    """``[P, K]`` int64: rows in output ``k`` of ``images[rank]`` images of ``patches[rank]``
    patches in all. An ``"image"`` output has a row per image; a token output's rows for images
    are the rows of their summed patches, since each image's patches are a multiple of
    ``merge_size**2`` (its H and W are checked divisible on input). In numpy: the layouts' loops
    over every peer cost milliseconds on 1,024 ranks in Python."""
    counts = np.asarray(patches, dtype=np.int64)
    if not kinds:
        return np.zeros((counts.size, 0), dtype=np.int64)
    by_kind = {
        kind: images.astype(np.int64) if kind == "image" else rows_per_image(kind, counts, merge_size)
        for kind in dict.fromkeys(kinds)
    }
    return np.stack([by_kind[kind] for kind in kinds], axis=1)


def _send_rows(homes: np.ndarray, rows: np.ndarray) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``[home][k] -> (a, b)``: the balanced batch's rows of output ``k`` from each home rank, from
    ``homes`` (``[P]``: whether any image of that home is here) and ``rows`` (``[P, K]``: their rows);
    ``(0, 0)`` for a home with none. Its images lie one after another, homes in rank order."""
    ends = np.cumsum(rows, axis=0)
    starts = np.where(homes[:, None], ends - rows, 0).tolist()
    ends = np.where(homes[:, None], ends, 0).tolist()
    return tuple(tuple(zip(a, b)) for a, b in zip(starts, ends))


# -- the status gather after the ViT --------------------------------------------------------------


@dataclass(frozen=True)
class LeafSignature:
    """One output of a rank's ViT forward that travels back, as the return trip needs to know it.

    Attributes:
        path: The output's path (``"0"``, ``"deepstack_features.1"``).
        kind: ``"patch"``, ``"merged"`` or ``"image"`` (the nearest kind when ``problem`` is set).
        dtype: ``str(dtype)``.
        trailing: Shape after the row dimension.
        rows: Rows the output had.
        expected: Rows its kind needs for the batch.
        problem: 0, or the output's problem code (``Classification.problem`` in outputs.py).
        history: This rank's ViT made it with autograd history (it requires grad); not encoded
            in the details, where it decodes as True.
    """

    path: str
    kind: str
    dtype: str
    trailing: tuple[int, ...]
    rows: int = field(default=0, compare=False)
    expected: int = field(default=0, compare=False)
    problem: int = field(default=0, compare=False)
    history: bool = field(default=True, compare=False)


def _compact(value: Any) -> bytes:
    """``value`` as compact JSON in UTF-8 (at most 4 bytes a character; a lone surrogate, as in a
    file name Python decoded with ``surrogateescape``, as its 6-byte JSON escape, which decodes to
    the same text on the other ranks: strict UTF-8 raised on this rank alone)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class ViTStatus:
    """How one rank's ViT forward went, gathered from every rank before the return trip.

    Attributes:
        error: ``"<ExceptionType>: <message>"`` when the ViT raised on this rank, else ``""``.
        leaves: The outputs that travel back, in output order (empty when the ViT raised);
            decoded from a status with more than fit in its bytes, as many of those with a problem
            as fit (their paths cut to :data:`_PATH_CHARS`), which may be none.
        digest_and_count: For such a decoded status, the :meth:`digest` and the count of all its
            outputs (which :meth:`digest` and :attr:`count` then give); ``None`` otherwise.
    """

    error: str = ""
    leaves: tuple[LeafSignature, ...] = ()
    digest_and_count: tuple[int, int] | None = None

    @property
    def flag(self) -> int:
        """0: fine; 1: the ViT raised; 2: an output's rows fit no kind."""
        if self.error:
            return 1
        return 2 if any(leaf.problem for leaf in self.leaves) else 0

    def history_mask(self) -> int:
        """Bit ``k`` set where output ``k`` (of the first :data:`HISTORY_BITS`) has history."""
        return sum(1 << k for k, leaf in enumerate(self.leaves[:HISTORY_BITS]) if leaf.history)

    @property
    def count(self) -> int:
        """The outputs that travel back."""
        return len(self.leaves) if self.digest_and_count is None else self.digest_and_count[1]

    def digest(self) -> int:
        """A 62-bit integer of the outputs' paths, kinds, dtypes and trailing shapes (not their rows)."""
        if self.digest_and_count is not None:
            return self.digest_and_count[0]
        text = json.dumps([[x.path, x.kind, x.dtype, list(x.trailing)] for x in self.leaves])
        return stable_digest(text.encode())

    def encode(self) -> bytes:
        """A compact UTF-8 form of at most ``_DETAIL_BYTES`` bytes: the message is cut to fit, and
        where the outputs are too many to list, the digest and count of them all travel with as
        many of the outputs that have a problem as fit (paths cut to :data:`_PATH_CHARS`: one
        always fits), which say what went wrong."""
        leaves = [
            [x.path, x.kind, x.dtype, list(x.trailing), x.rows, x.expected, x.problem] for x in self.leaves
        ]
        for limit in (_MESSAGE_CHARS, 120, 0):
            data = _compact({"e": self.error[:limit], "l": leaves})
            if len(data) <= _DETAIL_BYTES - 4:
                return data
        problems = [[leaf[0][:_PATH_CHARS], *leaf[1:]] for leaf in leaves if leaf[-1]]
        value = {"e": self.error[:120], "l": [], "d": [self.digest(), len(self.leaves)]}
        room = _DETAIL_BYTES - 4 - len(_compact(value))
        ends = accumulate(len(_compact(leaf)) + 1 for leaf in problems)  # a comma each
        value["l"] = problems[: sum(1 for end in ends if end <= room)]
        return _compact(value)

    @classmethod
    def decode(cls, data: bytes) -> ViTStatus:
        """The inverse of :meth:`encode` (a form with the outputs listed apart decodes with the
        listed ones, and the digest and count of all)."""
        value = json.loads(data.decode())
        leaves = tuple(
            LeafSignature(path, kind, dtype, tuple(trailing), rows, expected, problem)
            for path, kind, dtype, trailing, rows, expected, problem in value["l"]
        )
        apart = value.get("d")
        return cls(error=value["e"], leaves=leaves, digest_and_count=None if apart is None else tuple(apart))


@dataclass(frozen=True)
class StatusReport:
    """What the status gather found.

    Attributes:
        consistent: Every rank's ViT ran and made outputs of the same kinds, dtypes and trailing
            shapes, with rows that fit.
        statuses: Every rank's full status, in rank order; gathered only when not ``consistent``.
        collectives: Collectives issued (1, or 2 when the details were gathered).
        plan_digests: Every rank's :attr:`~lightning_vit_balance.RebalancePlan.digest` of the
            call's plan, in rank order (0 where the call moved no images).
        gradients: Whether each rank's return trip carries gradients back, in rank order.
        with_history: Bit ``k`` set where any rank's ViT made output ``k`` (of the first
            :data:`HISTORY_BITS`) with autograd history; ``-1`` (every bit) where not gathered.
        merges: The spatial merge size each rank's return trip sizes its rows by, in rank order
            (0 in the status of a call that moves nothing, whose rows never travel back).
        vits: A digest of the ViT each rank called, in rank order (0: not told).
    """

    consistent: bool
    statuses: tuple[ViTStatus, ...]
    collectives: int
    plan_digests: tuple[int, ...] = ()
    gradients: tuple[bool, ...] = ()
    with_history: int = -1
    merges: tuple[int, ...] = ()
    vits: tuple[int, ...] = ()

    def made_without_history(self, output: int) -> bool:
        """Whether no rank's ViT made output ``output`` with autograd history."""
        return output < HISTORY_BITS and not (self.with_history >> output) & 1


def _encode_detail(status: ViTStatus) -> torch.Tensor:
    data = status.encode()
    buffer = torch.zeros(_DETAIL_BYTES, dtype=torch.uint8)
    buffer[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    buffer[4 : 4 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return buffer


def _decode_detail(values: np.ndarray) -> ViTStatus:
    """The inverse of :func:`_encode_detail`, from one rank's gathered ``uint8`` row."""
    length = int.from_bytes(values[:4].tobytes(), "little")
    return ViTStatus.decode(values[4 : 4 + length].tobytes())


#: The status word every rank gathers after the ViT, one int64 each, in this order.
STATUS_WORD: tuple[str, ...] = (
    "flag",
    "output_digest",
    "output_count",
    "plan_digest",
    "gradients",
    "history_mask",
    "merge",
    "vit",
)
_PLAN_DIGEST, _GRADIENTS = STATUS_WORD.index("plan_digest"), STATUS_WORD.index("gradients")
_HISTORY_MASK, _MERGE, _VIT = (STATUS_WORD.index(name) for name in ("history_mask", "merge", "vit"))
#: Outputs whose autograd history the status word carries (a bit each in an int64).
HISTORY_BITS = 62


def exchange_status(
    status: ViTStatus, group: Any, plan_digest: int = 0, gradients: bool = False, merge: int = 0, vit: int = 0
) -> StatusReport:
    """Gather every rank's :class:`ViTStatus` after the ViT forward, before the return trip.

    One all_gather of eight int64 per rank (flag, output digest, output count, ``plan_digest``,
    ``gradients``, the outputs made with history, ``merge``, ``vit``) in the common case; when any
    rank's ViT raised, made rows that fit no kind, or made outputs that differ from another rank's
    (trailing shape, dtype: autocast on one rank only), a second all_gather brings every rank's
    full status, so each can raise the same error.
    The buffers are host (CPU) tensors where the backend carries them (gloo, or a
    ``"cpu:gloo,cuda:nccl"`` group), so no device sync happens.

    Args:
        status: This rank's.
        group: The group to gather on (a host-side one where there is one).
        plan_digest: This rank's :attr:`~lightning_vit_balance.RebalancePlan.digest` of the call's
            plan; 0 in a call that moves no images.
        gradients: Whether this rank's return trip carries gradients back (its backward pass then
            exchanges them with every rank's).
        merge: The ViT's spatial merge size this rank's return trip sizes its rows by; 0 in a call
            that moves nothing.
        vit: A digest of the ViT this rank called (equal on ranks that called the same tower).
    """
    fields = {
        "flag": status.flag,
        "output_digest": status.digest(),
        "output_count": status.count,
        "plan_digest": plan_digest,
        "gradients": int(gradients),
        "history_mask": status.history_mask(),
        "merge": merge,
        "vit": vit,
    }
    word = torch.tensor([fields[name] for name in STATUS_WORD], dtype=torch.int64)
    gathered = start_row_gather(word.to(host_device(group)), group).wait()  # [P, len(STATUS_WORD)]
    words = gathered.cpu().numpy()
    plan_digests = tuple(words[:, _PLAN_DIGEST].tolist())
    gradients_by_rank = tuple((words[:, _GRADIENTS] != 0).tolist())
    history = int(np.bitwise_or.reduce(words[:, _HISTORY_MASK])) if words.size else 0
    merges, vits = tuple(words[:, _MERGE].tolist()), tuple(words[:, _VIT].tolist())
    # Every rank's ViT succeeded with outputs alike: the flag 0, the outputs' digest and count rank 0's.
    if not words[:, 0].any() and (words[:, 1:_PLAN_DIGEST] == words[0, 1:_PLAN_DIGEST]).all():
        return StatusReport(True, (), 1, plan_digests, gradients_by_rank, history, merges, vits)
    details = _gathered_array(_encode_detail(status), gathered.device, group)
    statuses = tuple(_decode_detail(d) for d in details)
    return StatusReport(False, statuses, 2, plan_digests, gradients_by_rank, history, merges, vits)
