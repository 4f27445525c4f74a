"""Lightning loops beyond training on 2 real CPU ranks: resume, validation, predict on uneven data;
and training on 4, as a 2 x 2 data x tensor parallel mesh.

One module fixture fits 2 steps (``ddp`` on the test pool's 2 ranks, launched as ``torchrun``
would; checkpointing every step while monitoring ``vit_balance/imbalance_after``), then resumes to
4 steps from ``last.ckpt``; 2 fresh processes load the final checkpoint with
``load_from_checkpoint`` and predict 5 samples. Checkpoints are loaded the default way
(``weights_only``) throughout.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from equivalence import CompiledSources
from lightning_fit_script import (
    LOOP_CONFIG,
    PREDICT_SAMPLES,
    RANKS,
    STEPS,
    VALIDATION_VIT_S,
    PlanAheadVLM,
    TinyVLM,
    first,
    fit_with_checkpoints,
    make_sample,
    predict_from_checkpoint,
    predict_samples,
    quiet_trainer,
)
from multirank import World, groups_taken_for_nccl, launched_by_torchrun, skip_without_fsdp2
from towers import TensorTower

from lightning_vit_balance import CostModel, ViTBalanceConfig

CALLS_PER_STEP = 2  # images (applied) and videos (skipped: no-gain), as in test_lightning_fit.py
# Balanced and unbalanced training differ only in the batches images are encoded in: fp32 matmul
# blocking may change the last bits (~1e-7 relative), compounded over a few SGD steps.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _rows(run_dir: Path) -> list[dict[str, float]]:
    with open(run_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def _by_step(rows: list[dict[str, float]], key: str) -> dict[int, dict[str, float]]:
    return {int(row["step"]): row for row in rows if key in row}


def _fit_and_resume(out: str) -> dict[str, torch.Tensor] | None:
    """Worker: 2 steps, then a resumed fit to :data:`STEPS` from ``last.ckpt``; rank 0 returns the
    trained weights."""
    import torch.distributed as dist

    last = Path(out) / "checkpoints" / "last.ckpt"
    with launched_by_torchrun():
        fit_with_checkpoints(out, "first", max_steps=2)
        if dist.get_rank() == 0:  # the resumed fit writes over it
            shutil.copyfile(last, Path(out) / "first_last.ckpt")
        model = fit_with_checkpoints(out, "resumed", max_steps=STEPS, ckpt_path=str(last))
    return model.state_dict() if dist.get_rank() == 0 else None


def _predict(ckpt_path: str, out: str) -> None:
    """Worker: :func:`predict_from_checkpoint` on ranks launched as ``torchrun`` would."""
    with launched_by_torchrun():
        predict_from_checkpoint(ckpt_path, out)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory, multirank: Any) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("loops")
    with multirank(RANKS) as pool:
        weights, _ = pool.run(_fit_and_resume, str(out), timeout=200)
    rows = _rows(out / "first") + _rows(out / "resumed")
    return {
        "out": out,
        "rows": rows,
        "first_last": torch.load(out / "first_last.ckpt"),
        "last": torch.load(out / "checkpoints" / "last.ckpt"),
        "weights": weights,
    }


def _direct_loss(model: TinyVLM, sample: dict[str, torch.Tensor]) -> torch.Tensor:
    """:meth:`TinyVLM.step_loss` with every call direct."""
    images = model.visual(sample["pixel_values"], sample["image_grid_thw"])
    videos = model.visual(sample["pixel_values_videos"], sample["video_grid_thw"])
    return model.head(torch.cat([images, videos])).pow(2).mean()


SampleLoss = Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]


def _reference(
    model: TinyVLM | None = None, loss_of: SampleLoss = _direct_loss
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Rank 0's loss per step and the final weights of the same training in one process, unbalanced:
    ``model`` (a fresh :class:`TinyVLM`, which seeds itself: the fits' initial weights) trained on
    every rank's samples, each sample's loss ``loss_of(model, sample)``.

    DDP averages the ranks' gradients: the gradient of the mean of the ranks' losses.
    """
    model = TinyVLM() if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    rank0_losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = [loss_of(model, make_sample(step, rank)) for rank in range(RANKS)]
        rank0_losses.append(float(losses[0]))
        (sum(losses) / RANKS).backward()
        optimizer.step()
    return rank0_losses, model.state_dict()


