"""The what-would-I-gain simulator: sizes to grids, dataset files, simulated figures, the command."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_vit_balance import CostModel, RebalancePlan, ViTBalanceConfig, plan_rebalance
from lightning_vit_balance.simulate import (
    InputError,
    ResizeRule,
    draw_batches,
    main,
    read_dataset,
    read_timings,
    simulate,
    smart_resize,
)
from lightning_vit_balance.simulate.costs import (
    VIT_PRESETS,
    coefficients_model,
    named_cost_model,
    vit_shape_model,
)
from lightning_vit_balance.simulate.report import result_summary

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "sample_visual_sizes.jsonl"
QWEN2 = {"factor": 28, "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280}

# ----------------------------------------------------------------------------- sizes to grids


@pytest.mark.parametrize(
    ("height", "width", "expected"),
    [
        # 224/28 = 8 exactly; 224*224 lies within [min, max]: unchanged.
        (224, 224, (224, 224)),
        # 42/28 = 1.5 and 70/28 = 2.5 both round to the even 2 (Python's round): 56 x 56 = min_pixels.
        (42, 70, (56, 56)),
        # 20x30 rounds to 28x28 = 784 < 3136: scale by sqrt(3136/600) = 2.286, ceil: 1.63 -> 2, 2.45 -> 3.
        (20, 30, (56, 84)),
        # 3024x4032 rounds to itself (108 and 144 * 28), 12.19 MP > max: scale by 1/3.486, floor:
        # 3024/3.486/28 = 30.98 -> 30, 4032/3.486/28 = 41.31 -> 41.
        (3024, 4032, (840, 1148)),
        # 1000/28 = 35.7 -> 36, 1008^2 > max: scale by 1/0.99825, floor 35.78 -> 35.
        (1000, 1000, (980, 980)),
    ],
)
def test_smart_resize_hand_computed(height: int, width: int, expected: tuple[int, int]) -> None:
    assert smart_resize(height, width, **QWEN2) == expected


def test_grids_hand_computed() -> None:
    rule = ResizeRule()
    assert rule.image_grid(4032, 3024) == (1, 60, 82)  # width, height: 840/14 = 60, 1148/14 = 82
    assert rule.image_grid(224, 224) == (1, 16, 16)
    # 640x360 video: 364 x 644 (13 and 23 * 28) is within the video limits; 16 frames -> 8 steps.
    assert rule.video_grid(640, 360, 16) == (8, 26, 46)
    # An odd frame count repeats the last frame: 5 frames -> 3 steps.
    assert rule.video_grid(640, 360, 5) == (3, 26, 46)
    # 1280x720 rounds to 728 x 1288 > 602112: scale by 1/1.2372, floor: 20.78 -> 20, 36.95 -> 36.
    assert rule.video_grid(1280, 720, 16) == (8, 40, 72)
    # 160x120 rounds to 112 x 168 < 100352: scale by 2.2862, ceil: 9.80 -> 10, 13.06 -> 14.
    assert rule.video_grid(160, 120, 4) == (2, 20, 28)
    # With a 1000-token video budget: 1000*784*0.9*2 // 16 = 88200 per frame, floored at
    # 1.05 * 100352 = 105369; 360x640 scaled by 1/1.4787, floor: 8.70 -> 8, 15.46 -> 15.
    assert ResizeRule(video_max_tokens=1000).video_grid(640, 360, 16) == (8, 16, 30)
    # A budget above the floor: 16384*784*0.9*2 // 32 = 722534 per frame, the 602112 cap binds as at
    # 1280x720 (without the temporal patch size, 361267 px: 32 x 56).
    assert ResizeRule(video_max_tokens=16384).video_grid(1920, 1080, 32) == (16, 40, 72)
    # Qwen3-VL style patches of 16: factor 32; 512 and 768 are multiples of it, 393216 px fit.
    assert ResizeRule(patch_size=16).image_grid(768, 512) == (1, 32, 48)


def test_resize_rejects_bad_sizes_and_settings() -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        ResizeRule().image_grid(20100, 100)
    with pytest.raises(ValueError, match="must both be positive"):
        smart_resize(0, 10, **QWEN2)
    with pytest.raises(ValueError, match=r"ResizeRule\.min_pixels=.*at most max_pixels"):
        ResizeRule(min_pixels=10, max_pixels=5)
    with pytest.raises(ValueError, match=r"ResizeRule\.patch_size=0"):
        ResizeRule(patch_size=0)


def test_smart_resize_matches_transformers() -> None:
    """Extra check against transformers' own function and image processor, when installed."""
    pytest.importorskip("transformers")
    try:  # transformers 5 keeps the PIL-based processor (and smart_resize) here
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as module

        processor_class = module.Qwen2VLImageProcessorPil
    except ImportError:  # 4.x
        from transformers.models.qwen2_vl import image_processing_qwen2_vl as module

        processor_class = module.Qwen2VLImageProcessor
    rng = np.random.default_rng(0)
    sides = np.unique(np.concatenate([rng.integers(1, 9000, 400), [14, 27, 28, 42, 70, 98, 126]]))
    pairs = [(int(h), int(w)) for h in sides[::7] for w in sides[::5] if max(h, w) / min(h, w) <= 200]
    for limits in (QWEN2, {"factor": 28, "min_pixels": 128 * 28 * 28, "max_pixels": 28 * 28 * 768}):
        for h, w in pairs:
            assert smart_resize(h, w, **limits) == module.smart_resize(h, w, **limits), (h, w, limits)
    processor = processor_class()
    images = [np.zeros((h, w, 3), dtype=np.uint8) for h, w in [(37, 501), (20, 30), (300, 200)]]
    grids = processor(images=images, return_tensors="np")["image_grid_thw"].tolist()
    assert grids == [list(ResizeRule().image_grid(im.shape[1], im.shape[0])) for im in images]


