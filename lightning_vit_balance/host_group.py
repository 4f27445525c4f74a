"""The gloo twin of an NCCL data-parallel group, for the balancer's small host-side gathers.

:func:`make_host_group` makes it once per fit. Two things decide whether a twin can work and how
patient it is, and neither may be left to gloo's defaults:

* *Where gloo listens.* Without ``GLOO_SOCKET_IFNAME``, gloo binds to the address this host's
  name resolves to. Many machines map their own name to a loopback address (``127.0.1.1`` in
  Debian's ``/etc/hosts``), or cannot resolve it and gloo falls back to ``127.0.0.1``. That works
  on one host and cannot work across hosts: the other hosts' ranks connect to their own loopback,
  and one rank raises at once while the others wait for the twin's timeout (30 minutes by
  default). NCCL, which picks its interface itself, trains on such machines without complaint.
  So every rank reports where its gloo would listen, and no twin is made for a group that spans
  hosts with a rank on loopback; the balancer then gathers on the group itself (a device-to-host
  copy per gather) and rank 0 warns.
  An address that is not loopback can be out of reach too (a container's bridge, a firewall):
  gloo connects a group's ranks as it makes it, so each twin gets a short time to connect
  (:data:`CONNECT_TIMEOUT`), and the ranks agree to drop any twin that failed on one of them.
* *How long it waits.* A gloo group waits 30 minutes by default, whatever the job set for its
  NCCL group (``init_process_group(timeout=...)``, ``DDPStrategy(timeout=...)``, the ``Trainer``'s
  ``ddp_timeout``). The twin takes its group's timeout: a job that lets ranks wait two hours for a
  checkpoint is not ended by a planning gather after thirty minutes, and a hang surfaces when the
  job expects it to.
* *How many files it holds.* Gloo connects every pair of a group's ranks as it makes it: a twin of
  ``P`` ranks holds ``P + 3`` open files on each (a socket per other rank and four of gloo's own:
  its listening socket and its event loop's) until it is destroyed. Under the common open-file
  limit of 1,024, two twins of 512 ranks would use up what the job has left for its checkpoints,
  data loader workers and NCCL, and the job would fail later, somewhere else, with "Too many open
  files". So each rank first raises its soft limit as far as its twin needs (up to the hard
  limit, as ``ulimit -n`` would), every rank reports its open files and its limit, and no twin is
  made that would leave a rank less than a quarter of its limit free (rank 0 warns, naming the
  hard limit to raise). The Lightning mixin destroys its twin at the end of each fit, validate,
  test or predict run (:func:`release_host_group`), so a process never holds more than one.
  Where gloo connects lazily (``TORCH_GLOO_LAZY_INIT=1``), a twin holds a socket per rank the host
  gathers exchange with (``2 * ceil(log2 P)`` at most), and its first gather is made as it is
  made, so that an unreachable rank is still found then.
"""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import math
import os
import socket
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from lightning_vit_balance.callsite import warn_at_user
from lightning_vit_balance.exchange import (
    backend_device_type,
    current_group,
    forget_finished_gathers,
    gather_objects,
    require_member,
    start_row_gather,
)

__all__ = ["make_host_group", "release_host_group"]

#: Environment variables that name the interface gloo binds to (then the hostname does not matter).
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME",)
#: The most a twin may take to connect its ranks (see :func:`_connect_timeout`). Reachable ranks
#: connect in milliseconds (32 processes on one machine: 0.13 s); an address no other rank reaches
#: then fails the twin in minutes at most, not at the job's timeout.
CONNECT_TIMEOUT = timedelta(seconds=60)
#: Files a gloo group holds on each rank besides one socket per other rank: its listening socket
#: and its event loop's descriptors (counted in /proc/self/fd, torch 2.13: 11 at 8 ranks, 19 at 16).
GLOO_FILES_BESIDES_PEERS = 4
#: The share of its open-file limit a rank keeps free after making a twin, for what the job opens
#: later (checkpoints, data loader workers, NCCL's connections, made at its first collective).
FREE_FILES_SHARE = 0.25


class _GlooEndpoint(NamedTuple):
    """Where this process's gloo groups would listen, as the other ranks need to know it.

    Attributes:
        network: ``(hostname, boot id, network namespace)``: processes on one
            :func:`_loopback_domain` share a loopback interface, so each reaches the others'
            loopback address.
        loopback: The loopback address gloo would bind to; ``""`` when it binds to another
            address or an interface is named (:data:`INTERFACE_VARIABLES`).
    """

    network: tuple[str, str, int]
    loopback: str


