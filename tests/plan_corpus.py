"""A fixed corpus of planning problems and the digests of their plans, kept in
``tests/data/plan_corpus.json``.

Every rank plans alone from the same gathered sizes, so a Python, NumPy or machine on which the
planner decides differently would make ranks exchange different rows. The corpus covers the
planner's paths (few and many images, the numpy variants, the repair and the paired exchanges,
the patch cap, every cost model, temporal steps, the seed's solver) and the online cost fit;
``test_plan_corpus.py`` checks that this interpreter reproduces the recorded digests.

The batches are drawn with :class:`random.Random` and integer arithmetic alone, whose results
Python keeps the same across versions (NumPy's generators may change between releases).

Run ``python tests/plan_corpus.py`` to compare (exit status 1 on a difference), ``--write``
after a deliberate change of the planner to record the new digests; ``--planning-only`` imports
the planning layer alone (NumPy, no torch), for ``make plan-versions``'s interpreters;
``--older-cpu`` compares in a child process that runs the kernels of an older x86 CPU
(:func:`older_cpu_environment`), as a node of another generation in the same job would.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_vit_balance"


def _planning_layer_alone() -> None:
    """Make ``lightning_vit_balance`` a bare package, so that importing its planning modules runs
    neither its ``__init__`` nor torch (for interpreters with NumPy alone)."""
    spec = importlib.machinery.ModuleSpec("lightning_vit_balance", None, is_package=True)
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(PACKAGE)]
    sys.modules["lightning_vit_balance"] = package


if __name__ == "__main__" and "--planning-only" in sys.argv:
    _planning_layer_alone()

from lightning_vit_balance.config import ViTBalanceConfig  # noqa: E402
from lightning_vit_balance.cost import CostCalibrator, CostModel  # noqa: E402
from lightning_vit_balance.planning import plan_rebalance  # noqa: E402

RECORDED = Path(__file__).resolve().parent / "data" / "plan_corpus.json"

#: Both skip rules off, so that every problem runs a solver.
_FORCED = {"trigger_threshold": 0.0, "min_gain": 0.0}

#: The configurations each problem is planned under.
CONFIGS: dict[str, ViTBalanceConfig] = {
    "default": ViTBalanceConfig(),
    "forced": ViTBalanceConfig(**_FORCED),
    "seed": ViTBalanceConfig(solver="lpt", **_FORCED),
    "cap": ViTBalanceConfig(max_len_ratio=1.2, **_FORCED),
    "affine": ViTBalanceConfig(cost_quadratic=3e-4, cost_linear=2.5, cost_constant=900.0, **_FORCED),
    # Qwen2.5-VL-like: windows of 64 patches in most layers, attention within each temporal step.
    "windowed": ViTBalanceConfig(
        cost_quadratic=1e-4,
        cost_linear=1.0,
        cost_windowed=3e-4,
        cost_window_patches=64,
        cost_per_frame_attention=True,
        **_FORCED,
    ),
}


class Problem(NamedTuple):
    """One planning problem: patch counts per rank, each item's temporal steps, and the names of
    the configurations to plan it under."""

    counts: list[list[int]]
    frames: list[list[int]]
    configs: tuple[str, ...]


def _photo(rng: random.Random) -> tuple[int, int]:
    """56 px to about 1 MP: sides of 2-36 units of 28 px, 4 patches per unit squared."""
    return 4 * rng.randint(2, 36) * rng.randint(2, 36), 1


def _document(rng: random.Random) -> tuple[int, int]:
    return 4 * rng.randint(36, 58) * rng.randint(36, 58), 1


def _video(rng: random.Random) -> tuple[int, int]:
    """2-8 temporal steps of frames from 168 to 448 px a side."""
    steps = rng.randint(2, 8)
    return steps * 4 * rng.randint(6, 16) * rng.randint(6, 16), steps


def _mixed(rng: random.Random) -> tuple[int, int]:
    return _document(rng) if rng.random() < 0.25 else _photo(rng)


def _video_heavy(rng: random.Random) -> tuple[int, int]:
    return _video(rng) if rng.random() < 0.6 else _photo(rng)


def _heavy_tail(rng: random.Random) -> tuple[int, int]:
    if rng.random() < 0.02:
        return 4 * rng.randint(73, 128) * rng.randint(73, 128), 1
    return 4 * rng.randint(2, 18) * rng.randint(2, 18), 1


def _uniform(rng: random.Random) -> tuple[int, int]:
    return 4 * rng.randint(14, 18) * rng.randint(14, 18), 1


def _frames_of_one_size(rng: random.Random) -> tuple[int, int]:
    """A long video's temporal steps planned one by one: few sizes, many items alike."""
    return 4 * rng.choice((8, 12, 16)) * rng.choice((8, 12)), 1


