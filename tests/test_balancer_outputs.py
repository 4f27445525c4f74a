"""ViT output handling (single process): flatten/rebuild, classification, merge size, transit packing."""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict, namedtuple
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_vit_balance.outputs import (
    ROWS_PER_IMAGE_UNNAMED,
    WINDOW_INDEX_AMBIGUOUS,
    OutputLayout,
    classify_output,
    classify_outputs,
    describe_output_problem,
    flatten_output,
    merge_size_of,
    rebuild_output,
)
from lightning_vit_balance.wire import elements_per_row, pack_rows, transit_dtype, unpack_rows

Pair = namedtuple("Pair", ["embeds", "extra"])


def _roundtrip(output: Any) -> Any:
    leaves, structure = flatten_output(output)
    return leaves, rebuild_output(structure, [leaf for _, leaf in leaves])


@pytest.mark.parametrize(
    "output",
    [
        torch.ones(3, 2),
        (torch.ones(3, 2), torch.arange(3), [torch.zeros(1, 2), torch.zeros(1, 2)]),
        [torch.ones(2), None],
        {"a": torch.ones(2), "b": {"c": [torch.ones(1)], "d": 3}},
        OrderedDict(x=torch.ones(1), y=None),
        Pair(torch.ones(2, 2), "note"),
    ],
    ids=["tensor", "tuple", "list", "dict", "ordereddict", "namedtuple"],
)
def test_flatten_rebuild_roundtrip(output: Any) -> None:
    leaves, rebuilt = _roundtrip(output)
    assert type(rebuilt) is type(output)
    again, _ = flatten_output(rebuilt)
    assert [p for p, _ in again] == [p for p, _ in leaves]
    for (_, a), (_, b) in zip(again, leaves):
        assert a is b


@dataclasses.dataclass(slots=True)
class SlottedOutput:
    embeds: torch.Tensor
    scale: float = dataclasses.field(default=1.0, init=False)


@dataclasses.dataclass
class PartlySet:
    embeds: torch.Tensor
    later: torch.Tensor = dataclasses.field(init=False)


def test_a_dataclass_field_left_unset_is_not_walked() -> None:
    leaves, structure = flatten_output(PartlySet(torch.ones(2, 3)))
    assert [path for path, _ in leaves] == ["embeds"]
    rebuilt = rebuild_output(structure, [torch.zeros(1, 3)])
    assert rebuilt.embeds.shape == (1, 3) and not hasattr(rebuilt, "later")


def test_flatten_rebuild_dataclasses_without_calling_init_again() -> None:
    """Fields are leaves under their names; the rebuilt instance holds the new leaves, keeps the
    fields ``__init__`` does not take, and is not made by ``__init__`` again (no ``__post_init__``
    applied twice)."""
    output = SlottedOutput(torch.ones(2, 3))
    output.scale = 0.5
    leaves, structure = flatten_output({"out": output})
    assert [path for path, _ in leaves] == ["out.embeds", "out.scale"]
    rebuilt = rebuild_output(structure, [torch.zeros(1, 3), 0.5])["out"]
    assert type(rebuilt) is SlottedOutput and rebuilt.scale == 0.5 and rebuilt.embeds.shape == (1, 3)
    assert output.embeds.shape == (2, 3)  # the ViT's own output is left as it was
    again, _ = flatten_output(rebuild_output(structure, [leaf for _, leaf in leaves]))
    assert all(a is b for (_, a), (_, b) in zip(again, leaves))


class _Slotted:
    __slots__ = ("rows",)

    def __init__(self, rows: Any) -> None:
        self.rows = rows


