"""Input problems a rank can report in the metadata gather: one table, one template per problem.

A rank validates its own input without communicating, then sends a problem code and up to
:data:`MAX_DETAILS` integers in its gather header, so bad input on one rank raises the same
``ValueError`` on every rank instead of leaving the others waiting in a collective. Each problem is
defined once, in :data:`PROBLEMS`: its named integer fields (the order they travel in) and the
message template that renders them. Adding a check means adding one row here and the check
itself where the input is validated.

Fields whose name ends in ``_dtype`` are rendered as dtype names (codes index :data:`DTYPES`);
fields ending in ``_device`` as device types (codes index :data:`DEVICE_TYPES`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import torch

__all__ = [
    "DEVICE_TYPES",
    "DTYPES",
    "GRID_DTYPES",
    "GRID_DTYPE_NAMES",
    "INPUT_KINDS",
    "MAX_DETAILS",
    "PIXEL_DTYPES",
    "PROBLEMS",
    "InputProblem",
    "ProblemTemplate",
    "UncombinedInput",
    "dense_problem",
    "describe_problem",
    "input_kind_code",
    "layout_code",
    "problem_details",
]

#: Dtypes a rank can report, by code (index in this tuple): the floating and integer ones first,
#: then those listed only so that the errors refusing them can name them.
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
    # Not carried: listed so that the errors that refuse them can name them.
    *(
        getattr(torch, name)
        for name in (
            "complex64",
            "complex128",
            "complex32",
            "float8_e4m3fn",
            "float8_e5m2",
            "float8_e4m3fnuz",
            "float8_e5m2fnuz",
            "uint16",
            "uint32",
            "uint64",
        )
        if hasattr(torch, name)  # the uint and fnuz types are newer than torch 2.1
    ),
)
#: The dtypes ``grid_thw`` may have: a rank encoding another's images builds their grid rows in its
#: own grid's dtype, which must hold any rank's values (a W of 130 wraps around in int8).
GRID_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
#: The dtypes ``pixel_values`` may have: floating dtypes every backend's collectives carry (gloo
#: and NCCL carry no float8, and a float8 rank next to one building empty float32 rows would leave
#: it waiting in the pixel trip).
PIXEL_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: ``GRID_DTYPES`` as the error messages spell them ("int32 or int64").
GRID_DTYPE_NAMES = " or ".join(str(dtype).removeprefix("torch.") for dtype in GRID_DTYPES)
#: Device types a rank can report, by code.
DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda", "meta", "other")
#: Integers of detail each problem may carry in the gather header.
MAX_DETAILS = 4
#: Tensor layouts a rank can report, by code: the collectives and the checks take dense tensors.
LAYOUTS: tuple[str, ...] = ("strided", "sparse", "nested", "mkldnn", "non-strided")
#: Which argument a layout problem names, by code.
ARGUMENTS: tuple[str, ...] = ("pixel_values", "grid_thw")
#: Python types an input that is not a tensor is told by (see :func:`input_kind_code`), in order.
_INPUT_TYPES: tuple[type, ...] = (type(None), bool, int, float, str, list, tuple, dict)
#: What such an input is, by code, as the messages say it: those types, a NumPy array, another.
INPUT_KINDS: tuple[str, ...] = (
    "None",
    "a bool",
    "an int",
    "a float",
    "a str",
    "a list",
    "a tuple",
    "a dict",
    "a numpy.ndarray",
    "an object of another type",
)


class InputProblem(IntEnum):
    """Problem codes carried in the metadata gather (0 = valid); each has a row in :data:`PROBLEMS`."""

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
    GRID_DEVICE = 13
    PREPARED_GRID_VALUES = 14
    PREPARED_SKIPPED_MISMATCH = 15
    NOT_COMBINED = 16
    LAYOUT = 17


def input_kind_code(value: object) -> int:
    """The code in :data:`INPUT_KINDS` of what ``value`` (not a tensor) is (a NumPy array told by
    its type's name, so that NumPy need not be imported here)."""
    code = next((code for code, kind in enumerate(_INPUT_TYPES) if isinstance(value, kind)), None)
    if code is not None:
        return code
    numpy_array = (type(value).__module__, type(value).__name__) == ("numpy", "ndarray")
    return INPUT_KINDS.index("a numpy.ndarray" if numpy_array else "an object of another type")


def _input_kind_text(values: dict[str, int]) -> dict[str, object]:
    code = values["given"]
    return {"given_text": INPUT_KINDS[code] if 0 <= code < len(INPUT_KINDS) else INPUT_KINDS[-1]}


def layout_code(tensor: torch.Tensor) -> int:
    """The code in :data:`LAYOUTS` of ``tensor``'s layout (0 for a dense tensor)."""
    if tensor.is_nested:
        return LAYOUTS.index("nested")
    if tensor.layout == torch.strided:
        return LAYOUTS.index("strided")
    if tensor.layout == torch._mkldnn:  # type: ignore[attr-defined]
        return LAYOUTS.index("mkldnn")
    sparse = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
    return LAYOUTS.index("sparse") if tensor.layout in sparse else LAYOUTS.index("non-strided")


def dense_problem(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> dict[str, int] | None:
    """The :attr:`InputProblem.LAYOUT` details of the first of the two that is not a dense tensor
    (which the checks and the collectives take), or None: in a call and against a plan made ahead."""
    for argument, tensor in enumerate((pixel_values, grid_thw)):
        layout = layout_code(tensor)
        if layout:
            return {"argument": argument, "layout": layout}
    return None


@dataclass(frozen=True)
class UncombinedInput:
    """What a caller that joins several inputs into one call (the drop-in's images and videos)
    passes as ``grid_thw`` where they could not be joined: every rank then raises, naming this
    cause, where a missing grid would read as a type error the user never made.

    Attributes:
        problems: Why, as this rank found it (travels in the status where a plan was made ahead;
            the metadata gather's problem code cannot carry text).
    """

    problems: tuple[str, ...]

    def __str__(self) -> str:
        return "its images and videos could not be encoded together: " + "; ".join(self.problems)


@dataclass(frozen=True)
class ProblemTemplate:
    """How one problem's detail integers travel and read.

    Attributes:
        fields: Names of the detail integers, in the order they travel (at most :data:`MAX_DETAILS`).
        template: ``str.format`` text over the fields (and any names ``derive`` adds).
        derive: Optional extra names computed from the fields, for messages whose wording depends on
            the values (a shape of variable length, which device index was expected).
    """

    fields: tuple[str, ...]
    template: str
    derive: Callable[[dict[str, int]], dict[str, object]] | None = field(default=None, compare=False)

    def render(self, values: Mapping[str, int]) -> str:
        named: dict[str, object] = dict(values)
        for name, value in values.items():
            if name.endswith("_dtype"):
                named[name] = str(DTYPES[value]) if 0 <= value < len(DTYPES) else "an unsupported dtype"
            elif name.endswith("_device"):
                named[name] = DEVICE_TYPES[value] if 0 <= value < len(DEVICE_TYPES) else "unknown"
        if self.derive is not None:
            named.update(self.derive(dict(values)))
        return self.template.format(**named)


def _dtype_text(code: int) -> str:
    if 0 <= code < len(DTYPES):
        return f"dtype {DTYPES[code]}"
    return "a dtype the collectives do not carry (float8 or another: cast the rows before the call)"


def _grid_shape(values: dict[str, int]) -> dict[str, object]:
    ndim = values["ndim"]
    sizes = [values["size0"], values["size1"], values["size2"]]
    shape = tuple(sizes[:ndim]) if 0 <= ndim <= 3 else ()
    return {"shape": shape, "more": "" if ndim <= 3 else f" ({ndim} dims)"}


def _device_text(values: dict[str, int]) -> dict[str, object]:
    have = DEVICE_TYPES[values["have_device"]] if values["have_device"] < len(DEVICE_TYPES) else "unknown"
    want = DEVICE_TYPES[values["want_device"]] if values["want_device"] < len(DEVICE_TYPES) else "unknown"
    if values["have_device"] == values["want_device"]:
        text = (
            f"is on {have}:{values['have_index']}: expected the current device {have}:"
            f"{values['want_index']}, which the process group's backend communicates on"
        )
    else:
        text = f"is on a {have} device: the process group's backend carries {want} tensors"
    return {"text": text}


_DEVICE_FIELDS = ("have_device", "want_device", "have_index", "want_index")

#: Every input problem: its detail fields and message, defined once.
PROBLEMS: dict[InputProblem, ProblemTemplate] = {
    InputProblem.GRID_NOT_TENSOR: ProblemTemplate(
        ("given",),
        "grid_thw is {given_text}, not a torch.Tensor: expected an integer tensor of shape [n_images, 3]",
        _input_kind_text,
    ),
    InputProblem.GRID_SHAPE: ProblemTemplate(
        ("ndim", "size0", "size1", "size2"),
        "grid_thw has shape {shape}{more}: expected [n_images, 3]",
        _grid_shape,
    ),
    InputProblem.GRID_DTYPE: ProblemTemplate(
        ("grid_dtype",), f"grid_thw has dtype {{grid_dtype}}: expected {GRID_DTYPE_NAMES}"
    ),
    InputProblem.GRID_VALUE: ProblemTemplate(
        ("index", "t", "h", "w"),
        "grid_thw[{index}] = [{t}, {h}, {w}]: expected positive integers (T, H, W) for every image, "
        "whose product T*H*W and sum over the images stay below 2**62",
    ),
    InputProblem.PIXELS_NOT_TENSOR: ProblemTemplate(
        ("given",),
        "pixel_values is {given_text}, not a torch.Tensor: expected a float tensor of shape [sum(T*H*W), C]",
        _input_kind_text,
    ),
    InputProblem.PIXELS_SHAPE: ProblemTemplate(
        ("ndim",), "pixel_values has {ndim} dims: expected a 2-D tensor [sum(T*H*W), C]"
    ),
    InputProblem.PIXELS_DTYPE: ProblemTemplate(
        ("pixel_dtype",),
        "pixel_values has {pixel_text}: expected float32, float16, bfloat16 or float64",
        lambda values: {"pixel_text": _dtype_text(values["pixel_dtype"])},
    ),
    InputProblem.PIXEL_ROWS: ProblemTemplate(
        ("rows", "expected"), "pixel_values has {rows} rows: expected sum(T*H*W) over grid_thw = {expected}"
    ),
    InputProblem.NOT_DIVISIBLE: ProblemTemplate(
        ("index", "h", "w", "merge"),
        "grid_thw[{index}] has H={h}, W={w}: expected both divisible by the ViT's spatial merge size {merge}",
    ),
    InputProblem.DEVICE: ProblemTemplate(_DEVICE_FIELDS, "pixel_values {text}", _device_text),
    InputProblem.GRID_DEVICE: ProblemTemplate(_DEVICE_FIELDS, "grid_thw {text}", _device_text),
    InputProblem.PREPARED_GRID_VALUES: ProblemTemplate(
        (),
        "an earlier call given a prepared plan passed a grid_thw on its device whose values differ from "
        "that plan's (same shape and rows; compared on the device and read at this rank's next gather, so "
        "that the forward never waited): that call encoded its images with the prepared grid rows. "
        "Expected each call to pass the grid_thw its plan was prepared from",
    ),
    InputProblem.LAYOUT: ProblemTemplate(
        ("argument", "layout"),
        "{argument_name} is a {layout_name} tensor: expected a dense (strided) tensor",
        lambda values: {
            "argument_name": ARGUMENTS[values["argument"]],
            "layout_name": LAYOUTS[values["layout"]],
        },
    ),
    InputProblem.NOT_COMBINED: ProblemTemplate(
        (),
        "its images and videos could not be encoded together (that rank's own error says why: rows that "
        "do not match a modality's grid, modalities of different row widths, or no rows where the ViT's "
        "config tells no width)",
    ),
    InputProblem.PREPARED_SKIPPED_MISMATCH: ProblemTemplate(
        (),
        "an earlier call given a prepared plan that moved no image passed input that does not match that "
        "plan (this rank warned what differed): that call encoded this rank's own batch directly, as an "
        "unbalanced call would, and raised at this rank's next gather so that every rank raises together. "
        "Expected each call to pass the batch its plan was prepared from",
    ),
    InputProblem.CHANNELS_MISMATCH: ProblemTemplate(
        ("channels", "other_rank", "other_channels"),
        "pixel_values has C={channels} channels while rank {other_rank} has C={other_channels}: "
        "expected the same C",
    ),
    InputProblem.DTYPE_MISMATCH: ProblemTemplate(
        ("pixel_dtype", "other_rank", "other_dtype"),
        "pixel_values has dtype {pixel_dtype} while rank {other_rank} has {other_dtype}: "
        "expected the same dtype on every rank with images",
    ),
}


def describe_problem(code: int, details: Sequence[int]) -> str:
    """Text of a problem code and its detail integers; the same string on every rank."""
    problem = InputProblem(code)
    if problem is InputProblem.OK:
        return "valid input"
    template = PROBLEMS[problem]
    padded = [int(d) for d in details] + [0] * (len(template.fields) - len(details))
    return template.render(dict(zip(template.fields, padded)))


def problem_details(problem: InputProblem, **values: int) -> tuple[int, ...]:
    """The detail integers of ``problem`` in travel order, from its named fields.

    Raises:
        ValueError: ``values`` does not name exactly the problem's fields (a programming error).
    """
    fields = PROBLEMS[problem].fields
    if set(values) != set(fields):
        raise ValueError(f"{problem.name} takes the fields {fields}: got {tuple(sorted(values))}.")
    return tuple(int(values[name]) for name in fields)
