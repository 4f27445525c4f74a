"""ViTBalanceCallback on a real single-process Trainer, fed scripted BalanceStats records."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_vit_balance import ViTBalanceConfig, ViTBalanceMixin
from lightning_vit_balance.balancer import BalanceStats
from lightning_vit_balance.lightning.callback import ViTBalanceCallback
from lightning_vit_balance.metrics import BalanceMetrics
from lightning_vit_balance.planning import REASONS

SKIP_REASONS = [r for r in REASONS if r != "applied"]


def _stats(
    applied: bool, reason: str, before: tuple[float, ...], after: tuple[float, ...], **kw: Any
) -> BalanceStats:
    def imbalance(loads: tuple[float, ...]) -> float:
        mean = sum(loads) / len(loads)
        return max(loads) / mean - 1.0

    fields: dict[str, Any] = dict(
        applied=applied,
        reason=reason,
        rank=0,
        num_ranks=len(before),
        loads_before=before,
        loads_after=after,
        imbalance_before=imbalance(before),
        imbalance_after=imbalance(after),
        num_images=4,
        moved_images=0,
        moved_patches=0,
        total_patches=100,
        bytes_sent=0,
        bytes_received=0,
        plan_seconds=0.001,
        exchange_seconds=0.002,
        collectives=1,
    )
    fields.update(kw)
    return BalanceStats(**fields)


APPLIED_A = _stats(
    True,
    "applied",
    (900.0, 100.0),
    (500.0, 500.0),
    moved_images=2,
    moved_patches=30,
    bytes_sent=4000,
    bytes_received=1200,
    plan_seconds=0.004,
    exchange_seconds=0.010,
    collectives=3,
)
# It reports the trips of the applied call before it.
SKIPPED = _stats(False, "below-threshold", (520.0, 480.0), (520.0, 480.0), trip_ms=3.5)
APPLIED_B = _stats(
    True,
    "applied",
    (300.0, 100.0),
    (200.0, 200.0),
    moved_images=1,
    moved_patches=10,
    total_patches=20,
    bytes_sent=0,
    bytes_received=800,
    collectives=3,
    plan_seconds=0.0,
    prepare_seconds=0.006,
    trip_ms=1.25,
)
NO_GAIN = _stats(False, "no-gain", (400.0, 100.0), (400.0, 100.0))


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call, as a real logger would receive it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[dict[str, float], int | None]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((dict(metrics), step))

    def vit_balance_calls(self, loop: str | None = None) -> list[tuple[dict[str, float], int | None]]:
        """The callback's records of training steps, or (``loop``: ``"val"``, ``"test"``) of an
        evaluation loop's, which come with the epoch as Lightning logs its loops' values."""
        out = []
        for metrics, step in self.calls:
            ours = {k: v for k, v in metrics.items() if k.startswith("vit_balance/")}
            if not ours:
                continue
            # Each record is one loop's alone: training's, or every key under one evaluation's.
            loops = {k.split("/")[1] if k.split("/")[1] in ("val", "test") else None for k in ours}
            assert len(loops) == 1, f"a record mixes loops: {sorted(ours)}"
            [of] = loops
            assert set(metrics) - set(ours) == ({"epoch"} if of else set()), "nothing else mixed in"
            if of == loop:
                out.append((ours, step))
        return out


class ScriptedModule(L.LightningModule):
    """Reports the scripted records of each batch as ViTBalanceMixin would queue them."""

    def __init__(self, script: list[list[BalanceStats]]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.script = script
        self.queue: list[BalanceStats] = []

    def pop_vit_balance_stats(self) -> list[BalanceStats]:
        out, self.queue = self.queue, []
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.queue.extend(self.script[batch_idx])
        return self.layer(batch[0]).sum()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        # Calls made while validating must never reach the training metrics.
        self.queue.append(NO_GAIN)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.queue.extend([APPLIED_B, SKIPPED][: batch_idx + 1])

    def test_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(2, 2)))

    def predict_step(self, batch: Any, batch_idx: int) -> None:
        self.queue.extend(self.script[batch_idx])

    def predict_dataloader(self) -> Any:
        return self.train_dataloader()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(len(self.script), 2)))

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(1, 2)))


def _fit(
    script: list[list[BalanceStats]],
    callback: ViTBalanceCallback,
    module: ScriptedModule | None = None,
    quiet: bool = True,
    **trainer_kwargs: Any,
) -> Any:
    """Fit ``module`` (default ``ScriptedModule(script)``), its warnings silenced where ``quiet``;
    ``trainer_kwargs`` override the defaults."""
    logger = RecordingLogger()
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=logger,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    kwargs.update(trainer_kwargs)
    trainer = L.Trainer(**kwargs)
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        trainer.fit(ScriptedModule(script) if module is None else module)
    return trainer, logger


def _expected(
    records: list[BalanceStats], applied_total: int, calls_total: int, skipped: dict[str, int]
) -> dict:
    n = len(records)
    expected = {
        "vit_balance/calls": float(n),
        "vit_balance/applied": sum(s.applied for s in records) / n,
        "vit_balance/imbalance_before": sum(s.imbalance_before for s in records) / n,
        "vit_balance/imbalance_after": sum(s.imbalance_after for s in records) / n,
    }
    for side in ("before", "after"):
        for r in range(2):
            expected[f"vit_balance/load_{side}/rank_{r}"] = (
                sum(getattr(s, f"loads_{side}")[r] for s in records) / n
            )
    moved = sum(s.moved_patches for s in records)
    expected.update(
        {
            "vit_balance/moved_images": float(sum(s.moved_images for s in records)),
            "vit_balance/moved_patches": float(moved),
            "vit_balance/moved_patch_fraction": moved / sum(s.total_patches for s in records),
            "vit_balance/bytes_sent": float(sum(s.bytes_sent for s in records)),
            "vit_balance/bytes_received": float(sum(s.bytes_received for s in records)),
            "vit_balance/plan_ms": 1000.0 * sum(s.plan_seconds for s in records),
            "vit_balance/exchange_ms": 1000.0 * sum(s.exchange_seconds for s in records),
            "vit_balance/prepare_ms": 1000.0 * sum(s.prepare_seconds for s in records),
            "vit_balance/trip_ms": sum(max(0.0, s.trip_ms) for s in records),
            "vit_balance/collectives": float(sum(s.collectives for s in records)),
            "vit_balance/applied_total": float(applied_total),
            "vit_balance/calls_total": float(calls_total),
        }
    )
    for reason in sorted(SKIP_REASONS):
        expected[f"vit_balance/skipped/{reason}"] = float(skipped.get(reason, 0))
    return expected


def _assert_logged(actual: dict[str, float], expected: dict[str, float]) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        # float64 sums of a handful of values: equal up to rounding of the last bit.
        assert actual[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_exact_dicts_per_optimizer_step_with_several_calls() -> None:
    script = [[APPLIED_A, SKIPPED], [], [APPLIED_B]]
    trainer, logger = _fit(script, ViTBalanceCallback(), limit_val_batches=1, val_check_interval=1)
    logged = logger.vit_balance_calls()
    # A batch without ViT calls logs nothing; the validation-time records are not training's.
    assert [step for _, step in logged] == [0, 2]
    _assert_logged(logged[0][0], _expected([APPLIED_A, SKIPPED], 1, 2, {"below-threshold": 1}))
    _assert_logged(logged[1][0], _expected([APPLIED_B], 2, 3, {"below-threshold": 1}))
    assert "vit_balance/imbalance_before" not in trainer.progress_bar_metrics


def _under(loop: str, expected: dict[str, float]) -> dict[str, float]:
    return {key.replace("vit_balance/", f"vit_balance/{loop}/", 1): value for key, value in expected.items()}


class _LoggingItsValidation(ScriptedModule):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.log("val_marker", 1.0)  # Lightning's own on_epoch value, logged at the loop's end


def test_each_evaluation_loop_is_logged_once_under_its_name_and_never_its_sanity_check() -> None:
    """Validation and test calls had been dropped. Each loop now logs its calls once at its end,
    where Lightning logs its ``on_epoch`` values (the step it ran after, with the epoch), under
    ``vit_balance/val/`` or ``vit_balance/test/``, its counts its own; a sanity check logs none."""
    script = [[APPLIED_A], [SKIPPED], [APPLIED_B]]
    module = _LoggingItsValidation(script)
    trainer, logger = _fit(
        script,
        ViTBalanceCallback(),
        module,
        limit_val_batches=1,
        val_check_interval=1,
        num_sanity_val_steps=1,
    )
    validations = logger.vit_balance_calls("val")
    lightnings = [step for metrics, step in logger.calls if "val_marker" in metrics]
    # One record per validation, none for the sanity check, at Lightning's own steps.
    assert len(validations) == 3 and [step for _, step in validations] == lightnings, (
        validations,
        lightnings,
    )
    for record, _ in validations:
        _assert_logged(record, _under("val", _expected([NO_GAIN], 0, 1, {"no-gain": 1})))
    assert float(trainer.callback_metrics["vit_balance/val/calls"]) == 1.0
    # Training's records and counts leave the validations' out.
    assert logger.vit_balance_calls()[-1][0]["vit_balance/calls_total"] == 3.0
    [(tested, _)] = _test_records(trainer, ScriptedModule(script))
    _assert_logged(
        tested, _under("test", _expected([APPLIED_B, APPLIED_B, SKIPPED], 2, 3, {"below-threshold": 1}))
    )


def _test_records(trainer: L.Trainer, module: ScriptedModule) -> list[tuple[dict[str, float], int | None]]:
    logger = RecordingLogger()
    tester = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=trainer.callbacks[:1],
        enable_progress_bar=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tester.test(module)
    assert float(tester.callback_metrics["vit_balance/test/calls_total"]) == 3.0
    return logger.vit_balance_calls("test")


def test_a_predict_runs_figures_are_kept_and_said_in_a_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's predict loop logs nothing, and its calls had been dropped: the run's figures are
    ``last_predict_metrics`` (``vit_balance/predict/...``, that run's calls alone) and a line."""
    said: list[str] = []
    # What rank_zero_info is handed (Lightning's own loggers may not propagate to caplog's handler).
    monkeypatch.setattr("lightning_vit_balance.lightning.callback.rank_zero_info", said.append)
    script = [[APPLIED_A, SKIPPED], [], [APPLIED_B]]
    callback = ViTBalanceCallback()
    predictor = L.Trainer(accelerator="cpu", devices=1, callbacks=[callback], enable_progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        predictor.predict(ScriptedModule(script))
        _assert_logged(
            callback.last_predict_metrics,
            _under("predict", _expected([APPLIED_A, SKIPPED, APPLIED_B], 2, 3, {"below-threshold": 1})),
        )
        imbalance = (APPLIED_A.imbalance_before + SKIPPED.imbalance_before + APPLIED_B.imbalance_before) / 3
        assert said == [
            f"ViTBalanceCallback: predict: 2 of 3 calls moved images; load imbalance {imbalance:.3f}"
            f" -> {(0 + SKIPPED.imbalance_after + 0) / 3:.3f}."
        ], said
        predictor.predict(ScriptedModule([[], [], []]))  # a run without balanced calls: nothing
    assert callback.last_predict_metrics == {} and len(said) == 1


def test_gradient_accumulation_aggregates_the_micro_batches_of_a_step() -> None:
    script = [[APPLIED_A], [SKIPPED], [APPLIED_B], [NO_GAIN]]
    _, logger = _fit(script, ViTBalanceCallback(), accumulate_grad_batches=2)
    logged = logger.vit_balance_calls()
    assert [step for _, step in logged] == [0, 1]
    _assert_logged(logged[0][0], _expected([APPLIED_A, SKIPPED], 1, 2, {"below-threshold": 1}))
    _assert_logged(logged[1][0], _expected([APPLIED_B, NO_GAIN], 2, 4, {"below-threshold": 1, "no-gain": 1}))


def test_log_every_n_steps_aggregates_the_window_and_can_drop_rank_series() -> None:
    script = [[APPLIED_A], [SKIPPED], [APPLIED_B], [NO_GAIN]]
    callback = ViTBalanceCallback(log_every_n_steps=2, log_per_rank_loads=False, prog_bar=True)
    trainer, logger = _fit(script, callback)
    logged = logger.vit_balance_calls()
    assert [step for _, step in logged] == [1, 3]
    expected = _expected([APPLIED_B, NO_GAIN], 2, 4, {"below-threshold": 1, "no-gain": 1})
    expected = {k: v for k, v in expected.items() if "/rank_" not in k}
    _assert_logged(logged[1][0], expected)
    # The progress bar shows the last step's imbalance.
    assert trainer.progress_bar_metrics["vit_balance/imbalance_before"] == pytest.approx(
        NO_GAIN.imbalance_before
    )
    assert trainer.progress_bar_metrics["vit_balance/imbalance_after"] == pytest.approx(
        NO_GAIN.imbalance_after
    )
    state = callback.state_dict()
    assert {key: state[key] for key in ("applied_total", "calls_total", "skipped_total")} == {
        "applied_total": 2,
        "calls_total": 4,
        "skipped_total": {r: int(r in ("below-threshold", "no-gain")) for r in sorted(SKIP_REASONS)},
    }
    assert state["window"]["calls"] == 0  # the last step logged its record
    # Totals resume from a checkpoint.
    resumed = ViTBalanceCallback()
    resumed.load_state_dict(callback.state_dict())
    assert resumed.state_dict() == callback.state_dict()
    assert (resumed.applied_total, resumed.calls_total, resumed.skipped_total["no-gain"]) == (2, 4, 1)
    with pytest.raises(ValueError, match=r"load_state_dict\(state_dict=\{'calls_total': 4\}\) is invalid"):
        resumed.load_state_dict({"calls_total": 4})


def test_zero_means_never_log_and_bad_options_are_named() -> None:
    _, logger = _fit([[APPLIED_A]], ViTBalanceCallback(log_every_n_steps=0))
    assert logger.vit_balance_calls() == []
    with pytest.raises(ValueError, match=r"log_every_n_steps=-1"):
        ViTBalanceCallback(log_every_n_steps=-1)
    # bool("False") is True: a string from a config file would have turned the option on.
    with pytest.raises(
        ValueError, match=r"ViTBalanceCallback\(prog_bar='False'\) is invalid: expected a bool\."
    ):
        ViTBalanceCallback(prog_bar="False")
    with pytest.raises(
        ValueError, match=r"\(log_per_rank_loads='false'\) is invalid: expected a bool or None"
    ):
        ViTBalanceCallback(log_per_rank_loads="false")
    with pytest.raises(ValueError, match=r"BalanceMetrics\(per_rank_loads='no'\) is invalid"):
        BalanceMetrics(per_rank_loads="no")


def test_a_module_without_the_mixin_gets_a_warning() -> None:
    class Plain(ScriptedModule):
        pop_vit_balance_stats = None  # type: ignore[assignment]

    callback = ViTBalanceCallback()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=RecordingLogger(),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="does not use ViTBalanceMixin"):
        trainer.fit(Plain([[]]))