class _OpenFiles(NamedTuple):
    """How many files this process holds open, and its (soft) limit; ``limit`` 0: unknown or none.
    ``lazy``: its gloo groups connect their pairs at first use (:func:`_connects_lazily`)."""

    held: int
    limit: int
    lazy: bool = False


def make_host_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """A gloo group over the ranks of an NCCL data-parallel ``group``, in the same order, for the
    balancer's small host-side gathers (``ViTBalancer(..., host_group=...)``): the metadata and
    status words then never go through a CUDA buffer, so neither planning ahead nor the status
    gather makes the host wait for the device.

    ``group`` (``None``: the default group) may span the world (DDP, FSDP, DeepSpeed, Hugging
    Face's ``Trainer``) or be one of several disjoint data-parallel subgroups (tensor or pipeline
    parallelism alongside data parallelism: ``device_mesh["data_parallel"]``). Every process of the
    world must make this call at the same point, with its own data-parallel group: it all-gathers
    each process's group ranks and gloo endpoint over the world, then every process creates every
    group's twin in one order, as ``new_group`` requires, and one more all-gather says which
    connected. (A group-local ``new_group`` would spare the other ranks, but torch names such
    groups after how many groups each process belongs to, which differs between ranks that joined
    different subgroups before: they would wait for each other forever.) Each twin waits as long
    as ``group`` does (its backend's timeout).
    ``ViTBalanceMixin`` calls it once per fit, and the Hugging Face drop-in at its first balanced
    forward or ``prepare``: points every rank reaches alike.

    Returns:
        The twin, or ``None`` where none is needed or none can be made, on every rank alike: no
        process group; a group that carries CPU tensors itself (gloo, ``"cpu:gloo,cuda:nccl"``);
        a group of one rank; groups that overlap (not a partition of the ranks); a group whose
        ranks are not in ascending order (``new_group`` sorts them); a group that spans hosts
        while gloo would listen on a loopback address on one of its ranks, or whose ranks could
        not connect within :data:`CONNECT_TIMEOUT` (rank 0 warns, naming ``GLOO_SOCKET_IFNAME``);
        a twin that would leave one of its ranks less than :data:`FREE_FILES_SHARE` of its
        open-file limit free, once the soft limit is raised as far as the hard one allows (rank 0
        warns, naming the limit). See the module docstring. The balancer then gathers on
        ``group``. :func:`release_host_group` destroys the twin.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    require_member(group, "group")
    # Twins of a world destroyed since (a sweep's earlier trial) are no longer held: torch let go.
    _TWINS[:] = [entry for entry in _TWINS if _live(entry[1])]
    if not _nccl_only(group):
        return None
    ranks = (
        tuple(range(dist.get_world_size())) if group is None else tuple(dist.get_process_group_ranks(group))
    )
    gathered = gather_objects((_packed(ranks), _gloo_endpoint(), _room_for_twin(len(ranks))))
    endpoints = [endpoint for _, endpoint, _ in gathered]
    files = [open_files for _, _, open_files in gathered]
    candidates = _twin_ranks([tuple(packed) for packed, _, _ in gathered])
    unreachable = [twin for twin in candidates if _loopback_across_hosts(twin, endpoints)]
    crowded = [twin for twin in candidates if twin not in unreachable and _short_of_files(twin, files)]
    refused = unreachable + crowded
    twins, failed = _connected([twin for twin in candidates if twin not in refused], _timeout_of(group))
    if dist.get_rank() == 0:
        if unreachable:
            warn_at_user(_refusal_text(unreachable, endpoints))
        if crowded:
            warn_at_user(_files_text(crowded, files))
        if failed:
            warn_at_user(_failure_text(failed))
    return twins.get(ranks)


#: The twins :func:`make_host_group` made, until released (the groups :func:`release_host_group`
#: destroys), each with its owner's weak reference where :func:`owned_host_group` made it for one
#: that may be dropped without releasing its twin (None: the caller's own). Held as torch's registry
#: holds them, until released or their world is destroyed.
_TWINS: list[tuple[weakref.ref[Any] | None, dist.ProcessGroup]] = []


def owned_host_group(group: Any, owner: object) -> dist.ProcessGroup | None:
    """:func:`make_host_group` for ``owner``, which releases the twin (:func:`release_host_group`)
    when its run ends, after destroying the twins of owners gone without releasing theirs.

    A run that raises skips its owner's release: Lightning calls no module ``teardown`` after an
    exception, and Hugging Face's ``Trainer`` no callback's ``on_train_end``. A sweep whose trials
    fail or are pruned (an exception too), each with a new module or model, would otherwise hold
    one twin per such trial for the life of the process: ``P + 3`` open files and three threads
    each. A cyclic collection runs first where such a twin is left, since a failed run's module
    and trainer refer to each other. Every rank calls it at the same point, as
    :func:`make_host_group`; destroying is local.
    """
    if any(owner_ref is not None for owner_ref, _ in _TWINS):
        gc.collect()
        for orphan in [twin for owner_ref, twin in _TWINS if owner_ref is not None and owner_ref() is None]:
            release_host_group(orphan)
    twin = make_host_group(group)
    if twin is not None:
        _TWINS[:] = [(weakref.ref(owner) if held is twin else owner_ref, held) for owner_ref, held in _TWINS]
    return twin


def gathers_on(twin: dist.ProcessGroup | None, group: Any) -> Any:
    """The ``host_group`` a balancer on ``group`` is given: its twin, else ``group`` itself (the
    world for ``None``), passed explicitly where no twin was needed or could be made
    (:func:`make_host_group` said why), so that the balancer does not warn about it again."""
    if twin is not None:
        return twin
    return current_group(group)


def release_host_group(host_group: dist.ProcessGroup | None) -> None:
    """Destroy a twin from :func:`make_host_group`: torch lets go of it, and its sockets and gloo's
    threads close as soon as no reference to it is left (the balancer that used it included).

    Purely local (no collective): each rank calls it when it is done with the twin. Does nothing
    for ``None`` or a group already destroyed (with the whole of ``torch.distributed``, say). A
    twin otherwise lives as long as the process: a process that runs many fits would hold one per
    fit, ``P + 3`` open files each.

    Raises:
        ValueError: ``host_group`` is a live group that is no twin (the default group, say, held by
            ``make_host_group(group) or group`` where no twin was made), or no group at all.
    """
    # Not held here past its release either (that would keep its sockets open).
    made = any(twin is host_group for _, twin in _TWINS)
    _TWINS[:] = [entry for entry in _TWINS if entry[1] is not host_group]
    if host_group is not None and dist.is_available() and not isinstance(host_group, dist.ProcessGroup):
        _refuse_release(host_group)  # no group at all, whether or not a world is up
    if host_group is None or not (dist.is_available() and dist.is_initialized()):
        return
    if not made:
        _refuse_release(host_group)
        return  # destroyed already
    # Nor by the works of its latest gathers, finished long before: freed here, with the interpreter
    # alive, and its worker threads end as the group goes.
    forget_finished_gathers()
    with contextlib.suppress(ValueError):  # "Invalid process group specified": destroyed already
        dist.destroy_process_group(host_group)


def _live(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is one of this world's, not destroyed."""
    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError):  # "Invalid process group specified"
        return False
    return True


