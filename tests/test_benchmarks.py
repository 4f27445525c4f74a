"""The benchmark scripts run, with small arguments, and print what BENCHMARKS.md describes.

Their figures are measured by hand (``make bench``, ``make bench-e2e``...); here each script runs
once, in a subprocess of its own, so that a change of the engine that breaks a script, or a figure
it labels with a stale size, fails the suite.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_vit_balance.exchange import STATUS_WORD

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str, *arguments: str, cwd: Path) -> str:
    command = [sys.executable, str(BENCHMARKS / script), *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=cwd)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.timeout(300)
def test_planning_benchmark_quick(tmp_path: Path) -> None:
    out = _run("bench_planning.py", "--quick", cwd=tmp_path)
    assert "heap LPT" in out and "makespan" in out.lower(), out[-2000:]


@pytest.mark.timeout(300)
def test_end_to_end_benchmark_short(tmp_path: Path) -> None:
    timings = tmp_path / "timings.csv"
    arguments = ["--steps", "5", "--calibration-steps", "9", "--repeats", "1", "--batch-size", "2"]
    out = _run("bench_e2e.py", *arguments, "--timings-out", str(timings), cwd=tmp_path)
    assert "Cost model prediction error" in out and "ideal" in out, out[-2000:]
    assert timings.read_text().splitlines()[0] == "patch_count,milliseconds"  # what the simulator reads


@pytest.mark.timeout(300)
def test_predict_benchmark_short(tmp_path: Path) -> None:
    out = _run("bench_predict.py", "--batches", "3", "--repeats", "1", cwd=tmp_path)
    assert "direct, ranks apart" in out and "where they meet anyway" in out, out[-2000:]


@pytest.mark.timeout(300)
def test_engine_benchmark_short(tmp_path: Path) -> None:
    arguments = ["--repeats", "10", "--skipped-repeats", "4", "--images", "200", "--steps", "2"]
    out = _run("bench_engine.py", *arguments, "--steps-on-rank", "50", "--frame-repeats", "2", cwd=tmp_path)
    assert f"| raw all_gather of the same {len(STATUS_WORD)} int64 |" in out, out[-2000:]


@pytest.mark.timeout(300)
def test_many_ranks_benchmark_short(tmp_path: Path) -> None:
    arguments = ["--ranks", "2", "4", "--calls", "3", "--host-ranks", "64", "--host-repeats", "2"]
    arguments += [
        "--trip-ranks",
        "8",
        "--calibration-ranks",
        "8",
        "--gc-calls",
        "10",
        "--gc-ballast",
        "10000",
    ]
    out = _run("bench_many_ranks.py", *arguments, cwd=tmp_path)
    assert f"status = {len(STATUS_WORD)};" in out, out[-2000:]


@pytest.mark.timeout(300)
def test_memory_benchmark_short(tmp_path: Path) -> None:
    out = _run("bench_memory.py", "--steps", "1", cwd=tmp_path)
    assert "validate: all as expected" in out, out[-2000:]
    assert "peak_forward 52.00 (expect 52), at_backward 36.00 (expect 36), peak 56.00 (expect 56)" in out
    assert "unbalanced   balanced    overlap   prepared  plan_only" in out, out[-2000:]
    loss_line = next(line for line in out.splitlines() if "relative |variant - unbalanced|" in line)
    assert float(loss_line.rsplit("=", 1)[1]) < 1e-5, loss_line  # the same images: the same losses
