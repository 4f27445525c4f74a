"""LightningCLI fills a module's ViTBalanceConfig from YAML and the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.cli import LightningCLI

from lightning_vit_balance import ViTBalanceCallback, ViTBalanceConfig, ViTBalanceMixin


class CLIModule(ViTBalanceMixin, L.LightningModule):
    def __init__(self, vit_balance_config: ViTBalanceConfig | None = None, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.vit_balance_config = vit_balance_config
        self.layer = torch.nn.Linear(width, 1)


YAML = """
model:
  width: 8
  vit_balance_config:
    enabled: true
    max_len_ratio: 1.5
    trigger_threshold: 0.3
    verbose: true
    solver: seed
    cost_linear: 2.5
trainer:
  accelerator: cpu
  callbacks:
    - class_path: lightning_vit_balance.ViTBalanceCallback
      init_args:
        log_every_n_steps: 5
        log_per_rank_loads: false
"""


def _cli(tmp_path: Path, text: str, *extra: str) -> Any:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return LightningCLI(
        CLIModule,
        run=False,
        args=["--config", str(path), *extra],
        save_config_callback=None,
        trainer_defaults={"logger": False, "enable_progress_bar": False},
    )


def test_yaml_builds_the_config_and_the_callback(tmp_path: Path) -> None:
    cli = _cli(tmp_path, YAML)
    expected = ViTBalanceConfig(
        enabled=True, max_len_ratio=1.5, trigger_threshold=0.3, verbose=True, solver="seed", cost_linear=2.5
    )
    assert cli.model.vit_balance_config == expected
    assert cli.model.resolved_vit_balance_config() == expected
    # Under LightningCLI, save_hyperparameters records the parsed fields as a dict, which is what
    # load_from_checkpoint hands back to __init__: the mixin accepts it.
    recorded = cli.model.hparams["vit_balance_config"]
    assert ViTBalanceConfig(**recorded) == expected
    assert CLIModule(vit_balance_config=recorded).resolved_vit_balance_config() == expected
    callbacks = [cb for cb in cli.trainer.callbacks if isinstance(cb, ViTBalanceCallback)]
    assert len(callbacks) == 1
    assert (callbacks[0].log_every_n_steps, callbacks[0].log_per_rank_loads) == (5, False)


def test_command_line_overrides_and_absent_config(tmp_path: Path) -> None:
    cli = _cli(tmp_path, YAML, "--model.vit_balance_config.trigger_threshold=0.7")
    assert cli.model.vit_balance_config.trigger_threshold == 0.7
    assert cli.model.vit_balance_config.solver == "seed"
    cli = _cli(tmp_path, "model:\n  width: 2\n")
    assert cli.model.vit_balance_config is None
    assert cli.model.resolved_vit_balance_config() == ViTBalanceConfig()


def test_invalid_yaml_values_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        _cli(tmp_path, "model:\n  vit_balance_config:\n    solver: magic\n")
