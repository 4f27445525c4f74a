"""ViT output structures: flatten, classify each tensor by its rows, rebuild the same structure.

A ViT returns a tensor, a tuple/list (the seed's ``(pixel_embeds, window_index, deepstack_list)``),
a dict, or a Hugging Face ``ModelOutput`` (``last_hidden_state``, ``pooler_output``,
``deepstack_features``), nested arbitrarily. Flattening gives every leaf a dotted path (``"0"``,
``"2.1"``, ``"last_hidden_state"``, ``"deepstack_features.0"``) and a :class:`Structure` that rebuilds
the same type from new leaves.

Each tensor leaf is one of the :data:`OUTPUT_KINDS`, worked out from its rows over a batch of
``S`` patches (``sum(T*H*W)``) and merge size ``m``: ``S`` rows per patch; ``S / m**2`` rows per
merged token; for a ViT with ``get_window_index``, its one integer tensor of ``S / m**2`` rows (or,
among several, the one named ``window_index``) is the window index (regenerated from the original
grid, never exchanged; :func:`classify_outputs`). A tensor matching none of them cannot be routed back to
its images; :class:`OutputLayout` names the kind of any output explicitly (and the merge size) for
towers where the rows are ambiguous or the merge size cannot be looked up. Rows per image that do
not follow its patches (a CLS row or a pooled vector per image, a resampler's ``[n, K, D]`` queries)
are the ``"image"`` kind: a row per image, which only a layout names (their count can equal a
token kind's on a batch, so rows alone never tell it).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_vit_balance.exchange import rows_per_image
from lightning_vit_balance.problems import LAYOUTS, layout_code

__all__ = [
    "OUTPUT_KINDS",
    "Classification",
    "OutputLayout",
    "Structure",
    "classify_output",
    "classify_outputs",
    "describe_classification",
    "describe_output_problem",
    "flatten_output",
    "merge_size_of",
    "rebuild_output",
    "rows_per_image",
    "unroutable_output",
    "unwrap_module",
    "window_index_fn",
    "without_dropped",
]

#: Kinds of ViT output leaves. ``"patch"``: one row per patch; ``"merged"``: one row per merged
#: token (``merge**2`` patches); ``"image"`` (only when named in an :class:`OutputLayout`): one row
#: per image, i.e. per grid row (a CLS row, a pooled vector, ``[n, K, D]`` resampler queries);
#: ``"window_index"``: regenerated with ``vit.get_window_index``;
#: ``"passthrough"``: returned as computed (non-tensors, 0-d tensors); ``"drop"`` (only when named
#: in an :class:`OutputLayout`): returned as ``None`` and never exchanged, for outputs the caller
#: ignores (e.g. a Hugging Face tower's per-patch ``last_hidden_state`` when only
#: ``pooler_output`` is used), so their bytes do not travel.
OUTPUT_KINDS: tuple[str, ...] = ("patch", "merged", "image", "window_index", "passthrough", "drop")


@dataclass(frozen=True)
class OutputLayout:
    """Explicit description of a custom ViT's outputs, where the rows do not tell.

    Args:
        kinds: Output path (``"0"``, ``"last_hidden_state"``, ``"deepstack_features.1"``) to one of
            :data:`OUTPUT_KINDS`. A path also covers everything below it (``"2"`` names every
            layer of a deepstack list at index 2). Paths not listed are worked out from their rows.
        merge_size: Spatial merge size; default: ``vit.spatial_merge_size`` or
            ``vit.config.spatial_merge_size``, else 1.
    """

    kinds: Mapping[str, str] = dataclasses.field(default_factory=dict)
    merge_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kinds, Mapping):
            raise ValueError(
                f"OutputLayout.kinds={self.kinds!r} is invalid: expected a mapping from output path to kind."
            )
        for path, kind in self.kinds.items():
            if not isinstance(path, str) or kind not in OUTPUT_KINDS:
                raise ValueError(
                    f"OutputLayout.kinds[{path!r}]={kind!r} is invalid: expected a str path mapped to "
                    f"one of {OUTPUT_KINDS}."
                )
        if self.merge_size is not None and (
            isinstance(self.merge_size, bool) or not isinstance(self.merge_size, int) or self.merge_size < 1
        ):
            raise ValueError(f"OutputLayout.merge_size={self.merge_size!r} is invalid: expected an int >= 1.")
        object.__setattr__(self, "kinds", dict(sorted(self.kinds.items())))

    @classmethod
    def of(cls, value: OutputLayout | Mapping[str, str] | None) -> OutputLayout | None:
        """``value`` (an ``output_layout`` argument) as a layout of its own: a copy of a layout
        (its ``kinds`` a dict the caller may change later), the one a mapping from output path to
        kind describes, or None."""
        if value is None:
            return None
        if isinstance(value, OutputLayout):
            return cls(kinds=value.kinds, merge_size=value.merge_size)
        if isinstance(value, Mapping):
            return cls(kinds=dict(value))
        raise TypeError(
            f"output_layout={value!r} is invalid: expected None, an OutputLayout or a mapping from "
            "output path to kind."
        )

    def kind_of(self, path: str) -> str | None:
        """The kind named for ``path`` or its nearest listed ancestor, or None."""
        parts = path.split(".") if path else []
        for cut in range(len(parts), -1, -1):
            kind = self.kinds.get(".".join(parts[:cut]))
            if kind is not None:
                return kind
        return None


#: Attributes wrappers keep the module they wrap in: DDP and FSDP1 (``module``), ``torch.compile``
#: (``_orig_mod``), activation checkpointing's and FSDP1's inner wrappers.
_WRAPPED = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def unwrap_module(vit: Any) -> Any:
    """The module inside wrappers (DDP, FSDP1, ``torch.compile``, activation checkpointing), for
    attribute lookups and to tell one tower however a call wraps it."""
    for _ in range(4):
        inner = next(
            (
                getattr(vit, name)
                for name in _WRAPPED
                if isinstance(getattr(vit, name, None), torch.nn.Module)
            ),
            None,
        )
        if inner is None:
            break
        vit = inner
    return vit


def merge_size_of(vit: Any, layout: OutputLayout | None = None) -> int:
    """Spatial merge size: the layout's, ``vit.spatial_merge_size``, ``vit.config.spatial_merge_size``, or 1.

    Looked up through ``.module`` wrappers (DDP, FSDP).
    """
    if layout is not None and layout.merge_size is not None:
        return layout.merge_size
    inner = unwrap_module(vit)
    for holder in (inner, getattr(inner, "config", None)):
        value = getattr(holder, "spatial_merge_size", None) if holder is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return 1


def window_index_fn(vit: Any) -> Any:
    """``vit.get_window_index`` (looked up through wrappers), or None."""
    fn = getattr(unwrap_module(vit), "get_window_index", None)
    return fn if callable(fn) else None


@dataclass(frozen=True)
class Structure:
    """How to rebuild a ViT output from its flattened leaves (see :func:`flatten_output`)."""

    node: str  # "leaf", "list", "tuple", "namedtuple", "dict", "model_output", "dataclass"
    container: type | None = None
    keys: tuple[Any, ...] = ()
    children: tuple[Structure, ...] = ()
    #: A dataclass output without its fields' values, copied to rebuild it (see :func:`_emptied_copy`).
    template: Any = dataclasses.field(default=None, compare=False)


def _is_model_output(value: Any) -> bool:
    # Hugging Face ModelOutput: an OrderedDict dataclass with to_tuple (no transformers import needed).
    return isinstance(value, Mapping) and dataclasses.is_dataclass(value) and hasattr(value, "to_tuple")


def flatten_output(output: Any) -> tuple[list[tuple[str, Any]], Structure]:
    """Flatten a ViT output into ``(path, leaf)`` pairs (depth first, in order) and its structure.

    Containers (tuples, lists, namedtuples, mappings, dataclasses and Hugging Face ``ModelOutput``)
    are walked; tensors, ``None`` and any other values are leaves.
    """
    leaves: list[tuple[str, Any]] = []
    return leaves, _flatten(output, "", leaves)


# Recursion by module-level functions, not nested ones: a nested function that calls itself is a
# reference cycle holding its closure (the leaves: the ViT's outputs) until the next cyclic garbage
# collection, which the balanced call pauses; the outputs would outlive the step's use of them.
def _flatten(value: Any, path: str, leaves: list[tuple[str, Any]]) -> Structure:
    if _is_model_output(value):
        keys = tuple(value.keys())
        children = tuple(_flatten(value[k], _child(path, k), leaves) for k in keys)
        return Structure("model_output", type(value), keys, children)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Fields set (one with init=False that __post_init__ left unset has no value to route).
        names = tuple(f.name for f in dataclasses.fields(value) if hasattr(value, f.name))
        # Then attributes that are not fields (set in ``__post_init__``, say): routed as fields are.
        names += tuple(name for name in getattr(value, "__dict__", {}) if name not in names)
        children = tuple(_flatten(getattr(value, n), _child(path, n), leaves) for n in names)
        return Structure("dataclass", type(value), names, children, _emptied_copy(value, names))
    if isinstance(value, Mapping):
        keys = tuple(value.keys())
        return Structure(
            "dict", type(value), keys, tuple(_flatten(value[k], _child(path, k), leaves) for k in keys)
        )
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        children = tuple(_flatten(v, _child(path, i), leaves) for i, v in enumerate(value))
        return Structure("namedtuple", type(value), (), children)
    if isinstance(value, (tuple, list)):
        node = "tuple" if isinstance(value, tuple) else "list"
        return Structure(
            node, type(value), (), tuple(_flatten(v, _child(path, i), leaves) for i, v in enumerate(value))
        )
    leaves.append((path, value))
    return Structure("leaf")


def _emptied_copy(value: Any, names: Sequence[str]) -> Any:
    """A shallow copy of the dataclass instance ``value`` with its attributes ``names`` set to
    None: what :func:`_rebuild` copies again and fills. Its ``__init__`` is not called again, which
    could change the values (a ``__post_init__`` that scales a field)."""
    template = copy.copy(value)
    for name in names:
        object.__setattr__(template, name, None)
    return template


def unroutable_output(leaves: Sequence[tuple[str, Any]], layout: OutputLayout | None) -> str | None:
    """Why a leaf of :func:`flatten_output` cannot come back right, or None: a tensor that is not
    dense (a nested or sparse one has no rows to cut by image) unless ``layout`` names it
    ``"drop"`` or ``"passthrough"``, or an object that holds tensors with rows (in its attributes,
    or a set of them) in a container the balancer does not walk, unless ``layout`` names its kind
    (it would come back as computed, holding the encoded batch's tensors: other ranks' images)."""
    for path, leaf in leaves:
        kind = layout.kind_of(path) if layout is not None else None
        if kind in ("drop", "passthrough"):  # never travels
            continue
        if isinstance(leaf, torch.Tensor) and layout_code(leaf):  # no rows to cut by image
            name = f"output {path!r}" if path else "output"
            return (
                f"the ViT's {name} is a {LAYOUTS[layout_code(leaf)]} tensor: the balancer routes "
                'dense (strided) tensors back to their images\' ranks (name it "drop" or "passthrough" '
                "in output_layout if it stays where it was computed)"
            )
        if isinstance(leaf, torch.Tensor) or kind is not None:
            continue
        held = leaf if isinstance(leaf, (set, frozenset)) else getattr(leaf, "__dict__", {}).values()
        slots = (getattr(leaf, n, None) for cls in type(leaf).__mro__ for n in _slot_names(cls))
        # A 0-d tensor has no rows to route: it passes through, as it does outside an object.
        if any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in itertools.chain(held, slots)):
            name = f"output {path!r}" if path else "output"
            return (
                f"the ViT's {name} is a {type(leaf).__name__} holding tensors, which the balancer "
                "cannot route back to their images' ranks: return them in a tuple, list, dict, "
                "namedtuple, dataclass or Hugging Face ModelOutput, or name the output's kind in "
                "output_layout (OutputLayout(kinds={...}))"
            )
    return None


def _slot_names(cls: type) -> tuple[str, ...]:
    slots = cls.__dict__.get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _child(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def without_dropped(output: Any, layout: OutputLayout | None) -> Any:
    """``output`` with the leaves ``layout`` names ``"drop"`` as None, as a balanced call returns
    them (``output`` itself where it names none): for calls that go to the ViT directly."""
    if layout is None or "drop" not in layout.kinds.values():
        return output
    leaves, structure = flatten_output(output)
    kept = [None if layout.kind_of(path) == "drop" else leaf for path, leaf in leaves]
    return rebuild_output(structure, kept)


def rebuild_output(structure: Structure, leaves: Sequence[Any]) -> Any:
    """The inverse of :func:`flatten_output`: the same containers around new leaves."""
    return _rebuild(structure, iter(leaves))


def _rebuild(node: Structure, remaining: Iterator[Any]) -> Any:
    if node.node == "leaf":
        return next(remaining)
    values = [_rebuild(c, remaining) for c in node.children]
    container = node.container
    assert container is not None
    if node.node == "model_output":
        return container(**dict(zip(node.keys, values)))
    if node.node == "dict":
        try:
            return container(zip(node.keys, values))
        except TypeError:
            return dict(zip(node.keys, values))
    if node.node == "namedtuple":
        return container(*values)
    if node.node == "dataclass":
        rebuilt = copy.copy(node.template)
        for name, value in zip(node.keys, values):
            object.__setattr__(rebuilt, name, value)
        return rebuilt
    try:
        return container(values)
    except TypeError:
        return tuple(values) if node.node == "tuple" else list(values)


@dataclass(frozen=True)
class Classification:
    """The kind of one output leaf, or why it cannot be routed.

    Attributes:
        kind: One of :data:`OUTPUT_KINDS`.
        problem: 0 when the leaf fits ``kind``; :data:`ROWS_FIT_NO_KIND`: its rows fit no kind
            (``kind`` is then the nearest guess, used to keep the exchange sizes consistent);
            :data:`ROWS_UNLIKE_NAMED_KIND`: the layout names a kind its rows do not fit;
            :data:`WINDOW_INDEX_AMBIGUOUS`: it is one of several outputs that could be the window
            index (``kind`` is then ``"merged"``, which its rows fit); :data:`ROWS_PER_IMAGE_UNNAMED`:
            its rows fit no kind but are one per image, the ``"image"`` kind a layout must name
            (``kind`` is then the nearest guess, as for :data:`ROWS_FIT_NO_KIND`).
        rows: Rows of the leaf.
        expected: Rows the kind requires for this batch.
    """

    kind: str
    problem: int = 0
    rows: int = 0
    expected: int = 0


#: :attr:`Classification.problem` codes: rows that fit no kind; rows other than the kind an
#: :class:`OutputLayout` names needs; one of several integer outputs that could be the window index;
#: rows that fit no token kind, one per image, in an output no layout names ``"image"``.
ROWS_FIT_NO_KIND, ROWS_UNLIKE_NAMED_KIND, WINDOW_INDEX_AMBIGUOUS, ROWS_PER_IMAGE_UNNAMED = 1, 2, 3, 4


def classify_outputs(
    leaves: Sequence[tuple[str, Any]],
    *,
    total_patches: int,
    images: int,
    merge_size: int,
    has_window_index: bool,
    layout: OutputLayout | None,
) -> list[Classification]:
    """Work out the kind of every leaf of a ViT output over a batch of ``total_patches`` patches
    in ``images`` images (grid rows).

    Explicit kinds from ``layout`` win (where it names a window index, no other output is one).
    Otherwise, for a ViT with ``get_window_index``, the window index is its one integer output
    with a row per merged token; where several are, the one whose path ends in ``window_index``,
    and without one, each is reported as a problem (values that travel would otherwise be
    replaced by the regenerated index, silently). Every other leaf goes by
    :func:`classify_output`: integers travel bit for bit, like floats.
    """
    merged_rows = total_patches // (merge_size * merge_size)
    candidates = []
    named_index = layout is not None and any(layout.kind_of(path) == "window_index" for path, _ in leaves)
    if has_window_index and not named_index:
        candidates = [
            k
            for k, (path, leaf) in enumerate(leaves)
            if (layout is None or layout.kind_of(path) is None)
            and isinstance(leaf, torch.Tensor)
            and leaf.dim() >= 1
            and not (leaf.is_floating_point() or leaf.is_complex())
            and int(leaf.shape[0]) == merged_rows
        ]
    named = [k for k in candidates if leaves[k][0].rsplit(".", 1)[-1] == "window_index"]
    chosen = candidates if len(candidates) == 1 else named if len(named) == 1 else []
    kinds = []
    for k, (path, leaf) in enumerate(leaves):
        if k in chosen:
            kinds.append(Classification("window_index"))
        elif k in candidates and not chosen:
            kinds.append(Classification("merged", WINDOW_INDEX_AMBIGUOUS, merged_rows, merged_rows))
        else:
            kinds.append(
                classify_output(
                    path,
                    leaf,
                    total_patches=total_patches,
                    images=images,
                    merge_size=merge_size,
                    layout=layout,
                )
            )
    return kinds


def classify_output(
    path: str,
    leaf: Any,
    *,
    total_patches: int,
    images: int,
    merge_size: int,
    layout: OutputLayout | None,
) -> Classification:
    """Work out the kind of one leaf of a ViT output over a batch of ``total_patches`` patches in
    ``images`` images, by its rows (a window index is told by :func:`classify_outputs`, which sees
    every leaf).

    Explicit kinds from ``layout`` win (``"image"`` needs ``images`` rows); otherwise: non-tensors
    and 0-d tensors pass through; a tensor with ``total_patches`` rows is per patch, with
    ``total_patches / merge_size**2`` rows per merged token (per patch when ``merge_size`` is 1).
    Anything else is reported as a problem; rows that are one per image, as a problem that names
    the ``"image"`` kind (never taken from the rows alone: a batch whose images average one merged
    token each has as many rows of either kind).
    """
    merged_rows = total_patches // (merge_size * merge_size)
    named = layout.kind_of(path) if layout is not None else None
    if named == "drop":
        return Classification("drop")
    if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
        return Classification("passthrough")
    rows = int(leaf.shape[0])
    if named is not None:
        if named in ("passthrough", "window_index"):
            return Classification(named)
        expected = {"patch": total_patches, "merged": merged_rows, "image": images}[named]
        return Classification(named, 0 if rows == expected else ROWS_UNLIKE_NAMED_KIND, rows, expected)
    if rows == total_patches:
        return Classification("patch", 0, rows, rows)
    if rows == merged_rows:
        return Classification("merged", 0, rows, rows)
    # Guess the nearest kind so the exchange stays consistent with ranks that did classify it.
    guess = "patch" if abs(rows - total_patches) <= abs(rows - merged_rows) else "merged"
    # One image alone tells nothing: a row for the whole batch has as many.
    problem = ROWS_PER_IMAGE_UNNAMED if rows == images > 1 else ROWS_FIT_NO_KIND
    return Classification(guess, problem, rows, total_patches if guess == "patch" else merged_rows)


def describe_classification(path: str, found: Classification, merge_size: int) -> str:
    """:func:`describe_output_problem` of the output at ``path`` classified as ``found``."""
    return describe_output_problem(path, found.problem, found.rows, found.expected, merge_size, found.kind)


def describe_output_problem(
    path: str, problem: int, rows: int, expected: int, merge_size: int, kind: str = ""
) -> str:
    """Text of an output problem reported by :func:`classify_outputs` (``kind``: the one it
    reported), the same on every rank."""
    name = f"output {path!r}" if path else "output (a tensor)"
    if problem == WINDOW_INDEX_AMBIGUOUS:
        return (
            f"ViT {name} is one of several integer outputs with a row per merged token of a ViT with "
            "get_window_index, so which one is the window index (regenerated, not sent) is not "
            "clear: name it window_index (a dict key or attribute), or pass "
            "output_layout=OutputLayout(kinds={...}) naming the kinds"
        )
    if problem == ROWS_UNLIKE_NAMED_KIND:
        per = {
            "patch": "a row per patch",
            "merged": f"a row per merged token (merge size {merge_size})",
            "image": "a row per image (K rows per image as [n, K, ...], not [n*K, ...])",
        }
        named = f" {kind!r}, {per[kind]}," if kind in per else ""
        return (
            f"ViT {name} has {rows} rows: the output layout names its kind{named} which needs "
            f"{expected} rows for this batch"
        )
    if problem == ROWS_PER_IMAGE_UNNAMED:
        return (
            f"ViT {name} has {rows} rows, as many as its batch's images, which is neither one row "
            f"per patch nor one row per merged token (merge size {merge_size}): where each row "
            "belongs to one image (a CLS row, a pooled vector, [n, K, D] resampler queries), "
            f'name its kind, output_layout=OutputLayout(kinds={{{path!r}: "image"}}); where '
            "they are the batch's own (not its images'), \"passthrough\" returns each rank the "
            "rows of the batch it encoded"
        )
    return (
        f"ViT {name} has {rows} rows, which is neither one row per patch nor one row per merged "
        f"token (merge size {merge_size}) of its batch (nearest: {expected} rows). Where it is one of "
        "them under another merge size, pass output_layout=OutputLayout(kinds={...}, merge_size=...); "
        "rows that belong to one image each (a CLS row, a pooled vector, a resampler's fixed "
        'queries) are the "image" kind when the output has one row per image: return K such rows '
        'as [n, K, ...], not [n*K, ...]; rows of the batch\'s own (a learned token) are "passthrough"'
    )
