"""``vit-balance-simulate``: what would balancing buy on this dataset, at these DP sizes?

Reads a dataset's image and video sizes, simulates random micro-batches on every rank, plans each
step with :func:`~lightning_vit_balance.plan_rebalance` and prints the predicted gain per DP size.
Exit status: 0 on success, 2 for bad input (arguments, dataset or timing files); outputs are
written only once everything succeeded, each atomically.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from lightning_vit_balance.config import SOLVERS, ViTBalanceConfig
from lightning_vit_balance.cost import CostModel
from lightning_vit_balance.simulate.costs import (
    COST_MODELS,
    coefficients_model,
    named_cost_model,
    vit_shape_model,
)
from lightning_vit_balance.simulate.dataset import InputError, VisualDataset, read_dataset, read_timings
from lightning_vit_balance.simulate.report import dataset_summary, render_table, result_summary
from lightning_vit_balance.simulate.run import DPResult, simulate
from lightning_vit_balance.simulate.sizes import ResizeRule

__all__ = ["build_parser", "main"]

PROG = "vit-balance-simulate"
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
_DEFAULTS = ViTBalanceConfig()
_RULE = ResizeRule()


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except absent ones (their help says what absent means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def _rank_count(text: str) -> int:
    """A ``--ranks`` value; the option takes several, so a dataset named after it lands here."""
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError as error:
        numeric = text.lstrip("+-").replace(".", "", 1).isdigit()
        hint = "" if numeric else " (the dataset comes before --ranks)"
        raise argparse.ArgumentTypeError(f"{error}{hint}") from None


def _add_simulation_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dataset", type=Path, help="JSON Lines (one sample per line) or CSV (one image or video per row)"
    )
    group = parser.add_argument_group("simulation")
    group.add_argument(
        "--ranks", type=_rank_count, nargs="+", default=[8, 32, 128, 512], metavar="P", help="DP sizes"
    )
    group.add_argument(
        "--samples-per-rank", type=_positive_int, default=4, metavar="N", help="micro-batch size"
    )
    group.add_argument("--steps", type=_positive_int, default=1000, metavar="N", help="steps per DP size")
    group.add_argument("--seed", type=int, default=0, help="seeds the random micro-batches")
    group.add_argument("--solver", choices=SOLVERS, default=_DEFAULTS.solver, help="ViTBalanceConfig.solver")
    group.add_argument(
        "--trigger-threshold", type=float, default=_DEFAULTS.trigger_threshold, metavar="X", help="skip rule"
    )
    group.add_argument("--min-gain", type=float, default=_DEFAULTS.min_gain, metavar="X", help="skip rule")
    group.add_argument("--max-len-ratio", type=float, metavar="X", help="patch cap (default: none)")
    group.add_argument(
        "--split-videos",
        action="store_true",
        help="plan each temporal step of a video as an item (ViTBalanceConfig.split_videos, the HF "
        "drop-in's default for Qwen-VL towers); compare with a cost model that prices attention per step",
    )


def _add_cost_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "cost model (one of --cost-model, --vit-shape, --cost-coefficients, --timings)"
    )
    choice = group.add_mutually_exclusive_group()
    choice.add_argument(
        "--cost-model",
        choices=COST_MODELS,
        default="seed",
        help="seed: l**2; else a ViT's FLOPs, attention per frame",
    )
    choice.add_argument(
        "--vit-shape", metavar="K=V,...", help="hidden_size=1280,depth=32,... (from_vit_shape)"
    )
    choice.add_argument(
        "--cost-coefficients", metavar="K=V,...", help="quadratic=...,linear=...,constant=..."
    )
    choice.add_argument(
        "--timings", type=Path, metavar="FILE", help="fit: CSV/JSONL of patch_count, milliseconds"
    )
    group.add_argument(
        "--fit-window-patches", type=int, default=0, metavar="N", help="--timings: window term"
    )


_SIZE_HELP: dict[str, str] = {
    "patch_size": "pixels per patch side",
    "merge_size": "patches merged per side",
    "temporal_patch_size": "frames per patch",
    "min_pixels": "images: least area",
    "max_pixels": "images: most area",
    "video_min_pixels": "videos: least area a frame",
    "video_max_pixels": "videos: most area a frame",
    "video_max_tokens": "videos: total token budget (default: none)",
}


def _add_size_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("raw sizes to grids (Qwen2-VL processor defaults)")
    for field in dataclasses.fields(ResizeRule):
        name = f"--{field.name.replace('_', '-')}"
        group.add_argument(
            name, type=int, default=getattr(_RULE, field.name), metavar="N", help=_SIZE_HELP[field.name]
        )
    traffic = parser.add_argument_group("bytes moved")
    traffic.add_argument(
        "--channels", type=_positive_int, metavar="N", help="values a patch row (default: 3*T*p*p)"
    )
    traffic.add_argument("--dtype", choices=DTYPE_BYTES, default="bf16", help="pixel dtype on the wire")


def build_parser() -> argparse.ArgumentParser:
    """The command's argument parser."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=_HelpFormatter,
        description="Predict what ViT data-parallel balancing gains on a dataset's image and video sizes.",
        epilog="Exit status 2: bad input. See the README's simulator section for the file formats.",
    )
    _add_simulation_args(parser)
    _add_cost_args(parser)
    _add_size_args(parser)
    output = parser.add_argument_group("output")
    output.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write every figure as JSON to PATH (no PATH: stdout)",
    )
    output.add_argument("--plot", type=Path, metavar="PNG", help="draw speed-up and imbalance to this image")
    output.add_argument(
        "--progress", choices=("auto", "always", "never"), default="auto", help="auto: on a terminal"
    )
    return parser