@pytest.mark.timeout(240)
def test_resuming_continues_training_and_the_cumulative_counts(resumed: dict[str, Any]) -> None:
    assert resumed["first_last"]["global_step"] == 2
    assert resumed["last"]["global_step"] == STEPS
    balance = _by_step(resumed["rows"], "vit_balance/calls")
    assert sorted(balance) == list(range(STEPS))
    for step, row in balance.items():
        # The resumed fit's counts continue from the checkpoint's (steps 2 and 3).
        assert row["vit_balance/applied_total"] == step + 1
        assert row["vit_balance/calls_total"] == CALLS_PER_STEP * (step + 1)
        assert row["vit_balance/skipped/no-gain"] == step + 1
        # The online cost fit's progress reaches the logger: too few steps here for a fit.
        assert row["vit_balance/cost_fits"] == 0 and "vit_balance/cost_fit_error" not in row
    # Measured ViT time trails by one call, of the same loop: each fit's first step, after its
    # sanity check, and step 2, after the first epoch's validation, report the training calls'
    # (or none), not validation's, whose ViT sleeps VALIDATION_VIT_S.
    measured = {
        step: row["vit_balance/vit_ms_max"]
        for step, row in balance.items()
        if "vit_balance/vit_ms_max" in row
    }
    assert sorted(measured) == list(range(STEPS)), measured
    assert all(ms < 1000.0 * VALIDATION_VIT_S / 2 for ms in measured.values()), measured
    state = resumed["last"]["callbacks"]["ViTBalanceCallback"]
    assert (state["applied_total"], state["calls_total"]) == (STEPS, CALLS_PER_STEP * STEPS)
    # The online cost fit (`calibrate_cost`) goes on from the checkpoint: the resumed fit's rows
    # follow the first fit's, and its observations add to the first fit's count.
    first = resumed["first_last"]["vit_balance"]["cost_calibrator"]
    last = resumed["last"]["vit_balance"]["cost_calibrator"]
    assert first["history"] and last["history"][: len(first["history"])] == first["history"]
    assert last["steps_observed"] > first["steps_observed"] and last["fits"] == first["fits"] == 0
    # Two 2-step fits trained exactly as one 4-step fit would have.
    losses, weights = _reference()
    logged = _by_step(resumed["rows"], "train_loss")
    torch.testing.assert_close(
        torch.tensor([logged[s]["train_loss"] for s in range(STEPS)]), torch.tensor(losses), **TOLERANCE
    )
    torch.testing.assert_close(resumed["weights"], weights, **TOLERANCE)


def _assert_trained_as_the_reference(rows: list[dict[str, float]], weights: dict[str, torch.Tensor]) -> None:
    """Images balanced at every step, and the losses and final weights of the unbalanced training."""
    assert [row["vit_balance/applied_total"] for row in _by_step(rows, "vit_balance/calls").values()] == [
        step + 1 for step in range(STEPS)
    ]
    losses, reference_weights = _reference()
    logged = _by_step(rows, "train_loss")
    torch.testing.assert_close(
        torch.tensor([logged[s]["train_loss"] for s in range(STEPS)]), torch.tensor(losses), **TOLERANCE
    )
    torch.testing.assert_close(weights, reference_weights, **TOLERANCE)


