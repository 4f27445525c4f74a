"""Reading a dataset's visual sizes and a timing file, with errors that point at the input.

Dataset files (one sample per JSON line, or one image or video per CSV row) become a
:class:`VisualDataset`: the patch count ``t * h * w`` and the temporal steps ``t`` of every visual
of every sample. Timing
files (patch counts and milliseconds) become two arrays for :meth:`CostModel.fit`.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from lightning_vit_balance.simulate.sizes import ResizeRule

__all__ = ["GRID_KEYS", "SIZE_KEYS", "InputError", "VisualDataset", "read_dataset", "read_timings"]

#: JSON Lines keys holding processor grids: lists of ``[t, h, w]`` rows.
GRID_KEYS: tuple[str, ...] = ("image_grid_thw", "video_grid_thw")
#: JSON Lines keys holding raw sizes: lists of ``{"width", "height"}`` / ``{"width", "height", "frames"}``.
SIZE_KEYS: tuple[str, ...] = ("images", "videos")
_FLAT_KEYS = ("width", "height")
# Stands for the value of an absent key or column in error messages.
_MISSING: Any = type("Missing", (), {"__repr__": lambda self: "missing"})()


class InputError(ValueError):
    """A dataset or timing file holds something unexpected; the message names where and what."""

    def __init__(self, path: str | Path, line: int, field: str, value: object, expected: str) -> None:
        self.path, self.line, self.field = str(path), line, field
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        super().__init__(f"{path}:{line}: field {field!r} is {shown}: expected {expected}.")
        self.value, self.expected = value, expected


@dataclass(frozen=True)
class VisualDataset:
    """Patch counts of every sample's images and videos (a text-only sample has none).

    Attributes:
        source: Where it was read from.
        samples: ``samples[s]``: patches ``t * h * w`` of sample ``s``'s images, then its videos.
        num_images: Images over all samples.
        num_videos: Videos over all samples.
        frames: ``frames[s]``: the temporal steps ``t`` of the same visuals (shaped like
            ``samples``); empty: 1 each.
    """

    source: str
    samples: tuple[tuple[int, ...], ...]
    num_images: int
    num_videos: int
    frames: tuple[tuple[int, ...], ...] = ()


class _Where:
    """Raises :class:`InputError` for one line of one file."""

    def __init__(self, path: str | Path, line: int) -> None:
        self.path, self.line = path, line

    def fail(self, field: str, value: object, expected: str) -> NoReturn:
        raise InputError(self.path, self.line, field, value, expected)

    def positive_int(self, field: str, value: object) -> int:
        if isinstance(value, str):
            value = _parse_int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            self.fail(field, value, "a positive integer")
        if value >= 2**31:  # patches t*h*w must fit the planner's int64 sums
            self.fail(field, value, "a positive integer below 2**31")
        return int(value)  # type: ignore[arg-type]

    def entry(self, record: Any, key: str, field: str) -> Any:
        if not isinstance(record, dict):
            self.fail(field, record, "a JSON object")
        if key not in record:
            self.fail(_join(field, key), _MISSING, f"a value for {key!r}")
        return record[key]


def _join(field: str, key: str) -> str:
    return f"{field}.{key}" if field else key


def _parse_int(text: str) -> int | str:
    try:
        return int(text.strip())
    except ValueError:
        return text


#: The most temporal steps a grid row may hold: about 36 hours of video at the Qwen-VL processors'
#: 2 frames a second and 2 frames a step, far beyond any processor's frame limit (768 frames).
MOST_STEPS = 65_536
#: The most patches a frame of the Qwen-VL processors has under their default pixel limits.
_LARGEST_DEFAULT_PATCHES = 65_536
#: A visual: (patches ``t * h * w``, temporal steps ``t``).
_Visual = tuple[int, int]


def _grid_patches(where: _Where, field: str, row: object, rule: ResizeRule) -> _Visual:
    """Patches and steps of one ``[t, h, w]`` row, checking that ``h`` and ``w`` are multiples of
    the merge."""
    if not isinstance(row, (list, tuple)) or len(row) != 3:
        where.fail(field, row, "a [t, h, w] list of three positive integers")
    t, h, w = (where.positive_int(field, value) for value in row)
    if h % rule.merge_size or w % rule.merge_size:
        where.fail(field, row, f"h and w divisible by the merge size {rule.merge_size}")
    _check_steps(where, field, row, t, "t counts temporal patches")
    limit = _most_patches_a_frame(rule)
    if h * w > limit:  # the grid counts pixels: every plan would be priced wrong
        where.fail(
            field,
            row,
            f"at most {limit:,} patches a frame (four times the Qwen-VL processors' largest default "
            "limit, or 16 times that of --max-pixels or --video-max-pixels): grid rows count patches, "
            "not pixels; raise --max-pixels if your processor allows such frames",
        )
    return t * h * w, t


def _most_patches_a_frame(rule: ResizeRule) -> int:
    """The most patches a grid row's frame may hold: four times the largest default limit of the
    Qwen-VL processors (65,536 patches: Qwen2.5-VL's 12,845,056 pixels of 14 px, Qwen3-VL's
    16,777,216 of 16 px), or 16 times ``rule``'s larger pixel limit where that is more. A grid
    written in pixels (``[1, 1080, 1920]``: 2,073,600) is far beyond it."""
    return max(
        4 * _LARGEST_DEFAULT_PATCHES, 16 * max(rule.max_pixels, rule.video_max_pixels) // rule.patch_size**2
    )


def _size_patches(where: _Where, field: str, entry: object, rule: ResizeRule, video: bool) -> _Visual:
    """Patches and steps of one ``{"width", "height"[, "frames"]}`` entry under ``rule``."""
    width = where.positive_int(_join(field, "width"), where.entry(entry, "width", field))
    height = where.positive_int(_join(field, "height"), where.entry(entry, "height", field))
    frames = where.positive_int(_join(field, "frames"), where.entry(entry, "frames", field)) if video else 0
    try:
        t, h, w = rule.video_grid(width, height, frames) if video else rule.image_grid(width, height)
    except ValueError as error:  # the aspect ratio: the processors refuse such pictures
        where.fail(field or "width", entry, f"a size the processor accepts ({error})")
    if video:
        _check_steps(where, _join(field, "frames"), frames, t, f"{rule.temporal_patch_size} frames a step")
    return t * h * w, t


def _check_steps(where: _Where, field: str, value: object, steps: int, unit: str) -> None:
    """Refuse a video of more than :data:`MOST_STEPS` temporal steps: a frame count in pixels or a
    stray number, which ``--split-videos`` would plan as that many items."""
    if steps > MOST_STEPS:
        where.fail(field, value, f"at most {MOST_STEPS:,} temporal steps ({unit}), not {steps:,}")


def _list_of(where: _Where, key: str, value: object) -> list[Any]:
    if value is None:  # how some pipelines store "no images"
        return []
    if not isinstance(value, list):
        where.fail(key, value, "a list (empty or null for none)")
    return value


_EXPECTED_KEYS = (
    "at least one of 'image_grid_thw', 'video_grid_thw', 'images', 'videos' (a list each, empty for "
    "a text-only sample), or 'width' and 'height' (plus 'frames' for a video)"
)


def _json_sample(where: _Where, record: object, rule: ResizeRule) -> tuple[list[_Visual], list[_Visual]]:
    """(images, videos) of one JSON Lines sample."""
    if not isinstance(record, dict):
        where.fail("<line>", record, "a JSON object (one sample)")
    images: list[_Visual] = []
    videos: list[_Visual] = []
    found = [key for key in (*GRID_KEYS, *SIZE_KEYS) if key in record]
    for key in found:
        rows = _list_of(where, key, record[key])
        target = videos if key.startswith("video") else images
        for i, row in enumerate(rows):
            if key in GRID_KEYS:
                target.append(_grid_patches(where, f"{key}[{i}]", row, rule))
            else:
                target.append(_size_patches(where, f"{key}[{i}]", row, rule, key == "videos"))
    if not found:
        if not any(key in record for key in _FLAT_KEYS):
            where.fail("<keys>", sorted(record), _EXPECTED_KEYS)
        video = record.get("frames") is not None
        (videos if video else images).append(_size_patches(where, "", record, rule, video))
    return images, videos


def _text_lines(path: Path) -> Iterator[str]:
    """``path``'s lines as UTF-8 text (a byte order mark, as spreadsheets write, is skipped), or an
    :class:`InputError` naming the line that is not UTF-8."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                yield raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                shown = raw[max(error.start - 20, 0) : error.end + 20]
                _Where(path, number).fail(
                    "<line>", shown, f"UTF-8 text ({error.reason} at byte {error.start})"
                )


