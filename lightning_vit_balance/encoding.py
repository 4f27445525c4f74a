"""The ViT side of a balanced call: check the input, run the ViT, describe what it returned.

Nothing here communicates. :func:`validate_input` turns this rank's input into the
:class:`~lightning_vit_balance.exchange.RankMetadata` the gather carries; :func:`raise_for_input`
reads every rank's and raises the same error everywhere; :func:`encode` runs the ViT on a
:class:`BalancedBatch` (a dummy image when the batch is empty) and never raises, so that a rank whose
ViT failed still reaches the status gather; :func:`raise_for_vit` turns that gather into one error
on every rank.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import os
import time
import traceback
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint

from lightning_vit_balance.config import stable_digest
from lightning_vit_balance.exchange import (
    OUT_OF_STEP,
    LeafSignature,
    RankMetadata,
    StatusReport,
    ViTStatus,
    device_problem,
    host_to_device,
    rows_per_image,
)
from lightning_vit_balance.outputs import (
    Classification,
    OutputLayout,
    Structure,
    classify_outputs,
    describe_output_problem,
    flatten_output,
    unroutable_output,
    unwrap_module,
    window_index_fn,
)
from lightning_vit_balance.problems import (
    DTYPES,
    GRID_DTYPES,
    PIXEL_DTYPES,
    InputProblem,
    UncombinedInput,
    dense_problem,
    describe_problem,
    input_kind_code,
    layout_code,
    problem_details,
)
from lightning_vit_balance.recompute import in_backward_pass
from lightning_vit_balance.wire import autocast_off

__all__ = [
    "INVALID_INPUT",
    "BalancedBatch",
    "EncodedBatch",
    "TripClock",
    "ViTClock",
    "called_module",
    "dtype_code",
    "encode",
    "gathered_per_call",
    "merge_problem",
    "own_parameters",
    "parameters_sharded",
    "raise_for_gradients",
    "raise_for_input",
    "raise_for_merges",
    "raise_for_other_vits",
    "raise_for_plans",
    "raise_for_vit",
    "release_frames",
    "splice_encoded",
    "submodules",
    "validate_input",
    "vit_identity",
]

#: A value ranks are grouped by in a message (see :func:`_ranks_by`).
_Held = TypeVar("_Held")
#: Prefix of the status a rank reports when its input did not match a prepared plan.
INPUT_ERROR = "input: "
#: How the error every rank raises for any rank's invalid input (rows, grids, dtypes) begins.
INVALID_INPUT = "Invalid balanced ViT input"
#: Prefix of the status a rank reports when packing its outputs for the return trip raised.
PACKING_ERROR = "packing: "
#: This package's source folder: its frames are the ones :func:`release_frames` always clears.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: Output kinds whose rows travel back to the images' home ranks.
RETURNED_KINDS = ("patch", "merged", "image")


@functools.cache
def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def gathered_per_call(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` is sharded outside its module's forward, so that each call of the module
    gathers it (ZeRO-3's partitioned parameters, an FSDP2 unit's ``DTensor`` before its forward)."""
    return hasattr(param, "ds_id") or isinstance(param, _dtensor_type())