Draw = Callable[[random.Random], tuple[int, int]]
SCENARIOS: dict[str, Draw] = {
    "mixed": _mixed,
    "video": _video_heavy,
    "tail": _heavy_tail,
    "uniform": _uniform,
    "frames": _frames_of_one_size,
}


def _batch(rng: random.Random, draw: Draw, num_ranks: int, low: int, high: int) -> tuple[list, list]:
    counts: list[list[int]] = []
    frames: list[list[int]] = []
    for _ in range(num_ranks):
        items = [draw(rng) for _ in range(rng.randint(low, high))]
        counts.append([patches for patches, _ in items])
        frames.append([steps for _, steps in items])
    return counts, frames


#: ``(group, scenario, P, images per rank low and high, batches, configurations)``.
_GROUPS: tuple[tuple[str, str, int, int, int, int, tuple[str, ...]], ...] = (
    *(
        (f"small/{name}/P{p}", name, p, 1, 8, 6, ("default", "forced", "seed", "cap", "affine", "windowed"))
        for name in ("mixed", "video", "tail", "uniform")
        for p in (2, 3, 4, 8, 16, 32, 64)
    ),
    *(
        (f"full8/{name}/P{p}", name, p, 8, 8, 4, ("forced", "seed", "cap"))
        for name in ("mixed", "video", "uniform")
        for p in (2, 4, 8, 16, 64)
    ),
    ("empty-ranks/mixed/P16", "mixed", 16, 0, 3, 10, ("default", "forced", "seed", "cap")),
    # The numpy variants: more than 512 images; shed-and-fit from 32 images per rank; the
    # repair and then the paired exchanges beyond 256 ranks.
    ("many/mixed/P64", "mixed", 64, 8, 16, 2, ("forced", "seed", "cap", "affine", "windowed")),
    ("many/uniform/P128", "uniform", 128, 1, 16, 2, ("forced", "seed")),
    ("many/frames/P8", "frames", 8, 40, 120, 2, ("forced", "seed")),
    ("many/frames/P32", "frames", 32, 32, 64, 2, ("forced",)),
    ("many/mixed/P300", "mixed", 300, 1, 16, 1, ("forced", "seed", "cap")),
    ("many/uniform/P300", "uniform", 300, 1, 4, 1, ("forced",)),
    ("many/mixed/P1024", "mixed", 1024, 8, 8, 1, ("forced", "seed")),
    ("many/video/P1024", "video", 1024, 1, 8, 1, ("forced",)),
)


def problems() -> Iterator[tuple[str, Problem]]:
    """Every group's problems, in a fixed order; each group draws from its own seed."""
    for seed, (group, scenario, num_ranks, low, high, batches, configs) in enumerate(_GROUPS):
        rng = random.Random(seed)
        for _ in range(batches):
            counts, frames = _batch(rng, SCENARIOS[scenario], num_ranks, low, high)
            yield group, Problem(counts, frames, configs)


def _plan_record(problem: Problem, name: str) -> tuple[str, str]:
    """What must agree across ranks (the reason and every destination) and the loads' floats."""
    config = CONFIGS[name]
    frames = problem.frames if config.cost_per_frame_attention else None
    plan = plan_rebalance(problem.counts, config, frames=frames)
    loads = ",".join(load.hex() for load in plan.loads_after)
    return repr((name, plan.reason, plan.destinations)), loads