def _json_lines(path: Path) -> Iterator[tuple[_Where, object]]:
    for number, text in enumerate(_text_lines(path), start=1):
        if not text.strip():
            continue
        where = _Where(path, number)
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            where.fail("<line>", text.strip(), f"one JSON object per line ({error.msg})")
        yield where, record


def _csv_rows(
    path: Path, required: tuple[str, ...], note: str = ""
) -> Iterator[tuple[_Where, dict[str, str]]]:
    reader = csv.DictReader(_text_lines(path))
    columns = [name.strip() for name in reader.fieldnames or []]
    for name in required:
        if name not in columns:
            expected = f"a header row with the columns {', '.join(required)}{note}"
            _Where(path, 1).fail(name, _MISSING, expected)
    for row in reader:
        where = _Where(path, reader.line_num)
        if None in row:  # cells beyond the header's columns
            where.fail("<row>", [*row.values()][:-1] + row[None], f"{len(columns)} cells, as the header has")
        cells = {(k or "").strip(): (v or "").strip() for k, v in row.items()}
        if any(cells.values()):
            yield where, cells


def _is_csv(path: Path) -> bool:
    if path.suffix.lower() == ".csv":
        return True
    if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        return False
    with open(path, encoding="utf-8-sig", errors="replace") as handle:  # reading tells what is not
        return not handle.read(4096).lstrip().startswith("{")