def parameters_sharded(vit: torch.nn.Module) -> bool:
    """Whether ``vit``'s parameters are sharded across ranks (FSDP2's ``DTensor``s, ZeRO-3's
    partitioned parameters, FSDP1 units inside it): then every call of ``vit`` is a collective,
    which every rank must make as often as the others.

    One walk over the modules, reading each one's own parameters (0.33 ms for a 32-block tower's 258
    modules; ``modules()`` and ``parameters()``, each naming every module, took 1.1 ms): the mixin
    asks it in eval-mode calls, where a tower may have been sharded since an earlier call."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed import fsdp

    # FSDP2 units by their class too: between a forward and its backward a root unit's parameters
    # stay gathered, plain tensors, not DTensors.
    units = tuple(kind for kind in (fsdp.FullyShardedDataParallel, getattr(fsdp, "FSDPModule", None)) if kind)
    modules = list(submodules(vit))
    return any(isinstance(m, units) for m in modules) or any(map(gathered_per_call, own_parameters(modules)))


def own_parameters(modules: Iterable[torch.nn.Module]) -> Iterator[torch.nn.Parameter]:
    """The parameters each of ``modules`` holds itself (not its children's), in order, a shared one
    once per module holding it: with :func:`submodules`, the walk ``parameters()`` makes, without
    naming each one (and where a module's class defines ``__eq__`` without ``__hash__``, which
    ``parameters()`` cannot walk)."""
    for module in modules:
        for parameter in module._parameters.values():
            if parameter is not None:
                yield parameter


def submodules(root: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``root`` and every module under it, each once, breadth first: what ``root.modules()`` lists,
    without its qualified names. Walks that run in a call's forward take it, where ``modules()`` and
    ``parameters()`` build a name for each module and parameter (0.9 ms for a 32-block tower's
    walk, this 0.3)."""
    found = [root]
    seen = {id(root)}
    for module in found:  # grows while read
        yield module
        for child in module._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                found.append(child)


def dtype_code(dtype: torch.dtype) -> int:
    """Index of ``dtype`` in ``DTYPES``, -1 when not listed."""
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def _bad(problem: InputProblem, pixel_values: Any, **values: int) -> RankMetadata:
    channels, code = 0, -1
    # Read only from a dense tensor: a nested one of 1-D pieces has two dims and no sizes.
    if isinstance(pixel_values, torch.Tensor) and not layout_code(pixel_values) and pixel_values.dim() == 2:
        channels, code = int(pixel_values.shape[1]), dtype_code(pixel_values.dtype)
    return RankMetadata(
        status=int(problem),
        details=problem_details(problem, **values),
        channels=channels,
        dtype_code=code,
        requires_grad=False,
        grids=(),
    )


def _shape_problem(pixel_values: Any, grid_thw: Any) -> RankMetadata | None:
    if isinstance(grid_thw, UncombinedInput):
        return _bad(InputProblem.NOT_COMBINED, pixel_values)
    if not isinstance(grid_thw, torch.Tensor):
        return _bad(InputProblem.GRID_NOT_TENSOR, pixel_values, given=input_kind_code(grid_thw))
    if not isinstance(pixel_values, torch.Tensor):
        return _bad(InputProblem.PIXELS_NOT_TENSOR, pixel_values, given=input_kind_code(pixel_values))
    dense = dense_problem(pixel_values, grid_thw)
    if dense is not None:
        return _bad(InputProblem.LAYOUT, pixel_values, **dense)
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        sizes = [*list(grid_thw.shape)[:3], 0, 0, 0]
        return _bad(
            InputProblem.GRID_SHAPE,
            pixel_values,
            ndim=grid_thw.dim(),
            size0=sizes[0],
            size1=sizes[1],
            size2=sizes[2],
        )
    if grid_thw.dtype not in GRID_DTYPES:
        return _bad(InputProblem.GRID_DTYPE, pixel_values, grid_dtype=dtype_code(grid_thw.dtype))
    if pixel_values.dim() != 2:
        return _bad(InputProblem.PIXELS_SHAPE, pixel_values, ndim=pixel_values.dim())
    if pixel_values.dtype not in PIXEL_DTYPES:
        return _bad(InputProblem.PIXELS_DTYPE, pixel_values, pixel_dtype=dtype_code(pixel_values.dtype))
    return None


#: The details of a device problem, in the order :func:`device_problem` gives them.
_DEVICE_DETAILS = ("have_device", "want_device", "have_index", "want_index")


def _device_problem(pixel_values: torch.Tensor, group: Any) -> RankMetadata | None:
    wrong = device_problem(group, pixel_values.device)
    if wrong is not None:
        return _bad(InputProblem.DEVICE, pixel_values, **dict(zip(_DEVICE_DETAILS, wrong)))
    return None


def _grid_device_problem(
    pixel_values: torch.Tensor, grid_thw: torch.Tensor, group: Any
) -> RankMetadata | None:
    """Grid rows are read on the host, in a call and in a plan made ahead alike: any real device
    works, the meta device has no values (reading them would raise on this rank alone)."""
    if grid_thw.device.type != "meta":
        return None
    wrong = device_problem(group, grid_thw.device)
    assert wrong is not None
    return _bad(InputProblem.GRID_DEVICE, pixel_values, **dict(zip(_DEVICE_DETAILS, wrong)))


def validate_input(
    pixel_values: Any,
    grid_thw: Any,
    merge_size: int,
    group: Any,
    *,
    fingerprint: tuple[int, ...] = (),
    vit_us: int = -1,
    check_device: bool = True,
) -> RankMetadata:
    """Check this rank's input without communicating; the result travels in the metadata gather.

    Args:
        pixel_values: ``[sum(T*H*W), C]`` floating patch rows.
        grid_thw: ``[n_images, 3]`` integer grid rows.
        merge_size: The ViT's spatial merge size (``H`` and ``W`` must be divisible by it).
        group: The process group (its backend decides which devices can be exchanged).
        fingerprint: This rank's settings fingerprint, carried as is.
        vit_us: This rank's previous ViT time, carried as is.
        check_device: Check that ``pixel_values`` can be exchanged on ``group`` (not when planning
            ahead from a host copy of the batch).
    """
    problem = _shape_problem(pixel_values, grid_thw)
    if problem is None and check_device:
        problem = _device_problem(pixel_values, group)
    if problem is None:
        problem = _grid_device_problem(pixel_values, grid_thw, group)
    if problem is None:
        rows = grid_thw.detach().to("cpu", torch.int64)  # [n, 3]; one copy, checked vectorised
        problem = _grid_problem(pixel_values, rows, merge_size)
        if problem is None:
            problem = RankMetadata(
                status=0,
                details=(),
                channels=int(pixel_values.shape[1]),
                dtype_code=dtype_code(pixel_values.dtype),
                requires_grad=bool(pixel_values.requires_grad),
                grids=tuple(map(tuple, rows.tolist())),  # type: ignore[arg-type]
            )
    return RankMetadata(
        problem.status,
        problem.details,
        problem.channels,
        problem.dtype_code,
        problem.requires_grad,
        problem.grids,
        fingerprint,
        vit_us,
    )


def _first(mask: torch.Tensor) -> int | None:
    hits = mask.nonzero()
    return int(hits[0, 0]) if hits.numel() else None


#: Patch counts (T*H*W per image, and their sum) are planned and counted as int64: kept below 2**62.
_GRID_PRODUCT_END = float(2**62)


def _grid_problem(pixel_values: torch.Tensor, rows: torch.Tensor, merge_size: int) -> RankMetadata | None:
    """Problems of the grid rows ``[n, 3]`` (int64, on the host), first image first."""
    # Products in float64 as well: an int64 product that wraps (corrupt grids) must not pass.
    products = rows.double().prod(dim=1)
    wraps = products.cumsum(0) >= _GRID_PRODUCT_END
    bad = _first((rows <= 0).any(dim=1) | wraps)
    if bad is not None:
        t, h, w = rows[bad].tolist()
        return _bad(InputProblem.GRID_VALUE, pixel_values, index=bad, t=t, h=h, w=w)
    expected_rows = int(rows.prod(dim=1).sum())
    if pixel_values.shape[0] != expected_rows:
        return _bad(InputProblem.PIXEL_ROWS, pixel_values, rows=pixel_values.shape[0], expected=expected_rows)
    bad = _first((rows[:, 1:] % merge_size != 0).any(dim=1))
    if bad is not None:
        _, h, w = rows[bad].tolist()
        return _bad(InputProblem.NOT_DIVISIBLE, pixel_values, index=bad, h=h, w=w, merge=merge_size)
    return None


def _mismatch(metadata: Sequence[RankMetadata]) -> str | None:
    """Text for ranks with images whose ``C`` or dtype differs from the first such rank's."""
    with_images = [r for r, m in enumerate(metadata) if m.grids]
    for r in with_images[1:]:
        ref = with_images[0]
        mine, theirs = metadata[r], metadata[ref]
        if mine.channels != theirs.channels:
            details = (mine.channels, ref, theirs.channels)
            return f"rank {r}: {describe_problem(InputProblem.CHANNELS_MISMATCH, details)}"
        if mine.dtype_code != theirs.dtype_code:
            details = (mine.dtype_code, ref, theirs.dtype_code)
            return f"rank {r}: {describe_problem(InputProblem.DTYPE_MISMATCH, details)}"
    return None


class GatherFor(enum.IntEnum):
    """What a metadata gather is for, in its fingerprint (the first setting): a rank's gather met
    by another's of another kind (a rank that prepared its step's plan next to one that did not)
    raises on every rank, instead of pairing up and leaving the ranks to plan apart."""

    CALL = 0  #: a balanced call without a prepared plan
    PREPARE = 1  #: ViTBalancer.prepare
    CHECK = 2  #: ViTBalancer.check_pending


_GATHERS_FOR = {
    GatherFor.CALL: "a balanced call without a prepared plan",
    GatherFor.PREPARE: "prepare",
    GatherFor.CHECK: "check_pending",
}


def _gathers_apart(metadata: Sequence[RankMetadata]) -> str:
    kinds = [m.fingerprint[0] for m in metadata]
    held = "; ".join(
        f"{_GATHERS_FOR[kind]} on ranks {[r for r, k in enumerate(kinds) if k == kind]}"
        for kind in GatherFor
        if kind in kinds
    )
    return (
        f"the ranks gathered for different steps ({held}). Every rank must prepare a step's plan, "
        "or none; pass each rank's plan to the call that encodes that step; and call check_pending "
        "on every rank together. A loop that ends on some ranks before others (ranks given different "
        "numbers of batches: an evaluation loader that does not pad, accelerate's "
        "even_batches=False) meets so at its end"
    )


def _fingerprint_problem(metadata: Sequence[RankMetadata], names: Sequence[str]) -> str | None:
    """Text naming the settings that differ between ranks, or None when every rank agrees."""
    reference = metadata[0].fingerprint
    if all(m.fingerprint == reference for m in metadata):
        return None  # one tuple comparison per rank; the setting by setting scan names the ones apart
    differing = _settings_apart(metadata, names)
    if names[:1] == ["gather"] and any(m.fingerprint[0] != reference[0] for m in metadata):
        # Ranks gathering for different steps often do because a setting differs (plan_ahead on
        # some ranks): named too. Not the merge size, which a prepare without the ViT sends as 1.
        settings = [text for name, text in differing if name not in ("gather", "spatial_merge_size")]
        also = f"; the settings differ too: {', '.join(settings)}" if settings else ""
        return _gathers_apart(metadata) + also
    if not differing:
        return None
    return (
        "the balancing settings differ between ranks: "
        + ", ".join(text for _, text in differing)
        + ". Every rank must use the same ViTBalanceConfig (and the same cost model, the same "
        "package version and sources, and a ViT of the same spatial_merge_size), or ranks would "
        "plan differently and exchange the wrong rows"
    )


def _settings_apart(metadata: Sequence[RankMetadata], names: Sequence[str]) -> list[tuple[str, str]]:
    """``(name, text)`` of each setting some ranks send otherwise than rank 0, in ``names`` order."""
    reference = metadata[0].fingerprint
    differing = []
    for k, name in enumerate(names):
        ranks = [r for r, m in enumerate(metadata) if m.fingerprint[k] != reference[k]]
        if ranks:
            hint = _NOT_CONFIG_SETTINGS.get(name, "")
            differing.append((name, f"{name} (ranks {ranks} differ from rank 0{hint})"))
    return differing


#: What a setting that no ViTBalanceConfig field holds is, said where it differs between ranks.
_NOT_CONFIG_SETTINGS = {
    "cost_fit": (
        "; the online cost fit's state, its model, counters and measured steps: a checkpoint loaded "
        "on some ranks only, or another on each (load the same one on every rank), or calls out of "
        "step, through another balancer on these ranks (two towers called in another order)"
    ),
    "previous_call_plan": (
        "; the call before was given plans made ahead for other batches on these ranks (or another "
        "balancer's call came before on them), so their cost fits would be fed other figures; pass "
        "each call the plan prepared from its own batch"
    ),
    "package_sources": "; the package's files differ under one version; install the same sources everywhere",
}


def _ranks_by(pairs: Iterable[tuple[int, _Held]]) -> dict[_Held, list[int]]:
    """The ranks of ``(rank, value)`` pairs, by value, in the order each value first came."""
    held: dict[_Held, list[int]] = {}
    for rank, value in pairs:
        held.setdefault(value, []).append(rank)
    return held


def by_ranks(texts: Iterable[tuple[int, str]]) -> list[str]:
    """``(rank, text)`` pairs as a message lists them: ``"rank r: text"``, the ranks that share a
    text named once before it (``"ranks [0, 1, 2]: text"``), in the order each text first came.
    On 512 ranks that fail alike (every ViT out of memory) the text is written once, not 512 times."""
    return [f"{_named(ranks)}: {text}" for text, ranks in _ranks_by(texts).items()]


def _named(ranks: list[int]) -> str:
    """``"rank r"`` for one rank, ``"ranks [r, s, ...]"`` for more, as messages name them."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def raise_for_input(metadata: Sequence[RankMetadata], fingerprint_names: Sequence[str] = ()) -> int | None:
    """Raise the same ValueError on every rank for any invalid input; return the reference rank.

    The reference rank is the first rank with images; every rank with images must agree with it
    on ``C`` and dtype, and every rank must send the same settings fingerprint.
    """
    settings = _fingerprint_problem(metadata, fingerprint_names) if fingerprint_names else None
    if settings is not None:
        raise ValueError(f"Invalid balanced ViT call ({len(metadata)} ranks): {settings}.")
    problems = by_ranks(
        (r, describe_problem(m.status, m.details)) for r, m in enumerate(metadata) if m.status
    )
    if not problems:
        mismatch = _mismatch(metadata)
        if mismatch is None:
            with_images = [r for r, m in enumerate(metadata) if m.grids]
            return with_images[0] if with_images else None
        problems.append(mismatch)
    raise ValueError(f"{INVALID_INPUT} ({len(metadata)} ranks): " + "; ".join(problems) + ".")


@dataclass(frozen=True)
class BalancedBatch:
    """The images one rank encodes in a balanced call.

    Attributes:
        pixels: ``[sum(patch_counts), C]`` patch rows, in arrival order (a dummy image when empty).
        grid: ``[n, 3]`` grid rows of those images.
        patch_counts: ``T*H*W`` of each image.
        is_dummy: The batch is one dummy ``(1, m, m)`` image standing in for an empty batch.
        received: The pixel rows the forward trip delivered (``pixels`` itself unless dummy).
    """

    pixels: torch.Tensor
    grid: torch.Tensor
    patch_counts: tuple[int, ...]
    is_dummy: bool = False
    received: torch.Tensor | None = None

    @classmethod
    def dummy(
        cls, merge: int, channels: int, dtype: torch.dtype, like_grid: torch.Tensor, device: Any
    ) -> BalancedBatch:
        """One ``(1, merge, merge)`` image of zeros: a ViT is never called on an empty batch."""
        pixels = torch.zeros((merge * merge, channels), dtype=dtype, device=device)
        grid = host_to_device(torch.tensor([[1, merge, merge]]), like_grid.device, like_grid.dtype)
        return cls(pixels, grid, (merge * merge,), is_dummy=True)


@dataclass
class EncodedBatch:
    """The ViT's output on one :class:`BalancedBatch`, flattened and classified.

    Attributes:
        leaves: ``(path, value)`` of every output leaf (empty when the ViT raised).
        structure: How to rebuild the output's type.
        kinds: The classification of each leaf.
        error: The exception the ViT raised on this rank, else None.
        seconds: Host seconds the ViT forward took.
        input_problem: ``error`` is this rank's input not matching a prepared plan (the ViT never ran).
        packing_problem: ``error`` was raised packing the outputs for the return trip (out of
            memory, say), after the ViT ran.
    """

    leaves: list[tuple[str, Any]]
    structure: Structure | None
    kinds: list[Classification]
    error: BaseException | None
    seconds: float
    input_problem: bool = False
    packing_problem: bool = False

    @property
    def returned_indices(self) -> list[int]:
        """Indices of the leaves whose rows travel back (per patch, per merged token or per image)."""
        return [k for k, c in enumerate(self.kinds) if c.kind in RETURNED_KINDS]

    def status(self) -> ViTStatus:
        """What the other ranks need to know about this forward before the return trip."""
        if self.error is not None and self.input_problem:
            return ViTStatus(error=f"{INPUT_ERROR}{_text_of(self.error)}")
        if self.error is not None and self.packing_problem:
            return ViTStatus(error=f"{PACKING_ERROR}{type(self.error).__name__}: {_text_of(self.error)}")
        if self.error is not None:
            return ViTStatus(error=f"{type(self.error).__name__}: {_text_of(self.error)}")
        signatures = tuple(
            LeafSignature(
                path=self.leaves[k][0],
                kind=self.kinds[k].kind,
                dtype=str(self.leaves[k][1].dtype),
                trailing=tuple(int(s) for s in self.leaves[k][1].shape[1:]),
                rows=self.kinds[k].rows,
                expected=self.kinds[k].expected,
                problem=self.kinds[k].problem,
                history=bool(self.leaves[k][1].requires_grad),
            )
            for k in self.returned_indices
        )
        return ViTStatus(leaves=signatures)


def _text_of(error: BaseException) -> str:
    """``str(error)``, or a note where it raises itself: this rank must still send its status, or
    the others wait for it."""
    try:
        return str(error)
    except Exception as unreadable:
        return f"(its message could not be read: str() raised {type(unreadable).__name__})"


def encode(
    vit: Any,
    batch: BalancedBatch,
    *,
    merge: int,
    layout: OutputLayout | None,
    no_grad_dummy: bool,
    skip_with: Exception | None = None,
    routed: bool = True,
) -> EncodedBatch:
    """Run ``vit`` on ``batch`` and classify its outputs; a ViT exception is kept, not raised.

    Args:
        vit: Called as ``vit(pixels, grid)``.
        batch: The balanced batch.
        merge: The spatial merge size.
        layout: Explicit output kinds, if any.
        no_grad_dummy: Run a dummy batch without autograd (the ``"no_grad"`` empty-rank policy).
        skip_with: Do not run the ViT; report this error instead (this rank's input was bad).
        routed: The outputs travel back to their images' ranks (an applied call, every rank
            alike): an output holding tensors that cannot (:func:`unroutable_output`) is an error.
    """
    started = time.perf_counter()
    if skip_with is not None:
        return EncodedBatch([], None, [], skip_with, 0.0, input_problem=True)
    try:
        if batch.is_dummy and no_grad_dummy:
            with torch.no_grad():
                output = vit(batch.pixels, batch.grid)
        else:
            output = vit(batch.pixels, batch.grid)
    except BaseException as error:  # every rank must hear of it (an interrupt too) before this one re-raises
        return EncodedBatch([], None, [], error, time.perf_counter() - started)
    seconds = time.perf_counter() - started
    try:
        leaves, structure = flatten_output(output)
        unroutable = unroutable_output(leaves, layout) if routed else None
        if unroutable is not None:  # every rank hears of it before the return trip
            return EncodedBatch([], None, [], ValueError(unroutable), seconds, packing_problem=True)
        kinds = classify_outputs(
            leaves,
            total_patches=sum(batch.patch_counts),
            images=len(batch.patch_counts),
            merge_size=merge,
            has_window_index=window_index_fn(vit) is not None,
            layout=layout,
        )
    except BaseException as error:  # outputs it cannot read (a structure that holds itself), an interrupt
        return EncodedBatch([], None, [], error, seconds, packing_problem=True)
    return EncodedBatch(leaves, structure, kinds, None, seconds)


def _describe(status: ViTStatus, reference: ViTStatus, merge: int) -> str | None:
    """What is wrong with one rank's ``status`` (None: nothing), as :func:`by_ranks` lists it."""
    if status.error.startswith(INPUT_ERROR):
        return status.error[len(INPUT_ERROR) :]
    if status.error.startswith(PACKING_ERROR):
        raised = status.error[len(PACKING_ERROR) :]
        return f"packing the ViT's outputs for the return trip raised {raised}"
    if status.error:
        return f"the ViT raised {status.error}"
    for leaf in status.leaves:
        if leaf.problem:
            return describe_output_problem(
                leaf.path, leaf.problem, leaf.rows, leaf.expected, merge, kind=leaf.kind
            )
    advice = (
        "every rank's ViT must return the same kinds, dtypes and widths (autocast or a dtype cast "
        "on some ranks only, or an output_layout that differs between ranks?)"
    )
    if status.digest_and_count is None and reference.digest_and_count is None:
        if status.leaves == reference.leaves:
            return None
        mine = [(x.path, x.kind, x.dtype, x.trailing) for x in status.leaves]
        theirs = [(x.path, x.kind, x.dtype, x.trailing) for x in reference.leaves]
        return (
            f"the ViT's outputs that travel back (path, kind, dtype, trailing shape) are {mine}, while "
            f"the first rank's are {theirs}: {advice}"
        )
    if (status.digest(), status.count) == (reference.digest(), reference.count):
        return None
    return (
        f"the ViT's {status.count} outputs that travel back differ from the first rank's "
        f"{reference.count} in their paths, kinds, dtypes or trailing shapes (too many to list "
        f"here): {advice}"
    )


def raise_for_vit(report: StatusReport, encoded: EncodedBatch, merge: int) -> None:
    """After the status gather: raise on every rank when any rank's ViT failed or disagreed.

    A rank whose own ViT raised re-raises its own exception (the others' problems are attached as
    a note); a rank whose input did not match its prepared plan raises the same ``ValueError`` as
    the others; every other rank raises a ``RuntimeError`` (a ViT exception elsewhere; a
    ``torch.OutOfMemoryError``, itself a ``RuntimeError``, when every rank that failed ran out of
    memory) or a ``ValueError`` (outputs that cannot be routed), with the same text on every rank.
    """
    if report.consistent:
        return
    own, statuses = encoded.error, dict(enumerate(report.statuses))
    if any(s.error and not s.error.startswith(_EARLY_STOP) for s in report.statuses):
        # Non-reentrant checkpointing stops a recomputation once it has what the backward pass
        # needs, by raising in it: no failure. Where another rank's ViT failed, a rank stopped so
        # raises as a rank whose ViT ran; re-raised, checkpoint would swallow the signal and the
        # ranks would go on apart.
        statuses = {r: s for r, s in statuses.items() if not s.error.startswith(_EARLY_STOP)}
        own = None if _stopped_early(own) else own
    reference = next((s for s in statuses.values() if not s.error), ViTStatus())
    problems = by_ranks(
        (worker, text)
        for worker, status in statuses.items()
        if (text := _describe(status, reference, merge)) is not None
    )
    message = "The balanced ViT call failed: " + "; ".join(problems) + "."
    if own is not None and encoded.input_problem:
        raise ValueError(message) from own
    if own is not None:
        if hasattr(own, "add_note"):  # Python 3.11+
            own.add_note(message)
        raise own
    errors = [s.error for s in statuses.values() if s.error]
    # Input that did not match its prepared plan is a ValueError everywhere; a ViT failure is not.
    if errors and not all(e.startswith(INPUT_ERROR) for e in errors):
        if all(_out_of_memory(e) for e in errors):
            # The type the failing ranks raise: a loop that skips a batch on it skips it everywhere.
            raise torch.OutOfMemoryError(message)
        raise RuntimeError(message)
    raise ValueError(message)


def raise_for_plans(report: StatusReport, prepared: bool = False) -> None:
    """After the status gather, before the return trip: raise on every rank when the ranks' plans
    differ.

    Every rank plans from the same gathered batch, settings, package version and sources, so the
    plans are equal unless something outside them differs between the ranks (a Python or NumPy
    release other than those ``make plan-versions`` found to plan alike) or a bug. Where the call
    was given a plan made before it (``prepared``), the digests cover the batch each plan was made
    from too, so they also differ where a rank was given the plan of another call. Sizes that
    still match would let the trips complete with images encoded as the wrong grids and their
    outputs returned to the wrong images' rows, silently: a ``RuntimeError`` with the same text on
    every rank ends the call instead.
    """
    digests = report.plan_digests
    if len(set(digests)) <= 1:
        return
    if prepared:
        # No rank can tell whose plan is the call's: each group of ranks holding one is named.
        groups = _ranks_by(enumerate(digests))
        held = "; ".join(f"ranks {members}: {digest}" for digest, members in groups.items())
        raise RuntimeError(
            "The balanced ViT call failed: the ranks were given plans made before the call for "
            f"different batches (plan digests by rank, {held}), so images would be encoded as other "
            "images' grids and come back to rows other images own; the call ends before its return "
            "trip on every rank. Pass each call the plan `prepare` made for its batch, on every rank "
            "in the same order (a plan taken twice, or plans of two batches taken in another order, "
            "on the ranks out of step). If every rank did, their environments differ (compare "
            '`python -c "import sys, numpy; print(sys.version, numpy.__version__)"` on each) or this is '
            "a bug in lightning-vit-balance: please report it."
        )
    ranks = [r for r, digest in enumerate(digests) if digest != digests[0]]
    which = f"(plan digest {digests[ranks[0]]} on rank {ranks[0]}, {digests[0]} on rank 0)"
    raise RuntimeError(
        f"The balanced ViT call failed: the ranks planned it differently. Ranks {ranks} made other "
        f"plans than rank 0 from the same gathered batch, settings, package version and sources {which}, "
        "so images would come back to rows other images own; the call ends before its return trip on "
        "every rank. Plans depend on nothing else, so the ranks' environments differ (compare "
        '`python -c "import sys, numpy; print(sys.version, numpy.__version__)"` on each) or this is '
        "a bug in lightning-vit-balance: please report it."
    )


def raise_for_gradients(report: StatusReport) -> None:
    """After the status gather, before the return trip: raise on every rank when some ranks' return
    trips carry gradients and others' do not.

    Whether a trip carries gradients is each rank's own reading (grad mode, and whether its ViT has
    trainable parameters or any rank's pixels require grad). Where the ranks disagree (a ViT frozen
    on some ranks only, a call under ``torch.no_grad()`` on some), the ranks with gradients would
    wait in the trips' backward pass for ranks that run none, until the backend's timeout.
    """
    flags = report.gradients
    if len(set(flags)) <= 1:
        return
    with_grad = [r for r, flag in enumerate(flags) if flag]
    without = [r for r, flag in enumerate(flags) if not flag]
    raise ValueError(
        f"The balanced ViT call failed: ranks {with_grad} encode with gradients and ranks {without} "
        "without (grad mode off there, torch.no_grad() or inference_mode, or the ViT's parameters "
        "frozen there while trainable on the others), so the backward pass would wait for ranks that "
        "run none. Expected every rank of the group to make the call in the same grad mode, with the "
        "same parameters of the ViT requiring grad."
    )


#: How a rank's status names non-reentrant checkpointing's early stop of its recomputation.
_EARLY_STOP = "_StopRecomputationError: "


def _stopped_early(error: BaseException | None) -> bool:
    """Whether ``error`` is non-reentrant checkpointing's signal that a recomputation has every
    tensor the backward pass needs (``torch.utils.checkpoint``'s early stop), not a failure."""
    stop = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)
    return stop is not None and isinstance(error, stop)