def _refuse_release(host_group: object) -> None:
    """Raise unless ``host_group`` is a group destroyed already (a twin released before, or with
    the whole of ``torch.distributed``): :func:`release_host_group` destroys twins only."""
    if isinstance(host_group, dist.ProcessGroup) and not _live(host_group):
        return
    raise ValueError(
        f"release_host_group(host_group={host_group!r}) is invalid: expected a twin that "
        "make_host_group returned, or None. It destroys twins only, never the group a twin stands "
        "for or the default group (`make_host_group(group) or group` holds the group itself where "
        "no twin was made: release what make_host_group returned)."
    )


def _connected(
    candidates: Sequence[tuple[int, ...]], timeout: timedelta | None
) -> tuple[dict[tuple[int, ...], dist.ProcessGroup], dict[tuple[int, ...], str]]:
    """Make each candidate twin, every rank in one order, and keep those every member connected.

    Gloo connects a group's ranks as it makes it (with ``TORCH_GLOO_LAZY_INIT``, at a first
    gather made here), and a rank that cannot reach another raises while its peers wait for it,
    so each twin gets :func:`_connect_timeout` to connect (an unreachable rank then costs a few
    times that, once, rather than the job). The ranks then agree over the world which twins failed
    anywhere, and drop (destroy) those everywhere; the others get ``timeout`` for their gathers.

    Returns:
        This rank's twins by their ranks, and the failed twins with a member's error.
    """
    connect = _connect_timeout(timeout)
    made: dict[tuple[int, ...], Any] = {}
    errors: dict[tuple[int, ...], str] = {}
    for twin_ranks in candidates:
        try:
            made[twin_ranks] = twin = dist.new_group(ranks=list(twin_ranks), backend="gloo", timeout=connect)
            if isinstance(twin, dist.ProcessGroup):  # this rank is a member
                _TWINS.append((None, twin))
                if _connects_lazily():
                    # Connect now the pairs the host gathers use, within `connect` too, as eager
                    # gloo did.
                    start_row_gather(torch.zeros(1, dtype=torch.int64), twin).wait()
        except RuntimeError as error:  # gloo's connectFullMesh (or the first gather), within `connect`
            errors[twin_ranks] = f"rank {dist.get_rank()}: {type(error).__name__}: {str(error)[:300]}"
    failed = {
        twin: error for rank_errors in reversed(gather_objects(errors)) for twin, error in rank_errors.items()
    }
    twins = {}
    for twin_ranks, twin in made.items():
        if not isinstance(twin, dist.ProcessGroup):  # this rank is not a member
            continue
        if twin_ranks in failed:
            release_host_group(twin)
            continue
        twin._get_backend(torch.device("cpu")).set_timeout(timeout or default_pg_timeout)
        twins[twin_ranks] = twin
    return twins, failed


