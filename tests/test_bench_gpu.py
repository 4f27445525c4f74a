"""benchmarks/bench_gpu.py on the CPU's toy tower: it times, writes what the simulator reads, and
splits each image's cost from each call's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from lightning_vit_balance.simulate import main as simulate
from lightning_vit_balance.simulate import read_timings

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module
    spec.loader.exec_module(module)
    return module


def _rows(table: str) -> list[list[str]]:
    """The rows of a printed table for DP sizes 2 and 8 (what the tests ask for), split on spaces."""
    rows = [line.split() for line in table.splitlines() if line.strip().startswith(("2 |", "8 |"))]
    assert [row[0] for row in rows] == ["2", "8"], table
    return rows


def test_timings_feed_the_simulator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpu_timings.csv"
    # The median of 3 timed pairs per size: one taken while other jobs share the cores can flatten the fit.
    arguments = ["--device", "cpu", "--size", "tiny", "--max-patches", "1024", "--repeats", "3"]
    _bench().main([*arguments, "--ranks", "2", "8", "--steps", "20", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "fit to these timings, as fitted" in printed and "ms per call" in printed
    # The search table, a row per DP size: no plan is slower than none, none beats the bound.
    for row in _rows(printed.split("Plans by cost model")[0]):
        before, lpt, placed, default, bound = map(float, row[2:7])
        assert bound <= min(lpt, placed, default) and max(lpt, placed, default) <= before, row
    counts, milliseconds = read_timings(out)
    assert counts == [64, 256, 512, 1024]
    assert all(ms >= 0.0 for ms in milliseconds) and max(milliseconds) > 0.0
    dataset = ROOT / "examples" / "sample_visual_sizes.jsonl"
    status = simulate(
        [str(dataset), "--timings", str(out), "--ranks", "4", "--steps", "20", "--progress", "never"]
    )
    assert status == 0
    assert "cost model fitted to" in capsys.readouterr().out


def test_one_more_image_and_the_call_split_the_time() -> None:
    bench = _bench()
    copies = bench.copies_timed(16)
    assert copies == bench.MAX_COPIES  # small images are timed many to a call
    # One image: 10 ms; each added one 6 ms -> 6 ms an image, 4 ms a call; a noisy pair is outvoted.
    calls = iter([10.0, 10.0 + 6.0 * (copies - 1), 30.0, 10.0, 10.0, 10.0 + 6.0 * (copies - 1)])
    bench._clock = lambda device: lambda fn: next(calls)
    tower, width, dtype = bench.build_tower("tiny", bench.torch.device("cpu"))
    timings = bench.time_images(tower, width, dtype, bench.torch.device("cpu"), 3, [(1, 4, 4)])
    assert timings == [(16, 6.0, 4.0)]
    assert [bench.copies_timed(n) for n in (1024, 8192, 16384)] == [9, 2, 2]


def test_saved_timings_are_analysed_without_timing(capsys: pytest.CaptureFixture[str]) -> None:
    """``--from-timings``: the H200's ladder kept in the repo, analysed on any machine; plans made with
    each cost model (the online fit's included), judged on the measured times, on both mixes, are
    never slower than no plan nor faster than the bound."""
    saved = ROOT / "benchmarks" / "h200_timings.csv"
    _bench().main(["--from-timings", str(saved), "--ranks", "2", "8", "--steps", "10"])
    printed = capsys.readouterr().out
    assert "timings read from" in printed
    tables = printed.split("Plans by cost model")[1:]
    assert len(tables) == 2 and "thumbnail-heavy" in tables[1], printed
    for table in tables:
        for row in _rows(table):
            unbalanced, seed, shaped, fitted, online, bound = map(float, row[2:8])
            assert bound <= min(seed, shaped, fitted, online), row
            assert max(seed, shaped, fitted, online) <= unbalanced, row


def test_the_thumbnail_mix_draws_what_it_says() -> None:
    batches = _bench().thumbnail_heavy(8, 50, seed=1)
    assert len(batches) == 50 and all(len(step) == 8 for step in batches)
    images = [n for step in batches for row in step for n in row]
    assert all(1 <= len(row) <= 24 for step in batches for row in step)
    assert all(64 <= n <= 256 or 1024 <= n <= 8192 for n in images)
    small = sum(n <= 256 for n in images) / len(images)
    assert 0.65 < small < 0.75, small
