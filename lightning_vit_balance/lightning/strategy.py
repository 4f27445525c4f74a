"""Find the data-parallel process group of a Lightning (Trainer or Fabric) strategy.

Images may only move between ranks that hold the same ViT weights and see different data: the
data-parallel (DP) ranks. Tensor-parallel peers hold the same images and must never be balanced
against each other, so the group depends on the strategy, not just on the world.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.strategies import DataParallelStrategy as FabricDataParallelStrategy
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDeviceStrategy
from lightning.fabric.strategies import XLAFSDPStrategy as FabricXLAFSDPStrategy
from lightning.fabric.strategies import XLAStrategy as FabricXLAStrategy
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    XLAStrategy,
)

__all__ = ["dp_group_from_strategy", "tensor_parallel_size"]

_HOW_TO_PASS_A_GROUP = (
    "Pass the data-parallel process group explicitly: set the attribute `vit_balance_group` on your "
    "LightningModule, override `ViTBalanceMixin.configure_vit_balance_group()`, or call "
    "`ViTBalancer(config, group=...)` / `balanced_encode(..., group=...)` yourself."
)


def _user_group(kwargs: dict[str, Any]) -> dist.ProcessGroup:
    """The single process group a user handed to DDP or FSDP, if any.

    DDP reduces gradients only inside ``process_group``, or the group of a one-dimensional
    ``device_mesh``, so only there are the ViT weights identical. FSDP's hybrid sharding takes a
    ``(shard, replicate)`` pair (or a two-dimensional device mesh) that together span every rank:
    the default group, which is also the answer when none was given.
    """
    group = kwargs.get("process_group")
    if isinstance(group, dist.ProcessGroup):
        return group
    mesh = kwargs.get("device_mesh")
    if mesh is None or isinstance(mesh, tuple):  # a shape the strategy makes over every rank
        return dist.group.WORLD
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() != dist.get_world_size():
        raise TypeError(
            f"dp_group_from_strategy got a strategy whose device_mesh {mesh} spans {mesh.size()} of "
            f"the {dist.get_world_size()} ranks in {mesh.ndim} dimensions: which of them is data "
            f"parallel is not known here. {_HOW_TO_PASS_A_GROUP}"
        )
    return dist.group.WORLD


def _deepspeed_group(engine: Any) -> dist.ProcessGroup:
    # Duck-typed so that deepspeed need not be installed: the engine records its DP group.
    group = getattr(engine, "data_parallel_group", None)
    if isinstance(group, dist.ProcessGroup):
        return group
    try:
        from deepspeed import comm as deepspeed_comm  # type: ignore[import-not-found]
        from deepspeed.utils import groups as deepspeed_groups  # type: ignore[import-not-found]
    except ImportError:
        deepspeed_comm = deepspeed_groups = None
    # DeepSpeed's group registry asserts that its own communication layer has started.
    if deepspeed_groups is not None and deepspeed_comm.is_initialized():
        group = deepspeed_groups._get_data_parallel_group()
        if isinstance(group, dist.ProcessGroup):
            return group
    # Lightning configures DeepSpeed without model parallelism: every rank is data parallel.
    return dist.group.WORLD


def dp_group_from_strategy(strategy: Any) -> dist.ProcessGroup | None:
    """The process group whose ranks take part in ViT balancing under ``strategy``.

    Args:
        strategy: A Trainer strategy (``trainer.strategy``) or a Fabric one (``fabric.strategy``).

    Returns:
        - DDP (and ``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``) and FSDP: the ``process_group``
          passed to DDP or FSDP if there is one, or the group of a one-dimensional
          ``device_mesh``, else the default group.
        - DeepSpeed: the engine's data-parallel group (deepspeed need not be installed).
        - ``ModelParallelStrategy``: the group of ``device_mesh["data_parallel"]``; tensor-parallel
          peers are excluded.
        - Single device, Fabric's single-process ``DataParallelStrategy``, or a parallel strategy
          whose processes are not initialised yet: ``None``, meaning there is nothing to balance
          over and the ViT is called directly.

    Raises:
        TypeError: For any other strategy (e.g. XLA or a custom one), a DDP or FSDP device mesh of
            several dimensions that spans only some ranks, or a model-parallel mesh without a
            ``data_parallel`` dimension, naming it and saying how to pass a group explicitly.
    """
    if isinstance(strategy, (SingleDeviceStrategy, FabricSingleDeviceStrategy, FabricDataParallelStrategy)):
        return None
    _require_supported(strategy)
    if not (dist.is_available() and dist.is_initialized()):
        return None
    # DeepSpeed strategies subclass the DDP ones, so they are recognised first.
    if isinstance(strategy, DeepSpeedStrategy):
        return _deepspeed_group(strategy.model)
    if isinstance(strategy, FabricDeepSpeedStrategy):
        return _deepspeed_group(strategy._deepspeed_engine)
    if isinstance(strategy, (ModelParallelStrategy, FabricModelParallelStrategy)):
        return _model_parallel_group(strategy)
    if isinstance(strategy, (DDPStrategy, FabricDDPStrategy)):
        return _user_group(strategy._ddp_kwargs)
    if isinstance(strategy, FSDPStrategy):
        return _user_group(strategy.kwargs)
    return _user_group(strategy._fsdp_kwargs)


def _require_supported(strategy: Any) -> None:
    """Raise for a strategy :func:`dp_group_from_strategy` does not know (XLA's, a custom one)."""
    if isinstance(strategy, (XLAStrategy, FabricXLAStrategy, FabricXLAFSDPStrategy)):
        raise TypeError(
            f"dp_group_from_strategy got {type(strategy).__name__}: XLA strategies are not supported "
            f"(torch.distributed all_to_all on XLA devices is untested). {_HOW_TO_PASS_A_GROUP}"
        )
    known = (
        DDPStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        FabricDDPStrategy,
        FabricFSDPStrategy,
        FabricModelParallelStrategy,
    )
    if not isinstance(strategy, known):
        raise TypeError(
            f"dp_group_from_strategy got strategy={strategy!r} of type "
            f"{type(strategy).__module__}.{type(strategy).__qualname__}, "
            f"expected a DDP, FSDP, DeepSpeed, ModelParallel or single-device strategy of Lightning "
            f"or Fabric. {_HOW_TO_PASS_A_GROUP}"
        )


def _model_parallel_group(strategy: Any) -> dist.ProcessGroup:
    """The group of a model-parallel strategy's ``data_parallel`` mesh dimension."""
    mesh = strategy.device_mesh
    if "data_parallel" not in (mesh.mesh_dim_names or ()):
        # Lightning names its mesh's dimensions; one set in its place may name them otherwise.
        raise TypeError(
            f"dp_group_from_strategy got a {type(strategy).__name__} whose device mesh has the "
            f"dimensions {mesh.mesh_dim_names}: expected one named 'data_parallel', as Lightning "
            f"names it. {_HOW_TO_PASS_A_GROUP}"
        )
    return mesh["data_parallel"].get_group()


def tensor_parallel_size(strategy: Any) -> int:
    """How many ranks hold each data-parallel rank's batch under ``strategy``: the size of a
    ``ModelParallelStrategy``'s ``tensor_parallel`` mesh dimension, else 1 (also before the mesh
    exists). Those peers sit in different data-parallel groups and must encode the same images."""
    if not isinstance(strategy, (ModelParallelStrategy, FabricModelParallelStrategy)):
        return 1
    mesh = getattr(strategy, "_device_mesh", None)
    if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
        return 1
    return int(mesh["tensor_parallel"].size())