class _CompiledVLM(TinyVLM):
    """:class:`TinyVLM` for a fit given the module compiled (``torch.compile(model)``), where Lightning
    compiles the training step: the loss is logged after it (``self.log`` does not compile)."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.step_loss(batch)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log("train_loss", outputs["loss"], on_step=True, on_epoch=False)


def _compiled_fit(out: str) -> dict[str, Any]:
    """Worker: a fit of :class:`_CompiledVLM` given compiled; rank 0 returns the trained weights."""
    sources = CompiledSources()
    model = _CompiledVLM()
    with launched_by_torchrun():
        trainer = quiet_trainer(out, "compiled", strategy="ddp", max_steps=STEPS)
        trainer.fit(torch.compile(model, backend=sources))
    return {
        "weights": model.state_dict() if dist.get_rank() == 0 else None,
        "mixin_nodes": sources.traced_from("lightning_vit_balance"),
        "module_nodes": sources.traced_from("lightning_fit_script.py"),  # TinyVLM.step_loss
    }


@pytest.mark.timeout(240)
def test_a_compiled_module_trains_as_the_plain_one(tmp_path: Path, multirank: Any) -> None:
    """``trainer.fit(torch.compile(model))``, the mixin's calls in the compiled training step: the
    losses and weights of the plain training, images balanced at every step. The mixin's and the
    engine's code run eagerly; the module's own code is compiled."""
    with multirank(RANKS) as pool:
        results = pool.run(_compiled_fit, str(tmp_path), timeout=200)
    _assert_trained_as_the_reference(_rows(tmp_path / "compiled"), results[0]["weights"])
    for r in results:
        assert r["mixin_nodes"] == 0 and r["module_nodes"] > 0, r


class _CheckpointedVLM(PlanAheadVLM):
    """:class:`PlanAheadVLM` whose two calls run inside ``torch.utils.checkpoint`` (not reentrant:
    under DDP the reentrant one mis-trains the plain module too, its ViT in two regions): the
    backward pass recomputes them in Lightning's ``backward`` hook, where they must be balanced
    with their forward's plans (the images call's made ahead), as the cost fit goes on refitting."""

    def __init__(self) -> None:
        super().__init__(ViTBalanceConfig(plan_ahead=True, calibrate_cost=True))

    def step_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        keys = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))
        encoded = [
            checkpoint(self.encode_images, self.visual, batch[pixels], batch[grid], use_reentrant=False)
            for pixels, grid in keys
        ]
        return self.head(torch.cat(encoded)).pow(2).mean()


def _checkpointed_fit(out: str) -> dict[str, Any]:
    """Worker: a fit of :class:`_CheckpointedVLM`; rank 0 returns the trained weights."""
    model = _CheckpointedVLM()
    with launched_by_torchrun():
        trainer = quiet_trainer(out, "checkpointed", strategy="ddp", max_steps=STEPS)
        trainer.fit(model)
    return {"weights": model.state_dict() if dist.get_rank() == 0 else None}


@pytest.mark.timeout(240)
def test_calls_under_activation_checkpointing_train_as_the_plain_module(
    tmp_path: Path, multirank: Any
) -> None:
    """The recomputation in the backward pass is balanced as its forward call was: the plain
    training's losses and weights, each call counted once. Before, the ``backward`` hook encoded
    it directly: other images' activations in the ViT's backward (silently wrong gradients), or
    torch's checkpoint errors on some ranks while another waited in the exchange."""
    with multirank(RANKS) as pool:
        results = pool.run(_checkpointed_fit, str(tmp_path), timeout=200)
    rows = _rows(tmp_path / "checkpointed")
    assert [row["vit_balance/calls"] for row in _by_step(rows, "vit_balance/calls").values()] == [
        CALLS_PER_STEP
    ] * STEPS
    _assert_trained_as_the_reference(rows, results[0]["weights"])


@pytest.mark.timeout(240)
def test_checkpoints_monitor_the_imbalance_on_every_rank(resumed: dict[str, Any]) -> None:
    [state] = [v for k, v in resumed["last"]["callbacks"].items() if k.startswith("ModelCheckpoint")]
    rows = _by_step(resumed["rows"], "vit_balance/calls")
    after = {step: row["vit_balance/imbalance_after"] for step, row in rows.items()}
    best_step = min(after, key=lambda s: (after[s], s))
    assert float(state["best_model_score"]) == pytest.approx(after[best_step], rel=1e-12)
    assert Path(state["best_model_path"]).name == f"step={best_step + 1}.ckpt"
    # The hyperparameters keep the configuration itself, and the checkpoint loads weights_only.
    assert resumed["last"]["hyper_parameters"]["vit_balance_config"] == LOOP_CONFIG


