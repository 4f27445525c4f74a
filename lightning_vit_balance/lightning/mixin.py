"""ViTBalanceMixin: ``self.encode_images(vit, pixel_values, grid_thw)`` for LightningModules."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from lightning_vit_balance.balancer import BalanceStats, ViTBalancer
from lightning_vit_balance.config import ViTBalanceConfig
from lightning_vit_balance.lightning.callback import ViTBalanceCallback
from lightning_vit_balance.lightning.strategy import dp_group_from_strategy

__all__ = ["ViTBalanceMixin"]


def _ref(obj: object) -> weakref.ref | None:
    return None if obj is None else weakref.ref(obj)


class _State:
    """What the mixin keeps between calls. Never copied or pickled with the module.

    Process groups and balancers belong to one run of processes: a deep copy of the module (EMA,
    checkpoint callbacks) or the pickle that ``ddp_spawn`` sends to its workers starts afresh.
    """

    def __init__(self) -> None:
        self.fit_key: tuple[weakref.ref | None, ...] | None = None
        self.group: dist.ProcessGroup | None = None
        self.group_size = 1
        self.record = False
        self.balancer: ViTBalancer | None = None
        self.balancer_config: ViTBalanceConfig | None = None
        self.records: list[BalanceStats] = []
        self.last_stats: BalanceStats | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def __deepcopy__(self, memo: dict[int, Any]) -> _State:
        return _State()


class ViTBalanceMixin:
    """Gives a LightningModule ``self.encode_images(vit, pixel_values, grid_thw)``.

    Example::

        class MyVLM(ViTBalanceMixin, L.LightningModule):
            def __init__(self, vit_balance_config: ViTBalanceConfig | None = None):
                super().__init__()
                self.save_hyperparameters()
                self.vit_balance_config = vit_balance_config
                self.visual = ...

            def training_step(self, batch, batch_idx):
                embeds = self.encode_images(self.visual, batch["pixel_values"], batch["image_grid_thw"])
                ...

    The configuration is the attribute ``vit_balance_config`` (absent means
    ``ViTBalanceConfig()``), so it can be a typed ``__init__`` argument that LightningCLI fills from
    YAML (LightningCLI records it in ``hparams`` as a dict of fields, which is accepted too). The
    mixin has no ``__init__`` and works whichever order the bases are listed in.

    The data-parallel group is looked up once per fit (or once per Fabric setup) with
    :meth:`configure_vit_balance_group`. Every balanced call's
    :class:`~lightning_vit_balance.BalanceStats` is kept in :attr:`last_vit_balance_stats`, and,
    while a :class:`~lightning_vit_balance.ViTBalanceCallback` is attached to the Trainer, queued
    for it (see :meth:`pop_vit_balance_stats`).
    """

    def _vit_balance_state_object(self) -> _State:
        state = self.__dict__.get("_vit_balance_state")
        if state is None:
            state = _State()
            # Plain attribute: nn.Module.__setattr__ registers no module, parameter or buffer here.
            object.__setattr__(self, "_vit_balance_state", state)
        return state

    def resolved_vit_balance_config(self) -> ViTBalanceConfig:
        """The module's ``vit_balance_config`` attribute, ``ViTBalanceConfig()`` when absent.

        A mapping (e.g. hyperparameters loaded back as a dict) is turned into the dataclass.
        """
        config = getattr(self, "vit_balance_config", None)
        if config is None:
            return ViTBalanceConfig()
        if isinstance(config, ViTBalanceConfig):
            return config
        if isinstance(config, dict):
            return ViTBalanceConfig(**config)
        raise TypeError(
            f"{type(self).__name__}.vit_balance_config={config!r} is invalid: expected a "
            f"ViTBalanceConfig, a dict of its fields, or None."
        )

    def _vit_balance_runner(self) -> tuple[Any, Any]:
        """(trainer, fabric) this module is attached to; ``None`` for what it is not."""
        fabric = self.__dict__.get("_fabric")
        if fabric is not None:
            return None, fabric
        return self.__dict__.get("_trainer"), None

    def configure_vit_balance_group(self) -> dist.ProcessGroup | None:
        """The process group to balance over; ``None`` calls the ViT directly.

        Called once per fit. The default returns the attribute ``vit_balance_group`` when it is set,
        else :func:`~lightning_vit_balance.dp_group_from_strategy` of the Trainer's (or Fabric's)
        strategy, else ``None`` (not attached to either). Override it, or set
        ``vit_balance_group``, for strategies the adapter does not know. Prefer the override
        when the module is copied or pickled (``ddp_spawn``): a process group does not pickle.
        """
        group = getattr(self, "vit_balance_group", None)
        if group is not None:
            return group
        trainer, fabric = self._vit_balance_runner()
        runner = fabric if fabric is not None else trainer
        if runner is None:
            return None
        return dp_group_from_strategy(runner.strategy)

    def _vit_balance_refresh(self, state: _State) -> None:
        trainer, fabric = self._vit_balance_runner()
        runner = fabric if fabric is not None else trainer
        strategy = None if runner is None else runner.strategy
        # Lightning wraps the module anew (DDP, FSDP, DeepSpeed engine) at every fit, so the
        # wrapper's identity marks a new fit; the runner and strategy mark a new Trainer.
        model = getattr(strategy, "model", None) if trainer is not None else None
        key = (_ref(runner), _ref(strategy), _ref(model))
        if state.fit_key is not None and all(
            (old is None and new is None) or (old is not None and new is not None and old() is new())
            for old, new in zip(state.fit_key, key)
        ):
            return
        group = self.configure_vit_balance_group()
        size = 1
        if group is not None and dist.is_available() and dist.is_initialized():
            size = dist.get_world_size(group)
        state.fit_key = key
        state.group = group
        state.group_size = size
        # Queue records only for a callback that drains them, so they never pile up.
        callbacks = trainer.callbacks if trainer is not None else ()
        state.record = any(isinstance(cb, ViTBalanceCallback) for cb in callbacks)
        state.records = []
        state.balancer = None

    def encode_images(self, vit: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        """Run ``vit(pixel_values, grid_thw)``, balanced across the data-parallel ranks.

        Balances when ``vit_balance_config.enabled`` and the group from
        :meth:`configure_vit_balance_group` has more than one rank; calls the ViT directly
        otherwise (no Trainer attached, one device, balancing disabled). Every rank of the group
        must call it the same number of times, as with any collective.

        Args:
            vit: Called as ``vit(pixel_values, grid_thw)``; returns a tensor, tuple/list, dict or
                Hugging Face ``ModelOutput``.
            pixel_values: ``[sum(T*H*W), C]`` patch rows of this rank's images.
            grid_thw: ``[n_images, 3]`` ``(T, H, W)`` of each image.

        Returns:
            The same structure and values as ``vit(pixel_values, grid_thw)`` on this rank.
        """
        config = self.resolved_vit_balance_config()
        if not config.enabled:
            return vit(pixel_values, grid_thw)
        state = self._vit_balance_state_object()
        self._vit_balance_refresh(state)
        if state.group is None or state.group_size < 2:
            return vit(pixel_values, grid_thw)
        if state.balancer is None or state.balancer_config != config:
            state.balancer = ViTBalancer(config, state.group)
            state.balancer_config = config
        output = state.balancer(vit, pixel_values, grid_thw)
        stats = state.balancer.last_stats
        state.last_stats = stats
        if state.record and stats is not None:
            state.records.append(stats)
        return output

    @property
    def last_vit_balance_stats(self) -> BalanceStats | None:
        """Diagnostics of the latest balanced call (``None`` before the first)."""
        return self._vit_balance_state_object().last_stats

    def pop_vit_balance_stats(self) -> list[BalanceStats]:
        """Return and forget the diagnostics queued for :class:`ViTBalanceCallback`, oldest first."""
        state = self._vit_balance_state_object()
        records, state.records = state.records, []
        return records
