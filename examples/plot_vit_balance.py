"""Draw a ViT-balance dashboard from the metrics that ``ViTBalanceCallback`` logged.

Works on any CSV (Lightning's ``CSVLogger`` ``metrics.csv``) or TensorBoard event file (no
TensorBoard install needed) that holds the ``vit_balance/...`` keys, and on a Hugging Face
``Trainer``'s ``trainer_state.json``, whose log history ``ViTBalanceTrainerCallback`` fills. A
directory holding several runs draws the latest that holds the keys::

    python examples/plot_vit_balance.py lightning_logs/version_0 -o vit_balance.png
    python examples/plot_vit_balance.py output_dir -o vit_balance.png  # its latest checkpoint

The picture has three panels: the imbalance ``max/mean - 1`` before and after balancing per step
(applied steps marked), and the ViT load of every data-parallel rank without and with balancing;
a fourth, when the log holds measured ViT milliseconds, draws every rank's
(``vit_balance/vit_ms/rank_{r}``), the slowest rank's and the mean, and names the rank that was
slowest most often (``vit_balance/vit_ms_slowest_rank``), with the logging rank's time in the trips
per call (``vit_balance/trip_ms``: what balancing spends to shorten the slowest rank). Beyond 64
data-parallel ranks the callbacks log no per-rank series by default: the load panels then say so,
and the fourth draws the slowest rank and the mean alone.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "drawn_run",
    "find_metric_files",
    "load_metrics",
    "log_runs",
    "main",
    "plot_dashboard",
    "read_csv",
    "read_tensorboard",
    "read_trainer_state",
]

PREFIX = "vit_balance/"
#: Ranks named in a panel's legend; beyond, their lines are drawn alike, unnamed.
LEGEND_RANKS = 16

#: ``metrics[key]`` is a list of ``(step, value)`` pairs sorted by step.
Metrics = dict[str, list[tuple[int, float]]]


def read_csv(path: str | Path) -> Metrics:
    """Read a Lightning ``CSVLogger`` ``metrics.csv``: one column per key, empty cells skipped."""
    metrics: Metrics = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            step_text = row.get("step") or ""
            if not step_text:
                continue
            step = int(float(step_text))
            for key, text in row.items():
                if key in ("step", "epoch") or key is None or text in (None, ""):
                    continue
                value = float(text)
                if math.isfinite(value):
                    metrics.setdefault(key, []).append((step, value))
    return {key: sorted(pairs) for key, pairs in metrics.items()}


def _varints(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """Yield ``(field_number, wire_type, value)`` of a protobuf message (varint/len/fixed)."""
    pos = 0

    def varint() -> int:
        nonlocal pos
        result = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return result

    while pos < len(data):
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            yield field, wire, varint()
        elif wire == 1:
            yield field, wire, data[pos : pos + 8]
            pos += 8
        elif wire == 2:
            size = varint()
            yield field, wire, data[pos : pos + size]
            pos += size
        elif wire == 5:
            yield field, wire, data[pos : pos + 4]
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} in a TensorBoard event")


def _scalar_of_tensor(tensor: bytes) -> float | None:
    """A float scalar stored as a ``TensorProto`` (TF2-style summaries)."""
    for field, _, value in _varints(tensor):
        if field == 4 and isinstance(value, bytes) and len(value) in (4, 8):  # tensor_content
            return struct.unpack("<f" if len(value) == 4 else "<d", value)[0]
        elif field == 5 and isinstance(value, bytes):  # float_val (packed or single)
            return struct.unpack("<f", value[:4])[0]
        elif field == 6 and isinstance(value, bytes):  # double_val
            return struct.unpack("<d", value[:8])[0]
    return None


def read_tensorboard(path: str | Path) -> Metrics:
    """Read the scalars of a TensorBoard event file (TFRecord of ``Event`` protobufs)."""
    metrics: Metrics = {}
    data = Path(path).read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        record = data[pos + 12 : pos + 12 + length]  # skip length and its CRC
        pos += 12 + length + 4  # and the record's CRC
        step, summary = 0, None
        for field, _, value in _varints(record):
            if field == 2:
                step = int(value)  # type: ignore[arg-type]
            elif field == 5:
                summary = value
        if not isinstance(summary, bytes):
            continue
        for field, _, entry in _varints(summary):
            if field != 1 or not isinstance(entry, bytes):
                continue
            tag, scalar = None, None
            for vfield, _, vvalue in _varints(entry):
                if vfield == 1 and isinstance(vvalue, bytes):
                    tag = vvalue.decode()
                elif vfield == 2 and isinstance(vvalue, bytes):  # simple_value
                    scalar = struct.unpack("<f", vvalue)[0]
                elif vfield == 8 and isinstance(vvalue, bytes):
                    scalar = _scalar_of_tensor(vvalue)
            if tag is not None and scalar is not None and math.isfinite(scalar):
                metrics.setdefault(tag, []).append((step, float(scalar)))
    return {key: sorted(pairs) for key, pairs in metrics.items()}


def read_trainer_state(path: str | Path) -> Metrics:
    """Read a Hugging Face ``trainer_state.json``: the numbers of each ``log_history`` entry."""
    history = json.loads(Path(path).read_text()).get("log_history", [])
    metrics: Metrics = {}
    for entry in history:
        if "step" not in entry:
            continue
        for key, value in entry.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                metrics.setdefault(key, []).append((int(entry["step"]), float(value)))
    return {key: sorted(pairs) for key, pairs in metrics.items()}


def _latest_trainer_state(root: Path) -> list[Path]:
    """The ``trainer_state.json`` of the latest step under ``root`` (each checkpoint's history
    holds every earlier one's), as a list of at most one path."""
    states = sorted(root.rglob("trainer_state.json"))
    if not states:
        return []
    return [max(states, key=_global_step)]


def _global_step(state: Path) -> int:
    """A ``trainer_state.json``'s ``global_step``, or a ValueError naming the file."""
    try:
        step = json.loads(state.read_text()).get("global_step", 0)
    except (ValueError, AttributeError) as error:  # not JSON, or not an object
        raise ValueError(f"{state}: not a Trainer's state ({type(error).__name__}: {error})") from error
    return step if isinstance(step, int) else 0


def log_runs(root: Path) -> list[list[Path]]:
    """The ``metrics.csv`` and ``events.out.tfevents.*`` files under ``root``, one list per
    directory (a run: a logger's version directory, a Hugging Face ``runs/...`` directory), oldest
    first by their latest write. Runs are not merged: a second fit, or one resumed into a new
    version directory, logs its own steps again, which one series would hold twice."""
    files = sorted(root.rglob("metrics.csv")) + sorted(root.rglob("events.out.tfevents.*"))
    runs: dict[Path, list[Path]] = {}
    for file in files:
        runs.setdefault(file.parent, []).append(file)
    return sorted(runs.values(), key=lambda run: (max(f.stat().st_mtime for f in run), str(run[0])))


def find_metric_files(path: str | Path) -> list[Path]:
    """The ``metrics.csv`` and ``events.out.tfevents.*`` files at or under ``path`` (every run's),
    or else the latest ``trainer_state.json``."""
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"path={str(root)!r} is neither a metrics file nor a log directory.")
    found = [file for run in log_runs(root) for file in run] or _latest_trainer_state(root)
    if not found:
        raise FileNotFoundError(
            f"path={str(root)!r} holds no metrics.csv, events.out.tfevents.* or trainer_state.json "
            "file; pass the log directory of a Trainer that ran with ViTBalanceCallback (or the "
            "output directory of a Hugging Face Trainer that ran with ViTBalanceTrainerCallback)."
        )
    return found


