"""Run test code on several real gloo ranks: a reusable pool of worker processes.

Usage::

    from multirank import world

    def check(x):                       # module-level, so it pickles by reference
        import torch.distributed as dist
        return dist.get_rank() * x

    def test_something():
        with world(3) as w:              # or the ``multirank`` fixture from conftest.py
            assert w.run(check, 10) == [0, 10, 20]

* :func:`world` hands out a persistent :class:`World` of ``n`` ranks (worker processes, each
  in a gloo process group initialised through a file store in a temporary directory: no ports).
  Pools are reused across tests and closed at interpreter exit; at most :data:`MAX_POOLS` stay
  alive at a time (least recently used closed first) to bound memory.
* :meth:`World.run` calls a picklable function with the same arguments on every rank and returns
  the per-rank results in rank order. The function reads its rank from ``torch.distributed``.
* Failures never hang: if a rank raises, :meth:`World.run` waits a short grace period for the
  others, then raises :class:`MultiRankError` with every rank's traceback (or "no answer" for a
  rank stuck in a collective). A parent watchdog (``timeout``) does the same for hangs. In both
  cases the pool is killed and the next :func:`world` call starts a fresh one. Process groups use
  a short collective timeout, so a rank waiting on a failed peer gives up on its own as well.
* Workers run with one intra-op thread (the test machine's cores are shared).
* Workers start from a fork server that imported the heavy libraries once (:data:`PRELOAD`): a
  new pool, or one restarted after a failure, starts in 0.1 s instead of 3-5 s (each rank
  importing torch, and later transformers and Lightning, 6-11 s each on the test machine). A
  fork server, not a plain fork: the test process's own threads and state never reach the
  workers. They start with the environment the test process had when the first pool started.
* A worker whose ranks must all fail alike returns what :func:`caught` kept of the error (or
  ``"no error"``), so the test compares every rank's outcome.
* Inside a worker, :func:`subgroup` gives the process group of the first ``k`` ranks, so one pool
  of 4 serves 2-, 3- and 4-rank tests (process start-up, not the tests, dominates the run time).
  Ranks outside it just return.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

__all__ = [
    "EXIT_ABORT_MESSAGE",
    "MAX_POOLS",
    "MultiRankError",
    "World",
    "close_all",
    "groups_taken_for_nccl",
    "launched_by_torchrun",
    "reinit_default_group",
    "set_launcher_variables",
    "skip_without_fsdp2",
    "subgroup",
    "world",
]

#: Pools kept alive at once.
MAX_POOLS = 3
#: Seconds a collective may wait inside a worker before gloo raises.
COLLECTIVE_TIMEOUT_S = 30.0
#: Seconds to wait for the other ranks once one rank has raised.
GRACE_S = 3.0
#: What libstdc++ prints when a process exits with a thread left running: gloo's, when torch 2.13
#: aborts at exit (SIGABRT) after a process's work is done (test_host_group, test_readme).
EXIT_ABORT_MESSAGE = "terminate called without an active exception"
#: Imported once by the fork server the workers start from (those not installed are skipped).
#: Inductor's compiler too: ``torch.compile`` imports it at its first call in a process, even for
#: the ``eager`` backend (1-2 s a rank), and DeepSpeed's imports call it (test_hf_deepspeed.py's
#: pools: 134 -> 128 s for the file).
PRELOAD = ("torch", "torch.distributed", "numpy", "transformers", "lightning", "torch._inductor.compile_fx")


class MultiRankError(AssertionError):
    """A multi-rank call failed or hung; the message holds every rank's outcome."""