class _FailingAtBatch(ScriptedModule):
    def __init__(self, script: list[list[BalanceStats]], fail_at: int | None) -> None:
        super().__init__(script)
        self.fail_at = fail_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at:
            raise KeyError("a step that fails: the fit ends without on_train_end")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("steps", "fail_at"), [(3, None), (12, 11)], ids=["at-the-end", "after-10-steps"])
def test_a_fit_whose_steps_balance_nothing_is_told_once(steps: int, fail_at: int | None) -> None:
    """A model never given to balance_vision_tower trained unbalanced without a word (the callback
    logged nothing, and nothing said why); a fit whose steps make calls is not told."""
    told = []
    for script in ([[]] * steps, [[SKIPPED]] + [[]] * (steps - 1)):
        told.append(_told_no_calls(script, ViTBalanceCallback(), _FailingAtBatch(script, fail_at)))
    assert len(told[0]) == 1 and "self.balance_vision_tower(model)" in told[0][0], told
    assert told[1] == [], told


def _told_no_calls(
    script: list[list[BalanceStats]], callback: ViTBalanceCallback, module: ScriptedModule | None = None
) -> list[str]:
    """The callback's warnings that the fit's steps made no balanced call (a KeyError ends the fit)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.suppress(KeyError):
            _fit(script, callback, module, quiet=False)
    return [str(w.message) for w in caught if "called a ViT through ViTBalanceMixin" in str(w.message)]


class _SwitchedOff(ViTBalanceMixin, ScriptedModule):
    """Balancing switched off in the module's configuration: a comparison run."""

    def __init__(self, script: list[list[BalanceStats]], config: ViTBalanceConfig | None) -> None:
        super().__init__(script)
        self.vit_balance_config = config