#: Hugging Face's reporting callbacks (TensorBoard, W&B) log a training entry ``key`` as ``train/key``.
HF_TRAIN_PREFIX = "train/"
#: ``ViTBalanceCallback``'s records of a validation or test loop: not drawn.
EVALUATION_PREFIXES = (PREFIX + "val/", PREFIX + "test/")


def _read_files(files: Sequence[Path]) -> Metrics:
    """The ``vit_balance/...`` series of ``files`` (CSV, TensorBoard events or ``trainer_state.json``)."""
    metrics: Metrics = {}
    readers = {".csv": read_csv, ".json": read_trainer_state}
    for file in files:
        try:
            part = readers.get(file.suffix, read_tensorboard)(file)
        except (ValueError, TypeError, AttributeError, KeyError, IndexError) as error:  # not a log's shape
            raise ValueError(
                f"{file}: not a log this dashboard reads ({type(error).__name__}: {error})"
            ) from error
        for key, pairs in part.items():
            name = key.removeprefix(HF_TRAIN_PREFIX) if key.startswith(HF_TRAIN_PREFIX + PREFIX) else key
            # Training's series alone: a validation's or test's (ViTBalanceCallback's
            # vit_balance/val/..., vit_balance/test/...) is no training step, and a run of
            # trainer.test() or trainer.validate() alone has nothing to draw.
            if name.startswith(PREFIX) and not name.startswith(EVALUATION_PREFIXES):
                metrics.setdefault(name, []).extend(pairs)
    return metrics


