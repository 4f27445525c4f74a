"""The gloo twin of an NCCL data-parallel group (``make_host_group``): where its gloo would listen,
whether a twin can reach every rank, how long it waits, and the files it holds."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multirank import COLLECTIVE_TIMEOUT_S, EXIT_ABORT_MESSAGE, groups_taken_for_nccl, reinit_default_group

from lightning_vit_balance import host_group, make_host_group, release_host_group
from lightning_vit_balance.host_group import (
    _files_for_twin,
    _files_text,
    _gloo_endpoint,
    _GlooEndpoint,
    _loopback_across_hosts,
    _open_files,
    _OpenFiles,
    _packed,
    _refusal_text,
    _room_for_twin,
    _short_of_files,
)

POOL = 4
#: The tests that count this process's open files, in ``/proc/self/fd`` (Linux).
_COUNTS_OPEN_FILES = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="no /proc/self/fd to count open files in"
)


def _files_held() -> int:
    return len(os.listdir("/proc/self/fd"))


def _resolving_to(address: str) -> Any:
    def getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (address, 0))]

    return getaddrinfo


def _unresolved(host: str, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


@pytest.mark.parametrize(
    ("resolver", "interface", "loopback"),
    [
        (_resolving_to("127.0.1.1"), "", "127.0.1.1"),  # Debian's /etc/hosts line for the own name
        (_resolving_to("::1"), "", "::1"),
        (_resolving_to("fe80::1%eth0"), "", ""),  # an IPv6 address with its zone
        (_resolving_to("10.0.3.7"), "", ""),
        (_unresolved, "", "127.0.0.1"),  # gloo falls back to the loopback address itself
        (_resolving_to("127.0.1.1"), "eth0", ""),  # a named interface: the hostname does not matter
    ],
)
def test_the_endpoint_says_where_gloo_would_listen(
    monkeypatch: pytest.MonkeyPatch, resolver: Any, interface: str, loopback: str
) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface)
    endpoint = _gloo_endpoint()
    assert endpoint.loopback == loopback
    assert endpoint.network[0] == socket.gethostname()
    assert endpoint == _gloo_endpoint()  # the same on every call: ranks compare these


def test_releasing_what_is_no_group_is_refused_without_a_world_too() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"release_host_group\(host_group=3\) is invalid: expected a twin"):
        release_host_group(3)  # type: ignore[arg-type]
    release_host_group(None)


def test_a_group_across_hosts_with_a_rank_on_loopback_gets_no_twin() -> None:
    a, b = ("node-a", "boot-a", 1), ("node-b", "boot-b", 1)
    container = ("node-a", "boot-a", 2)  # another network namespace on node-a's machine
    on_loopback = [
        _GlooEndpoint(a, "127.0.1.1"),
        _GlooEndpoint(a, "127.0.1.1"),
        _GlooEndpoint(b, "127.0.1.1"),
    ]
    assert _loopback_across_hosts([0, 1], on_loopback) == []  # one host: its loopback reaches both
    assert _loopback_across_hosts([0, 1, 2], on_loopback) == [0, 1, 2]
    routable = [_GlooEndpoint(a, ""), _GlooEndpoint(b, ""), _GlooEndpoint(container, "127.0.0.1")]
    assert _loopback_across_hosts([0, 1], routable) == []  # both hosts listen on a routable address
    assert _loopback_across_hosts([0, 2], routable) == [2]  # a container does not share a's loopback
    # A container on the machine's network under another name shares its loopback; without a boot
    # id and a namespace to read (not Linux), the hostname decides.
    shared = [_GlooEndpoint(a, "127.0.1.1"), _GlooEndpoint(("web-1", "boot-a", 1), "127.0.0.1")]
    assert _loopback_across_hosts([0, 1], shared) == []
    unknown = [_GlooEndpoint((name, "", 0), "127.0.0.1") for name in ("mac-1", "mac-1", "mac-2")]
    assert _loopback_across_hosts([0, 1], unknown) == [] and _loopback_across_hosts([1, 2], unknown) == [1, 2]
    text = _refusal_text([(0, 1, 2), (3, 4, 5)], [*on_loopback, *on_loopback])
    assert "ranks [0, 1, 2] (and 1 more data-parallel groups like it)" in text, text
    assert "2 hosts (node-a, node-b)" in text and "node-a -> 127.0.1.1" in text, text
    assert "GLOO_SOCKET_IFNAME" in text, text
    text = _refusal_text([(0, 2)], [on_loopback[0], on_loopback[1], _GlooEndpoint(container, "127.0.0.1")])
    assert "2 network namespaces (node-a [namespace 1], node-a [namespace 2])" in text, text


def test_group_ranks_travel_as_a_range_when_they_step_evenly() -> None:
    """Every rank gathers every rank's group: the world's 4,096 ranks as a tuple pickle to 12 kB,
    50 MB gathered on each rank; as a range, 44 bytes."""
    for ranks in [tuple(range(4096)), tuple(range(3, 4096, 8)), (0, 2, 3), (5,), (), (3, 1), (0, 2, 4, 7)]:
        packed = _packed(ranks)
        assert tuple(packed) == ranks
        assert isinstance(packed, range) == (ranks in (tuple(range(4096)), tuple(range(3, 4096, 8)))), ranks
    assert len(pickle.dumps(_packed(tuple(range(4096))))) < 64


def _twins_across_two_hosts(loopback: str) -> dict[str, Any]:
    """The pool as two hosts of two ranks, gloo listening on ``loopback`` on each (``""``: on a
    routable address). The world group and the pairs across hosts, [0, 2] and [1, 3], then get no
    twin where a rank listens on loopback; the pairs within a host, [0, 1] and [2, 3], always do."""
    rank = dist.get_rank()
    endpoint = _GlooEndpoint((f"node-{rank // 2}", f"boot-{rank // 2}", 1), loopback)
    original = host_group._gloo_endpoint
    host_group._gloo_endpoint = lambda: endpoint
    # Each group waits its own time, and so does its twin.
    waits = {"world": COLLECTIVE_TIMEOUT_S, "within": 45.0, "across": 50.0}
    within_pairs = [dist.new_group(r, timeout=timedelta(seconds=waits["within"])) for r in ([0, 1], [2, 3])]
    across_pairs = [dist.new_group(r, timeout=timedelta(seconds=waits["across"])) for r in ([0, 2], [1, 3])]
    within, across = within_pairs[rank // 2], across_pairs[rank % 2]
    try:
        with groups_taken_for_nccl(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            twins = {
                "world": make_host_group(),
                "within": make_host_group(within),
                "across": make_host_group(across),
            }
    finally:
        host_group._gloo_endpoint = original
    timeouts = {
        name: twin._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for name, twin in twins.items()
        if twin is not None
    }
    if twins["within"] is not None:  # a twin that works: one gather over it
        gathered: list[Any] = [None] * 2
        dist.all_gather_object(gathered, rank, group=twins["within"])
        assert gathered == [rank // 2 * 2, rank // 2 * 2 + 1], gathered
    return {
        "made": sorted(name for name, twin in twins.items() if twin is not None),
        "timeouts": timeouts,
        "waits": {name: waits[name] for name in timeouts},
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    }


def test_twins_are_made_only_where_every_rank_can_reach_them(multirank: Any) -> None:
    """On loopback, twins within a host are made and twins across hosts are not (rank 0 warns,
    the balancer gathers on the group itself); listening on a routable address, every twin is
    made. Each twin waits as long as its group (30-50 s here, not gloo's default 30 minutes)."""
    with multirank(POOL) as w:
        on_loopback = w.run(_twins_across_two_hosts, "127.0.1.1")
        routable = w.run(_twins_across_two_hosts, "")
    for rank, got in enumerate(on_loopback):
        assert got["made"] == ["within"], got
        assert len(got["warnings"]) == (2 if rank == 0 else 0), got  # the world's call and the pairs'
    assert "ranks [0, 1, 2, 3]" in on_loopback[0]["warnings"][0], on_loopback[0]
    assert "ranks [0, 2] (and 1 more" in on_loopback[0]["warnings"][1], on_loopback[0]
    for got in routable:
        assert got["made"] == ["across", "within", "world"] and not got["warnings"], got
    for got in on_loopback + routable:
        assert got["timeouts"] == got["waits"], got


def test_a_twin_that_would_crowd_out_the_jobs_files_is_not_made() -> None:
    """512 ranks: the twin holds 515 files on each. A rank holding 300 under the common limit of
    1,024 would keep 209 free, less than a quarter: no twin. Half the ranks fit there."""
    files = [_OpenFiles(100, 65536)] * 512
    files[7] = _OpenFiles(300, 1024)
    assert _short_of_files(range(512), files) == [7]
    assert _short_of_files(range(256), files) == []  # 300 + 259 = 559 files, 768 allowed
    assert _short_of_files(range(4096), [_OpenFiles(0, 0)] * 4096) == []  # no limit, or unknown
    # Connecting lazily (TORCH_GLOO_LAZY_INIT), gloo holds sockets only to the host gathers' peers:
    # 2 x 11 rounds at 2,048 ranks, 26 files in all.
    lazy = [_OpenFiles(300, 1024, lazy=True)] * 2048
    assert _files_for_twin(2048, lazy=True) == 26 and _files_for_twin(3, lazy=True) == 6
    assert _short_of_files(range(2048), lazy) == []
    text = _files_text([tuple(range(512))], files)
    assert "no gloo twin for the data-parallel group of ranks [0, 1, 2" in text, text
    assert "515 more open files on each rank" in text and "on ranks [7]" in text, text
    assert "(rank 7: 300 open, limit 1024)" in text and "hard open-file limit" in text, text


@_COUNTS_OPEN_FILES
def test_open_files_are_read_from_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    resource = pytest.importorskip("resource")
    monkeypatch.delenv("TORCH_GLOO_LAZY_INIT", raising=False)
    assert _open_files().lazy is False
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    held, limit, _ = _open_files()
    assert abs(held - _files_held()) <= 1  # listdir's own descriptor
    assert limit == (0 if soft == resource.RLIM_INFINITY else soft)
    for value, connects_lazily in (("Yes", True), ("TRUE", True), ("1", True), ("0", False), ("no", False)):
        monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", value)  # torch's spellings, any case
        assert _open_files().lazy is connects_lazily, value
    with open(os.devnull) as _:
        assert _open_files().held == held + 1


def _twin_files() -> dict[str, Any]:
    """On the pool's world: rank 2's soft open-file limit lowered to 8 files above what it holds
    (the twin's 7 would take its last quarter), which the call raises again; then rank 2 reporting
    such a limit as its hard one too; then a twin made, gathered on and released."""
    import resource

    rank = dist.get_rank()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with groups_taken_for_nccl(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            before = _files_held()
            if rank == 2:
                resource.setrlimit(resource.RLIMIT_NOFILE, (before + 8, hard))
            lowered = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            release_host_group(raised := make_host_group())
            limits = (before, lowered, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        made_raised = raised is not None
        del raised
        if rank == 2:  # as a hard limit would leave it
            host_group._room_for_twin = lambda size: _OpenFiles(_files_held(), _files_held() + 8)
        try:
            refused = make_host_group()
        finally:
            host_group._room_for_twin = _room_for_twin
        before = _files_held()
        twin = make_host_group()
    made = twin is not None
    with_twin = _files_held()
    gathered: list[Any] = [None] * POOL
    dist.all_gather_object(gathered, rank, group=twin)
    name = twin.group_name
    release_host_group(twin)
    release_host_group(twin)  # again: nothing to do
    release_host_group(None)
    del twin
    return {
        "raised": made_raised,
        "limits": limits,
        "refused": refused is None,
        "made": made,
        "gathered": gathered,
        "files": (with_twin - before, _files_held() - before),
        "registered": name in dist.distributed_c10d._world.pg_names.values(),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    }


def _releases_refused() -> dict[str, Any]:
    """Groups that are no twin given to release_host_group: the default group (what
    ``make_host_group(g) or g`` holds where no twin was made), another group, a string."""
    refusals = []
    three = dist.new_group([0, 1, 2])  # rank 3 holds new_group's placeholder
    for other in (dist.group.WORLD, three, "dp"):
        try:
            release_host_group(other)
            refusals.append("released")
        except ValueError as error:
            refusals.append(str(error).split(" is invalid")[0])
    if dist.get_rank() < 3:
        dist.destroy_process_group(three)
    return {"refusals": refusals, "world_kept": dist.is_initialized() and dist.get_world_size() == POOL}


def _twins_of_destroyed_worlds(store: str) -> dict[str, Any]:
    """A sweep's trials under one launcher: a twin made, the world destroyed and made again, the
    twin then released (or not); the files held after each trial."""
    held = []
    with groups_taken_for_nccl():
        before = _files_held()
        for trial in range(3):
            twin = make_host_group()
            reinit_default_group(f"{store}.{trial}")
            if trial != 1:  # a trial that never releases its twin: forgotten at the next make
                release_host_group(twin)
            del twin
            held.append(_files_held() - before)
        release_host_group(make_host_group())  # the make drops what a destroyed world left
    return {"held": held, "twins": len(host_group._TWINS)}


@_COUNTS_OPEN_FILES
def test_twins_of_a_destroyed_world_are_let_go(multirank: Any, tmp_path: Path) -> None:
    """Released after their world was destroyed, twins were still held (their sockets open): one
    twin's files more per trial of a sweep."""
    with multirank(POOL) as w:
        results = w.run(_twins_of_destroyed_worlds, str(tmp_path / "store"))
        w.close()  # its ranks are in a world of the test's own (see reinit_default_group)
    for got in results:
        assert got["twins"] == 0 and max(got["held"]) <= 7, got


def test_release_refuses_what_is_no_twin(multirank: Any) -> None:
    """release_host_group destroyed whatever it was given: the default group too, without a word."""
    with multirank(POOL) as w:
        results = w.run(_releases_refused)
    for got in results:
        assert got["world_kept"] and len(got["refusals"]) == 3, got
        assert all(text.startswith("release_host_group(host_group=") for text in got["refusals"]), got


def _lazy_twin_files() -> dict[str, Any]:
    """A twin made where gloo connects lazily: the files it holds, and a gather on it."""
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # read whenever gloo makes a group
    try:
        with groups_taken_for_nccl():
            before = _files_held()
            twin = make_host_group()
            held = _files_held() - before
    finally:
        del os.environ["TORCH_GLOO_LAZY_INIT"]
    gathered: list[Any] = [None] * POOL
    dist.all_gather_object(gathered, dist.get_rank(), group=twin)
    release_host_group(twin)
    return {"held": held, "gathered": gathered}


def _orphaned_twins() -> dict[str, Any]:
    """Twins made for owners (as the mixin's runs and the drop-in's handles are): one whose owner
    is dropped without releasing it, in a reference cycle (a failed fit's module and trainer), and
    one whose owner lives on; then the next twin made."""

    class Owner:
        pass

    with groups_taken_for_nccl():
        gc.collect()  # earlier tasks' garbage, which the first collection here would close
        before = _files_held()
        dropped, kept = Owner(), Owner()
        dropped.itself = dropped  # freed only by a cyclic collection
        orphan = host_group.owned_host_group(None, dropped)
        alive = host_group.owned_host_group(None, kept)
        names = (orphan.group_name, alive.group_name)
        del dropped, orphan
        with_three = host_group.owned_host_group(None, Owner())  # its owner gone at once, too
        held = _files_held() - before
        registered = [name in dist.distributed_c10d._world.pg_names.values() for name in names]
        release_host_group(alive)
        release_host_group(with_three)
        del alive, with_three  # a released twin's sockets close with its last reference
    left = sum(owner_ref is not None for owner_ref, _ in host_group._TWINS)
    return {"held": held, "registered": registered, "left": left, "end": _files_held() - before}


@_COUNTS_OPEN_FILES
def test_a_twin_whose_owner_is_gone_is_destroyed_before_the_next_is_made(multirank: Any) -> None:
    """A run that raised never released its twin (Lightning skips the module's teardown then, the
    Hugging Face Trainer its callbacks' on_train_end): the next twin made destroys it, so a sweep
    of failing trials holds the live ones' twins only (4 ranks: 7 files each)."""
    with multirank(POOL) as w:
        results = w.run(_orphaned_twins)
    for got in results:
        # Two live twins: up to 14 files (12-14 seen: gloo's pairs connect as they come), 19-21
        # with the orphan's still open.
        assert got["held"] <= 14 and got["registered"] == [False, True], got
        assert got["left"] == 0 and got["end"] <= 0, got


@_COUNTS_OPEN_FILES
def test_a_lazily_connecting_twin_holds_its_gathers_sockets_only(multirank: Any) -> None:
    """With ``TORCH_GLOO_LAZY_INIT=1`` the twin's first gather, made as the twin is, connects the
    pairs the host gathers use (4 ranks: gloo's ring, 2 peers): 6 files, within the 7 counted."""
    with multirank(POOL) as w:
        results = w.run(_lazy_twin_files)
    for got in results:
        assert got["held"] == 6 and got["gathered"] == list(range(POOL)), got


@_COUNTS_OPEN_FILES
def test_a_twin_leaves_room_for_the_jobs_files_and_releasing_it_closes_them(multirank: Any) -> None:
    """A soft limit too low for the twin is raised (the twin is made); a hard one is not, and the
    refusal is agreed on every rank (rank 0 warns, naming rank 2's files). A twin of 4 ranks holds
    7 files on each, all closed when it is released."""
    pytest.importorskip("resource")
    with multirank(POOL) as w:
        results = w.run(_twin_files)
    for rank, got in enumerate(results):
        assert got["raised"] and got["refused"] and got["made"] and got["gathered"] == list(range(POOL)), got
        assert got["files"] == (7, 0) and not got["registered"], got
        assert len(got["warnings"]) == (1 if rank == 0 else 0), got
    held, lowered, raised = results[2]["limits"]
    # Raised so that the twin's 7 files leave a quarter of the limit free.
    assert lowered == held + 8 and raised > lowered and held + 7 <= 0.75 * raised, results[2]
    warning = results[0]["warnings"][0]
    assert "on ranks [2]" in warning and "7 more open files" in warning and "hard open-file limit" in warning


def test_the_soft_limit_is_raised_only_as_far_as_the_hard_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """2,000 files held under 1,024 / 4,096: a twin of 512 ranks wants 3,354 (a quarter free), and
    gets it; under 1,024 / 2,048, the hard limit; with room already, or for one rank, no change."""
    resource = pytest.importorskip("resource")
    limits = {"soft": 1024, "hard": 4096}
    monkeypatch.setattr(host_group, "_open_files", lambda: _OpenFiles(2000, limits["soft"]))
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limits["soft"], limits["hard"]))

    def setrlimit(which: int, values: tuple[int, int]) -> None:
        assert which == resource.RLIMIT_NOFILE and values[1] == limits["hard"]
        limits["soft"] = values[0]

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert _room_for_twin(512) == _OpenFiles(2000, 3354)  # ceil((2000 + 515) / 0.75)
    assert _room_for_twin(512) == _OpenFiles(2000, 3354) and _room_for_twin(1) == _OpenFiles(2000, 3354)
    limits.update(soft=1024, hard=2048)
    assert _room_for_twin(512) == _OpenFiles(2000, 2048)


def test_the_twin_waits_as_long_as_its_group(one_rank_world: None) -> None:
    """Read from the group's backend; gloo's own default (30 minutes) otherwise."""
    assert host_group._timeout_of(None) == timedelta(seconds=20)  # the fixture's group
    assert host_group._timeout_of(object()) is None  # nothing to read: new_group's default


@contextlib.contextmanager
def _two_networks() -> Iterator[list[tuple[str, str, str]]]:
    """Two network namespaces joined by a veth pair (10.77.0.1 and .2), as two hosts are: each
    one's name, its end of the pair, and a link of its own no other namespace reaches
    (10.66.0.x). Skips where they cannot be made (not root, no ``ip``, no network namespaces)."""
    tag = f"{os.getpid() % 100_000}"
    spaces, links = (f"vb{tag}a", f"vb{tag}b"), (f"vb{tag}x", f"vb{tag}y")
    dead = (f"vb{tag}d", f"vb{tag}e")  # each namespace's own link to nowhere (its peer stays down)
    steps = [
        *(["ip", "netns", "add", space] for space in spaces),
        ["ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1]],
    ]
    for k, (space, link, nowhere) in enumerate(zip(spaces, links, dead)):
        steps += [
            ["ip", "link", "add", nowhere, "type", "veth", "peer", "name", f"{nowhere}p"],
            *(["ip", "link", "set", name, "netns", space] for name in (link, nowhere)),
            ["ip", "-n", space, "addr", "add", f"10.77.0.{k + 1}/24", "dev", link],
            ["ip", "-n", space, "addr", "add", f"10.66.0.{k + 1}/24", "dev", nowhere],
            *(["ip", "-n", space, "link", "set", name, "up"] for name in (link, nowhere, "lo")),
            ["ip", "netns", "exec", space, "true"],  # entering one needs more rights than making it
        ]
    try:
        for step in steps:
            made = subprocess.run(step, capture_output=True, text=True, check=False)
            if made.returncode != 0:
                pytest.skip(f"cannot make network namespaces here: {' '.join(step)}: {made.stderr.strip()}")
        yield list(zip(spaces, links, dead))
    finally:
        for space in spaces:  # deleting a namespace deletes its links, and their peers
            subprocess.run(["ip", "netns", "del", space], capture_output=True, check=False)
        for nowhere in dead:  # a peer left behind when the namespace was never made
            subprocess.run(["ip", "link", "del", f"{nowhere}p"], capture_output=True, check=False)


def _gloo_aborted_at_exit(returncode: int, out: str, err: str) -> bool:
    """A rank that printed its whole result, then aborted as the interpreter exited, with
    libstdc++'s message for a thread left running (gloo's), after everything this test checks.
    Seen once in about seven full test runs with a lazily connecting twin that failed (never in 57
    runs of that mode alone), and once with a twin made on the named interface, under load."""
    finished = out.strip().endswith("}")
    aborted = EXIT_ABORT_MESSAGE in err
    return returncode == -signal.SIGABRT and finished and aborted


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network namespaces need Linux, root and iproute2",
)
def test_a_twin_across_two_network_namespaces(tmp_path: Path) -> None:
    """Two real networks whose hostname resolves to loopback (this machine's resolves to
    127.0.0.1): gloo's default address cannot connect them, so there is no twin (made directly,
    one rank fails to connect and the other waits for the group's timeout, 30 minutes by
    default); the balancer gathers on the job's group. With ``GLOO_SOCKET_IFNAME`` the twin is
    made and carries the gathers. Naming an interface no other rank reaches, the ranks fail to
    connect within the connect timeout and agree to do without the twin; so do they where gloo
    connects lazily (``TORCH_GLOO_LAZY_INIT``), at the twin's first gather."""
    if not _gloo_endpoint().loopback:
        pytest.skip("this machine's hostname resolves to a routable address: gloo's default would work")
    script = Path(__file__).resolve().parent / "two_networks_script.py"
    modes = ("default", "named", "unreachable", "unreachable-lazy")
    with _two_networks() as networks:
        # The modes' jobs run side by side (each its own store, its own addresses): a rank's start,
        # importing torch, is most of its time, and the unreachable modes wait on connect timeouts.
        launched = {
            mode: [
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        space,
                        sys.executable,
                        str(script),
                        *map(str, (k, tmp_path / f"store-{mode}")),
                        link,
                        mode,
                        nowhere,
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for k, (space, link, nowhere) in enumerate(networks)
            ]
            for mode in modes
        }
        results = {}
        try:
            for mode, ranks in launched.items():
                outputs = [rank.communicate(timeout=180) for rank in ranks]
                for rank, (out, err) in zip(ranks, outputs):
                    if _gloo_aborted_at_exit(rank.returncode, out, err):
                        continue  # its result line is checked below
                    assert rank.returncode == 0, f"{mode}: exit {rank.returncode}\n{out}\n{err[-3000:]}"
                results[mode] = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
        finally:  # a mode that failed or hung leaves no rank of another running
            for rank in (rank for ranks in launched.values() for rank in ranks):
                rank.kill()
                rank.wait()
    for rank, got in enumerate(results["default"]):
        assert not got["twin"] and got["applied"], got
        assert len(got["warnings"]) == (1 if rank == 0 else 0), got
    assert "spans 2 network namespaces" in results["default"][0]["warnings"][0], results
    for got in results["named"]:
        assert got["twin"] and got["gathered_on_twin"] and got["applied"] and not got["warnings"], got
    for mode in ("unreachable", "unreachable-lazy"):  # lazy: the twin's first gather fails instead
        for rank, got in enumerate(results[mode]):
            # A 1 s connect timeout: gloo gives up within a few (its retries), then every rank agrees.
            assert not got["twin"] and got["applied"] and got["seconds"] < 30, (mode, got)
            assert len(got["warnings"]) == (1 if rank == 0 else 0), (mode, got)
        assert "its ranks could not connect (rank " in results[mode][0]["warnings"][0], results


def test_a_balancer_on_nccl_without_a_host_group_says_what_it_costs(
    one_rank_world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare ``ViTBalancer`` on a group that carries CUDA tensors alone, given no host group, warns
    once at its first call that its gathers will wait for the GPU; given the group itself as its
    host group (what the mixin and the drop-in pass where no twin could be made, after
    ``make_host_group`` warned why), it does not. Patched: this group is gloo, and no GPU."""
    from lightning_vit_balance import ViTBalancer
    from lightning_vit_balance import balancer as balancer_module

    monkeypatch.setattr(balancer_module, "host_device", lambda group: torch.device("cuda", 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        balancer = ViTBalancer()
        balancer._host()
        balancer._host()
        ViTBalancer(host_group=dist.group.WORLD)._host()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "host_group=make_host_group(group)" in messages[0], messages
    monkeypatch.undo()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ViTBalancer()._host()  # gloo: nothing to say
    assert not caught