@dataclass(frozen=True)
class _Setup:
    """Everything validated before the (long) simulation starts."""

    dataset: VisualDataset
    config: ViTBalanceConfig
    cost_name: str
    rule: ResizeRule
    channels: int


def _cost_option(args: argparse.Namespace) -> str:
    """The option that chose the cost model, as typed: named in its errors."""
    for option, value in (
        ("--timings", args.timings),
        ("--vit-shape", args.vit_shape),
        ("--cost-coefficients", args.cost_coefficients),
    ):
        if value is not None:
            return f"{option} {value}"
    return f"--cost-model {args.cost_model}"


def _cost_model(args: argparse.Namespace, rule: ResizeRule) -> tuple[CostModel, str]:
    if args.timings is not None:
        counts, milliseconds = read_timings(args.timings, rule)
        _check_sizes_timed(args, counts)
        if not any(milliseconds):
            raise ValueError(
                f"--timings {args.timings}: every time is 0 ms: expected measured times, some > 0."
            )
        model = CostModel.fit(counts, milliseconds, window_patches=args.fit_window_patches)
        if not (model.quadratic or model.linear or model.windowed):  # no image would outweigh another
            raise ValueError(
                f"--timings {args.timings}: the fit prices every image alike ({model.constant:.4g} ms, "
                "nothing per patch): expected times that grow with patch_count; time images of several sizes."
            )
        return model, f"fitted to {args.timings} ({len(counts)} timings, milliseconds)"
    if args.vit_shape is not None:
        return vit_shape_model(args.vit_shape), f"ViT shape {args.vit_shape}"
    if args.cost_coefficients is not None:
        return coefficients_model(args.cost_coefficients), f"coefficients {args.cost_coefficients}"
    name = "seed (l**2)" if args.cost_model == "seed" else f"{args.cost_model} ViT FLOPs, attention per frame"
    return named_cost_model(args.cost_model), name


def _check_sizes_timed(args: argparse.Namespace, counts: list[int]) -> None:
    """Refuse timings of fewer image sizes than the fit has terms: many models then fit them
    exactly, and each extrapolates to other sizes differently (one size fits ``a*l**2`` as well as
    ``b*l``, so the speed-up would be the first term's)."""
    terms = 4 if args.fit_window_patches > 0 else 3
    sizes = sorted(set(counts))
    if len(sizes) < terms:
        shown = ", ".join(str(size) for size in sizes)
        raise ValueError(
            f"--timings {args.timings}: {len(counts)} timings of {len(sizes)} image size"
            f"{'s' * (len(sizes) > 1)} (patch_count {shown}), too few to fit {terms} terms "
            f"(quadratic, linear, constant{', windowed' * (terms == 4)}): expected timings of at least "
            f"{terms} sizes."
        )