def _out_of_memory(error: str) -> bool:
    """Whether a rank's status ``error`` says its ViT, or packing its outputs, ran out of memory."""
    raised = error[len(PACKING_ERROR) :] if error.startswith(PACKING_ERROR) else error
    return raised.startswith(f"{torch.OutOfMemoryError.__name__}: ")


def release_frames(error: BaseException) -> None:
    """Drop the local variables of the finished frames that ``error`` (and its causes and contexts)
    keeps alive, as it leaves a balanced call: this package's frames always, and for an
    out-of-memory error every frame of its traceback.

    The package's frames hold the error itself (kept to be reported to every rank, then re-raised),
    so the error, its traceback and those frames made a reference cycle that kept the call's buffers
    (the pixel rows that arrived, the outputs) and, through the traceback, the ViT's partial
    activations alive until the next cyclic garbage collection, after the loop had caught the error
    and gone on. Without the cycle they are freed when the error is, as after a direct call; the
    ViT's frames keep their locals for a post-mortem debugger. An out-of-memory error's go at once,
    so that memory returns to the device while the loop still holds the error (its ``except``
    block). The trace's text (files and lines) stays.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen or not _raised_through_package(current):
            # Not raised in a balanced call (the caller's own error, being handled as it called):
            # its frames are the caller's to keep.
            continue
        seen.add(id(current))
        if isinstance(current, torch.OutOfMemoryError):
            traceback.clear_frames(current.__traceback__)
        for frame in _own_frames(current):
            with contextlib.suppress(RuntimeError):  # a frame still running: the caller's own
                frame.clear()
        pending += [current.__cause__, current.__context__]


def _raised_through_package(error: BaseException) -> bool:
    """Whether ``error`` passed through one of this package's frames on its way up."""
    frames = traceback.walk_tb(error.__traceback__)
    return any(frame.f_code.co_filename.startswith(_PACKAGE_DIR) for frame, _ in frames)