def load_metrics(path: str | Path) -> Metrics:
    """The ``vit_balance/...`` series at or under ``path``: of the latest run that holds them (CSV or
    TensorBoard, see :func:`drawn_run`), or else of the latest ``trainer_state.json`` there (a Hugging
    Face output directory whose TensorBoard events hold only the Trainer's own entries)."""
    return drawn_run(path)[0]


def drawn_run(path: str | Path) -> tuple[Metrics, list[Path]]:
    """:func:`load_metrics`'s series, and the directories of the other runs under ``path`` that hold
    such series, not drawn (earliest first; empty for a file, or series from a ``trainer_state.json``)."""
    root = Path(path)
    runs = log_runs(root) if root.is_dir() else []
    # A run without the series (a test run's, a restart that logged nothing yet) is passed over.
    drawable = [(run[0].parent, series) for run in runs if (series := _read_files(run))]
    if drawable:
        metrics, others = drawable[-1][1], [where for where, _ in drawable[:-1]]
    else:  # a file, the latest trainer_state.json, or find_metric_files' error for a path without logs
        metrics, others = _read_files(_latest_trainer_state(root) if runs else find_metric_files(root)), []
    if not metrics:
        raise ValueError(
            f"no '{PREFIX}...' metrics under path={str(path)!r}: expected the logs of a run with "
            "ViTBalanceCallback and balancing enabled (enabled=False records nothing: for a run "
            "that moves nothing but logs, use trigger_threshold=1e9)"
        )
    return {key: sorted(pairs) for key, pairs in metrics.items()}, others


def _rank_series(metrics: Mapping[str, Sequence[tuple[int, float]]], kind: str) -> dict[int, list]:
    """``{rank: [(step, value), ...]}`` for ``vit_balance/{kind}/rank_{r}`` (``load_before``, ``vit_ms``)."""
    prefix = f"{PREFIX}{kind}/rank_"
    series = {}
    for key, pairs in metrics.items():
        if key.startswith(prefix) and key[len(prefix) :].isdigit():
            series[int(key[len(prefix) :])] = list(pairs)
    return dict(sorted(series.items()))