def test_objects_holding_tensors_outside_the_walked_containers_are_named() -> None:
    from lightning_vit_balance.outputs import unroutable_output

    walked = [("0", torch.ones(1)), ("1", None), ("2", "text"), ("3", 3), ("4", _Slotted([1]))]
    walked.append(("5", SimpleNamespace(loss=torch.tensor(2.0))))  # no rows: passes, as 0-d leaves do
    assert unroutable_output(walked, None) is None
    for held in (_Slotted(torch.ones(1)), {torch.ones(1)}, SimpleNamespace(rows=torch.ones(2, 3))):
        message = unroutable_output([*walked, ("extra", held)], None)
        assert message is not None and f"output 'extra' is a {type(held).__name__} holding tensors" in message
        # Named in the layout, its kind is the caller's decision.
        assert unroutable_output([("extra", held)], OutputLayout(kinds={"extra": "drop"})) is None


def test_tensors_that_are_not_dense_travel_only_where_the_layout_keeps_them_home() -> None:
    from lightning_vit_balance.outputs import unroutable_output

    rows = torch.ones(4, 3)
    nested = torch.nested.nested_tensor([rows[:1], rows[1:]])
    for leaf, name in ((rows.to_sparse(), "sparse"), (nested, "nested")):
        message = unroutable_output([("aux", leaf)], None)
        assert message is not None and f"output 'aux' is a {name} tensor" in message, message
        assert unroutable_output([("aux", leaf)], OutputLayout(kinds={"aux": "merged"})) == message
        for kind in ("drop", "passthrough"):  # never travels: as computed, or None
            assert unroutable_output([("aux", leaf)], OutputLayout(kinds={"aux": kind})) is None


def test_flatten_paths() -> None:
    leaves, _ = flatten_output((torch.ones(1), None, [torch.ones(1), torch.ones(1)]))
    assert [p for p, _ in leaves] == ["0", "1", "2.0", "2.1"]
    leaves, _ = flatten_output({"last_hidden_state": 1, "deepstack_features": [2, 3]})
    assert [p for p, _ in leaves] == ["last_hidden_state", "deepstack_features.0", "deepstack_features.1"]
    leaves, _ = flatten_output(torch.ones(1))
    assert [p for p, _ in leaves] == [""]


def test_flatten_rebuild_hf_model_output() -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs")
    out = outputs.BaseModelOutputWithPooling(
        last_hidden_state=torch.ones(8, 2), pooler_output=torch.ones(2, 3)
    )
    leaves, rebuilt = _roundtrip(out)
    assert type(rebuilt) is type(out) and [p for p, _ in leaves] == ["last_hidden_state", "pooler_output"]
    assert rebuilt.hidden_states is None and rebuilt.pooler_output is out.pooler_output


def _kind(
    leaf: Any, layout: OutputLayout | None = None, window: bool = False, path: str = "x"
) -> tuple[Any, ...]:
    (c,) = classify_outputs(
        [(path, leaf)], total_patches=32, images=3, merge_size=2, has_window_index=window, layout=layout
    )
    return (c.kind, c.problem, c.rows, c.expected)


def test_classify_by_rows() -> None:
    assert _kind(torch.ones(32, 4))[:2] == ("patch", 0)
    assert _kind(torch.ones(8, 4))[:2] == ("merged", 0)
    assert _kind(torch.ones(8, 4, 2))[:2] == ("merged", 0)
    assert _kind(torch.arange(8), window=True)[:2] == ("window_index", 0)
    assert _kind(torch.arange(8))[:2] == ("merged", 0)  # integer, but the ViT has no get_window_index
    for value in (None, 3, "s", torch.tensor(1.0)):
        assert _kind(value)[:2] == ("passthrough", 0)
    # Rows that fit nothing: the nearest kind is guessed (so the exchange stays consistent), with a problem.
    assert _kind(torch.ones(31, 4)) == ("patch", 1, 31, 32)
    assert _kind(torch.ones(7, 4)) == ("merged", 1, 7, 8)
    # Its text names the remedy for each cause: a merge size to declare, or rows that belong to
    # one image each (CLS rows, pooled vectors, a resampler's queries) as [n, K, ...].
    text = describe_output_problem("pooled", 1, 7, 8, 2)
    assert "neither one row per patch nor one row per merged token (merge size 2)" in text, text
    assert "OutputLayout(kinds={...}, merge_size=...)" in text and "as [n, K, ...], not [n*K, ...]" in text
    # A row per image is never taken from the rows alone: reported, naming the kinds to declare,
    # where the batch has several images (a row of one image's batch may be the batch's own).
    assert _kind(torch.ones(3, 4, 5)) == ("merged", ROWS_PER_IMAGE_UNNAMED, 3, 8)
    text = describe_output_problem("pooled", ROWS_PER_IMAGE_UNNAMED, 3, 8, 2)
    assert "3 rows, as many as its batch's images" in text, text
    assert """OutputLayout(kinds={'pooled': "image"})""" in text and '"passthrough"' in text, text
    one = classify_output("x", torch.ones(1, 4), total_patches=32, images=1, merge_size=2, layout=None)
    assert one.problem == 1
    # Merge size 1: per patch.
    c = classify_output("x", torch.ones(32, 1), total_patches=32, images=3, merge_size=1, layout=None)
    assert c.kind == "patch" and c.problem == 0