def test_a_fit_with_balancing_switched_off_is_not_told() -> None:
    """The README's comparison run (``enabled=False``) was told to call balance_vision_tower, which
    it did; the module's default configuration (balancing on) is still told."""
    off = _told_no_calls(
        [[]] * 3, ViTBalanceCallback(), _SwitchedOff([[]] * 3, ViTBalanceConfig(enabled=False))
    )
    on = _told_no_calls([[]] * 3, ViTBalanceCallback(), _SwitchedOff([[]] * 3, None))
    assert off == [] and len(on) == 1, (off, on)


def test_a_fit_is_told_after_its_tenth_step_without_calls_and_each_fit_again() -> None:
    callback = ViTBalanceCallback()
    assert len(_told_no_calls([[]] * 10 + [[SKIPPED]], callback)) == 1  # told after step 10
    assert len(_told_no_calls([[]] * 10 + [[SKIPPED]], callback)) == 1  # the next fit is told too
    assert _told_no_calls([[]] * 9 + [[SKIPPED]] + [[]], ViTBalanceCallback()) == []  # a call by step 10


class LoggingModule(ScriptedModule):
    """Also logs a value of its own through ``self.log``, at the Trainer's cadence."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("own", float(batch_idx), on_step=True, on_epoch=False)
        return super().training_step(batch, batch_idx)


def test_by_default_it_logs_at_the_trainers_cadence() -> None:
    script = [[APPLIED_A], [SKIPPED], [APPLIED_B], [NO_GAIN], [APPLIED_A]]
    _, logger = _fit(script, ViTBalanceCallback(), module=LoggingModule(script), log_every_n_steps=2)
    own_steps = [step for metrics, step in logger.calls if "own" in metrics]
    logged = logger.vit_balance_calls()
    assert [step for _, step in logged] == own_steps == [1, 3]
    # A record aggregates the calls since the previous one; the fifth step is not logged, like `own`.
    _assert_logged(logged[1][0], _expected([APPLIED_B, NO_GAIN], 2, 4, {"below-threshold": 1, "no-gain": 1}))


def test_checkpoint_and_early_stopping_monitor_the_latest_step(tmp_path: Path) -> None:
    # imbalance_after per step: 0.6, 0.0 (the best), 0.04; every epoch the same.
    script = [[NO_GAIN], [APPLIED_A], [SKIPPED]]
    callback = ViTBalanceCallback(log_every_n_steps=3)
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path,
        filename="{step}",
        monitor="vit_balance/imbalance_after",
        mode="min",
        every_n_train_steps=1,
        save_top_k=1,
    )
    stopping = EarlyStopping(
        monitor="vit_balance/imbalance_after",
        mode="min",
        stopping_threshold=0.05,
        check_on_train_epoch_end=True,
    )
    trainer, logger = _fit(
        script, callback, callbacks=[callback, checkpoint, stopping], enable_checkpointing=True, max_epochs=3
    )
    assert float(checkpoint.best_model_score) == APPLIED_A.imbalance_after
    assert Path(checkpoint.best_model_path).name == "step=2.ckpt"
    # The first epoch ends on 0.04 < 0.05: stopped after 3 of 9 steps.
    assert (trainer.global_step, stopping.stopped_epoch) == (3, 0)
    skipped = {"below-threshold": 1, "no-gain": 1}
    # callback_metrics hold the last step's values; the logger got the 3-step record.
    ours = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("vit_balance/")}
    _assert_logged(ours, _expected([SKIPPED], 1, 3, skipped))
    [(record, step)] = logger.vit_balance_calls()
    assert step == 2
    _assert_logged(record, _expected(script[0] + script[1] + script[2], 1, 3, skipped))


class _StoppingAtTheSecondBatch(ScriptedModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            self.trainer.should_stop = True
        return super().training_step(batch, batch_idx)


def test_a_fit_stopped_between_logs_logs_its_last_window() -> None:
    """Stopped at step 2 of a 5-step cadence: the window's two steps are logged at the stop, not
    lost (the early-stopping test above stops on the cadence anyway)."""
    script = [[APPLIED_A], [SKIPPED], [APPLIED_B], [APPLIED_A]]
    callback = ViTBalanceCallback(log_every_n_steps=5)
    trainer, logger = _fit(script, callback, module=_StoppingAtTheSecondBatch(script))
    assert trainer.global_step == 2
    [(record, step)] = logger.vit_balance_calls()
    assert step == 1
    _assert_logged(record, _expected(script[0] + script[1], 1, 2, {"below-threshold": 1}))


class _EncodingAtEpochStart(ScriptedModule):
    def on_train_epoch_start(self) -> None:  # sample images encoded for a log, outside any batch
        self.queue.append(NO_GAIN)


def test_calls_outside_a_training_batch_do_not_count_as_its_steps() -> None:
    script = [[APPLIED_A], [SKIPPED]]
    _, logger = _fit(script, ViTBalanceCallback(), module=_EncodingAtEpochStart(script))
    record, _ = logger.vit_balance_calls()[0]
    _assert_logged(record, _expected([APPLIED_A], 1, 1, {}))


def test_a_trainer_without_a_logger_is_refused_unless_logging_is_off() -> None:
    with pytest.raises(MisconfigurationException, match=r"Trainer that has no logger"):
        _fit([[APPLIED_A]], ViTBalanceCallback(), logger=False)
    trainer, _ = _fit([[APPLIED_A]], ViTBalanceCallback(log_every_n_steps=0, prog_bar=True), logger=False)
    assert float(trainer.callback_metrics["vit_balance/imbalance_before"]) == pytest.approx(
        APPLIED_A.imbalance_before
    )
    assert trainer.progress_bar_metrics["vit_balance/imbalance_after"] == pytest.approx(
        APPLIED_A.imbalance_after
    )


def test_measured_vit_milliseconds_are_logged_per_rank_max_and_mean() -> None:
    """The straggler itself: every rank's measured ViT time, its maximum and mean over ranks, and
    which rank it was."""
    first = dataclasses.replace(APPLIED_A, vit_ms=(30.0, 10.0))
    second = dataclasses.replace(SKIPPED, vit_ms=(20.0, 20.0))
    unknown = dataclasses.replace(APPLIED_B, vit_ms=(-1.0, 5.0))  # a rank with no earlier call
    _, logger = _fit([[first, second, unknown]], ViTBalanceCallback())
    (metrics, _), *_ = logger.vit_balance_calls()
    assert metrics["vit_balance/vit_ms_max"] == pytest.approx(25.0)
    assert metrics["vit_balance/vit_ms_mean"] == pytest.approx(20.0)
    assert metrics["vit_balance/vit_ms/rank_0"] == pytest.approx(25.0)
    assert metrics["vit_balance/vit_ms/rank_1"] == pytest.approx(15.0)
    assert metrics["vit_balance/vit_ms_slowest_rank"] == 0.0  # 30 + 20 ms against 10 + 20
    assert ViTBalanceCallback().log_per_rank_loads is None  # per-rank series up to 64 ranks
    _, quiet = _fit([[first]], ViTBalanceCallback(log_per_rank_loads=False))
    assert not any("vit_ms/rank_" in key for key in quiet.vit_balance_calls()[0][0])


def test_evaluation_records_follow_the_callbacks_options() -> None:
    """``log_per_rank_loads=False`` drops the rank series of the evaluation loops' records too, and
    ``log_every_n_steps=0`` (never log) sends them to no logger, only to ``callback_metrics``."""
    script = [[APPLIED_A]]
    _, logger = _fit(script, ViTBalanceCallback(log_per_rank_loads=False), limit_val_batches=1)
    [(record, _)] = logger.vit_balance_calls("val")
    assert record["vit_balance/val/calls"] == 1.0 and not [k for k in record if "/rank_" in k], record
    trainer, logger = _fit(script, ViTBalanceCallback(log_every_n_steps=0), limit_val_batches=1)
    assert logger.vit_balance_calls("val") == [] and logger.vit_balance_calls() == []
    assert float(trainer.callback_metrics["vit_balance/val/calls"]) == 1.0


class _PredictingModule(ScriptedModule):
    def predict_step(self, batch: Any, batch_idx: int) -> None:
        self.queue.append(APPLIED_B)

    def predict_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(1, 2)))


def test_an_evaluation_after_a_fit_keeps_its_counts_and_needs_no_logger() -> None:
    """``trainer.validate`` without a logger, with the fit's callback: no ``Trainer that has no
    logger`` error (that is for fits), and the fit's counts (checkpointed) are not reset; the
    calls of a prediction before it reach no loop's record."""
    callback = ViTBalanceCallback()
    _fit([[APPLIED_A]], callback)
    module = _PredictingModule([[APPLIED_A]])
    evaluator = L.Trainer(
        accelerator="cpu", devices=1, logger=False, callbacks=[callback], enable_progress_bar=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        evaluator.predict(module)
        evaluator.validate(module)
    assert float(evaluator.callback_metrics["vit_balance/val/calls"]) == 1.0  # NO_GAIN alone
    assert float(evaluator.callback_metrics["vit_balance/val/applied_total"]) == 0.0
    assert callback.calls_total == 1


class _FailingValidation(ScriptedModule):
    fail = True

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.fail and batch_idx == 1:
            raise KeyError("a validation that fails: its loop never ends")
        super().validation_step(batch, batch_idx)

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(2, 2)))