def _cost_config(
    args: argparse.Namespace, rule: ResizeRule, base: ViTBalanceConfig
) -> tuple[ViTBalanceConfig, str]:
    """``base`` priced by the chosen cost model, and the model's name; its errors name the option."""
    try:
        model, cost_name = _cost_model(args, rule)
        return model.to_config(base), cost_name
    except ValueError as error:
        option = _cost_option(args)
        if isinstance(error, InputError) or str(error).startswith(option.split()[0]):
            raise  # the files' and the options' own checks name them already
        # The models' and the config's checks name their fields (CostModel.quadratic=-1.0).
        raise ValueError(f"{option}: {error}") from None


def _check_outputs(args: argparse.Namespace) -> None:
    inputs = (args.dataset, args.timings)
    _check_output(args.json, "--json", inputs)
    _check_output(args.plot, "--plot", inputs)
    written = args.json not in (None, "-") and args.plot is not None
    if written and Path(args.json).resolve() == Path(args.plot).resolve():
        raise ValueError(f"--json {args.json} and --plot {args.plot} name one file: expected two file names.")


def _check_output(path: str | Path | None, option: str, inputs: tuple[Path | None, ...] = ()) -> None:
    if path is None or str(path) == "-":
        return
    for source in inputs:  # `--json data.jsonl` would replace the data with the report
        if source is not None and Path(path).resolve() == Path(source).resolve():
            raise ValueError(f"{option} {path} is an input of this run: expected another file name.")
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: the folder {parent} does not exist.")
    if Path(path).is_dir():
        raise ValueError(f"{option} {path} is a folder: expected a file name.")


@contextlib.contextmanager
def _named_as_options(owner: type) -> Iterator[None]:
    """Re-raise ``owner``'s ValueErrors naming the command's options (``--min-pixels 0``), not the
    fields they set (``ResizeRule.min_pixels=0``)."""
    try:
        yield
    except ValueError as error:
        fields = "|".join(field.name for field in dataclasses.fields(owner))
        named = re.sub(rf"(?:{owner.__name__}\.)?\b({fields})=", lambda m: f"{_option(m[1])} ", str(error))
        raise ValueError(named) from None


def _option(field: str) -> str:
    return "--" + field.replace("_", "-")


def _prepare(args: argparse.Namespace) -> _Setup:
    """Validate options and read the inputs; raises ValueError or OSError (exit status 2)."""
    if args.seed < 0:
        raise ValueError(f"--seed {args.seed} is invalid: expected an int >= 0.")
    _check_outputs(args)
    if args.plot is not None:
        from lightning_vit_balance.simulate.plot import check_format

        check_format(args.plot)
    with _named_as_options(ResizeRule):
        rule = ResizeRule(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ResizeRule)})
    with _named_as_options(ViTBalanceConfig):
        base = ViTBalanceConfig(
            solver=args.solver,
            trigger_threshold=args.trigger_threshold,
            min_gain=args.min_gain,
            max_len_ratio=args.max_len_ratio,
            split_videos=args.split_videos,
        )
    config, cost_name = _cost_config(args, rule, base)
    dataset = read_dataset(args.dataset, rule)
    return _Setup(dataset, config, cost_name, rule, args.channels or rule.channels)