def _own_frames(error: BaseException) -> list[Any]:
    """This package's frames in ``error``'s traceback and among their callers (a finished frame
    keeps its caller's frame alive: the overlapped trip's holds the other forward's error)."""
    frames: dict[int, Any] = {}
    for frame, _ in traceback.walk_tb(error.__traceback__):
        while frame is not None and id(frame) not in frames:
            frames[id(frame)] = frame
            frame = frame.f_back
    return [frame for frame in frames.values() if frame.f_code.co_filename.startswith(_PACKAGE_DIR)]


def merge_problem(metadata: Sequence[RankMetadata], merge: int, steps: bool = False) -> str | None:
    """Why the rows of a plan made before the ViT's merge size was known (a plan made ahead without
    the ViT) cannot be encoded by a ViT of spatial merge size ``merge``: the first gathered image
    whose H or W it does not divide; None when it divides all. ``steps``: the rows are videos'
    temporal steps (``split_videos``), and the index counts steps. Every rank holds every rank's
    rows, but not every rank's ViT: the status gather carries the problem to all of them."""
    for rank, rank_metadata in enumerate(metadata):
        bad = next((i for i, (_, h, w) in enumerate(rank_metadata.grids) if h % merge or w % merge), None)
        if bad is not None:
            _, h, w = rank_metadata.grids[bad]
            where = f"temporal step {bad} of grid_thw's images" if steps else f"grid_thw[{bad}]"
            return (
                f"the ViT's spatial merge size {merge} does not divide H={h}, W={w} of rank {rank}'s "
                f"{where} (checked at the call: the plan was made ahead before the ViT's merge size "
                "was known; prepare(..., vit=vit) checks it there)"
            )
    return None


