"""Configuration of ViT data-parallel balancing.

One frozen dataclass, :class:`ViTBalanceConfig`, serves three front ends: Python keyword
arguments, LightningCLI YAML (it is a plain typed dataclass) and the seed trainer's argparse
flags (:func:`add_vit_balance_args` adds them with the seed's names and defaults,
:meth:`ViTBalanceConfig.from_args` reads them back).
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import hashlib
import importlib.metadata
import math
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

from lightning_vit_balance.callsite import warn_on_rank_zero

__all__ = [
    "EMPTY_RANK_POLICIES",
    "SOLVERS",
    "ViTBalanceConfig",
    "add_vit_balance_args",
    "check_int",
    "check_number",
    "package_version",
    "require_config",
    "require_flag",
    "setting_digest",
    "stable_digest",
]

#: Set within :meth:`ViTBalanceConfig.dropping_unknown_fields`.
_DROPPING_UNKNOWN_FIELDS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "vit_balance_dropping_unknown_fields", default=False
)

#: Accepted ``solver`` names. ``"seed"`` is an alias of ``"lpt"``: a config keeps the name it was
#: given (so configs saved with ``"seed"`` load and compare as before), and both plan identically.
SOLVERS: tuple[str, ...] = ("locality", "lpt", "seed")
EMPTY_RANK_POLICIES: tuple[str, ...] = ("attached", "no_grad")


def _fail(name: str, value: object, expected: str, owner: str = "ViTBalanceConfig") -> None:
    raise ValueError(f"{owner}.{name}={value!r} is invalid: expected {expected}.")


def require_flag(
    owner: str, name: str, value: object, optional: bool = False, attribute: bool = False
) -> bool | None:
    """``value`` of ``owner``'s argument ``name`` (its attribute, where ``attribute``) where it is a
    bool (or None, where ``optional``); else a ValueError naming both, as for the config's own
    flags: ``bool()`` of a string such as ``"False"`` is True."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    expected = "a bool or None" if optional else "a bool"
    if attribute:
        _fail(name, value, expected, owner)
    raise ValueError(f"{owner}({name}={value!r}) is invalid: expected {expected}.")


