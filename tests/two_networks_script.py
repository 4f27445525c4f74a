"""One rank of a 2-rank job whose ranks sit in two network namespaces joined by a veth pair, the
way two hosts are: the hostname resolves to a loopback address, which each namespace has its own
of. Run by ``test_host_group.py`` inside ``ip netns exec``::

    python tests/two_networks_script.py RANK STORE INTERFACE MODE DEAD_INTERFACE

The job's process group (gloo on the veth interface, standing for NCCL, which picks its interface
itself) works. Then ``make_host_group`` runs with gloo left to its default address (``default``)
or with ``GLOO_SOCKET_IFNAME`` still naming the interface (``named``) or naming one no other
rank reaches (``unreachable``; ``unreachable-lazy`` with ``TORCH_GLOO_LAZY_INIT=1`` too, so
that gloo would connect at the first gather), and a plan made ahead and a balanced call gather on
what it returned. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import towers

from lightning_vit_balance import ViTBalanceConfig, ViTBalancer, host_group


def main() -> None:
    rank, store, interface, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=20)
    )
    if mode == "default":
        del os.environ["GLOO_SOCKET_IFNAME"]  # gloo reads it whenever it makes a group
    elif mode.startswith("unreachable"):
        # An interface whose address no other rank can reach; a second to connect, not a minute.
        os.environ["GLOO_SOCKET_IFNAME"] = sys.argv[5]
        host_group.CONNECT_TIMEOUT = timedelta(seconds=1)
        if mode == "unreachable-lazy":  # read whenever gloo makes a group: the twin's, not the job's
            os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    host_group._nccl_only = lambda group: True  # take the job's group for NCCL: it gets a twin
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        twin = host_group.make_host_group()
    seconds = time.perf_counter() - started
    torch.manual_seed(0)
    tower = towers.TensorTower()
    pixels, grid = towers.make_batch([[(1, 8, 8), (1, 8, 8)], [(1, 2, 2)]][rank], seed=rank)
    balancer = ViTBalancer(ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0), None, host_group=twin)
    ticket = balancer.prepare(pixels, grid, tower)
    out = balancer(tower, pixels, grid, prepared=ticket)
    # Same ops on the same rows in another batch: fp32 agrees to a few ulps.
    torch.testing.assert_close(out, tower(pixels, grid), rtol=1e-4, atol=1e-5)
    result = {
        "twin": twin is not None,
        "gathered_on_twin": twin is not None and balancer._host() is twin,
        "applied": ticket.plan.applied,
        "seconds": seconds,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