def _connect_timeout(timeout: timedelta | None) -> timedelta:
    """How long a twin may take to connect: :data:`CONNECT_TIMEOUT`, or a sixth of the group's
    ``timeout`` when shorter, so that the ranks that raise early do not outwait the group while
    they agree with the last one (gloo's retries make a failed connection take up to about five
    times this)."""
    return min(CONNECT_TIMEOUT, (timeout or default_pg_timeout) / 6)


def _packed(ranks: tuple[int, ...]) -> range | tuple[int, ...]:
    """``ranks`` as a ``range`` when they rise in even steps (the world, or every ``k``-th rank of
    it: a few bytes to gather whatever the group's size), else as they are. Each rank gathers every
    rank's: 4,096 ranks sending the world's ranks as a tuple would gather 50 MB on each."""
    if len(ranks) >= 2 and ranks[1] > ranks[0]:
        stepped = range(ranks[0], ranks[-1] + 1, ranks[1] - ranks[0])
        if len(stepped) == len(ranks) and tuple(stepped) == ranks:
            return stepped
    return ranks


def _nccl_only(group: Any) -> bool:
    """Whether the group's backend carries CUDA tensors alone (NCCL), so that reading a host value
    gathered over it waits for the device."""
    return backend_device_type(group) == "cuda"