def raise_for_merges(report: StatusReport) -> None:
    """After the status gather, before the return trip: raise on every rank when the ranks' ViTs
    have different spatial merge sizes. Each rank sizes its images' returned rows by its own, so
    the rows would come back cut at other places (a plan made ahead without the ViT, or calls of
    different ViTs: no gather before compared them)."""
    sizes = _ranks_by((rank, merge) for rank, merge in enumerate(report.merges) if merge)
    if len(sizes) <= 1:
        return
    held = "; ".join(f"merge {size}: ranks {sizes[size]}" for size in sorted(sizes))
    raise ValueError(
        f"The balanced ViT call failed: the ViT's spatial merge size differs between ranks ({held}), "
        "and each rank cuts the returned rows of every image by its own; the call ends before its "
        "return trip on every rank. Call the same ViT on every rank (prepare(..., vit=vit) compares "
        "the merge sizes when it plans)."
    )


def raise_for_other_vits(report: StatusReport) -> None:
    """After the status gather, before the return trip: raise on every rank when the ranks called
    different ViTs in this call. Their calls were paired by their order alone, so each rank's
    images were encoded by another rank's tower too and came back as that tower's outputs."""
    towers = _ranks_by((rank, vit) for rank, vit in enumerate(report.vits) if vit)
    if len(towers) <= 1:
        return
    held = "; ".join(map(_named, towers.values()))
    raise ValueError(
        f"The balanced ViT call failed: the ranks called different ViTs in this call (one each: {held}; "
        "their classes or parameter counts differ): their calls are out of step, paired by their "
        "order alone, and images that move would come back encoded by another rank's tower; the "
        "call ends before its return trip on every rank. Two towers called in another order on "
        f"some ranks pair one rank's call with another's too: {OUT_OF_STEP}."
    )