def _kinds(named_leaves: dict[str, Any], window: bool = True) -> dict[str, tuple[str, int]]:
    leaves = list(named_leaves.items())
    found = classify_outputs(
        leaves, total_patches=32, images=3, merge_size=2, has_window_index=window, layout=None
    )
    return {path: (c.kind, c.problem) for (path, _), c in zip(leaves, found)}


def test_the_window_index_is_one_integer_output_with_a_row_per_merged_token() -> None:
    embeds, index, ids = torch.ones(8, 4), torch.arange(8), torch.arange(8) + 1
    # The seed's tuple: the one integer output of merged rows is the window index.
    assert _kinds({"0": embeds, "1": index})["1"] == ("window_index", 0)
    # Other integer outputs travel bit for bit, by their rows: per patch, or a second merged one
    # told apart by its name; one whose rows fit no kind is reported, never overwritten.
    kinds = _kinds({"embeds": embeds, "window_index": index, "token_ids": ids, "patch_ids": torch.arange(32)})
    assert kinds == {
        "embeds": ("merged", 0),
        "window_index": ("window_index", 0),
        "token_ids": ("merged", 0),
        "patch_ids": ("patch", 0),
    }
    assert _kinds({"0": embeds, "1": index, "2": torch.arange(5)})["2"] == ("merged", 1)
    # Two unnamed candidates: which one to regenerate is not clear, so both are reported.
    assert _kinds({"0": embeds, "1": index, "2": ids}) == {
        "0": ("merged", 0),
        "1": ("merged", WINDOW_INDEX_AMBIGUOUS),
        "2": ("merged", WINDOW_INDEX_AMBIGUOUS),
    }
    # An output layout naming one settles it; without get_window_index no integer output is one.
    found = classify_outputs(
        [("0", embeds), ("1", index), ("2", ids)],
        total_patches=32,
        images=3,
        merge_size=2,
        has_window_index=True,
        layout=OutputLayout(kinds={"1": "window_index", "2": "merged"}),
    )
    assert [(c.kind, c.problem) for c in found] == [("merged", 0), ("window_index", 0), ("merged", 0)]
    # Where it names the window index alone, the other integer output travels: it is no candidate.
    layout = OutputLayout(kinds={"1": "window_index"})
    found = classify_outputs(
        [("0", embeds), ("1", index), ("2", ids)],
        total_patches=32,
        images=3,
        merge_size=2,
        has_window_index=True,
        layout=layout,
    )
    assert [(c.kind, c.problem) for c in found] == [("merged", 0), ("window_index", 0), ("merged", 0)]
    assert _kinds({"0": embeds, "1": index, "2": ids}, window=False)["1"] == ("merged", 0)