def _read_json_dataset(path: Path, rule: ResizeRule) -> list[tuple[list[_Visual], list[_Visual]]]:
    return [_json_sample(where, record, rule) for where, record in _json_lines(path)]


def _read_csv_dataset(path: Path, rule: ResizeRule) -> list[tuple[list[_Visual], list[_Visual]]]:
    """One image or video per row; rows sharing a non-empty ``sample`` cell form one sample; a row
    with ``width``, ``height`` and ``frames`` empty (but another cell filled) is a text-only sample."""
    samples: dict[object, tuple[list[_Visual], list[_Visual]]] = {}
    rows = _csv_rows(path, ("width", "height"), " (optional: frames for videos, sample to group rows)")
    for where, cells in rows:
        entry = {k: cells[k] for k in ("width", "height", "frames") if cells.get(k)}
        images, videos = samples.setdefault(cells.get("sample") or ("row", where.line), ([], []))
        if entry:
            video = "frames" in entry
            (videos if video else images).append(_size_patches(where, "", entry, rule, video))
    return list(samples.values())


def read_dataset(path: str | Path, rule: ResizeRule | None = None) -> VisualDataset:
    """Read a dataset's visual sizes.

    Args:
        path: JSON Lines (one sample per line, see :data:`GRID_KEYS` and :data:`SIZE_KEYS`) or CSV
            (columns ``width``, ``height``, optional ``frames`` and ``sample``; one visual per row).
            ``.csv`` files are CSV, ``.jsonl``/``.json``/``.ndjson`` JSON Lines; otherwise a file
            whose first character is ``{`` is JSON Lines.
        rule: Turns raw sizes into grids; default Qwen2-VL's. Grid rows are checked against its
            ``merge_size``.

    Raises:
        InputError: naming the file, line, field and what was expected.
        OSError: the file cannot be read.
    """
    path = Path(path)
    rule = rule if rule is not None else ResizeRule()
    reader: Callable[[Path, ResizeRule], list[tuple[list[_Visual], list[_Visual]]]]
    reader = _read_csv_dataset if _is_csv(path) else _read_json_dataset
    parsed = reader(path, rule)
    if not any(images or videos for images, videos in parsed):
        raise InputError(path, max(len(parsed), 1), "<samples>", len(parsed), "at least one image or video")
    return VisualDataset(
        source=str(path),
        samples=tuple(tuple(n for n, _ in images + videos) for images, videos in parsed),
        num_images=sum(len(images) for images, _ in parsed),
        num_videos=sum(len(videos) for _, videos in parsed),
        frames=tuple(tuple(t for _, t in images + videos) for images, videos in parsed),
    )


def _milliseconds(where: _Where, value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number < 0:
        where.fail("milliseconds", value, "a finite number >= 0")
    return number


def _timing_row(where: _Where, record: object, rule: ResizeRule) -> tuple[int, float]:
    if isinstance(record, dict) and "patch_count" not in record and "grid_thw" in record:
        patches, steps = _grid_patches(where, "grid_thw", record["grid_thw"], rule)
        if steps > 1:  # a whole-item fit would price its attention as one sequence of t*h*w
            where.fail(
                "grid_thw", record["grid_thw"], "t = 1: the fit is a whole-item model; give patch_count"
            )
    else:
        patches = where.positive_int("patch_count", where.entry(record, "patch_count", ""))
    return patches, _milliseconds(where, where.entry(record, "milliseconds", ""))


def read_timings(path: str | Path, rule: ResizeRule | None = None) -> tuple[list[int], list[float]]:
    """Patch counts and milliseconds of timed ViT calls, for :meth:`CostModel.fit`.

    Args:
        path: CSV with the columns ``patch_count`` and ``milliseconds`` (others are ignored), or
            JSON Lines of ``{"patch_count": n, "milliseconds": x}`` (or ``"grid_thw": [t, h, w]``
            instead of ``patch_count``), one timed image, or batch of equal images, per row.
        rule: Checks ``grid_thw`` rows against its merge size.

    Raises:
        InputError: a bad row, or fewer than two rows.
    """
    path = Path(path)
    rule = rule if rule is not None else ResizeRule()
    if _is_csv(path):
        rows = [_timing_row(w, c, rule) for w, c in _csv_rows(path, ("patch_count", "milliseconds"))]
    else:
        rows = [_timing_row(w, record, rule) for w, record in _json_lines(path)]
    if len(rows) < 2:
        raise InputError(path, max(len(rows), 1), "<rows>", len(rows), "at least two timed rows to fit")
    return [n for n, _ in rows], [ms for _, ms in rows]