def called_module(vit: Any) -> torch.nn.Module | None:
    """The module a call of ``vit`` runs: ``vit`` itself inside its wrappers (DDP, FSDP1,
    ``torch.compile``), or the one a ``functools.partial`` or a bound method reaches; None for
    another callable (a lambda around the tower), which cannot tell which tower it calls."""
    while isinstance(vit, functools.partial):
        vit = vit.func
    module = unwrap_module(getattr(vit, "__self__", vit) if inspect.ismethod(vit) else vit)
    return module if isinstance(module, torch.nn.Module) else None


def vit_identity(module: torch.nn.Module) -> int:
    """A 62-bit digest of a tower (:func:`called_module`), equal on the ranks that call the same
    one: its class's name and its count of parameters. Not the class's module, which
    ``trust_remote_code`` names after each node's folder or snapshot; nor the parameters' names or
    shapes, which wrappers inside the tower (activation checkpointing, ``torch.compile`` of a block)
    rename and FSDP1 and ZeRO-3 cut per rank. Towers of one architecture (an image and a video
    tower of the same class) look alike."""
    parameters = {id(p) for p in own_parameters(submodules(module))}  # a shared one counted once
    return stable_digest(f"{type(module).__qualname__}\n{len(parameters)}".encode())


def splice_encoded(
    away: EncodedBatch, home: EncodedBatch, counts_before: Sequence[int], merge: int
) -> EncodedBatch:
    """One :class:`EncodedBatch` for a balanced batch encoded in two ViT calls (overlapped trip).

    ``away`` encoded the arrivals from other ranks, ``home`` this rank's own images, which sit
    after the arrivals from lower ranks (``counts_before``: their patch counts) in arrival order.
    Token outputs are spliced in that order; other outputs are ``away``'s.
    """
    if away.error is not None or home.error is not None:
        return away if away.error is not None else home
    if [c.kind for c in away.kinds] != [c.kind for c in home.kinds]:
        error = ValueError("the ViT's outputs differ in structure between two batches of the same call")
        return EncodedBatch([], None, [], error, away.seconds + home.seconds)
    leaves = list(away.leaves)
    kinds = list(away.kinds)
    for k in away.returned_indices:
        kind = kinds[k].kind
        cut = sum(rows_per_image(kind, n, merge) for n in counts_before)
        rows = away.leaves[k][1]
        with autocast_off(rows.device):
            leaves[k] = (leaves[k][0], torch.cat([rows[:cut], home.leaves[k][1], rows[cut:]]))
        problem = max(away.kinds[k].problem, home.kinds[k].problem)
        kinds[k] = Classification(
            kind,
            problem,
            away.kinds[k].rows + home.kinds[k].rows,
            away.kinds[k].expected + home.kinds[k].expected,
        )
    return EncodedBatch(leaves, away.structure, kinds, None, away.seconds + home.seconds)