def test_a_validation_interrupted_before_its_end_leaves_nothing_to_the_next() -> None:
    """The calls of a validation that never reached its end are not added to the next one's."""
    callback = ViTBalanceCallback()
    module = _FailingValidation([[APPLIED_A]])
    logger = RecordingLogger()
    validator = L.Trainer(
        accelerator="cpu", devices=1, logger=logger, callbacks=[callback], enable_progress_bar=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(KeyError):
            validator.validate(module)
        module.fail = False
        validator.validate(module)
    [(record, _)] = logger.vit_balance_calls("val")
    assert record["vit_balance/val/calls"] == 2.0, record


def test_the_progress_bar_skips_an_imbalance_no_call_of_the_step_knew() -> None:
    """``prog_bar=True`` on a step whose calls were all disabled on many ranks (imbalance NaN, left
    out of the record): no KeyError, and nothing shown for it."""
    disabled = BalanceStats.of_direct_call(
        ViTBalanceConfig(enabled=False), None, reason="disabled", num_ranks=2
    )
    trainer, _ = _fit([[disabled]], ViTBalanceCallback(prog_bar=True))
    assert float(trainer.callback_metrics["vit_balance/calls"]) == 1.0
    assert "vit_balance/imbalance_before" not in trainer.progress_bar_metrics


def test_a_resumed_fit_counts_on_in_callback_metrics(tmp_path: Path) -> None:
    """A fit resumed from a checkpoint counts on in ``callback_metrics`` as in its logged records
    (a monitor of ``calls_total`` had seen the count restart from the resume)."""
    script = [[APPLIED_A], [SKIPPED]]
    trainer, _ = _fit(script, ViTBalanceCallback())
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    logger = RecordingLogger()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=logger,
        callbacks=[ViTBalanceCallback()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        limit_val_batches=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(ScriptedModule(script), ckpt_path=tmp_path / "last.ckpt")
    assert logger.vit_balance_calls()[-1][0]["vit_balance/calls_total"] == 4.0
    assert float(trainer.callback_metrics["vit_balance/calls_total"]) == 4.0


def test_a_module_without_the_mixin_is_warned_once() -> None:
    class Plain(ScriptedModule):
        pop_vit_balance_stats = None  # type: ignore[assignment]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit([[]] * 3, ViTBalanceCallback(), Plain([[]] * 3), quiet=False)
    assert len([w for w in caught if "does not use ViTBalanceMixin" in str(w.message)]) == 1


def test_a_trainer_without_a_logger_is_refused_at_any_logging_cadence() -> None:
    """Not only the Trainer's own cadence (``None``): every this many steps needs a logger too."""
    with pytest.raises(MisconfigurationException, match=r"Trainer that has no logger"):
        _fit([[APPLIED_A]], ViTBalanceCallback(log_every_n_steps=2), logger=False)