def _worker_main(rank: int, size: int, store: str, tasks: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
    except BaseException:  # report and stop: the parent turns it into a MultiRankError
        results.put((-1, rank, False, traceback.format_exc()))
        return
    results.put((-1, rank, True, None))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            value = fn(*args, **kwargs)
            results.put((task_id, rank, True, value))
        except BaseException:
            results.put((task_id, rank, False, traceback.format_exc()))
    # No destroy_process_group(): its shutdown can wait on peers that already left; exiting is enough.


class World:
    """``size`` worker processes in one gloo process group, reused for many calls.

    Args:
        size: Number of ranks.
        start_timeout: Seconds to wait for every rank to join the process group.
    """

    def __init__(self, size: int, start_timeout: float = 120.0) -> None:
        self.size = size
        self.alive = False
        self._tmp = tempfile.mkdtemp(prefix="multirank-")
        context = mp.get_context("forkserver")
        # Read when the server starts (the first pool of the session), ignored afterwards.
        context.set_forkserver_preload(list(PRELOAD))
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(size)]
        self._next_task = 0
        self._procs = [
            context.Process(
                target=_worker_main,
                args=(rank, size, os.path.join(self._tmp, "store"), self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(size)
        ]
        for proc in self._procs:
            proc.start()
        self.alive = True
        self._collect(-1, start_timeout, "start")

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order.

        Raises:
            MultiRankError: Some rank raised, died or did not answer within ``timeout`` seconds.
        """
        if not self.alive:
            raise MultiRankError(f"the {self.size}-rank pool is closed")
        task_id = self._next_task = self._next_task + 1
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        return self._collect(task_id, timeout, getattr(fn, "__name__", repr(fn)))

    def _collect(self, task_id: int, timeout: float, what: str) -> list[Any]:
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < self.size:
            if any(not ok for ok, _ in outcomes.values()):
                deadline = min(deadline, time.monotonic() + GRACE_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                got_id, rank, ok, value = self._results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in outcomes]
                for r in dead:
                    outcomes[r] = (False, f"process died (exit code {self._procs[r].exitcode})")
                continue
            if got_id == task_id:
                outcomes[rank] = (ok, value)
        if len(outcomes) == self.size and all(ok for ok, _ in outcomes.values()):
            return [outcomes[r][1] for r in range(self.size)]
        self.close(kill=True)
        lines = [f"{what} failed on the {self.size}-rank pool (pool killed):"]
        for r in range(self.size):
            ok, value = outcomes.get(r, (False, f"no answer within the time limit ({timeout:.0f}s)"))
            lines.append(f"--- rank {r}: {'ok' if ok else 'FAILED'}")
            if not ok:
                lines.append(str(value).rstrip())
        raise MultiRankError("\n".join(lines))

    def close(self, kill: bool = False) -> None:
        """Stop the workers (politely, or at once with ``kill``) and remove the store."""
        if not self.alive:
            return
        self.alive = False
        if not kill:
            for q in self._tasks:
                with contextlib.suppress(Exception):
                    q.put(None)
            deadline = time.monotonic() + 1.0  # shared: exiting gloo workers may linger on teardown
            for proc in self._procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        shutil.rmtree(self._tmp, ignore_errors=True)


_SUBGROUPS: dict[tuple[int, str | None], Any] = {}


def subgroup(size: int, backend: str | None = None) -> Any:
    """In a worker: the process group of ranks ``0 .. size-1`` of the pool, or None (the default
    group) when ``size`` is the pool's size and no ``backend`` is asked for; members are those with
    ``dist.get_rank() < size``.

    ``backend``: e.g. ``"cpu:gloo,cuda:gloo"``, a group that carries CUDA tensors too (the pool's
    default group is plain gloo, which the balancer uses for CPU tensors only).

    Created on first use; call it on every rank of the pool with the same arguments (as
    :meth:`World.run` does), because creating a group is collective.
    """
    import torch.distributed as dist

    if size == dist.get_world_size() and backend is None:
        return None
    key = (size, backend)
    if key not in _SUBGROUPS:
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        _SUBGROUPS[key] = dist.new_group(list(range(size)), timeout=timeout, backend=backend)
    return _SUBGROUPS[key]


def reinit_default_group(store: str) -> None:
    """In a worker: destroy every process group and initialise the default group again through the
    file ``store`` (the same path on every rank), as a sweep under one launcher does between trials.
    The test then closes the pool (``World.close``), so that later tests start on a world of the
    pool's own: a group made in such a world by a later test failed now and then in the full suite
    (gloo's ``connectFullMesh``: "Connection closed by peer" between two of three ranks)."""
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    _SUBGROUPS.clear()
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    init = f"file://{store}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size, timeout=timeout)


def set_launcher_variables(**extra: str) -> None:
    """In a worker: the environment a launcher (``torchrun``) gives this rank, for libraries that
    read it even when the process group exists already (DeepSpeed refuses to start without
    ``LOCAL_RANK``; accelerate reads the rendezvous address too, passed in ``extra``)."""
    import torch.distributed as dist

    rank = str(dist.get_rank())
    os.environ.update(LOCAL_RANK=rank, RANK=rank, WORLD_SIZE=str(dist.get_world_size()), **extra)


@contextlib.contextmanager
def launched_by_torchrun() -> Iterator[None]:
    """In a worker, for the duration: the environment ``torchrun`` gives this rank (one node, every
    rank of the pool on it), so a Lightning ``Trainer`` runs on the pool's ranks as under
    ``torchrun``: its ``TorchElasticEnvironment`` starts no processes and its strategy takes the
    process group that exists. A fit then costs no process start-up (each fresh rank imports
    torch, Lightning and transformers, 8-10 s of CPU time on the test machine). The previous
    environment is restored afterwards, so later calls on the pool see none of it."""
    import torch.distributed as dist

    rank, size = str(dist.get_rank()), str(dist.get_world_size())
    values = {
        "RANK": rank,
        "LOCAL_RANK": rank,
        "GROUP_RANK": "0",
        "WORLD_SIZE": size,
        "LOCAL_WORLD_SIZE": size,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",  # never dialled: the process group exists
        "TORCHELASTIC_RUN_ID": "multirank",  # how torch (and Lightning) tell a torchrun launch
    }
    saved = {key: os.environ.get(key) for key in values}
    # A strategy's setup tells Lightning's rank-zero helpers this rank: put back what they held, so
    # later calls warn and print as before (every rank as rank 0, the pool's state from its start).
    deciders = {id(d): d for d in map(_rank_zero_decider, _RANK_ZERO_MODULES) if d is not None}
    ranks = {key: decider.rank for key, decider in deciders.items() if hasattr(decider, "rank")}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for key, rank in ranks.items():
            deciders[key].rank = rank


def skip_without_fsdp2() -> None:
    """Skip the calling test where this torch has no FSDP2 (``fully_shard``)."""
    import pytest

    if not hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard"):
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")


@contextlib.contextmanager
def groups_taken_for_nccl() -> Iterator[None]:
    """In a worker, for the duration: the balancer takes every process group for an NCCL group
    (its backend check patched, this process only), so it makes and uses the gloo twins
    (``make_host_group``) it makes on GPUs, on the pool's gloo groups."""
    from lightning_vit_balance import host_group

    original = host_group._nccl_only
    host_group._nccl_only = lambda group: True
    try:
        yield
    finally:
        host_group._nccl_only = original


#: The modules whose ``rank_zero_only`` a Lightning strategy sets the rank of.
_RANK_ZERO_MODULES = (
    "lightning_utilities.core.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.pytorch.utilities.rank_zero",
)


def _rank_zero_decider(module_name: str) -> Any:
    """``rank_zero_only`` of ``module_name``, where that module is imported."""
    return getattr(sys.modules.get(module_name), "rank_zero_only", None)


_POOLS: OrderedDict[int, World] = OrderedDict()


@contextlib.contextmanager
def world(size: int) -> Iterator[World]:
    """The persistent pool of ``size`` ranks (started on first use, restarted after a failure)."""
    pool = _POOLS.get(size)
    if pool is None or not pool.alive:
        while len(_POOLS) >= MAX_POOLS:
            _, oldest = _POOLS.popitem(last=False)
            oldest.close()
        _POOLS.pop(size, None)
        pool = World(size)
        _POOLS[size] = pool
    _POOLS.move_to_end(size)
    yield pool


def close_all() -> None:
    """Close every pool (registered to run at interpreter exit)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


atexit.register(close_all)


class Caught:
    """What :func:`caught` kept: ``message``, the error's text, or ``"no error"``."""

    message = "no error"


@contextlib.contextmanager
def caught(*errors: type[BaseException]) -> Iterator[Caught]:
    """Keep the text of an error of one of the ``errors`` types that the block raises::

    with caught(ValueError) as outcome:
        balancer(tower, pixels, grid)
    return outcome.message  # "no error" where it raised none
    """
    outcome = Caught()
    try:
        yield outcome
    except errors as error:
        outcome.message = str(error)