class ViTClock:
    """Times this rank's ViT forwards without ever waiting for the device.

    On CPU a host timer measures the forward. On CUDA the forward only launches kernels, so a pair
    of CUDA events brackets it, and the elapsed time is read at the next call (by then the events
    have normally completed; ``Event.query()`` checks without blocking, and a pair still running is
    reported as unknown). Either way the figure travels in the next metadata gather.

    A recomputation in the backward pass (activation checkpointing) is neither timed nor makes the
    clock forget: the figure is its forward's, paired with that forward's images (non-reentrant
    checkpointing ends each recomputation early, with an error the call sees as a failure).
    """

    def __init__(self) -> None:
        self._pending: tuple[Any, Any] | None = None
        self._started = 0.0
        self._cuda = False
        self.last_us = -1

    def start(self, device: torch.device) -> None:
        if in_backward_pass():
            return
        self._cuda = device.type == "cuda"
        if self._cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self._pending = (begin, None)
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if in_backward_pass():
            return
        if self._cuda and self._pending is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending = (self._pending[0], end)
        else:
            self.last_us = int((time.perf_counter() - self._started) * 1e6)

    def forget(self) -> None:
        """Drop the latest figure: the call it timed failed, or a plan for other images was made
        since (a prepared plan whose call never ran), so that no time is paired with images it did
        not measure."""
        if in_backward_pass():
            return
        self._pending = None
        self.last_us = -1

    def read(self) -> int:
        """Microseconds of the latest forward; -1 before the first, or while its CUDA events still
        run (that figure is then dropped rather than paired with a later call's images)."""
        if self._pending is not None:
            begin, end = self._pending
            self._pending = None
            done = end is not None and end.query()
            self.last_us = int(begin.elapsed_time(end) * 1000) if done else -1
        return self.last_us