def check_number(
    name: str,
    value: object,
    expected: str,
    accept: Callable[[float], bool],
    owner: str = "ViTBalanceConfig",
) -> None:
    """Raise unless ``value`` is a finite real number (not a bool; NumPy's scalars too) that
    ``accept`` takes."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not accept(float(value))
    ):
        _fail(name, value, f"a finite number {expected}", owner)


def check_int(name: str, value: object, minimum: int, owner: str = "ViTBalanceConfig") -> None:
    """Raise unless ``value`` is an int (not a bool; NumPy's integers too) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        _fail(name, value, f"an int >= {minimum}", owner)


@dataclass(frozen=True)
class ViTBalanceConfig:
    """How (and whether) ViT work is balanced across data-parallel ranks.

    Args:
        enabled: Balance at all. The seed's ``--use-vit-dp-balance`` flag defaults to off; a config
            built in Python (or an absent one on a module using the mixin) means balancing is wanted,
            so the dataclass default is on. Set ``False`` to call the ViT directly.
        max_len_ratio: The seed's ``--dp-balance-max-len-ratio-vit``: no rank receives more than
            ``mean_patches_per_rank * max_len_ratio`` patches when that is achievable (the
            locality solver; the ``"lpt"`` solver places greedily, an image with room nowhere on the
            lightest rank), but for a rank that encodes one image alone, which may exceed it (see
            :mod:`lightning_vit_balance.planning`). ``None`` (default) means no cap. Must be at
            least 1.
        trigger_threshold: The seed's ``--dp-balance-trigger-threshold-vit``: skip balancing when
            the imbalance ratio ``max_load / mean_load - 1`` is below this value. Default 0.2.
        verbose: The seed's ``--dp-balance-verbose``: DP rank 0 prints a report per call
            (decision, reason, imbalance, load per rank, cumulative applied/total).
        solver: ``"locality"`` (default): fast, keeps images at home unless moving them helps and
            balances around a dominating image. ``"lpt"``: the seed's algorithm, LPT plus move/swap
            refinement and its skip rule, for comparison. ``"seed"`` is accepted as an alias of
            ``"lpt"`` (same plans; the config keeps the name it was given).
        cost_quadratic: ``a`` in the image cost
            ``a*l**2 + w*l*min(l, window) + b*l + c`` of an image with ``l`` patches. The defaults
            (``a=1``, the rest 0) are the seed's ``l**2``. :class:`~lightning_vit_balance.CostModel`
            derives all five from a ViT's shape or fits them to timings; ``CostModel.to_config``
            puts them here.
        cost_linear: ``b``, the per-patch term (MLP and projections).
        cost_constant: ``c``, the fixed cost per image.
        cost_windowed: ``w``, the windowed-attention term.
        cost_window_patches: ``window``, patches per attention window (0: no windowed layers).
        cost_per_frame_attention: Attention runs within each temporal step of a video, not over
            the whole video: an item with ``T`` temporal steps costs
            ``a*l**2/T + w*l*min(l/T, window) + b*l + c`` (``T`` segments of ``l/T`` patches). True
            for Hugging Face's Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers (``CostModel.from_vit`` sets
            it for them). Default ``False``: the seed's whole-item ``l**2``. Images (``T = 1``) cost
            the same either way.
        refine_tolerance: Seed solver, and the locality solver's final refinement: stop refining once
            ``(max - min) / min`` is below this.
        refine_iterations: Seed solver, and the locality solver's final refinement: at most this
            many move/swap refinements.
        min_gain: Locality solver: skip (reason ``"no-gain"``) when the plan lowers the makespan
            by less than this fraction of the unbalanced makespan, since the exchange would cost
            more than it saves. (The ``"lpt"`` solver skips so when its plan does not lower it.)
        empty_rank_forward: What a rank left with no images does so that every rank runs the
            same forward: ``"attached"`` (default) runs the ViT on one tiny dummy image and returns
            zero-row outputs still attached to the ViT's parameters (DDP without
            ``find_unused_parameters`` and FSDP keep working); ``"no_grad"`` runs the dummy forward
            without autograd (cheaper, for setups that tolerate unused parameters; not with the
            call under activation checkpointing, whose recomputation such a rank would skip).
        gather_capacity: No longer used; accepted so that saved configurations still load. The
            metadata gather now always carries 64 runs of equal grid rows per rank (one more
            gather for a rank with more): a fixed size lets ranks whose settings differ still meet
            in it and raise a clear error instead of hanging.
        overlap_pixel_trip: Start the pixel trip asynchronously and encode the images that stay on
            this rank while it is in flight, then the arrivals (two ViT calls instead of one; the
            same outputs and gradients). It pays where the transfer runs beside the computation
            (NCCL on GPUs); on CPU with gloo the trip competes for the same cores, so it is off
            by default (see BENCHMARKS.md). A ViT whose parameters are sharded (FSDP, ZeRO-3) is
            called once, without the overlap: each call gathers its parameters.
        calibrate_cost: Fit the cost model online (``CostCalibrator``) to every rank's measured
            ViT milliseconds of recent calls, carried in the metadata gather the balancer makes
            anyway, so every rank fits the same coefficients at the same call; the ``cost_*`` fields
            are the model until the first fit. The fitted coefficients are part of the settings
            that ranks must agree on.
        plan_ahead: Lightning: gather the grid rows and plan each batch of a loop that balances
            (training; validation and test on ``DistributedSampler`` loaders) in
            ``on_before_batch_transfer``, while the batch is on the host, so the step's balanced call
            makes no metadata gather and no device-to-host sync (see ``ViTBalanceMixin``). Without
            Lightning, call ``ViTBalancer.prepare`` yourself.
        split_videos: Plan and move each temporal step of a video (a grid row ``(T, H, W)``) as an
            item of its own, ``T`` items ``(1, H, W)``: a long video no longer bounds the slowest
            rank. Only for a ViT whose output rows for a temporal step depend on that step alone
            (attention within each step and no temporal position embedding), as in Hugging Face's
            Qwen-VL towers, for which the drop-in's default configuration sets it: elsewhere the
            outputs would change. Default ``False``.
        check_skipped_calls: In a call the plan skips (every rank encodes its own images), gather
            a status word from every rank after the ViT too, as a call that moves images does:
            a ViT that raises on one rank (out of memory, say) then fails every rank at once with
            the same error. Off (default), such a call makes no collective after the ViT (none at
            all with a prepared plan, unless no rank has images), and the other ranks meet the
            failure at their next collective (DDP's gradient all-reduce), which waits for the
            backend's timeout unless the launcher ends the job first. The word travels on the
            host-side group (gloo); where the data-parallel group has none (an NCCL group without
            a twin from ``make_host_group``), reading it would wait for the device, so skipped
            calls there stay unchecked.
    """

    enabled: bool = True
    max_len_ratio: float | None = None
    trigger_threshold: float = 0.2
    verbose: bool = False
    solver: Literal["locality", "lpt", "seed"] = "locality"
    cost_quadratic: float = 1.0
    cost_linear: float = 0.0
    cost_constant: float = 0.0
    cost_windowed: float = 0.0
    cost_window_patches: int = 0
    cost_per_frame_attention: bool = False
    refine_tolerance: float = 0.05
    refine_iterations: int = 20
    min_gain: float = 0.02
    empty_rank_forward: Literal["attached", "no_grad"] = "attached"
    gather_capacity: int = 64
    overlap_pixel_trip: bool = False
    calibrate_cost: bool = False
    plan_ahead: bool = False
    split_videos: bool = False
    check_skipped_calls: bool = False

    def __post_init__(self) -> None:
        for name in (
            "enabled",
            "verbose",
            "overlap_pixel_trip",
            "calibrate_cost",
            "plan_ahead",
            "split_videos",
            "check_skipped_calls",
            "cost_per_frame_attention",
        ):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "a bool")
        if self.max_len_ratio is not None:
            check_number("max_len_ratio", self.max_len_ratio, ">= 1.0", lambda v: v >= 1.0)
        check_number("trigger_threshold", self.trigger_threshold, ">= 0", lambda v: v >= 0)
        check_number("refine_tolerance", self.refine_tolerance, ">= 0", lambda v: v >= 0)
        check_number("min_gain", self.min_gain, "in [0, 1)", lambda v: 0 <= v < 1)
        check_int("refine_iterations", self.refine_iterations, 0)
        check_int("gather_capacity", self.gather_capacity, 1)
        if self.solver not in SOLVERS:
            _fail("solver", self.solver, f"one of {SOLVERS}")
        if self.empty_rank_forward not in EMPTY_RANK_POLICIES:
            _fail("empty_rank_forward", self.empty_rank_forward, f"one of {EMPTY_RANK_POLICIES}")
        for name in ("cost_quadratic", "cost_linear", "cost_constant", "cost_windowed"):
            check_number(name, getattr(self, name), ">= 0", lambda v: v >= 0)
        check_int("cost_window_patches", self.cost_window_patches, 0)
        if self.cost_windowed > 0 and self.cost_window_patches == 0:  # every windowed cost would be 0
            _fail("cost_window_patches", 0, "a window > 0 (patches) with cost_windowed > 0")
        if self.cost_quadratic + self.cost_linear + self.cost_constant + self.cost_windowed <= 0:
            _fail("cost_quadratic", self.cost_quadratic, "at least one cost coefficient > 0")
        self._hold_plain_numbers()

    def _hold_plain_numbers(self) -> None:
        """Hold NumPy scalars as Python's numbers: the settings then compare, print and pickle
        (``torch.load(weights_only=True)``) as the same values given as Python's do."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or type(value) in (int, float):
                continue
            if isinstance(value, numbers.Integral):
                object.__setattr__(self, field.name, int(value))
            elif isinstance(value, numbers.Real):  # NumPy's float64 too, a float of another type
                object.__setattr__(self, field.name, float(value))

    def __setstate__(self, state: dict[str, object]) -> None:
        """Unpickle (a checkpoint's hyperparameters, a spawned process) through ``__init__``'s checks.

        Fields absent from ``state`` (a checkpoint written before they existed) take their
        defaults; a field this version does not know raises ``ValueError``, naming it, except
        within :meth:`dropping_unknown_fields`, which leaves it out with a warning.
        """
        fields = {f.name: f for f in dataclasses.fields(self)}
        unknown = sorted(set(state) - set(fields))
        if unknown and not _DROPPING_UNKNOWN_FIELDS.get():
            raise ValueError(
                f"ViTBalanceConfig state has unknown fields {unknown}: expected fields among "
                f"{sorted(fields)} (saved by another version of lightning-vit-balance?). Load it "
                "with that version, or within `with ViTBalanceConfig.dropping_unknown_fields():` "
                "to leave those fields out."
            )
        if unknown:
            warn_on_rank_zero(
                f"ViTBalanceConfig: the loaded configuration's fields {unknown} are unknown to this "
                "version of lightning-vit-balance and left out (dropping_unknown_fields).",
            )
        for name, field in fields.items():
            # Frozen: set through object, then validate as __init__ does.
            object.__setattr__(self, name, state.get(name, field.default))
        self.__post_init__()

    @staticmethod
    @contextlib.contextmanager
    def dropping_unknown_fields() -> Iterator[None]:
        """Within it, configurations unpickled (a checkpoint written by a later version, say) leave
        out the fields this version does not know, with a ``RuntimeWarning`` naming them, instead
        of raising. The configuration then balances as this version does without those fields::

            with ViTBalanceConfig.dropping_unknown_fields():
                checkpoint = torch.load(path, weights_only=False)
        """
        token = _DROPPING_UNKNOWN_FIELDS.set(True)
        try:
            yield
        finally:
            _DROPPING_UNKNOWN_FIELDS.reset(token)

    @classmethod
    def from_args(
        cls, namespace: argparse.Namespace, base: ViTBalanceConfig | None = None
    ) -> ViTBalanceConfig:
        """Build the configuration from the seed's flags (see :func:`add_vit_balance_args`).

        Args:
            namespace: ``parser.parse_args()`` of a parser given to :func:`add_vit_balance_args`.
            base: Supplies every field the seed has no flag for (solver, cost model...); default
                ``ViTBalanceConfig()``.

        Returns:
            ``base`` with ``enabled``, ``max_len_ratio``, ``trigger_threshold`` and ``verbose`` taken
            from the flags. Invalid values raise ``ValueError``, naming the field.
        """
        if base is None:
            base = cls()
        elif not isinstance(base, ViTBalanceConfig):
            raise TypeError(f"ViTBalanceConfig.from_args(base={base!r}) expected a ViTBalanceConfig or None.")
        missing = [dest for dest in _DEST_TO_FIELD if not hasattr(namespace, dest)]
        if missing:
            raise ValueError(
                f"ViTBalanceConfig.from_args(namespace) lacks {', '.join(missing)}: expected a namespace "
                f"parsed by a parser given to add_vit_balance_args(parser)."
            )
        values = {field: getattr(namespace, dest) for dest, field in _DEST_TO_FIELD.items()}
        return dataclasses.replace(base, **values)

    def fingerprint(self, **extra: object) -> tuple[tuple[str, int], ...]:
        """One integer per setting that shapes the plan or the exchange, to compare across ranks.

        Ranks whose settings differ would plan differently and exchange the wrong rows, so the
        balancer sends this in its metadata gather and raises on every rank when ranks disagree,
        naming the settings. It covers every field but ``verbose`` (only printing) and
        ``gather_capacity`` (no longer used), plus the package version, a digest of the package's
        Python sources (a stale install that kept its version number, or a file edited on one
        node, runs other code) and ``extra`` (e.g. a cost model fitted at run time).

        Args:
            **extra: Further named values that must agree across ranks.

        Returns:
            ``(name, value)`` pairs in a fixed order; each value is a 62-bit hash of the setting, so
            equal settings give equal integers on every process (no ``hash()`` seed involved).
        """
        named: dict[str, object] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in _NOT_FINGERPRINTED
        }
        if named.get("solver") == "seed":
            named["solver"] = "lpt"  # an alias: the same plans
        named["package_version"] = package_version()
        named["package_sources"] = _package_sources()
        named.update(extra)
        return tuple((name, setting_digest(value)) for name, value in named.items())


#: Fields that do not change what ranks compute or exchange.
_NOT_FINGERPRINTED = frozenset({"verbose", "gather_capacity"})


def _canonical(value: object) -> object:
    # Numbers are compared by value, so 1 and 1.0 (from YAML or Python) agree.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value).hex()
    if isinstance(value, (tuple, list)):
        return [_canonical(v) for v in value]
    return value


def setting_digest(value: object) -> int:
    """The integer :meth:`ViTBalanceConfig.fingerprint` gives one setting's ``value``: a pair
    ``(name, setting_digest(value))`` appended to a fingerprint equals the fingerprint made with
    that pair as ``extra``, without hashing the other settings again."""
    return stable_digest(repr(_canonical(value)).encode())


def stable_digest(data: bytes) -> int:
    """A 62-bit integer of ``data`` (blake2b), equal in every process, to compare across ranks: it
    fits an int64 row of a gather, and no ``hash()`` seed is involved."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


@lru_cache(maxsize=1)
def package_version() -> str:
    try:
        return importlib.metadata.version("lightning-vit-balance")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@lru_cache(maxsize=1)
def _package_sources() -> str:
    """:func:`_sources_digest` of the installed package, read once per process (about a
    millisecond)."""
    return _sources_digest(Path(__file__).resolve().parent)


def _sources_digest(root: Path) -> str:
    """A digest of every ``.py`` file under ``root``, each by its path relative to ``root`` and
    its bytes; ``"unreadable"`` where they cannot be read (a zipped install)."""
    digest = hashlib.blake2b(digest_size=16)
    try:
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    except OSError:
        return "unreadable"
    return digest.hexdigest()


#: namespace attribute (argparse ``dest``) -> ViTBalanceConfig field.
_DEST_TO_FIELD: dict[str, str] = {
    "use_vit_dp_balance": "enabled",
    "dp_balance_max_len_ratio_vit": "max_len_ratio",
    "dp_balance_trigger_threshold_vit": "trigger_threshold",
    "dp_balance_verbose": "verbose",
}


def _flag_number(at_least: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite float ``>= at_least``; anything else is a usage error that
    names the flag (as argparse reports a value that is not a number), not a traceback later."""

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        if not math.isfinite(value) or value < at_least:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a finite number >= {at_least:g}")
        return value

    return number


def require_config(owner: str, config: object) -> None:
    """Raise a TypeError naming ``owner``'s ``config`` argument unless it is a
    :class:`ViTBalanceConfig` or None."""
    if config is not None and not isinstance(config, ViTBalanceConfig):
        raise TypeError(f"{owner}(config={config!r}) is invalid: expected a ViTBalanceConfig or None.")


def add_vit_balance_args(
    parser: argparse.ArgumentParser,
) -> argparse.ArgumentParser:
    """Add the seed's four ViT-balance flags to ``parser`` and return it.

    ``--use-vit-dp-balance`` (off), ``--dp-balance-max-len-ratio-vit`` (``None``),
    ``--dp-balance-trigger-threshold-vit`` (``0.2``) and ``--dp-balance-verbose`` (off). In the
    seed ``--dp-balance-verbose`` is shared with the VLM-level balance, so a parser that already
    defines it keeps its own definition.

    Args:
        parser: The training script's parser.

    Returns:
        The same parser, so calls can be chained.
    """
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(
            f"add_vit_balance_args(parser={parser!r}) expected an argparse.ArgumentParser, "
            f"got {type(parser).__name__}."
        )
    group = parser.add_argument_group("ViT data-parallel balance")
    group.add_argument(
        "--use-vit-dp-balance",
        action="store_true",
        default=False,
        help="Balance ViT encoder work across data-parallel ranks.",
    )
    group.add_argument(
        "--dp-balance-max-len-ratio-vit",
        type=_flag_number(1.0),
        default=None,
        help="Cap on patches per rank after balancing: avg_patches * ratio (>= 1). Default: no cap.",
    )
    group.add_argument(
        "--dp-balance-trigger-threshold-vit",
        type=_flag_number(0.0),
        default=0.2,
        help="Skip balancing while the imbalance max_load/mean_load - 1 is below this (>= 0). Default: 0.2.",
    )
    # Already defined when the script also has the seed's VLM-level balance, which shares it.
    with contextlib.suppress(argparse.ArgumentError):
        group.add_argument(
            "--dp-balance-verbose",
            action="store_true",
            default=False,
            help="Print per step: imbalance, load per rank, decision and applied/total count.",
        )
    return parser