def test_classify_with_layout() -> None:
    layout = OutputLayout(kinds={"global": "passthrough", "deep": "merged", "emb": "patch"})
    assert _kind(torch.ones(1, 4), layout, path="global")[:2] == ("passthrough", 0)
    assert _kind(torch.ones(8, 4), layout, path="deep.1")[:2] == ("merged", 0)  # prefix covers children
    assert _kind(torch.ones(32, 4), layout, path="deep.1") == ("merged", 2, 32, 8)
    assert _kind(torch.ones(8, 4), layout, path="emb") == ("patch", 2, 8, 32)
    assert layout.kind_of("deep") == "merged" and layout.kind_of("deeper") is None
    # A row per image, whatever follows it ([n, D] pooled, [n, K, D] queries), once named.
    per_image = OutputLayout(kinds={"pooled": "image"})
    assert _kind(torch.ones(3, 4), per_image, path="pooled") == ("image", 0, 3, 3)
    assert _kind(torch.ones(3, 5, 4), per_image, path="pooled") == ("image", 0, 3, 3)
    assert _kind(torch.ones(8, 4), per_image, path="pooled") == ("image", 2, 8, 3)
    text = describe_output_problem("pooled", 2, 8, 3, 2, kind="image")
    assert "its kind 'image', a row per image (K rows per image as [n, K, ...], not [n*K, ...]), " in text
    assert text.endswith("which needs 3 rows for this batch"), text
    text = describe_output_problem("e", 2, 8, 32, 2, "patch")
    assert "names its kind 'patch', a row per patch, which" in text, text
    assert OutputLayout(kinds={"": "patch"}).kind_of("any.path") == "patch"


def test_output_layout_validation() -> None:
    with pytest.raises(ValueError, match=r"kinds\['x'\]='rows'"):
        OutputLayout(kinds={"x": "rows"})
    with pytest.raises(ValueError, match="merge_size=0"):
        OutputLayout(merge_size=0)
    with pytest.raises(ValueError, match="mapping"):
        OutputLayout(kinds=["x"])  # type: ignore[arg-type]
    assert OutputLayout.of({"x": "image"}) == OutputLayout(kinds={"x": "image"})
    assert OutputLayout.of(None) is None
    with pytest.raises(TypeError, match=r"output_layout=\['x'\] is invalid"):
        OutputLayout.of(["x"])  # type: ignore[arg-type]