def plot_dashboard(
    metrics: Mapping[str, Sequence[tuple[int, float]]],
    output: str | Path,
    *,
    title: str = "ViT data-parallel balance",
    timings: Mapping[str, Sequence[tuple[int, float]]] | None = None,
    timings_title: str = "Slowest rank's ViT time per step",
) -> Path:
    """Write the dashboard PNG.

    Args:
        metrics: ``{key: [(step, value), ...]}`` as :func:`load_metrics` returns.
        output: PNG path (parent directories are created).
        title: Figure title.
        timings: Optional ``{label: [(step, seconds), ...]}`` (e.g. the slowest rank's ViT time
            with and without balancing) drawn as a fourth panel.
        timings_title: Title of that panel.

    Returns:
        The written path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    loads = {"before": _rank_series(metrics, "load_before"), "after": _rank_series(metrics, "load_after")}
    measured = _rank_series(metrics, "vit_ms")
    summary = {key: metrics.get(f"{PREFIX}vit_ms_{key}", []) for key in ("max", "mean", "slowest_rank")}
    summary["trips"] = _per_call(metrics, "trip_ms")
    summary["cost_fit_error"] = metrics.get(f"{PREFIX}cost_fit_error", [])
    show_measured = bool(measured or summary["max"])
    panels = 3 + (1 if show_measured else 0) + (1 if timings else 0)
    fig, axes = plt.subplots(panels, 1, figsize=(10, 2.6 * panels + 0.6), sharex=False)
    fig.suptitle(title, fontsize=13)
    _plot_imbalance(axes[0], metrics)
    _plot_loads(axes[1:3], loads)
    if show_measured:
        _plot_measured(axes[3], measured, summary)
    if timings:
        _plot_timings(axes[-1], timings, timings_title)
    for ax in axes:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 2.5 on a short run
    fig.tight_layout()
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_imbalance(ax: Any, metrics: Mapping[str, Sequence[tuple[int, float]]]) -> None:
    """Imbalance before and after balancing per step, the steps where any call moved images circled."""
    before = metrics.get(f"{PREFIX}imbalance_before", [])
    after = metrics.get(f"{PREFIX}imbalance_after", [])
    if before:
        ax.plot(*zip(*before), color="tab:red", marker="o", ms=3, label="before (as the data came)")
    if after:
        ax.plot(*zip(*after), color="tab:green", marker="o", ms=3, label="after balancing")
    # One value per step, the last logged: the share of its calls that moved images (0.5 for a
    # step whose images moved and whose videos did not, in two calls).
    applied = dict(metrics.get(f"{PREFIX}applied", []))
    applied_steps = [step for step, value in applied.items() if value > 0]
    lookup = dict(before)
    marks = [(s, lookup[s]) for s in applied_steps if s in lookup]
    if marks:
        ax.scatter(*zip(*marks), s=60, facecolors="none", edgecolors="black", label="applied", zorder=3)
    ax.set_ylabel("max/mean - 1")
    ax.set_title("Imbalance of ViT load across ranks, per step" + _calls_told(metrics))
    # Headroom for the legend; a run without imbalance (one device) keeps a readable 0-0.1 axis.
    top = max((v for _, v in [*before, *after]), default=1.0)
    ax.set_ylim(0, max(top * 1.35, 0.1))
    ax.legend(loc="upper center", fontsize=8, ncol=3)
    ax.grid(alpha=0.3)


def _calls_told(metrics: Mapping[str, Sequence[tuple[int, float]]]) -> str:
    """A title line with the run's calls by outcome (``vit_balance/calls_total``, ``applied_total``
    and ``skipped/{reason}`` at the last logged step), the most frequent skip first, or ``""``
    without the counts: why the lines meet where nothing moved."""
    totals = metrics.get(f"{PREFIX}calls_total", [])
    if not totals:
        return ""
    applied = metrics.get(f"{PREFIX}applied_total", [(0, 0.0)])[-1][1]
    skipped = {
        key[len(f"{PREFIX}skipped/") :]: series[-1][1]
        for key, series in metrics.items()
        if key.startswith(f"{PREFIX}skipped/") and series and series[-1][1] > 0
    }
    reasons = ", ".join(
        f"{reason} {count:.0f}" for reason, count in sorted(skipped.items(), key=lambda kv: -kv[1])
    )
    return f"\n{totals[-1][1]:.0f} calls: {applied:.0f} moved images" + (
        f"; skipped: {reasons}" if reasons else ""
    )


def _relative_to_the_step(series: Mapping[int, list]) -> dict[int, list]:
    """Each rank's load divided by the mean over ranks at its step: cost units mean nothing to a
    reader, and change where the online cost fit (``calibrate_cost``) takes over from the
    configuration's model (FLOPs, then milliseconds)."""
    per_step: dict[int, list[float]] = {}
    for pairs in series.values():
        for step, value in pairs:
            per_step.setdefault(step, []).append(value)
    means = {step: sum(values) / len(values) for step, values in per_step.items()}
    return {
        rank: [(step, value / means[step]) for step, value in pairs if means[step] > 0]
        for rank, pairs in series.items()
    }


def _plot_loads(axes: Sequence[Any], loads: Mapping[str, Mapping[int, list]]) -> None:
    """Each rank's load without and with balancing, relative to the step's mean load, on one
    scale so the two panels compare (1: the rank's fair share)."""
    relative = {kind: _relative_to_the_step(series) for kind, series in loads.items()}
    values = [value for series in relative.values() for pairs in series.values() for _, value in pairs]
    peak = max(values, default=1.0)
    for ax, kind, label in ((axes[0], "before", "without balancing"), (axes[1], "after", "with balancing")):
        series = relative[kind]
        _plot_ranks(ax, series, lw=1.2)
        _legend(ax)
        ax.set_ylim(0, peak * 1.25)
        ax.set_ylabel("load / mean load")
        ax.set_title(f"ViT load per rank relative to the step's mean, {label}")
        ax.grid(alpha=0.3)
        if not series:
            message = "no per-rank series in this log (log_per_rank_loads; off beyond 64 ranks by default)"
            ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, fontsize=9)


def _plot_timings(ax: Any, timings: Mapping[str, Sequence[tuple[int, float]]], title: str) -> None:
    """Seconds per step of each labelled run, drawn in milliseconds."""
    for label, pairs in timings.items():
        if pairs:
            steps, seconds = zip(*pairs)
            ax.plot(steps, [1000 * s for s in seconds], marker=".", label=label)
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)