class TripClock:
    """Times this rank's trips without ever waiting for the device: a balanced call's forward trips
    and, in the backward pass, the exchanges that send their gradients back.

    Each trip is bracketed (:meth:`start`, :meth:`stop`): a host timer on CPU, a pair of CUDA
    events on CUDA, where the collectives run on the device after the host has moved on. The
    brackets closed since the previous call ended (the backward trips of earlier calls, then this
    call's forward trips) are summed and reported once, at the next call (:meth:`end_call`), when
    their CUDA events have normally completed; ``Event.query()`` checks without blocking, and a
    figure whose events still run is reported as unknown. Summed over a run, every trip counts once.
    """

    def __init__(self) -> None:
        #: The CUDA event pairs (the end ``None`` until stopped) and host seconds since the previous
        #: call ended.
        self._pairs: list[tuple[Any, Any]] = []
        self._host_seconds = 0.0
        self._started = 0.0
        self._cuda = False
        #: What the previous call's end closed, reported at the next :meth:`end_call`.
        self._due: tuple[list[tuple[Any, Any]], float] | None = None

    def start(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        if self._cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self._pairs.append((begin, None))
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if self._cuda and self._pairs:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pairs[-1] = (self._pairs[-1][0], end)
        elif not self._cuda:
            self._host_seconds += time.perf_counter() - self._started

    def end_call(self) -> float:
        """Close the brackets since the previous call (due at the next call) and return the
        milliseconds of those the previous call closed: -1.0 when it closed none, or while their
        CUDA events still run."""
        due, self._due = self._due, None
        # A pair left open is a trip that raised (its call failed on every rank): dropped.
        closed = [pair for pair in self._pairs if pair[1] is not None]
        if closed or self._host_seconds > 0.0:
            self._due = (closed, self._host_seconds)
        self._pairs, self._host_seconds = [], 0.0
        if due is None:
            return -1.0
        pairs, host_seconds = due
        if not all(end.query() for _, end in pairs):
            return -1.0
        return 1000.0 * host_seconds + sum(float(begin.elapsed_time(end)) for begin, end in pairs)