class _Progress:
    """A one-line progress bar on a stream, redrawn at most five times a second."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.stream, self.done = total, stream, 0
        self.start = self.shown = time.monotonic()

    def __call__(self, steps: int) -> None:
        self.done += steps
        now = time.monotonic()
        if now - self.shown >= 0.2 or self.done == self.total:
            self.shown = now
            elapsed = now - self.start
            left = elapsed * (self.total - self.done) / self.done
            self.stream.write(
                f"\r{PROG}: {self.done:,}/{self.total:,} steps ({self.done / self.total:.0%}), "
                f"{elapsed:.0f} s, ~{left:.0f} s left "
            )
            self.stream.flush()

    def close(self) -> None:
        if self.done:
            self.stream.write("\n")
            self.stream.flush()


def _settings(args: argparse.Namespace, setup: _Setup) -> dict[str, Any]:
    config, row_bytes = setup.config, setup.channels * DTYPE_BYTES[args.dtype]
    return {
        "ranks": list(args.ranks),
        "samples_per_rank": args.samples_per_rank,
        "steps": args.steps,
        "seed": args.seed,
        "solver": config.solver,
        "trigger_threshold": config.trigger_threshold,
        "min_gain": config.min_gain,
        "max_len_ratio": config.max_len_ratio,
        "split_videos": config.split_videos,
        "cost_model": {"name": setup.cost_name, **dataclasses.asdict(CostModel.from_config(config))},
        "resize": dataclasses.asdict(setup.rule),
        "channels": setup.channels,
        "dtype": args.dtype,
        "row_bytes": row_bytes,
    }


def _run(args: argparse.Namespace, setup: _Setup) -> tuple[dict[str, Any], tuple[DPResult, ...]]:
    show = args.progress == "always" or (args.progress == "auto" and sys.stderr.isatty())
    progress = _Progress(args.steps * len(args.ranks), sys.stderr) if show else None
    start = time.perf_counter()
    try:
        results = simulate(
            setup.dataset.samples,
            args.ranks,
            samples_per_rank=args.samples_per_rank,
            steps=args.steps,
            seed=args.seed,
            config=setup.config,
            progress=progress,
            frames=setup.dataset.frames or None,
        )
    finally:
        if progress is not None:
            progress.close()
    settings = _settings(args, setup)
    report = {
        "dataset": dataset_summary(setup.dataset),
        "settings": settings,
        "results": [result_summary(r, settings["row_bytes"]) for r in results],
        "elapsed_seconds": time.perf_counter() - start,
    }
    return report, results


def _write_all(files: list[tuple[Path, bytes]]) -> None:
    """Write each ``(path, data)`` to a temporary file beside ``path``, then, once all are written,
    rename them over their paths: a file that cannot be written leaves none of them."""
    temporaries: list[tuple[str, Path]] = []
    try:
        for path, data in files:
            handle, temporary = tempfile.mkstemp(
                dir=path.resolve().parent, prefix=f".{path.name}.", suffix=".tmp"
            )
            temporaries.append((temporary, path))
            with os.fdopen(handle, "wb") as stream:
                stream.write(data)
            # mkstemp makes the file private; give it the permissions a plain open() would.
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(temporary, 0o666 & ~umask)
        for temporary, path in temporaries:
            os.replace(temporary, path)
    except BaseException:
        for temporary, _ in temporaries:
            Path(temporary).unlink(missing_ok=True)
        raise


def _emit(args: argparse.Namespace, report: dict[str, Any], results: tuple[DPResult, ...]) -> None:
    """Render everything first, then write the files, then print."""
    text = json.dumps(report, indent=2) + "\n"
    picture = None
    if args.plot is not None:
        from lightning_vit_balance.simulate.plot import render_plot

        picture = render_plot(results, args.plot.suffix.lstrip(".").lower())
    files = [(args.plot, picture)] if picture is not None else []
    if args.json not in (None, "-"):
        files.append((Path(args.json), text.encode()))
    _write_all(files)
    sys.stdout.write(text if args.json == "-" else render_table(report))


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (2 for bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fit_window_patches and args.timings is None:
        parser.error("--fit-window-patches is a term of the fit to --timings: give --timings FILE too")
    try:
        setup = _prepare(args)
        report, results = _run(args, setup)
    except (ValueError, OSError) as error:
        parser.exit(2, f"{PROG}: error: {error}\n")
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted; nothing written.\n")
        return 130
    try:
        _emit(args, report, results)
    except OSError as error:  # a folder that cannot be written, a full disk
        parser.exit(2, f"{PROG}: error: {error}; nothing written.\n")
    return 0