def _calibrator_records() -> Iterator[str]:
    """The online fit's coefficients after each of 40 steps of 8 ranks, for a whole-item and a
    windowed per-frame model; times from a known model with deterministic noise."""
    rng = random.Random(1234)
    for initial in (CostModel(), CostModel(window_patches=64, per_frame_attention=True)):
        calibrator = CostCalibrator(initial, history=16, min_rank_steps=8)
        for _ in range(40):
            counts, frames = _batch(rng, _video_heavy, 8, 1, 6)
            # fsum: the builtin sum of floats adds differently from Python 3.12 on.
            model_ms = [
                math.fsum(3e-6 * n * n / t + 2e-3 * n + 0.05 for n, t in zip(row, steps))
                for row, steps in zip(counts, frames)
            ]
            milliseconds = [0.4 + ms * rng.uniform(0.9, 1.1) for ms in model_ms]
            calibrator.observe(counts, milliseconds, frames)
            yield repr(tuple(float(value).hex() for value in calibrator.fingerprint()))


def digests() -> dict[str, dict[str, str]]:
    """Per group, a digest of its plans and one of their loads; the same for the online fit."""
    hashes: dict[str, tuple[hashlib._Hash, hashlib._Hash]] = {}
    for group, problem in problems():
        plans, loads = hashes.setdefault(group, (hashlib.sha256(), hashlib.sha256()))
        for name in problem.configs:
            plan, load = _plan_record(problem, name)
            plans.update(plan.encode())
            loads.update(load.encode())
    fit = hashlib.sha256()
    for record in _calibrator_records():
        fit.update(record.encode())
    found = {
        group: {"plans": plans.hexdigest()[:20], "loads": loads.hexdigest()[:20]}
        for group, (plans, loads) in hashes.items()
    }
    found["calibrator"] = {"fits": fit.hexdigest()[:20]}
    return found


def differences(found: dict[str, dict[str, str]], recorded: dict[str, dict[str, str]]) -> list[str]:
    """``group: what`` for every digest that differs from the recorded one (or is missing)."""
    groups = sorted(set(found) | set(recorded))
    return [
        f"{group}: {key}"
        for group in groups
        for key in sorted(set(found.get(group, {})) | set(recorded.get(group, {})))
        if found.get(group, {}).get(key) != recorded.get(group, {}).get(key)
    ]


def older_cpu_environment() -> dict[str, str]:
    """Environment variables under which NumPy and OpenBLAS run, on this CPU, the kernels they run
    on an older x86 one: NumPy's dispatched SIMD targets that this CPU has switched off
    (``NPY_DISABLE_CPU_FEATURES``: the AVX2 and AVX-512 loops give way to the baseline's), and
    OpenBLAS's Nehalem kernels (``OPENBLAS_CORETYPE``, read by the wheels' ``DYNAMIC_ARCH``
    builds). Both are read at import, so they apply to a child process."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:  # NumPy 1.x
        from numpy.core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    present = [name for name in __cpu_dispatch__ if __cpu_features__.get(name)]
    return {"NPY_DISABLE_CPU_FEATURES": " ".join(present), "OPENBLAS_CORETYPE": "Nehalem"}


def _compare_on_an_older_cpu(planning_only: bool) -> int:
    """This script's comparison in a child process with :func:`older_cpu_environment`."""
    older = older_cpu_environment()
    command = [sys.executable, __file__, *(["--planning-only"] if planning_only else [])]
    print("older CPU kernels: " + ", ".join(f"{name}={value!r}" for name, value in older.items()))
    return subprocess.run(command, env={**os.environ, **older}, check=False).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record this interpreter's digests")
    parser.add_argument(
        "--planning-only", action="store_true", help="import the planning layer alone (NumPy, no torch)"
    )
    parser.add_argument("--older-cpu", action="store_true", help="compare with an older x86 CPU's kernels")
    args = parser.parse_args()
    if args.older_cpu:
        return _compare_on_an_older_cpu(args.planning_only)
    found = digests()
    if args.write:
        RECORDED.parent.mkdir(exist_ok=True)
        RECORDED.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(found)} groups in {RECORDED}")
        return 0
    different = differences(found, json.loads(RECORDED.read_text()))
    print(f"Python {sys.version.split()[0]}, NumPy {np.__version__}: {len(found)} groups, ", end="")
    print(f"{len(different)} differ" + "".join(f"\n  {line}" for line in different))
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