def _gloo_endpoint() -> _GlooEndpoint:
    """Where a gloo group made by this process would listen (no communication).

    Mirrors gloo's choice: a named interface (:data:`INTERFACE_VARIABLES`) wins; else the first
    address the hostname resolves to; else, when it does not resolve, the loopback address.
    """
    hostname = socket.gethostname()
    network = (hostname, _read_text("/proc/sys/kernel/random/boot_id"), _network_namespace())
    if any(os.environ.get(name) for name in INTERFACE_VARIABLES):
        return _GlooEndpoint(network, "")
    try:
        address = str(socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        return _GlooEndpoint(network, "127.0.0.1")
    try:
        loopback = ipaddress.ip_address(address.split("%")[0]).is_loopback  # "%": an IPv6 zone
    except ValueError:
        loopback = False
    return _GlooEndpoint(network, address if loopback else "")


def _open_files() -> _OpenFiles:
    """This process's open files (Linux: ``/proc/self/fd``) and its soft limit on them; ``(0, 0)``
    where either cannot be read or there is no limit."""
    lazy = _connects_lazily()
    try:
        import resource  # POSIX only

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        held = len(os.listdir("/proc/self/fd"))
    except (ImportError, OSError, ValueError):
        return _OpenFiles(0, 0, lazy)
    if limit == resource.RLIM_INFINITY or limit <= 0:
        return _OpenFiles(0, 0, lazy)
    return _OpenFiles(held, int(limit), lazy)


def _connects_lazily() -> bool:
    """Whether this process's gloo groups connect each pair of ranks at its first message instead
    of all pairs when made: ``TORCH_GLOO_LAZY_INIT``, read as torch reads it."""
    return os.environ.get("TORCH_GLOO_LAZY_INIT", "").lower() in ("1", "t", "true", "y", "yes")


def _room_for_twin(size: int) -> _OpenFiles:
    """:func:`_open_files` once this process's soft open-file limit is raised, up to its hard
    limit, as far as a twin of ``size`` ranks needs (:func:`_short_of_files`), as ``ulimit -n``
    in the launch script would: the soft limit is the process's own to raise (a common default is
    1,024 under a hard limit of 524,288), the hard one the administrator's. Never lowers it."""
    files = _open_files()
    wanted = _limit_wanted(_holding(files, size))
    if size < 2 or not files.limit or wanted <= files.limit:
        return files
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if raised > files.limit:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    return _open_files()


def _files_for_twin(size: int, lazy: bool) -> int:
    """Files a twin of ``size`` ranks holds open on each of them: a socket per other rank, or, when
    gloo connects ``lazy``-ly, per rank the host gathers exchange with (``ceil(log2 P)`` rounds of
    two peers each, :func:`~lightning_vit_balance.exchange.start_row_gather`)."""
    peers = size - 1
    if lazy and size > 1:
        peers = min(peers, 2 * math.ceil(math.log2(size)))
    return peers + GLOO_FILES_BESIDES_PEERS


def _short_of_files(ranks: Sequence[int], files: Sequence[_OpenFiles]) -> list[int]:
    """The ranks of a group that a twin would leave with less than :data:`FREE_FILES_SHARE` of
    their open-file limit free; ``[]`` when the twin fits (or the limits are unknown)."""
    return [
        r for r in ranks if files[r].limit and _limit_wanted(_holding(files[r], len(ranks))) > files[r].limit
    ]


def _holding(files: _OpenFiles, size: int) -> int:
    """The files a rank holding ``files`` would hold with a twin of ``size`` ranks made."""
    return files.held + _files_for_twin(size, files.lazy)


def _limit_wanted(holding: int) -> int:
    """The least open-file limit that leaves :data:`FREE_FILES_SHARE` of it free with ``holding``
    files open: the one rule behind both raising the soft limit and refusing a twin."""
    return math.ceil(holding / (1 - FREE_FILES_SHARE))


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return ""


def _network_namespace() -> int:
    """The inode of this process's network namespace (Linux), 0 where there is none to read:
    containers on one machine share its boot id but not their loopback interfaces."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def _timeout_of(group: Any) -> timedelta | None:
    """The timeout of ``group``'s backend (NCCL's, or gloo's where a test takes a gloo group for
    NCCL); ``None`` (``new_group``'s default) where torch does not expose it."""
    process_group = current_group(group)
    for device_type in ("cuda", "cpu"):
        try:
            timeout = process_group._get_backend(torch.device(device_type)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def _twin_ranks(gathered: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The groups to twin, from every process's gathered group ranks, in one order on every rank:
    none when they overlap; else each distinct group of two or more ranks in ascending order."""
    distinct = sorted(set(gathered))
    members = [r for ranks in distinct for r in ranks]
    if len(members) != len(set(members)):
        return []
    return [ranks for ranks in distinct if len(ranks) > 1 and list(ranks) == sorted(ranks)]


def _loopback_domain(network: tuple[str, str, int]) -> tuple[str, ...]:
    """What decides whether two processes share a loopback interface: the machine (its boot id)
    and the network namespace, where both are known; else the hostname. Containers on one machine
    may share a hostname and not a loopback, or share the machine's network under other names."""
    hostname, boot_id, namespace = network
    return (boot_id, str(namespace)) if boot_id and namespace else (hostname,)


def _loopback_across_hosts(ranks: Sequence[int], endpoints: Sequence[_GlooEndpoint]) -> list[int]:
    """The ranks of a group spanning more than one network whose gloo would listen on loopback
    (no other host could reach them); ``[]`` when the group can be twinned."""
    if len({_loopback_domain(endpoints[r].network) for r in ranks}) < 2:
        return []
    return [r for r in ranks if endpoints[r].loopback]


def _refusal_text(refused: Sequence[tuple[int, ...]], endpoints: Sequence[_GlooEndpoint]) -> str:
    """The warning for the groups left without a twin: which ranks, hosts and addresses, and the fix."""
    first = refused[0]
    stranded = _loopback_across_hosts(first, endpoints)
    domains = {_loopback_domain(endpoints[r].network): endpoints[r].network for r in reversed(first)}
    kind, hosts = _network_labels(sorted(domains.values()))
    where = sorted({f"{endpoints[r].network[0]} -> {endpoints[r].loopback}" for r in stranded})
    why = (
        f"it spans {len(hosts)} {kind} ({_names_text(hosts)}), and on ranks {_ranks_text(stranded)} the "
        f"hostname resolves to a loopback address ({_names_text(where)}), which gloo would listen on and no "
        "other host can reach (making the twin would wait for its timeout)"
    )
    return _without_twin_text(refused, why) + (
        "set GLOO_SOCKET_IFNAME to the network interface the hosts reach each other on (as "
        "NCCL_SOCKET_IFNAME does for NCCL; e.g. GLOO_SOCKET_IFNAME=eth0) on every rank, or map each "
        "hostname to that interface's address in /etc/hosts."
    )


def _files_text(crowded: Sequence[tuple[int, ...]], files: Sequence[_OpenFiles]) -> str:
    """The warning for the groups whose twin would crowd out the job's files: the ranks, their
    files and limits, and the fix."""
    first = crowded[0]
    short = _short_of_files(first, files)
    worst = max(short, key=lambda r: _holding(files[r], len(first)) / files[r].limit)
    needed = _files_for_twin(len(first), files[worst].lazy)
    why = (
        f"gloo would hold {needed} more open files on each rank (a socket per rank it connects to), "
        f"and on ranks {_ranks_text(short)} that leaves less than {FREE_FILES_SHARE:.0%} of the "
        f"open-file limit free for the rest of the job, with the limit raised to the hard limit (rank "
        f"{worst}: {files[worst].held} open, limit {files[worst].limit})"
    )
    return _without_twin_text(crowded, why) + (
        "raise the hard open-file limit on every host (nofile in /etc/security/limits.conf, "
        "LimitNOFILE for a systemd unit, `--ulimit nofile=65536:65536` for a container, or the "
        "scheduler's setting; the soft limit follows it here)."
    )


def _failure_text(failed: dict[tuple[int, ...], str]) -> str:
    """The warning for twins whose ranks could not connect: which ranks, a member's error, the fix."""
    groups = sorted(failed)
    return _without_twin_text(groups, f"its ranks could not connect ({failed[groups[0]]})") + (
        "every rank must reach the address gloo listens on, on any TCP port: the first address of the "
        "interface GLOO_SOCKET_IFNAME names, else the one the hostname resolves to (set GLOO_SOCKET_IFNAME "
        "to the interface the hosts reach each other on, as NCCL_SOCKET_IFNAME does for NCCL)."
    )


def _without_twin_text(groups: Sequence[tuple[int, ...]], why: str) -> str:
    """The opening both warnings share: the first group left without a twin, how many more, ``why``,
    and what the balancer does instead; the fix follows."""
    others = f" (and {len(groups) - 1} more data-parallel groups like it)" if len(groups) > 1 else ""
    return (
        f"make_host_group: no gloo twin for the data-parallel group of ranks {_ranks_text(groups[0])}"
        f"{others}: {why}. The balancer gathers on the data-parallel group instead: correct, with a "
        "device-to-host copy per gather. To plan on the host, "
    )


def _network_labels(networks: Sequence[tuple[str, str, int]]) -> tuple[str, list[str]]:
    """What the networks are (hosts, or network namespaces where they share a hostname) and a
    label for each."""
    names = [hostname for hostname, _, _ in networks]
    if len(set(names)) == len(names):
        return "hosts", names
    return "network namespaces", [f"{hostname} [namespace {inode}]" for hostname, _, inode in networks]


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"[{_listed([str(r) for r in ranks], 8, 'ranks')}]"


def _names_text(names: Sequence[str]) -> str:
    return _listed(names, 4, "in all")


def _listed(items: Sequence[str], shown: int, counted: str) -> str:
    """``items`` joined by commas, the first ``shown`` of them and the count when there are more."""
    if len(items) <= shown:
        return ", ".join(items)
    return f"{', '.join(items[:shown])}, ... ({len(items)} {counted})"