def _plot_ranks(ax: Any, series: Mapping[int, list], lw: float) -> None:
    """One line per rank, labelled for the legend up to :data:`LEGEND_RANKS` ranks, thin and grey beyond."""
    few = len(series) <= LEGEND_RANKS
    for rank, pairs in series.items():
        if pairs:
            style = {"marker": ".", "lw": lw, "label": f"rank {rank}"} if few else {"lw": 0.5, "color": "0.7"}
            ax.plot(*zip(*pairs), **style)


def _legend(ax: Any) -> None:
    """The panel's named lines in a legend, up to 8 columns; none without named lines."""
    handles, labels = ax.get_legend_handles_labels()
    if labels:
        ax.legend(handles, labels, loc="upper right", fontsize=8, ncol=min(len(labels), 8))


def _plot_measured(
    ax: Any, measured: Mapping[int, list], summary: Mapping[str, Sequence[tuple[int, float]]]
) -> None:
    """The measured ViT milliseconds of every rank (when logged), the slowest rank's and the mean,
    and the rank slowest most often: a device slower than the rest stands out there."""
    _plot_ranks(ax, measured, lw=1.0)
    if summary["max"]:
        ax.plot(*zip(*summary["max"]), color="black", ls="--", lw=1.5, label="slowest rank")
    if summary["mean"] and not measured:
        ax.plot(*zip(*summary["mean"]), color="tab:blue", lw=1.2, label="mean over ranks")
    if any(value > 0 for _, value in summary["trips"]):
        ax.plot(*zip(*summary["trips"]), color="0.4", ls=":", lw=2.0, label="trips per call")
    ax.set_ylabel("ms")
    ax.set_title(
        "Measured ViT time per rank (vit_balance/vit_ms: each step shows the previous call)"
        + _most_often_slowest(summary["slowest_rank"])
        + _cost_fit_off_by(summary["cost_fit_error"])
    )
    _legend(ax)
    ax.grid(alpha=0.3)


def _per_call(metrics: Mapping[str, Sequence[tuple[int, float]]], key: str) -> list[tuple[int, float]]:
    """``vit_balance/{key}`` (a record's sum over its calls) per call, at the steps logging both."""
    calls = dict(metrics.get(PREFIX + "calls", []))
    return [
        (step, value / calls[step]) for step, value in metrics.get(PREFIX + key, []) if calls.get(step, 0) > 0
    ]


def _most_often_slowest(slowest_rank: Sequence[tuple[int, float]]) -> str:
    """A second title line, ``slowest most often: rank r (k of n records)`` (ties: the lowest
    rank), or ``""`` without the series."""
    if not slowest_rank:
        return ""
    counts: dict[int, int] = {}
    for _, value in slowest_rank:
        counts[int(value)] = counts.get(int(value), 0) + 1
    rank = max(sorted(counts), key=counts.__getitem__)
    return f"\nslowest most often: rank {rank} ({counts[rank]} of {len(slowest_rank)} records)"


def _cost_fit_off_by(errors: Sequence[tuple[int, float]], last: int = 10) -> str:
    """A title line, ``online cost fit off by x% (median of the last k records)``, from
    ``vit_balance/cost_fit_error`` (``calibrate_cost``), or ``""`` without the series: whether the
    plans follow the measured times."""
    if not errors:
        return ""
    recent = [value for _, value in errors[-last:]]
    return (
        f"\nonline cost fit off by {statistics.median(recent):.0%} (median of the last {len(recent)} records)"
    )


def _png_path(text: str) -> Path:
    """``-o``: the PNG file to write; a name without a suffix gets ``.png`` (as matplotlib would
    add, so the path printed is the one written)."""
    path = Path(text)
    if not text.strip() or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory or empty: expected a .png file to write")
    if not path.suffix:
        return path.with_suffix(".png")
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a .png file to write")
    return path


def main(argv: Sequence[str] | None = None) -> Path:
    """Command line: ``plot_vit_balance.py LOG_PATH [-o out.png] [--title T]``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "path", help="metrics.csv, a TensorBoard event file, a trainer_state.json, or a log directory"
    )
    parser.add_argument(
        "-o", "--output", type=_png_path, default="vit_balance_dashboard.png", help="PNG file to write"
    )
    parser.add_argument("--title", default="ViT data-parallel balance")
    args = parser.parse_args(argv)
    try:
        metrics, others = drawn_run(args.path)
    except (OSError, ValueError) as error:  # a path without the metrics: say so, no traceback
        parser.error(str(error))
    out = plot_dashboard(metrics, args.output, title=args.title)
    if others:
        print(f"drew the latest run; pass another's directory to draw it: {', '.join(map(str, others))}")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