def test_merge_size_lookup() -> None:
    class Direct(torch.nn.Module):
        spatial_merge_size = 3

    class FromConfig(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("C", (), {"spatial_merge_size": 4})()

    class Wrapper(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.module = inner

    assert merge_size_of(Direct()) == 3
    assert merge_size_of(FromConfig()) == 4
    assert merge_size_of(Wrapper(FromConfig())) == 4
    assert merge_size_of(torch.nn.Linear(1, 1)) == 1
    assert merge_size_of(Direct(), OutputLayout(merge_size=2)) == 2


@pytest.mark.parametrize("transit", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool])
def test_integer_outputs_travel_bit_exact(dtype: torch.dtype, transit: torch.dtype) -> None:
    """Integers share the floating buffer bit for bit (values far beyond bf16's exact range)."""
    if dtype == torch.bool:
        values = torch.tensor([[True, False, True], [False, False, True]])
    else:
        info = torch.iinfo(dtype)
        values = torch.tensor([[info.max, info.min, 1], [0, info.max - 1, 7]], dtype=dtype)
    packed = pack_rows(values, transit)
    assert packed.dtype == transit and packed.numel() == 2 * elements_per_row(values, transit)
    # Misalign the chunk inside a larger buffer, as in the real return trip.
    buffer = torch.cat([torch.zeros(1, dtype=transit), packed])
    unpacked = unpack_rows(buffer[1:], 2, values)
    assert unpacked.dtype == dtype and torch.equal(unpacked, values)


def test_transit_dtype_only_widens() -> None:
    assert transit_dtype([torch.bfloat16, torch.bfloat16, torch.int64]) == torch.bfloat16
    assert transit_dtype([torch.bfloat16, torch.float32]) == torch.float32
    assert transit_dtype([torch.float16, torch.bfloat16]) == torch.float32
    assert transit_dtype([torch.int32, torch.int64]) == torch.int64
    assert transit_dtype([torch.bool]) == torch.uint8
    floats = torch.randn(5, 3).to(torch.bfloat16)
    assert torch.equal(unpack_rows(pack_rows(floats, torch.float32), 5, floats), floats)


def test_a_layout_names_an_integer_output_so_it_is_never_taken_for_the_window_index() -> None:
    """An integer output with a row per merged token that the layout names ``"merged"`` travels
    bit for bit: taken for the window index, its values would be replaced by the regenerated index
    without a word. It is no candidate either, so the one integer output left unnamed is the index
    (counted as a second candidate, both would be reported as ambiguous)."""
    layout = OutputLayout(kinds={"ids": "merged"})
    (ids,) = classify_outputs(
        [("ids", torch.arange(4))],
        total_patches=16,
        images=1,
        merge_size=2,
        has_window_index=True,
        layout=layout,
    )
    assert (ids.kind, ids.problem) == ("merged", 0)
    found = classify_outputs(
        [("ids", torch.arange(4)), ("index", torch.arange(4))],
        total_patches=16,
        images=1,
        merge_size=2,
        has_window_index=True,
        layout=layout,
    )
    assert [(c.kind, c.problem) for c in found] == [("merged", 0), ("window_index", 0)]


def test_a_layout_path_takes_the_kind_of_its_nearest_named_ancestor() -> None:
    """A layout that names a whole list and one of its entries otherwise means the entry's own
    kind for everything below it: the list's would send the entry's bytes where it asked to drop
    them (or drop what it asked to keep)."""
    layout = OutputLayout({"2": "merged", "2.1": "drop"})
    assert layout.kind_of("2.1.0") == "drop"
    assert layout.kind_of("2.1") == "drop"
    assert layout.kind_of("2.0") == "merged"
    assert OutputLayout({"": "patch", "2": "merged"}).kind_of("2.1") == "merged"


def test_the_towers_own_merge_size_wins_over_its_configs() -> None:
    """A tower that sets ``spatial_merge_size`` itself (changed after its config was read) merges
    by that size: the config's would cut its merged outputs at the wrong rows."""

    class Tower(torch.nn.Module):
        spatial_merge_size = 2

        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(spatial_merge_size=4)

    assert merge_size_of(Tower()) == 2


def test_nested_wrappers_are_unwrapped_to_the_tower() -> None:
    """A tower under activation checkpointing under DDP is two wrappers deep: one level only would
    find no merge size (1, its merged outputs then taken for rows per patch) and no
    ``get_window_index``."""
    from lightning_vit_balance.outputs import unwrap_module, window_index_fn

    class Tower(torch.nn.Module):
        spatial_merge_size = 2

        def get_window_index(self, grid_thw: torch.Tensor) -> torch.Tensor:
            return grid_thw

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self._checkpoint_wrapped_module = inner

    class DataParallel(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.module = inner

    tower = Tower()
    wrapped = DataParallel(Checkpointed(tower))
    assert unwrap_module(wrapped) is tower
    assert merge_size_of(wrapped) == 2
    assert window_index_fn(wrapped) is not None


@pytest.mark.parametrize("merge_size", [True, False, 2.0, 0])
def test_a_merge_size_that_is_not_a_positive_int_is_refused_naming_the_argument(merge_size: Any) -> None:
    """``True`` is an int to Python, and would merge by 1 without a word: a flag passed in the
    merge size's place (or a float read from a config) is refused where it is passed."""
    expected = re.escape(f"OutputLayout.merge_size={merge_size!r} is invalid: expected an int >= 1")
    with pytest.raises(ValueError, match=expected):
        OutputLayout(merge_size=merge_size)
