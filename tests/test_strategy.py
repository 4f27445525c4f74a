"""dp_group_from_strategy for every strategy of Lightning and Fabric."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch.distributed as dist
from lightning.fabric.strategies import DataParallelStrategy as FabricDataParallelStrategy
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDeviceStrategy
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    XLAStrategy,
)
from multirank import world

from lightning_vit_balance.lightning.strategy import dp_group_from_strategy


def test_single_device_means_no_balancing() -> None:
    assert dp_group_from_strategy(SingleDeviceStrategy("cpu")) is None
    assert dp_group_from_strategy(FabricSingleDeviceStrategy("cpu")) is None
    # Fabric's DataParallel runs in one process: nothing to exchange with.
    assert dp_group_from_strategy(FabricDataParallelStrategy()) is None


def test_parallel_strategy_before_processes_start_means_no_balancing() -> None:
    assert not dist.is_initialized()
    assert dp_group_from_strategy(DDPStrategy()) is None
    assert dp_group_from_strategy(ModelParallelStrategy()) is None


@pytest.mark.usefixtures("one_rank_world")
def test_ddp_and_fsdp_variants_use_the_default_group_unless_given_one() -> None:
    world = dist.group.WORLD
    for strategy in (
        DDPStrategy(),
        DDPStrategy(start_method="spawn"),
        DDPStrategy(start_method="fork"),
        FSDPStrategy(),
        FabricDDPStrategy(),
        FabricDDPStrategy(start_method="spawn"),
        FabricFSDPStrategy(),
    ):
        assert dp_group_from_strategy(strategy) is world, type(strategy)

    own = dist.new_group([0])
    assert own is not world
    for strategy in (
        DDPStrategy(process_group=own),
        FSDPStrategy(process_group=own),
        FabricDDPStrategy(process_group=own),
        FabricFSDPStrategy(process_group=own),
    ):
        assert dp_group_from_strategy(strategy) is own, type(strategy)
    # Hybrid sharding's (shard, replicate) pair spans every rank: the default group.
    assert dp_group_from_strategy(FSDPStrategy(process_group=(own, own))) is world

    class SomeRanks:  # a two-dimensional mesh over fewer ranks than the world (a pipeline stage's)
        ndim = 2

        def size(self) -> int:
            return 2

    with pytest.raises(
        TypeError, match=r"device_mesh .* spans 2 of the 1 ranks in 2 dimensions.*vit_balance_group"
    ):
        dp_group_from_strategy(FSDPStrategy(device_mesh=SomeRanks()))
    # As a pipeline stage's mesh is: 2 of 4 ranks (fewer than the world, not more).
    with (
        mock.patch.object(dist, "get_world_size", return_value=4),
        pytest.raises(TypeError, match=r"device_mesh .* spans 2 of the 4 ranks in 2 dimensions"),
    ):
        dp_group_from_strategy(FSDPStrategy(device_mesh=SomeRanks()))


class _FakeEngine:
    def __init__(self, group: Any) -> None:
        self.data_parallel_group = group


@pytest.mark.usefixtures("one_rank_world")
def test_deepspeed_strategies_without_a_deepspeed_engine() -> None:
    own = dist.new_group([0])
    # Built without __init__: the real one refuses to construct without deepspeed installed; with
    # it installed, DeepSpeed's own communication layer is not started here (the ZeRO-3 tests in
    # test_hf_deepspeed.py give the adapter a real engine).
    trainer_strategy = object.__new__(DeepSpeedStrategy)
    trainer_strategy._model = _FakeEngine(own)
    trainer_strategy._lightning_module = None
    assert dp_group_from_strategy(trainer_strategy) is own
    fabric_strategy = object.__new__(FabricDeepSpeedStrategy)
    fabric_strategy._deepspeed_engine = _FakeEngine(own)
    assert dp_group_from_strategy(fabric_strategy) is own
    # An engine that does not say: Lightning's DeepSpeed has no model parallelism, all ranks are DP.
    fabric_strategy._deepspeed_engine = object()
    assert dp_group_from_strategy(fabric_strategy) is dist.group.WORLD


def test_unknown_strategy_names_itself_and_the_way_out() -> None:
    class MyStrategy:  # e.g. a third-party strategy the adapter cannot know
        pass

    with pytest.raises(TypeError, match=r"MyStrategy.*vit_balance_group.*configure_vit_balance_group"):
        dp_group_from_strategy(MyStrategy())
    # XLA subclasses DDP in Lightning but is not supported: refused, not guessed.
    with pytest.raises(TypeError, match=r"XLAStrategy.*vit_balance_group"):
        dp_group_from_strategy(object.__new__(XLAStrategy))
    with pytest.raises(TypeError, match=r"got strategy='ddp' of type builtins.str"):
        dp_group_from_strategy("ddp")


def _ddp_mesh_groups() -> dict[str, list[int]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    found = {}
    for name in ("dp", "tp"):
        for cls in (DDPStrategy, FabricDDPStrategy, FSDPStrategy):
            group = dp_group_from_strategy(cls(device_mesh=mesh[name]))
            found[f"{cls.__module__}.{cls.__name__}:{name}"] = dist.get_process_group_ranks(group)
    # A hybrid-sharding mesh spanning every rank, or its shape (made at setup): all data parallel.
    found["fsdp:2-D"] = dist.get_process_group_ranks(dp_group_from_strategy(FSDPStrategy(device_mesh=mesh)))
    found["fsdp:shape"] = dist.get_process_group_ranks(
        dp_group_from_strategy(FSDPStrategy(device_mesh=(2, 1)))
    )
    return found


def test_ddp_and_fsdp_given_a_device_mesh_balance_over_its_group() -> None:
    """DDP given ``device_mesh=`` reduces gradients over that mesh's group only: the adapter took
    the default group, so images moved between ranks whose ViT weights differ (pipeline stages) or
    that hold the same batch (tensor-parallel peers)."""
    with world(2) as w:
        outcome = w.run(_ddp_mesh_groups)
    for rank, found in enumerate(outcome):
        for key, ranks in found.items():
            assert ranks == ([rank] if key.endswith(":tp") else [0, 1]), (rank, key, ranks)


# ---------------------------------------------------------------------------- ModelParallelStrategy


def _mesh_groups() -> dict[tuple[tuple[int, int], str], list[int]]:
    from torch.distributed.device_mesh import init_device_mesh

    found = {}
    for shape in ((2, 1), (1, 2)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("data_parallel", "tensor_parallel"))
        for cls in (ModelParallelStrategy, FabricModelParallelStrategy):
            strategy = cls() if cls is ModelParallelStrategy else cls(parallelize_fn=lambda m, _: m)
            strategy._device_mesh = mesh
            found[(shape, cls.__module__)] = dist.get_process_group_ranks(dp_group_from_strategy(strategy))
    # A mesh set in Lightning's place with other names raised torch's KeyError.
    strategy._device_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    try:
        dp_group_from_strategy(strategy)
    except TypeError as error:
        found[((0, 0), "refused")] = [
            int("dimensions ('dp',): expected one named 'data_parallel'" in str(error))
        ]
    return found


def test_model_parallel_uses_the_data_parallel_mesh_dimension() -> None:
    with world(2) as w:
        outcome = w.run(_mesh_groups)
    for rank, found in enumerate(outcome):
        assert len(found) == 5 and found.pop(((0, 0), "refused")) == [1], found
        for (shape, _module), ranks in found.items():
            # (2, 1): both ranks are data parallel. (1, 2): the two ranks are tensor-parallel
            # peers holding the same images, so each balances with itself only.
            assert ranks == ([0, 1] if shape == (2, 1) else [rank]), (rank, shape)
