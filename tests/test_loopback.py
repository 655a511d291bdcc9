"""Every embedded Ray, and everything the job starts, listens on loopback only."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from parallelism import Topology
from recovery import FailureSchedule, Kill, Trainer
from tests.workloads import mlp_spec

_LOOPBACK = {  # as /proc writes them: 127.0.0.1, ::1, ::ffff:127.0.0.1
    "0100007F",
    "00000000000000000000000001000000",
    "0000000000000000FFFF00000100007F",
}


def _family(pid: int) -> set[int]:
    """``pid`` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    family, todo = set(), [pid]
    while todo:
        p = todo.pop()
        family.add(p)
        todo.extend(children.get(p, []))
    return family


def _socket_inodes(pids: set[int]) -> dict[str, int]:
    inodes = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:  # the process ended, or is not ours to read
            continue
    return inodes


def non_loopback_listeners(pid: int) -> list[str]:
    """Listening TCP sockets of ``pid``'s process family not bound to loopback."""
    inodes = _socket_inodes(_family(pid))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            ip, port = local.split(":")
            if state == "0A" and inode in inodes and ip not in _LOOPBACK:
                found.append(f"pid {inodes[inode]} {_cmd(inodes[inode])}: {ip}:{int(port, 16)}")
    return found


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
    except OSError:
        return "?"


@pytest.mark.ray
@pytest.mark.timeout(240)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc")
def test_an_embedded_run_listens_on_loopback_only() -> None:
    seen: list[str] = []
    checks = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.3):
            checks.append(1)
            seen.extend(non_loopback_listeners(os.getpid()))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = Trainer(
            mlp_spec(),
            topology=Topology(2, 2),
            failures=FailureSchedule([Kill(step=6, stage=1, replica=0)]),
        ).fit(12)
    finally:
        done.set()
        watcher.join()
    assert result.events, "the kill (a replacement's groups and store) was not exercised"
    assert len(checks) >= 3, "the run ended before the sockets were looked at"
    assert not seen, sorted(set(seen))


def test_the_cluster_simulator_starts_ray_through_the_one_loopback_helper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import recovery.groups.ray_env
    from simulations import cluster

    calls = []

    class Started(Exception):
        pass

    def connect(**kwargs: object) -> bool:
        calls.append(kwargs)
        raise Started

    monkeypatch.setattr(recovery.groups.ray_env, "connect", connect)
    with pytest.raises(Started):
        cluster.sweep([], use_ray=True)
    assert calls