@pytest.mark.timeout(240)
def test_validation_on_a_distributed_sampler_balances_with_exact_outputs(resumed: dict[str, Any]) -> None:
    # One validation per 2-step epoch, one in each fit.
    rows = _by_step(resumed["rows"], "val_balanced")
    assert sorted(rows) == [1, 3]
    for row in rows.values():
        assert row["val_balanced"] == 1.0  # every validation call of both ranks was balanced
        assert row["val_max_error"] < 1e-5  # fp32 rounding of a different batch composition
    # The callback logs each validation's balanced calls at the same steps: both batches, with the
    # validation's own counts and ViT time (each of its calls sleeps VALIDATION_VIT_S).
    logged = _by_step(resumed["rows"], "vit_balance/val/calls")
    assert sorted(logged) == [1, 3], logged
    for row in logged.values():
        assert row["vit_balance/val/calls"] == row["vit_balance/val/calls_total"] == 2.0, row
        assert row["vit_balance/val/vit_ms_max"] >= 1000 * VALIDATION_VIT_S, row


@pytest.mark.timeout(240)
def test_fresh_processes_load_the_checkpoint_and_predict_uneven_data_balancing_what_every_rank_runs(
    resumed: dict[str, Any], tmp_path: Path
) -> None:
    ckpt = resumed["out"] / "checkpoints" / "last.ckpt"
    # Ranks of their own, which never built a module: only the checkpoint carries the configuration.
    pool = World(RANKS)
    try:
        pool.run(_predict, str(ckpt), str(tmp_path), timeout=180)
    finally:
        pool.close()
    loaded = json.loads((tmp_path / "loaded.json").read_text())
    assert loaded["type"] == "ViTBalanceConfig"
    assert ViTBalanceConfig(**loaded["fields"]) == LOOP_CONFIG

    tower = TensorTower()
    state = resumed["last"]["state_dict"]
    tower.load_state_dict({k.removeprefix("visual."): v for k, v in state.items() if k.startswith("visual.")})
    # Lightning's predict sampler does not pad: of 5 and 3 samples rank 0 runs 3 and 2, rank 1 runs
    # 2 and 1. The batches both run are balanced; rank 0's last of each loader is encoded directly.
    # The second run (the second loader alone, plans made ahead) gathers its own lengths. Without
    # vit_balance_predict (the run before), every batch is encoded directly.
    # A datamodule's batch hook replaces the module's: no plan made ahead there (4 collectives), but
    # balanced (the lengths are gathered in on_predict_start).
    runs = {"off": (1,), "first": (0, 1), "second": (1,), "datamodule": (1,)}
    for run, loader_ids in runs.items():
        seen: dict[int, list[int]] = {k: [] for k in loader_ids}
        for rank in range(RANKS):
            record = torch.load(tmp_path / f"{run}_rank_{rank}.pt")
            for predictions, indices, k in zip(record["predictions"], record["indices"], loader_ids):
                count = PREDICT_SAMPLES[k]
                assert len(indices) == len(predictions) == (count + RANKS - 1 - rank) // RANKS
                samples = predict_samples(count, offset=200 + 10 * k)
                shared = count // RANKS  # the batches every rank runs
                for batch_idx, (index, prediction) in enumerate(zip(indices, predictions)):
                    sample = samples[index]
                    expected = tower(sample["pixel_values"], sample["image_grid_thw"])
                    assert prediction["balanced"] is (run != "off" and batch_idx < shared), (
                        run,
                        rank,
                        k,
                        batch_idx,
                    )
                    if prediction["balanced"]:
                        # No gather where the plan was made ahead; 1 for a skipped plan made in the call.
                        assert prediction["applied"]  # rank 0's samples are the heavy ones
                        assert prediction["collectives"] == (3 if run == "second" else 4)
                    # Balanced: fp32 rounding of another batch's composition; direct: the same maths.
                    tolerance = 1e-5 if prediction["balanced"] else 0.0
                    torch.testing.assert_close(prediction["images"], expected, rtol=0, atol=tolerance)
                    seen[k].append(index)
        assert {k: sorted(v) for k, v in seen.items()} == {
            k: list(range(PREDICT_SAMPLES[k])) for k in loader_ids
        }
        # ViTBalanceCallback's figures of the run count its balanced calls (none: no figures).
        balanced = 0 if run == "off" else sum(PREDICT_SAMPLES[k] // RANKS for k in loader_ids)
        for rank in range(RANKS):
            figures = json.loads((tmp_path / f"{run}_metrics_rank_{rank}.json").read_text())
            expected = {"calls_total": balanced, "applied_total": balanced} if balanced else {}
            got = {key.removeprefix("vit_balance/predict/"): figures[key] for key in figures}
            assert {key: got[key] for key in expected} == expected and bool(got) == bool(balanced), (run, got)


def _checkpoint_holding(config_state: dict[str, Any]) -> io.BytesIO:
    """A checkpoint whose hyperparameters hold a ViTBalanceConfig pickled with ``config_state``."""
    config = object.__new__(ViTBalanceConfig)
    config.__dict__.update(config_state)  # as another version of the class would have pickled it
    buffer = io.BytesIO()
    torch.save({"hyper_parameters": {"vit_balance_config": config}}, buffer)
    buffer.seek(0)
    return buffer


def test_configs_in_checkpoints_load_weights_only_across_versions() -> None:
    # Defining a module class with the mixin (LoopVLM, imported above) allowed both types.
    assert {ViTBalanceConfig, CostModel} <= set(torch.serialization.get_safe_globals())
    older = {k: v for k, v in vars(LOOP_CONFIG).items() if k != "min_gain"}
    loaded = torch.load(_checkpoint_holding(older))["hyper_parameters"]["vit_balance_config"]
    assert loaded == LOOP_CONFIG  # a field the checkpoint lacks takes its default
    later = {**vars(LOOP_CONFIG), "bogus": 1}  # as a later version with another field wrote it
    for weights_only in (True, False):
        with pytest.raises(ValueError, match=r"unknown fields \['bogus'\].*dropping_unknown_fields"):
            torch.load(_checkpoint_holding(later), weights_only=weights_only)
        # What the error offers: this version's configuration, the field left out, with a warning.
        dropping = ViTBalanceConfig.dropping_unknown_fields()
        with pytest.warns(RuntimeWarning, match=r"fields \['bogus'\] are unknown") as told, dropping:
            checkpoint = torch.load(_checkpoint_holding(later), weights_only=weights_only)
        assert [w.filename for w in told] == [__file__]  # the torch.load line, past torch's unpickler
        assert checkpoint["hyper_parameters"]["vit_balance_config"] == LOOP_CONFIG
    with pytest.raises(ValueError, match=r"unknown fields"):  # only within the block
        torch.load(_checkpoint_holding(later))
    with pytest.raises(ValueError, match=r"ViTBalanceConfig.solver='magic' is invalid"):
        torch.load(_checkpoint_holding({**vars(LOOP_CONFIG), "solver": "magic"}))


class _MeshVLM(TinyVLM):
    """:class:`TinyVLM` under ``ModelParallelStrategy`` on a ``(2, 2)`` mesh: tensor-parallel peers
    (ranks 0 and 1, 2 and 3) hold the same batches and the data-parallel pairs [0, 2] and [1, 3]
    balance; the images call is planned before the forward. No tensor parallelism is applied (the
    layout is what matters here; FSDP2 units on the data-parallel dimension), and each balanced
    output is checked against the direct call."""

    vit_balance_prepare_keys = (("pixel_values", "image_grid_thw"),)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        # The pairs' gradients averaged, as data parallelism does: the ranks' towers stay equal.
        for unit in (self.visual, self.head):
            fully_shard(unit, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images = self.encode_images(self.visual, batch["pixel_values"], batch["image_grid_thw"])
        with torch.no_grad():
            direct = self.visual(batch["pixel_values"], batch["image_grid_thw"])
        # Same ops on the same rows in another batch: fp32 agrees to a few ulps.
        torch.testing.assert_close(images, direct, rtol=1e-4, atol=1e-5)
        stats = self._vit_balance_state_object()
        last = stats.balancer.last_stats
        self.calls.append((dist.get_process_group_ranks(stats.host_group), last.collectives, last.applied))
        return self.head(images).pow(2).mean()

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data_parallel_rank = self.global_rank // 2
        samples = [make_sample(step, data_parallel_rank) for step in range(STEPS)]
        return torch.utils.data.DataLoader(samples, batch_size=1, shuffle=False, collate_fn=first)


def _mesh_fit(out: str, calibrate: bool = False) -> list[tuple[list[int], int, bool]] | str:
    """Worker: :class:`_MeshVLM` for :data:`STEPS` steps on the pool's 4 ranks, its data-parallel
    groups taken for NCCL groups (so the mixin makes their gloo twins); ``calibrate``: with the
    online cost fit, the error the fit raised."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    model = _MeshVLM(ViTBalanceConfig(plan_ahead=True, calibrate_cost=calibrate))
    model.calls = []
    with groups_taken_for_nccl(), launched_by_torchrun():
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
        version = f"mesh_{dist.get_rank()}"
        trainer = quiet_trainer(out, version, strategy=strategy, devices=4, max_steps=STEPS)
        try:
            trainer.fit(model)
        except ValueError as error:
            if not calibrate:
                raise
            return str(error)
    return model.calls


@pytest.mark.timeout(240)
def test_model_parallel_mesh_plans_ahead_on_host_twins(tmp_path: Path, multirank: Any) -> None:
    """ModelParallelStrategy with tensor parallelism: the data-parallel group is a subgroup of the
    mesh, and the mixin still gathers on a gloo twin of it, made at the same point on every rank."""
    skip_without_fsdp2()
    with multirank(4) as pool:
        results = pool.run(_mesh_fit, str(tmp_path), timeout=200)
    for rank, calls in enumerate(results):
        # Every step applied on the twin of the rank's pair, planned before the forward: the forward
        # made only the pixel trip, the status gather and the return trip.
        assert calls == [([[0, 2], [1, 3]][rank % 2], 3, True)] * STEPS, (rank, calls)


@pytest.mark.timeout(240)
def test_model_parallel_mesh_refuses_the_online_cost_fit(tmp_path: Path, multirank: Any) -> None:
    """Each data-parallel group fitted its own model from its own ranks' times, so tensor-parallel
    peers (the same images, other groups) planned apart: 12 of 16 steps in a reviewer's run, and a
    tensor-parallel ViT's collectives then failed. The fit now stops on every rank, saying why."""
    skip_without_fsdp2()
    with multirank(4) as pool:
        errors = pool.run(_mesh_fit, str(tmp_path), True, timeout=200)
    assert len(set(errors)) == 1, errors
    assert "calibrate_cost=True with a tensor_parallel mesh dimension of size 2" in errors[0], errors[0]


class _TwinNamingVLM(PlanAheadVLM):
    """:class:`PlanAheadVLM` that notes the name of the gloo twin its steps gather on (a name, not
    the group: holding the group would keep its sockets open), and raises at step ``fail_at``."""

    fail_at: int | None = None

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        twin = self._vit_balance_state_object().host_group
        self.twin_names.add(None if twin is None else twin.group_name)
        if batch_idx == self.fail_at:
            raise KeyError("a user's error, on every rank")
        return super().training_step(batch, batch_idx)


def _three_fits(out: str, new_modules: bool) -> list[dict[str, Any]]:
    """Worker: three fits with fresh Trainers (a sweep's loop) of one module, or of a new module
    each (``new_modules``, every one kept alive, as a sweep that keeps its trials' exceptions
    does), the group taken for NCCL so that each fit makes a twin; the second fit raises at its
    second step, so it ends without its teardown. Per fit: its twin, whether torch still holds
    any fit's twin, and the process's open files, once the fit ended."""
    import os

    kept = [_TwinNamingVLM(ViTBalanceConfig(plan_ahead=True))]
    fits: list[dict[str, Any]] = []
    with groups_taken_for_nccl(), launched_by_torchrun():
        for index in range(3):
            if new_modules and index:
                kept.append(_TwinNamingVLM(ViTBalanceConfig(plan_ahead=True)))
            model = kept[-1]
            model.twin_names, model.fail_at = set(), 1 if index == 1 else None
            with contextlib.suppress(KeyError):
                quiet_trainer(out, f"fit_{index}_{dist.get_rank()}", max_steps=2).fit(model)
            held = dist.distributed_c10d._world.pg_names.values()
            fits.append({"twins": sorted(model.twin_names), "files": len(os.listdir("/proc/self/fd"))})
            fits[-1]["held"] = [name in held for fit in fits for name in fit["twins"]]
    return fits


class _HoldsANestedModule(TinyVLM):
    """:class:`TinyVLM` holding another (``child``: a teacher, say) with the mixin, whose images call
    it makes inside ``torch.utils.checkpoint``. Lightning attaches the Trainer to the child too,
    but names the running hook on the Trainer's module only: the child's calls had all been made
    directly, unseen by the callback, and a trainable child's recomputation in the backward pass
    was balanced against its direct forward (a CheckpointError on the rows' count)."""

    def __init__(self) -> None:
        super().__init__(ViTBalanceConfig(trigger_threshold=0.0))
        # Its plan_ahead cannot plan: the Trainer runs the batch hooks of its own module only.
        self.child = TinyVLM(ViTBalanceConfig(trigger_threshold=0.0, plan_ahead=True))
        self.twin_names: set[str | None] = set()

    def step_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        pixels, grid = batch["pixel_values"], batch["image_grid_thw"]
        child = checkpoint(self.child.encode_images, self.child.visual, pixels, grid, use_reentrant=False)
        for module in (self, self.child):
            twin = module._vit_balance_state_object().host_group
            self.twin_names.add(None if twin is None else twin.group_name)
        return super().step_loss(batch) + self.child.head(child).pow(2).mean()


def _nested_fit(out: str) -> dict[str, Any]:
    """Worker: a fit of :class:`_HoldsANestedModule`; its logged calls, the child's latest stats,
    whether any twin is held after the fit, and rank 0's losses and weights."""
    model = _HoldsANestedModule()
    with groups_taken_for_nccl(), launched_by_torchrun(), warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        quiet_trainer(out, "nested", strategy="ddp", max_steps=STEPS).fit(model)
    held = dist.distributed_c10d._world.pg_names.values()
    stats = model.child.last_vit_balance_stats
    return {
        "child_applied": stats is not None and stats.applied,
        "twins": sorted(name for name in model.twin_names if name is not None),
        "held": any(name in held for name in model.twin_names),
        "told": [str(w.message) for w in told if "which is nested in" in str(w.message)],
        "weights": model.state_dict() if dist.get_rank() == 0 else None,
    }


def _nested_loss(model: _HoldsANestedModule, sample: dict[str, torch.Tensor]) -> torch.Tensor:
    """:meth:`_HoldsANestedModule.step_loss` with every call direct."""
    child = model.child.visual(sample["pixel_values"], sample["image_grid_thw"])
    return _direct_loss(model, sample) + model.child.head(child).pow(2).mean()


@pytest.mark.timeout(240)
def test_a_module_nested_in_the_trainers_balances_its_calls_in_the_step(
    tmp_path: Path, multirank: Any
) -> None:
    """The child's calls are balanced in the step (and recomputed with their forward's plan), the
    callback counts them with the module's (three calls a step), the training is the direct
    calls', and the child's twin goes with the module's at the end of the fit."""
    with multirank(RANKS) as pool:
        results = pool.run(_nested_fit, str(tmp_path), timeout=200)
    rows = _rows(tmp_path / "nested")
    calls = _by_step(rows, "vit_balance/calls")
    assert [row["vit_balance/calls"] for row in calls.values()] == [CALLS_PER_STEP + 1.0] * STEPS, calls
    for r in results:
        assert r["child_applied"] and len(r["twins"]) == 2 and not r["held"], r
    told = results[0]["told"]  # rank 0 tells, once
    assert len(told) == 1 and "TinyVLM, which is nested in _HoldsANestedModule" in told[0], told
    losses, weights = _reference(_HoldsANestedModule(), _nested_loss)
    logged = _by_step(rows, "train_loss")
    torch.testing.assert_close(
        torch.tensor([logged[s]["train_loss"] for s in range(STEPS)]), torch.tensor(losses), **TOLERANCE
    )
    torch.testing.assert_close(results[0]["weights"], weights, **TOLERANCE)


class _PlainParent(L.LightningModule):
    """A Trainer's module without the mixin, holding one with it: nothing of the parent's would
    drain, check or release the child's balancing, so the child's calls encode directly."""

    def __init__(self) -> None:
        super().__init__()
        self.child = TinyVLM(ViTBalanceConfig(trigger_threshold=0.0))
        self.twins: set[str | None] = set()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        twin = self.child._vit_balance_state_object().host_group
        self.twins.add(None if twin is None else twin.group_name)
        return self.child.step_loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self.child.train_dataloader()


def _plain_parent_fit(out: str) -> dict[str, Any]:
    model = _PlainParent()
    with groups_taken_for_nccl(), launched_by_torchrun(), warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        quiet_trainer(out, "plain_parent", strategy="ddp", max_steps=STEPS, callbacks=[]).fit(model)
    twins = [name for name in model.twins if name is not None]
    return {
        "twins": twins,
        "stats": model.child.last_vit_balance_stats,
        "queued": len(model.child.pop_vit_balance_stats()),
        "told": [str(w.message) for w in told if "does not use ViTBalanceMixin" in str(w.message)],
    }


@pytest.mark.timeout(240)
def test_a_module_nested_in_one_without_the_mixin_encodes_directly_and_says_so(
    tmp_path: Path, multirank: Any
) -> None:
    """Balanced there, the child's twins were held after every fit and its records never drained
    (3 fits: 3 twins, 15 open files more)."""
    with multirank(RANKS) as pool:
        results = pool.run(_plain_parent_fit, str(tmp_path), timeout=200)
    for r in results:
        assert r["twins"] == [] and r["stats"] is None and r["queued"] == 0, r
    told = results[0]["told"]
    assert len(told) == 1 and "TinyVLM (with ViTBalanceMixin) is nested in _PlainParent" in told[0], told
    assert results[1]["told"] == []  # rank 0 tells


def _a_trainer_reused_after_a_failure(out: str) -> dict[str, Any]:
    """Worker: one Trainer fits a module that raises at its second step, then goes on with a new
    module (kept alive, as the first is). Whether the failed fit's twin is still held once the
    second fit ran, and the second's twin once it ended."""
    failed, second = _TwinNamingVLM(ViTBalanceConfig(plan_ahead=True)), _TwinNamingVLM(ViTBalanceConfig())
    failed.twin_names, failed.fail_at, second.twin_names = set(), 1, set()
    with groups_taken_for_nccl(), launched_by_torchrun():
        trainer = quiet_trainer(out, f"reused_{dist.get_rank()}", max_steps=2)
        with contextlib.suppress(KeyError):
            trainer.fit(failed)
        trainer.fit(second)
    held = dist.distributed_c10d._world.pg_names.values()
    return {
        name: [twin in held for twin in module.twin_names]
        for name, module in (("failed", failed), ("second", second))
    }


@pytest.mark.timeout(240)
def test_a_trainer_reused_after_a_failure_releases_the_failed_fits_twin(
    tmp_path: Path, multirank: Any
) -> None:
    """A Trainer whose fit raised runs the next module's fit: its status is no longer
    ``INTERRUPTED`` then, but it runs one module at a time, so the failed module's run has ended
    and its twin goes (it had stayed held as long as that module lived)."""
    with multirank(RANKS) as pool:
        results = pool.run(_a_trainer_reused_after_a_failure, str(tmp_path), timeout=200)
    assert all(r == {"failed": [False], "second": [False]} for r in results), results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("new_modules", [False, True], ids=["one-module", "a-module-per-fit"])
def test_each_fit_destroys_its_gloo_twin(tmp_path: Path, multirank: Any, new_modules: bool) -> None:
    """A process running fit after fit holds no twin between them (each twin of 2 ranks held 5
    open files and gloo's threads until the process ended): its open files stay level. A fit that
    raised keeps its twin until the next fit starts, also where its module is still referenced
    (it had held it as long as the process kept the module)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("no /proc/self/fd to count open files in")
    with multirank(RANKS) as pool:
        results = pool.run(_three_fits, str(tmp_path), new_modules, timeout=200)
    for fits in results:
        names = [fit["twins"] for fit in fits]
        assert all(len(twins) == 1 and twins[0] is not None for twins in names), fits
        assert len({twins[0] for twins in names}) == 3, fits  # a twin per fit
        assert [fit["held"] for fit in fits] == [[False], [False, True], [False, False, False]], fits
        assert fits[1]["files"] == fits[0]["files"] + 5 and fits[2]["files"] == fits[0]["files"], fits