# ----------------------------------------------------------------------------- dataset files


def _write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_files_are_utf8_with_or_without_a_byte_order_mark(tmp_path: Path) -> None:
    marked = tmp_path / "marked.csv"  # what a spreadsheet's "CSV UTF-8" writes
    marked.write_bytes(b"\xef\xbb\xbfwidth,height\n640,480\n")
    assert read_dataset(marked).num_images == 1
    latin = tmp_path / "latin.jsonl"
    grid = b'{"image_grid_thw": [[1, 4, 4]]'
    latin.write_bytes(grid + b"}\n" + grid + b', "caption": "caf\xe9"}\n')
    with pytest.raises(InputError, match=r"latin.jsonl:2: field '<line>' .* expected UTF-8 text"):
        read_dataset(latin)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        # Without --timings it was ignored without a word (with it, CostModel.fit names a bad one).
        (["--fit-window-patches", "64"], "--fit-window-patches is a term of the fit to --timings"),
        (["--fit-window-patches", "-5"], "--fit-window-patches is a term of the fit to --timings"),
    ],
)
def test_fit_options_are_checked_where_they_are_given(
    tiny_file: Path, flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main([str(tiny_file), "--steps", "2", *flags])
    assert done.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs a folder nobody can write in: /proc")
def test_a_file_that_cannot_be_written_leaves_none(
    tiny_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    picture = tmp_path / "gain.png"
    before = sorted(tmp_path.iterdir())
    with pytest.raises(SystemExit) as done:
        main([str(tiny_file), "--steps", "2", "--plot", str(picture), "--json", "/proc/report.json"])
    assert done.value.code == 2 and "nothing written" in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == before  # the plot, which could be written, is not


def test_json_lines_grids_sizes_and_text_only(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "mix.jsonl",
        [
            {"id": "a", "image_grid_thw": [[1, 4, 6], [1, 2, 2]], "video_grid_thw": [[3, 8, 8]]},
            {
                "images": [{"width": 224, "height": 224}],
                "videos": [{"width": 640, "height": 360, "frames": 5}],
            },
            {"width": 4032, "height": 3024},  # one image, flat
            {"width": 640, "height": 360, "frames": 16},  # one video, flat
            "",
            {"images": []},  # text-only
            {"image_grid_thw": None, "video_grid_thw": None},  # text-only, as some pipelines store it
        ],
    )
    data = read_dataset(path)
    assert data.samples == ((24, 4, 192), (256, 3 * 26 * 46), (60 * 82,), (8 * 26 * 46,), (), ())
    assert (data.num_images, data.num_videos) == (4, 3)


def test_csv_rows_grouped_by_sample(tmp_path: Path) -> None:
    path = tmp_path / "sizes.csv"
    rows = "s1,224,224,\ns2,640,360,16\ns3,,,\ns1,4032,3024,\n,224,224,\n,,,\n"  # s3: text only
    path.write_text("sample,width,height,frames\n" + rows)
    data = read_dataset(path)
    assert data.samples == ((256, 60 * 82), (8 * 26 * 46,), (), (256,))
    no_group = tmp_path / "plain.csv"
    no_group.write_text("width,height\n224,224\n224,224\n")
    assert read_dataset(no_group).samples == ((256,), (256,))


def test_timings_csv_and_json_lines(tmp_path: Path) -> None:
    table = tmp_path / "timings.csv"
    table.write_text("patch_count,milliseconds,note\n100,1.5,x\n400,4.0,y\n")
    assert read_timings(table) == ([100, 400], [1.5, 4.0])
    lines = _write(
        tmp_path / "timings.jsonl",
        [{"patch_count": 100, "milliseconds": 1.5}, {"grid_thw": [1, 4, 4], "milliseconds": 2}],
    )
    assert read_timings(lines) == ([100, 16], [1.5, 2.0])
    # A video's timing would be fitted as one sequence of t*h*w patches: refused, saying why.
    video = _write(tmp_path / "video.jsonl", [{"grid_thw": [2, 4, 4], "milliseconds": 2}] * 2)
    with pytest.raises(InputError, match=r"video.jsonl:1: field 'grid_thw' is \[2, 4, 4\]: expected t = 1"):
        read_timings(video)


BAD_INPUTS = [
    # (file name, content, line, field, expected words)
    ("a.jsonl", ['{"images": []}', '{"id": 3}'], 2, "<keys>", "at least one of 'image_grid_thw'"),
    ("b.jsonl", ['{"image_grid_thw": [[1, 3, 4]]}'], 1, "image_grid_thw[0]", "divisible by the merge size 2"),
    ("c.jsonl", ['{"video_grid_thw": [[1, 4]]}'], 1, "video_grid_thw[0]", "three positive integers"),
    ("d.jsonl", ['{"image_grid_thw": [[0, 4, 4]]}'], 1, "image_grid_thw[0]", "a positive integer"),
    ("e.jsonl", ['{"images": [{"width": 0, "height": 9}]}'], 1, "images[0].width", "a positive integer"),
    ("f.jsonl", ["", '{"images": [{"width": 9}]}'], 2, "images[0].height", "a value for 'height'"),
    ("f2.jsonl", ['{"image_grid_thw": [[1, 4, 1' + 20 * "0" + "]]}"], 1, "image_grid_thw[0]", "below 2**31"),
    ("f3.csv", ["width,height", "640,480,7"], 2, "<row>", "2 cells, as the header has"),
    # a grid in pixels (1080p): 262,144 patches a frame at most under Qwen2-VL's limits
    (
        "f4.jsonl",
        ['{"image_grid_thw": [[1, 4, 4]]}', '{"video_grid_thw": [[2, 1080, 1920]]}'],
        2,
        "video_grid_thw[0]",
        "at most 262,144 patches a frame",
    ),
    ("g.jsonl", ['{"videos": [{"width": 64, "height": 64}]}'], 1, "videos[0].frames", "a value for 'frames'"),
    # a frame count or a stray number as t: with split_videos, as many items to plan
    (
        "g2.jsonl",
        ['{"video_grid_thw": [[2147483647, 4, 4]]}'],
        1,
        "video_grid_thw[0]",
        "at most 65,536 temporal steps (t counts temporal patches)",
    ),
    (
        "g3.jsonl",
        ['{"videos": [{"width": 64, "height": 64, "frames": 2147483646}]}'],
        1,
        "videos[0].frames",
        "at most 65,536 temporal steps (2 frames a step), not 1,073,741,823",
    ),
    ("h.jsonl", ['{"images": {"width": 64}}'], 1, "images", "a list"),
    ("i.jsonl", ["{not json"], 1, "<line>", "one JSON object per line"),
    ("j.jsonl", ['{"width": -5, "height": 10}'], 1, "width", "a positive integer"),
    ("k.jsonl", ['{"images": [{"width": 30000, "height": 100}]}'], 1, "images[0]", "aspect ratio"),
    ("l.jsonl", ['{"images": []}'], 1, "<samples>", "at least one image or video"),
    ("m.csv", ["w,h", "1,2"], 1, "width", "columns width, height"),
    ("n.csv", ["width,height,frames", "64,64,", "64,64,-3"], 3, "frames", "a positive integer"),
    ("o.csv", ["width,height", "64,64", "64,abc"], 3, "height", "a positive integer"),
]


@pytest.mark.parametrize(
    ("name", "lines", "line", "field", "expected"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_dataset_errors_name_file_line_field(
    tmp_path: Path, name: str, lines: list[str], line: int, field: str, expected: str
) -> None:
    path = _write(tmp_path / name, lines)
    with pytest.raises(InputError) as caught:
        read_dataset(path)
    assert (caught.value.path, caught.value.line, caught.value.field) == (str(path), line, field)
    assert str(caught.value).startswith(f"{path}:{line}: field {field!r} is ")
    assert expected in str(caught.value)


@pytest.mark.parametrize(
    ("lines", "line", "field", "expected"),
    [
        (["patch_count,ms", "1,2"], 1, "milliseconds", "columns patch_count, milliseconds"),
        (["patch_count,milliseconds", "10,1", "20,-1"], 3, "milliseconds", "a finite number >= 0"),
        (["patch_count,milliseconds", "10,1"], 1, "<rows>", "at least two timed rows"),
    ],
)
def test_bad_timing_errors(tmp_path: Path, lines: list[str], line: int, field: str, expected: str) -> None:
    path = _write(tmp_path / "t.csv", lines)
    with pytest.raises(InputError, match=re.escape(expected)) as caught:
        read_timings(path)
    assert (caught.value.line, caught.value.field) == (line, field)


def test_example_file_is_the_generators_output_and_reads(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import make_sample_visual_sizes as generator
    finally:
        sys.path.remove(str(ROOT / "examples"))
    assert EXAMPLE.read_text() == generator.render()
    generator.main(["--output", str(tmp_path / "copy.jsonl")])
    assert (tmp_path / "copy.jsonl").read_text() == EXAMPLE.read_text()
    docstring = (generator.__doc__ or "").splitlines()
    shown = [line.strip() for line in docstring if line.strip().startswith('{"id"')]
    assert shown and all(line in EXAMPLE.read_text().splitlines() for line in shown), shown  # the file's rows
    assert EXAMPLE.stat().st_size < 1_000_000
    data = read_dataset(EXAMPLE)
    kinds = [json.loads(line)["kind"] for line in EXAMPLE.read_text().splitlines()]
    assert {k: kinds.count(k) for k in generator.KIND_COUNTS} == generator.KIND_COUNTS
    assert len(data.samples) == sum(generator.KIND_COUNTS.values())
    assert sum(not s for s in data.samples) == generator.KIND_COUNTS["text"]
    assert data.num_videos == generator.KIND_COUNTS["video"]


# ----------------------------------------------------------------------------- simulation

TINY = ((4,), (16, 4), (64,), (), (36, 9, 1))


def test_draw_batches_are_seeded_and_drawn_from_the_samples() -> None:
    first = list(draw_batches(TINY, 3, 2, 4, seed=7))
    assert first == list(draw_batches(TINY, 3, 2, 4, seed=7))
    assert first != list(draw_batches(TINY, 3, 2, 4, seed=8))
    concatenations = {a + b for a in TINY for b in TINY}
    assert all(len(step) == 3 and all(tuple(row) in concatenations for row in step) for step in first)


def _busiest_rows(plan: RebalancePlan) -> int:
    """Most rows one rank sends to, or receives from, the other ranks."""
    sent = [sum(plan.send_patches(r)) - plan.send_patches(r)[r] for r in range(plan.num_ranks)]
    received = [sum(plan.receive_patches(r)) - plan.receive_patches(r)[r] for r in range(plan.num_ranks)]
    return max(sent + received)


@pytest.mark.parametrize("solver", ["locality", "seed"])
def test_simulated_figures_match_plan_rebalance(solver: str) -> None:
    config = ViTBalanceConfig(solver=solver, trigger_threshold=0.1)
    results = simulate(TINY, [2, 3], samples_per_rank=2, steps=25, seed=3, config=config)
    assert [r.ranks for r in results] == [2, 3]
    for result in results:
        plans = [plan_rebalance(batch, config) for batch in draw_batches(TINY, result.ranks, 2, 25, 3)]
        assert result.reasons == tuple(p.reason for p in plans)
        assert "applied" in result.reasons
        np.testing.assert_array_equal(result.imbalance_before, [p.imbalance_before for p in plans])
        np.testing.assert_array_equal(result.imbalance_after, [p.imbalance_after for p in plans])
        np.testing.assert_array_equal(result.makespan_before, [p.makespan_before for p in plans])
        np.testing.assert_array_equal(result.makespan_after, [p.makespan_after for p in plans])
        np.testing.assert_array_equal(result.lower_bound, [p.lower_bound for p in plans])
        np.testing.assert_array_equal(result.moved_rows, [p.moved_patches for p in plans])
        np.testing.assert_array_equal(result.busiest_rows, [_busiest_rows(p) for p in plans])
        assert result.speedup == pytest.approx(
            np.mean([p.makespan_before for p in plans]) / np.mean([p.makespan_after for p in plans])
        )
        summary = result_summary(result, row_bytes=10)
        applied = sum(p.applied for p in plans) / len(plans)
        assert summary["applied_share"] == pytest.approx(applied)
        assert sum(summary["skipped_shares"].values()) == pytest.approx(1 - applied)
        assert summary["moved_bytes_per_rank"] == pytest.approx(
            10 * np.mean([p.moved_patches for p in plans]) / result.ranks
        )
        assert summary["imbalance_before"]["p90"] == pytest.approx(
            np.percentile([p.imbalance_before for p in plans], 90)
        )


def test_simulate_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match=r"simulate\(steps=0\)"):
        simulate(TINY, [2], samples_per_rank=1, steps=0)
    with pytest.raises(ValueError, match=r"simulate\(ranks=0\)"):
        simulate(TINY, [0], samples_per_rank=1, steps=1)
    with pytest.raises(ValueError, match=r"simulate\(seed=-1\)"):
        simulate(TINY, [2], samples_per_rank=1, steps=1, seed=-1)
    # A count that is no positive int is named where the user put it: 1.5 was drawn as 1, and 0.4
    # was reported as a 0 at a position of a drawn batch.
    for bad in (1.5, 0.4, True, 0):
        with pytest.raises(ValueError, match=rf"samples\[1\]\[0\]={bad!r} is invalid: expected a positive"):
            simulate([[4096], [bad]], [2], samples_per_rank=1, steps=1)
    simulate([[np.int64(4096)], [np.int32(9)]], [2], samples_per_rank=1, steps=1)  # NumPy's ints are ints


# ----------------------------------------------------------------------------- the command


@pytest.fixture
def tiny_file(tmp_path: Path) -> Path:
    lines = [{"image_grid_thw": [[1, 2 * n, 2]]} if n else {"images": []} for n in (1, 4, 16, 0, 9, 2)]
    return _write(tmp_path / "tiny.jsonl", [*lines, {"video_grid_thw": [[3, 8, 4]]}])


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for option in ("--ranks", "--samples-per-rank", "--steps", "--seed", "--solver", "--trigger-threshold"):
        assert option in text
    for option in ("--min-gain", "--max-len-ratio", "--cost-model", "--timings", "--json", "--plot"):
        assert option in text


def test_module_entry_point_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lightning_vit_balance.simulate", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "vit-balance-simulate" in done.stdout, done.stderr


def test_json_round_trip_table_and_plot(
    tiny_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, picture = tmp_path / "report.json", tmp_path / "gain.png"
    args = ["--ranks", "2", "4", "--samples-per-rank", "2", "--steps", "30", "--seed", "1"]
    args += ["--trigger-threshold", "0.1", "--min-gain", "0.01", "--dtype", "fp32"]
    assert (
        main([str(tiny_file), *args, "--json", str(out), "--plot", str(picture), "--progress", "never"]) == 0
    )
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert picture.read_bytes().startswith(b"\x89PNG")
    settings = report["settings"]
    assert (settings["ranks"], settings["steps"], settings["row_bytes"]) == ([2, 4], 30, 1176 * 4)
    config = ViTBalanceConfig(trigger_threshold=0.1, min_gain=0.01)
    direct = simulate(
        read_dataset(tiny_file).samples, [2, 4], samples_per_rank=2, steps=30, seed=1, config=config
    )
    for item, result in zip(report["results"], direct):
        expected = result_summary(result, 1176 * 4)
        del item["plan_ms"], expected["plan_ms"]
        assert item == expected  # JSON keeps every float exactly (repr round trip)
        # The first line of the ranks column with this DP size is its row of the main table.
        row = next(line for line in table.splitlines() if line.startswith(f"{result.ranks:>5}  "))
        assert f"{result.speedup:.3f}x" in row and f"{item['applied_share']:.0%}" in row
    assert report["dataset"]["samples"] == 7 and report["dataset"]["text_only_samples"] == 1


def test_json_to_stdout(tiny_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tiny_file), "--ranks", "3", "--steps", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [item["ranks"] for item in report["results"]] == [3]


def test_cost_model_options(tiny_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    timings = tmp_path / "timings.csv"
    timings.write_text("patch_count,milliseconds\n16,1.0\n64,2.5\n256,9.0\n1024,40.0\n")
    fitted = CostModel.fit([16, 64, 256, 1024], [1.0, 2.5, 9.0, 40.0])
    cases = {
        ("--cost-model", "qwen2.5-vl"): CostModel.from_vit_shape(**VIT_PRESETS["qwen2.5-vl"]),
        ("--timings", str(timings)): fitted,
        (
            "--vit-shape",
            "hidden_size=64,depth=2,window_layers=0-0,window_patches=16",
        ): CostModel.from_vit_shape(hidden_size=64, depth=2, window_layers=[0], window_patches=16),
        ("--cost-coefficients", "linear=2,constant=3"): CostModel(quadratic=0.0, linear=2.0, constant=3.0),
    }
    for option, model in cases.items():
        assert main([str(tiny_file), "--ranks", "2", "--steps", "2", "--json", *option]) == 0
        coefficients = json.loads(capsys.readouterr().out)["settings"]["cost_model"]
        assert CostModel(**{k: v for k, v in coefficients.items() if k != "name"}) == model, option


BAD_OPTIONS = [
    (["--vit-shape", "depth=2"], "lacks hidden_size"),
    (["--vit-shape", "width=2"], "KEY=VALUE with KEY in"),
    (
        ["--cost-coefficients", "quadratic=0"],
        "--cost-coefficients quadratic=0: ViTBalanceConfig.cost_quadratic=0.0",
    ),
    (["--cost-coefficients", "quadratic=-1"], "--cost-coefficients quadratic=-1: CostModel.quadratic=-1.0"),
    (["--ranks", "8.5"], "argument --ranks: expected an int >= 1, got '8.5'"),
    (["--ranks", "8", "data.jsonl"], "got 'data.jsonl' (the dataset comes before --ranks)"),
    (["--steps", "1e3"], "argument --steps: expected an int >= 1, got '1e3'\n"),  # no hint of --ranks
    (["--timings", "BAD"], "vit-balance-simulate: error: BAD:2: field 'milliseconds' is 'abc'"),  # named once
    (["--min-gain", "2"], "--min-gain 2.0 is invalid"),
    (["--max-len-ratio", "0.5"], "--max-len-ratio 0.5 is invalid"),
    (["--seed", "-1"], "--seed -1"),
    (["--min-pixels", "9999999"], "--min-pixels 9999999 is invalid: expected at most --max-pixels 1003520"),
    (["--trigger-threshold", "nan"], "--trigger-threshold nan is invalid"),
    (["--min-pixels", "0"], "--min-pixels 0 is invalid"),
    (["--plot", "/no/such/folder/gain.png"], "does not exist"),
    (["--plot", "gain.xyz"], "expected a file name ending in one of"),
    (["--json", "."], "is a folder"),
    (["--json", "TINY"], "is an input of this run"),
    (["--timings", "/no/such/timings.csv"], "No such file"),
    (["--timings", "FLAT"], "FLAT: the fit prices every image alike (1 ms, nothing per patch)"),
    (["--timings", "ZERO"], "ZERO: every time is 0 ms: expected measured times, some > 0."),
    # One size fits a*l**2 as exactly as b*l: the speed-up would be whichever term came first.
    (
        ["--timings", "ONE_SIZE"],
        "ONE_SIZE: 3 timings of 1 image size (patch_count 100), too few to fit 3 terms",
    ),
    (["--timings", "TWO_SIZES"], "2 timings of 2 image sizes (patch_count 100, 400), too few to fit 3 terms"),
    (["--json", "SAME.png", "--plot", "SAME.png"], "name one file: expected two file names"),
    (["--cost-coefficients", "windowed=1"], "CostModel.window_patches=0 is invalid with windowed=1.0"),
    (["--vit-shape", "hidden_size=64,depth=8,window_layers=6-0,window_patches=4"], "LOW <= HIGH"),
]


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS, ids=[" ".join(o) for o, _ in BAD_OPTIONS])
def test_bad_options_exit_2(
    tiny_file: Path, options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    timings = {
        "FLAT": "100,1\n400,1\n1600,1\n",  # times that do not grow with the patches
        "ZERO": "100,0\n400,0\n1600,0\n",
        "ONE_SIZE": "100,1\n100,1.1\n100,0.9\n",
        "TWO_SIZES": "100,1\n400,4\n",
        "BAD": "100,abc\n",
    }
    files = {"TINY": tiny_file, "SAME.png": tiny_file.with_name("same.png")}
    for name, rows in timings.items():
        files[name] = tiny_file.with_name(f"{name.lower()}.csv")
        files[name].write_text("patch_count,milliseconds\n" + rows)
    options = [str(files[option]) if option in files else option for option in options]
    for name in timings:
        message = message.replace(name, str(files[name]))
    with pytest.raises(SystemExit) as done:
        main([str(tiny_file), "--steps", "2", *options])
    assert done.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("name", "lines", "line", "field", "expected"), BAD_INPUTS[:4] + BAD_INPUTS[-3:])
def test_bad_input_exits_2_and_writes_nothing(
    tmp_path: Path,
    name: str,
    lines: list[str],
    line: int,
    field: str,
    expected: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _write(tmp_path / name, lines)
    out, picture = tmp_path / "report.json", tmp_path / "gain.png"
    out.write_text("old")
    before = sorted(tmp_path.iterdir())
    with pytest.raises(SystemExit) as done:
        main([str(path), "--steps", "2", "--json", str(out), "--plot", str(picture)])
    assert done.value.code == 2
    error = capsys.readouterr().err
    assert (
        error.startswith(f"vit-balance-simulate: error: {path}:{line}: field {field!r}") and expected in error
    )
    assert out.read_text() == "old" and sorted(tmp_path.iterdir()) == before


def test_progress_bar_when_asked(tiny_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tiny_file), "--ranks", "2", "3", "--steps", "3", "--progress", "always"]) == 0
    assert "6/6 steps (100%)" in capsys.readouterr().err
    assert main([str(tiny_file), "--ranks", "2", "--steps", "3"]) == 0  # auto: not a TTY here
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- attention per frame


def test_datasets_keep_each_visuals_temporal_steps(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "mix.jsonl",
        [
            {"image_grid_thw": [[1, 4, 6]], "video_grid_thw": [[3, 8, 8]]},
            {"videos": [{"width": 640, "height": 360, "frames": 16}]},  # 16 frames: 8 temporal steps
            {"images": []},
        ],
    )
    data = read_dataset(path)
    assert data.samples == ((24, 192), (8 * 26 * 46,), ())
    assert data.frames == ((1, 3), (8,), ())
    table = tmp_path / "sizes.csv"
    table.write_text("sample,width,height,frames\ns1,224,224,\ns2,640,360,5\ns1,4032,3024,\n")
    assert read_dataset(table).frames == ((1, 1), (3,))


def test_presets_attend_per_frame() -> None:
    for name in VIT_PRESETS:
        assert named_cost_model(name).per_frame_attention is True, name
    assert named_cost_model("seed") == CostModel()
    shape = vit_shape_model("hidden_size=64,depth=2,per_frame_attention=true")
    assert shape == CostModel.from_vit_shape(hidden_size=64, depth=2, per_frame_attention=True)
    assert coefficients_model("quadratic=1,per_frame_attention=1") == CostModel(per_frame_attention=True)


# One sample per frame count: a video of t temporal steps has 100*t patches, so a drawn batch's
# frames follow from its patch counts.
VIDEOS = ((100,), (1600, 300), (800,), (), (1200, 100, 400))


def _frames_of(samples: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(n // 100 for n in sample) for sample in samples)


def test_simulate_passes_frames_to_the_planner() -> None:
    config = replace(ViTBalanceConfig(trigger_threshold=0.1), cost_per_frame_attention=True)
    frames = _frames_of(VIDEOS)
    (result,) = simulate(VIDEOS, [3], samples_per_rank=2, steps=20, seed=3, config=config, frames=frames)
    batches = list(draw_batches(VIDEOS, 3, 2, 20, 3))
    plans = [plan_rebalance(b, config, frames=[[n // 100 for n in row] for row in b]) for b in batches]
    assert result.reasons == tuple(p.reason for p in plans)
    np.testing.assert_array_equal(result.makespan_before, [p.makespan_before for p in plans])
    np.testing.assert_array_equal(result.makespan_after, [p.makespan_after for p in plans])
    (without,) = simulate(VIDEOS, [3], samples_per_rank=2, steps=20, seed=3, config=config)
    np.testing.assert_array_equal(
        without.makespan_before, [plan_rebalance(b, config).makespan_before for b in batches]
    )
    assert (without.makespan_before > result.makespan_before).any()  # l**2 prices videos higher
    with pytest.raises(ValueError, match=r"simulate\(frames\[1\]=\[16\]\) is invalid: expected 2 ints >= 1"):
        simulate(VIDEOS, [3], samples_per_rank=2, steps=2, frames=((1,), (16,), (8,), (), (12, 1, 4)))
    with pytest.raises(ValueError, match="has 1 samples, samples has 5"):
        simulate(VIDEOS, [3], samples_per_rank=2, steps=2, frames=((1,),))


def test_split_videos_plans_each_temporal_step(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``split_videos``: the planner sees each step of a video as an item of 100 patches."""
    config = replace(ViTBalanceConfig(trigger_threshold=0.0), cost_per_frame_attention=True)
    frames = _frames_of(VIDEOS)
    run = {"samples_per_rank": 1, "steps": 30, "seed": 5, "frames": frames}
    (split,) = simulate(VIDEOS, [3], config=replace(config, split_videos=True), **run)
    (whole,) = simulate(VIDEOS, [3], config=config, **run)
    batches = list(draw_batches(VIDEOS, 3, 1, 30, 5))
    steps = [[[100 for n in row for _ in range(n // 100)] for row in batch] for batch in batches]
    plans = [plan_rebalance(b, config) for b in steps]
    np.testing.assert_array_equal(split.makespan_after, [p.makespan_after for p in plans])
    # Priced per step, the loads before are the same either way; by step the plans do better.
    np.testing.assert_allclose(split.makespan_before, whole.makespan_before)
    assert split.makespan_after.mean() < 0.8 * whole.makespan_after.mean()
    dataset = tmp_path / "videos.jsonl"
    dataset.write_text('{"videos": [{"width": 56, "height": 56, "frames": 64}]}\n{"images": []}\n')
    args = ["--ranks", "2", "--samples-per-rank", "1", "--steps", "5", "--cost-model", "qwen2-vl"]
    assert main([str(dataset), *args, "--split-videos", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["split_videos"] is True
    assert main([str(dataset), *args, "--split-videos"]) == 0
    assert "videos move by temporal step" in capsys.readouterr().out


def test_command_prices_videos_per_frame(tiny_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--ranks", "2", "--samples-per-rank", "2", "--steps", "20", "--trigger-threshold", "0.0"]
    assert main([str(tiny_file), *args, "--json", "--cost-model", "qwen2-vl"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["settings"]["cost_model"]["per_frame_attention"] is True
    data = read_dataset(tiny_file)
    config = named_cost_model("qwen2-vl").to_config(ViTBalanceConfig(trigger_threshold=0.0))
    run = {"samples_per_rank": 2, "steps": 20, "config": config}
    (direct,) = simulate(data.samples, [2], frames=data.frames, **run)
    (whole,) = simulate(data.samples, [2], **run)
    expected = result_summary(direct, report["settings"]["row_bytes"])
    del expected["plan_ms"], report["results"][0]["plan_ms"]
    assert report["results"][0] == expected
    assert expected["makespan_before_mean"] < whole.makespan_before.mean()  # the 3-step video is cheaper


# ----------------------------------------------------------------------------- the README's example


def _readme_example() -> tuple[list[str], str] | None:
    """The README's simulator command (its arguments) and the text block that follows it."""
    lines = (ROOT / "README.md").read_text().splitlines()
    module = "lightning_vit_balance.simulate"
    for index, line in enumerate(lines):
        if f"-m {module} " not in line:
            continue
        words = shlex.split(line.split("#")[0])
        start = next(i for i in range(index, len(lines)) if lines[i].startswith("```text"))
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
        return words[words.index(module) + 1 :], "\n".join(lines[start + 1 : end]) + "\n"
    return None


def _without_timings(table: str) -> list[str]:
    """The table's words minus its plan ms column (wall time, not reproducible)."""
    rows = [
        re.sub(r"\s+\S+$", "", line) if re.match(r"^ *\d+ .*x ", line) else line
        for line in table.splitlines()
    ]
    return " ".join(rows).split()


def _same_figure(shown: str, actual: str) -> bool:
    """Words equal, or numbers within 5% (shares within one point): the README stays true while
    planner changes shift the rows moved a little; a change of substance fails."""
    if shown == actual:
        return True
    try:
        a, b = (float(w.rstrip("x%").replace(",", "")) for w in (shown, actual))
    except ValueError:
        return False
    if shown.endswith("%") and actual.endswith("%"):
        return abs(a - b) <= 1.0
    return abs(a - b) <= 0.05 * max(abs(a), abs(b)) + 0.002


def test_readme_table_is_the_commands_output(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = _readme_example()
    if example is None:
        pytest.skip("README.md has no simulator example")
    arguments, expected = example
    monkeypatch.chdir(ROOT)
    assert main(arguments) == 0
    actual, shown = _without_timings(capsys.readouterr().out), _without_timings(expected)
    assert len(actual) == len(shown), "the README's simulator table does not match the command's"
    wrong = [(s, a) for s, a in zip(shown, actual) if not _same_figure(s, a)]
    assert not wrong, f"README figures differ from the command's output (shown, actual): {wrong}"
