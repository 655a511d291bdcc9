"""Snapshots (recovery/snapshots/): the durable tier on disk, the peer tier's pure pieces.

Oracles: bit-exact state (`torch.equal` on every tensor, step counts included) after a
round trip; corruption is reported by file and never loaded; the buddy ring and the
peer rollback step against brute force.
"""

from __future__ import annotations

import itertools
import json
import pickle
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from parallelism.topology import Topology
from recovery.errors import RecoveryError, SnapshotCorrupted
from recovery.groups.placement import place
from recovery.snapshots import (
    COMPLETE,
    MANIFEST,
    DurableStore,
    PeerSnapshots,
    buddies,
    buddy_of,
    buddy_ring,
    pack_state,
    peer_rollback_step,
    unpack_state,
)
from recovery.snapshots.checkpoint import checkpoint_path, step_path
from recovery.state import Progress, WorkerState

# DCP warns on every single-process save and load, which is what the durable tier does.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# -- helpers ------------------------------------------------------------------------------


def make_worker(seed: int, width: int = 16) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4))
    module.register_buffer("seen", torch.zeros(3, dtype=torch.int64))
    return module, torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)


def train(module: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    width = next(module.parameters()).shape[1]
    for _ in range(steps):
        optimizer.zero_grad()
        module(torch.randn(8, width, generator=g)).pow(2).mean().backward()
        optimizer.step()
        if hasattr(module, "seen"):  # a buffer, which must travel with the state too
            module.seen += 1


def state_copy(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """A deep copy of a worker's state, to compare against later."""
    return {
        "model": {k: v.clone() for k, v in module.state_dict().items()},
        "optim": pickle.loads(pickle.dumps(optimizer.state_dict())),
    }


def assert_same(a: object, b: object, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), (where, set(a), set(b))
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


def ws(module: nn.Module, optimizer: torch.optim.Optimizer, step: int = 0) -> WorkerState:
    """A worker's state at ``step`` (see recovery/state.py)."""
    return WorkerState(module, optimizer, Progress(step))


def trained(seed: int, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    module, optimizer = make_worker(seed)
    train(module, optimizer, steps, seed)
    return module, optimizer


def write_step(store: DurableStore, step: int, world: int, meta: dict | None = None) -> None:
    """Every rank writes its state at ``step`` (rank r trained with seed r), then commit."""
    handles = []
    for rank in range(world):
        module, optimizer = trained(rank, steps=step)
        handles.append(store.write(rank, ws(module, optimizer, step), info={"rank": rank}))
    for handle in handles:
        store.wait(handle)
    store.commit(step, world, meta)


def data_file(root: Path, step: int, rank: int) -> Path:
    (path,) = checkpoint_path(root, step, rank).glob("*.distcp")
    return path


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = DurableStore(tmp_path / "snapshots")
    yield s
    s.close()


# -- durable tier -------------------------------------------------------------------------


def test_durable_round_trip_is_bit_exact_and_training_continues_identically(
    store: DurableStore,
) -> None:
    write_step(store, 3, world=2, meta={"topology": "1x2"})
    assert store.steps() == [3]
    assert store.verify(3, 2) == []
    for rank in range(2):
        original_module, original_opt = trained(rank, steps=3)
        module, optimizer = make_worker(100 + rank)  # fresh weights, no optimizer state
        assert store.load(3, rank, ws(module, optimizer)).step == 3
        assert_same(state_copy(original_module, original_opt), state_copy(module, optimizer))
        # the oracle of exact recovery: one more step gives the same state as never failing
        train(original_module, original_opt, 1, seed=7)
        train(module, optimizer, 1, seed=7)
        assert_same(state_copy(original_module, original_opt), state_copy(module, optimizer))
    manifest = json.loads((checkpoint_path(store.root, 3, 1) / MANIFEST).read_text())
    assert manifest["step"] == 3 and manifest["rank"] == 1 and manifest["info"] == {"rank": 1}
    assert set(manifest["files"]) == {".metadata", data_file(store.root, 3, 1).name}


def test_a_flipped_byte_is_detected_and_the_previous_snapshot_is_used(
    store: DurableStore,
) -> None:
    write_step(store, 2, world=2)
    write_step(store, 4, world=2)
    victim = data_file(store.root, 4, 1)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))

    problems = store.verify(4, 2)
    assert len(problems) == 1 and str(victim) in problems[0] and "sha256" in problems[0]
    assert store.verify(4, 2, checksums=False) == []  # same size: only checksums see it
    module, optimizer = make_worker(9)
    before = state_copy(module, optimizer)
    with pytest.raises(SnapshotCorrupted, match=victim.name) as info:
        store.load(4, 1, ws(module, optimizer))
    assert isinstance(info.value, RecoveryError)
    assert_same(before, state_copy(module, optimizer))  # nothing was loaded
    assert store.load(4, 0, ws(module, optimizer)).step == 4  # the other rank's files are fine
    assert store.newest_intact(2) == 2
    assert store.load(2, 1, ws(module, optimizer)).step == 2


@pytest.mark.parametrize("damage", ["delete", "truncate", "manifest", "complete"])
def test_missing_truncated_or_altered_files_are_detected(store: DurableStore, damage: str) -> None:
    write_step(store, 2, world=2)
    write_step(store, 4, world=2)
    folder = checkpoint_path(store.root, 4, 0)
    if damage == "delete":
        (folder / ".metadata").unlink()
        expected = ".metadata: missing"
    elif damage == "truncate":
        victim = data_file(store.root, 4, 0)
        victim.write_bytes(victim.read_bytes()[:-10])
        expected = "bytes, the manifest says"
    elif damage == "manifest":  # a manifest edited to match a changed file
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["files"][".metadata"]["size"] += 1
        (folder / MANIFEST).write_text(json.dumps(manifest))
        expected = "does not match the manifest committed"
    else:
        body = json.loads((step_path(store.root, 4) / COMPLETE).read_text())
        body["world_size"] = 3
        (step_path(store.root, 4) / COMPLETE).write_text(json.dumps(body))
        expected = "altered"
    problems = store.verify(4, 2)
    assert problems and expected in problems[0], problems
    with pytest.raises(SnapshotCorrupted, match=expected):
        store.load(4, 0, ws(*make_worker(0)))
    assert store.newest_intact(2) == 2


def test_no_intact_snapshot_gives_none_and_a_clear_error(store: DurableStore) -> None:
    assert store.steps() == [] and store.newest_intact(2) is None
    with pytest.raises(FileNotFoundError, match="no complete durable snapshot"):
        store.require_intact(2)
    with pytest.raises(FileNotFoundError, match="step 5"):
        store.load(5, 0, ws(*make_worker(0)))
    write_step(store, 5, world=2)
    (checkpoint_path(store.root, 5, 1) / ".metadata").unlink()
    assert store.newest_intact(2) is None
    with pytest.raises(SnapshotCorrupted, match=r"step 5: .*rank_0001/\.metadata: missing"):
        store.require_intact(2)
    # a snapshot of another job size is not this job's
    assert "job of 2 workers, this job has 4" in store.verify(5, 4)[0]


def test_a_step_without_complete_is_torn_and_never_loaded(store: DurableStore) -> None:
    write_step(store, 2, world=2)
    module, optimizer = trained(0, steps=6)
    store.wait(store.write(0, ws(module, optimizer, 6)))  # rank 1 never finishes step 6
    assert store.steps() == [2] and store.newest_intact(2) == 2
    with pytest.raises(FileNotFoundError, match="step 6"):
        store.load(6, 0, ws(*make_worker(0)))
    with pytest.raises(FileNotFoundError, match=r"ranks \[1\]"):
        store.commit(6, 2)
    # an interrupted write leaves only a .tmp folder, which is not a rank's
    (step_path(store.root, 6) / "rank_0001.tmp").mkdir()
    with pytest.raises(FileNotFoundError, match=r"ranks \[1\]"):
        store.commit(6, 2)


def test_meta_is_stored_and_another_jobs_snapshot_refused(store: DurableStore) -> None:
    meta = {"topology": [2, 1], "spec": "mlp", "data": "abc123"}
    write_step(store, 2, world=2, meta=meta)
    assert store.load_meta(2) == meta
    store.check_meta(2, {"topology": (2, 1), "spec": "mlp"})
    with pytest.raises(ValueError, match=r"different job \(spec: 'llama' here, 'mlp'"):
        store.check_meta(2, {"topology": (2, 1), "spec": "llama"})
    with pytest.raises(ValueError, match="JSON"):
        store.commit(2, 2, {"bad": object()})


def test_prune_keeps_the_newest_and_the_newest_intact(store: DurableStore) -> None:
    for step in (1, 2, 3, 4):
        write_step(store, step, world=1)
    for step in (3, 4):
        (checkpoint_path(store.root, step, 0) / ".metadata").unlink()
    module, optimizer = trained(0, steps=5)
    store.wait(store.write(0, ws(module, optimizer, 5)))  # torn, newer: maybe in flight
    (step_path(store.root, 0) / "rank_0000.tmp").mkdir(parents=True)  # torn, abandoned
    assert store.prune(keep=1) == [0, 1, 3]
    assert store.steps() == [4, 2]  # the newest, and the newest intact
    assert step_path(store.root, 5).exists()
    with pytest.raises(ValueError, match="keep"):
        store.prune(keep=0)


def test_after_a_rollback_newer_snapshots_are_discarded_before_rewriting(
    store: DurableStore,
) -> None:
    write_step(store, 2, world=1)
    write_step(store, 4, world=1)
    module, optimizer = trained(0, steps=4)
    with pytest.raises(FileExistsError, match="discard_after"):
        store.write(0, ws(module, optimizer, 4))
    assert store.discard_after(2) == [4]
    store.wait(store.write(0, ws(module, optimizer, 4)))
    store.commit(4, 1)
    assert store.steps() == [4, 2]


def test_async_write_does_not_block_and_snapshots_the_state_at_the_call(
    store: DurableStore,
) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(1280, 1280), nn.Linear(1280, 1280))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    train(module, optimizer, 1, seed=0)
    expected = state_copy(module, optimizer)
    handle = store.write(0, ws(module, optimizer, 1))
    train(module, optimizer, 1, seed=1)  # training goes on while the write runs
    assert len(store.pending()) <= 1
    result = store.wait(handle)
    print(
        f"\ndurable write of {result.bytes / 1e6:.0f} MB: write() blocked "
        f"{result.blocked_s * 1e3:.0f} ms, in place after {result.total_s * 1e3:.0f} ms"
    )
    assert result.bytes > 35e6
    # ~10x measured on 2 busy CPU cores; a generous bound, for loaded CI machines
    assert result.blocked_s * 2 < result.total_s, result
    store.commit(1, 1)
    fresh = nn.Sequential(nn.Linear(1280, 1280), nn.Linear(1280, 1280))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    store.load(1, 0, ws(fresh, fresh_opt))
    assert_same(expected, state_copy(fresh, fresh_opt))  # not the state after the later step
    # at most one write per rank in flight: the next waits for the previous
    first = store.write(0, ws(module, optimizer, 2))
    second = store.write(0, ws(module, optimizer, 3))
    assert first.done() and store.pending() in ([], [second])
    store.wait(second)


def test_bad_arguments_are_rejected(store: DurableStore) -> None:
    module, optimizer = make_worker(0)
    with pytest.raises(ValueError, match="step"):
        store.write(0, ws(module, optimizer, -1))
    with pytest.raises(ValueError, match="rank"):
        store.write(True, ws(module, optimizer, 0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size"):
        store.verify(0, 0)
    write_step(store, 1, world=1)
    with pytest.raises(ValueError, match="rank 1 is not in"):
        store.load(1, 1, ws(module, optimizer))


# -- peer tier: packing -------------------------------------------------------------------


def test_pack_unpack_is_bit_exact_and_shares_no_memory() -> None:
    module, optimizer = trained(0, steps=3)
    expected = state_copy(module, optimizer)
    packed = pack_state(ws(module, optimizer, 3))
    assert packed.data.dtype == torch.uint8 and packed.data.dim() == 1
    train(module, optimizer, 2, seed=5)  # the copy was taken: later steps do not leak in

    # it travels as header + one tensor
    received = type(packed).from_parts(packed.header(), packed.data.clone())
    fresh, fresh_opt = make_worker(42)
    assert unpack_state(received, ws(fresh, fresh_opt)).step == 3
    assert_same(expected, state_copy(fresh, fresh_opt))
    assert fresh_opt.state_dict()["state"][0]["step"] == torch.tensor(3.0)

    train(fresh, fresh_opt, 2, seed=5)  # training after unpacking leaves the snapshot alone
    again, again_opt = make_worker(43)
    unpack_state(received, ws(again, again_opt))
    assert_same(expected, state_copy(again, again_opt))
    assert_same(state_copy(module, optimizer), state_copy(fresh, fresh_opt))  # same continuation


def test_pack_reuses_a_spent_buffer() -> None:
    module, optimizer = trained(0, steps=3)
    old = pack_state(ws(module, optimizer, 3))
    train(module, optimizer, 1, seed=9)
    expected = state_copy(module, optimizer)
    packed = pack_state(ws(module, optimizer, 4), out=old.data)
    assert packed.data.data_ptr() == old.data.data_ptr()
    fresh, fresh_opt = make_worker(1)
    assert unpack_state(packed, ws(fresh, fresh_opt)).step == 4
    assert_same(expected, state_copy(fresh, fresh_opt))
    small = torch.empty(8, dtype=torch.uint8)
    assert pack_state(ws(module, optimizer, 4), out=small).data.data_ptr() != small.data_ptr()


class _Event:
    """Stands for the CUDA event of a copy from a GPU still in flight."""

    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def test_a_cpu_state_is_packed_synchronously_into_plain_memory() -> None:
    packed = pack_state(ws(*trained(0), 3))
    assert packed.ready is None and not packed.data.is_pinned()
    assert packed.wait() is packed


def test_every_reader_of_a_packed_copy_waits_for_the_copy_first() -> None:
    """A copy from a GPU is queued into pinned memory asynchronously (`pack_state`): its
    bytes are read only after `PackedState.wait` -- to check, restore or serve them."""
    from dataclasses import replace
    from types import SimpleNamespace

    from recovery.worker.keeper import SnapshotKeeper

    module, optimizer = trained(0, steps=3)
    packed = pack_state(ws(module, optimizer, 3), digests=True)

    pending = replace(packed, ready=_Event())
    assert pending.corrupted() == () and pending.ready.synchronized == 1
    unpack_state(pending, ws(*make_worker(1)))
    assert pending.ready.synchronized == 2

    pending = replace(packed, ready=_Event())
    keeper = SnapshotKeeper()
    keeper.peer.put(3, 5, pending)
    seen: list[int] = []
    comm = SimpleNamespace(
        wire=torch.device("cpu"),
        isend=lambda t, dst: seen.append(pending.ready.synchronized),
        wait_sends=lambda: None,
    )
    keeper.send(comm, 3, 5, 1)  # type: ignore[arg-type]
    assert seen == [1, 1, 1]  # waited before the first byte was handed over


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_state_is_packed_asynchronously_into_pinned_memory() -> None:
    module, optimizer = trained(0, steps=3)
    module.cuda()
    optimizer.load_state_dict(optimizer.state_dict())  # moves the moments to the GPU
    expected = state_copy(module, optimizer)
    packed = pack_state(ws(module, optimizer, 3))
    assert packed.data.is_pinned() and packed.ready is not None
    with torch.no_grad():  # queued after the copies: cannot leak into them
        for p in module.parameters():
            p.add_(1.0)
    fresh, fresh_opt = make_worker(42)
    fresh.cuda()
    unpack_state(packed, ws(fresh, fresh_opt))
    assert_same(expected, state_copy(fresh, fresh_opt))


def test_unpack_refuses_another_stage_before_changing_anything() -> None:
    packed = pack_state(ws(*trained(0), 3))
    other = nn.Sequential(nn.Linear(8, 8))
    other_opt = torch.optim.AdamW(other.parameters())
    before = state_copy(other, other_opt)
    with pytest.raises(ValueError, match="does not match this module"):
        unpack_state(packed, ws(other, other_opt))
    assert_same(before, state_copy(other, other_opt))
    with pytest.raises(ValueError, match="uint8"):
        type(packed).from_parts(packed.header(), packed.data[:10])


def test_a_peer_snapshot_always_records_its_digests_before_it_is_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fingerprints on or off, the own copy gets its digests on the exchange thread (off
    the training thread); a reader -- a rollback, a send -- waits for them, even when the
    exchange was given up meanwhile (a generation left at once)."""
    from recovery.snapshots.packing import PackedState
    from recovery.worker.keeper import SnapshotKeeper

    real = PackedState.digested

    def slow(self: PackedState) -> PackedState:
        time.sleep(0.2)
        return real(self)

    monkeypatch.setattr(PackedState, "digested", slow)
    module, optimizer = trained(0)
    keeper = SnapshotKeeper()
    keeper.take(2, ws(module, optimizer, 3), None, None, None)
    assert keeper.peer.get(3, 2).digests is None  # not yet: the caller did not wait
    keeper.join_exchange(timeout=0)  # given up, as leaving a generation may
    own = keeper.held(3, 2)
    assert own.digests is not None and own.corrupted() == ()
    own.data[own.layout[0].offset] ^= 1
    assert own.corrupted() == (own.layout[0].name,)
    bare = pack_state(ws(module, optimizer, 3))
    assert bare.digests is None and len(bare.corrupted()) == len(bare.layout)  # never trusted


# -- peer tier: buddies -------------------------------------------------------------------


def ring_score(top: Topology, node_of: Mapping[int, str], ring: list[int]) -> tuple[int, int]:
    """What the ring minimises, in order (buddy_ring's docstring): pairs sharing a stage
    or a node that hosts a whole stage group, then pairs sharing a node."""
    whole_group_nodes = {
        node_of[top.rank(s, 0)]
        for s in range(top.stages)
        if len({node_of[r] for r in top.stage_group(s)}) == 1
    }
    pairs = list(zip(ring, ring[1:] + ring[:1], strict=True))
    same_node = [node_of[a] == node_of[b] for a, b in pairs]
    severe = sum(
        top.worker(a).stage == top.worker(b).stage or (same and node_of[a] in whole_group_nodes)
        for (a, b), same in zip(pairs, same_node, strict=True)
    )
    return severe, sum(same_node)


def brute_force_score(top: Topology, node_of: Mapping[int, str]) -> tuple[int, int]:
    n = top.world_size
    return min(ring_score(top, node_of, [0, *rest]) for rest in itertools.permutations(range(1, n)))


@st.composite
def layouts(draw: st.DrawFn, max_workers: int = 6) -> tuple[Topology, dict[int, str]]:
    stages = draw(st.integers(1, max_workers))
    replicas = draw(st.integers(1, max_workers // stages))
    top = Topology(stages, replicas)
    nodes = [f"node{i}" for i in range(draw(st.integers(1, 4)))]
    if draw(st.booleans()):
        return top, place(top, nodes)
    return top, {r: draw(st.sampled_from(nodes)) for r in range(top.world_size)}


@settings(max_examples=120, deadline=None)
@given(layouts())
def test_buddy_ring_is_a_permutation_ring_and_optimal(
    case: tuple[Topology, dict[int, str]],
) -> None:
    top, node_of = case
    n = top.world_size
    ring = list(buddy_ring(top, node_of))
    assert sorted(ring) == list(range(n))  # every rank once: one cycle through everyone
    mapping = buddies(top, node_of)
    assert sorted(mapping.values()) == list(range(n))  # each holder holds exactly one ward
    assert all(buddy_of(r, top, node_of) == mapping[r] for r in range(n))
    if n > 1:
        assert all(mapping[r] != r for r in range(n))
        assert ring_score(top, node_of, ring) == brute_force_score(top, node_of)
    if len(set(node_of.values())) == 1:
        assert all(mapping[r] == (r + 1) % n for r in range(n))  # one node: the next rank
    # deterministic, whatever the mapping's order
    assert buddy_ring(top, dict(reversed(list(node_of.items())))) == tuple(ring)


@settings(max_examples=60, deadline=None)
@given(st.integers(3, 6), st.integers(1, 6), st.integers(2, 6))
def test_buddies_are_on_another_node_and_another_stage_when_nodes_allow(
    stages: int, replicas: int, num_nodes: int
) -> None:
    top = Topology(stages, replicas)
    node_of = place(top, [f"node{i}" for i in range(num_nodes)])
    loads = [list(node_of.values()).count(n) for n in set(node_of.values())]
    mapping = buddies(top, node_of)
    same_stage = [r for r, b in mapping.items() if top.worker(r).stage == top.worker(b).stage]
    assert same_stage == []  # a stage group's loss never takes its own snapshots
    same_node = [r for r, b in mapping.items() if node_of[r] == node_of[b]]
    if len(loads) >= 2:  # the job spans >= 2 nodes: the fewest same-node buddies possible
        assert len(same_node) == max(0, 2 * max(loads) - top.world_size)


def test_two_stages_on_two_nodes_keep_stages_apart() -> None:
    # Nodes and stages cannot both alternate around a ring here. A single node loss is
    # repaired by replica_copy; rollback needs a whole stage group gone, so stages win.
    top = Topology(2, 2)
    node_of = place(top, ["a", "b"])
    mapping = buddies(top, node_of)
    assert all(top.worker(r).stage != top.worker(b).stage for r, b in mapping.items())
    # with one pipeline per node and no replicas (R=1), nodes are what matter
    top1 = Topology(4, 1)
    spread = {0: "a", 1: "b", 2: "a", 3: "b"}
    assert all(spread[r] != spread[b] for r, b in buddies(top1, spread).items())


def test_buddy_of_rejects_bad_input() -> None:
    top = Topology(2, 2)
    with pytest.raises(ValueError, match=r"no node for ranks \[3\]"):
        buddy_of(0, top, {0: "a", 1: "a", 2: "b"})
    with pytest.raises(ValueError, match="rank 4 outside"):
        buddy_of(4, top, place(top, ["a"]))


# -- peer tier: holding and rolling back --------------------------------------------------


def test_peer_snapshots_keep_a_bounded_number_of_steps() -> None:
    held = PeerSnapshots(keep=2)
    packs = {s: pack_state(ws(*trained(0, steps=1), s)) for s in (10, 20, 30)}
    held.put(10, 0, packs[10])
    held.put(10, 1, packs[10])
    held.put(20, 0, packs[20])
    assert held.steps() == [20, 10] and held.steps(rank=1) == [10]
    assert held.nbytes() == 3 * packs[10].nbytes
    assert held.put(30, 0, packs[30]) == [10]  # the oldest goes
    assert held.holdings() == {0: frozenset({20, 30})}
    with pytest.raises(ValueError, match="older than every held step"):
        held.put(10, 0, packs[10])
    with pytest.raises(ValueError, match="of step 30, not 40"):
        held.put(40, 0, packs[30])
    with pytest.raises(KeyError, match="no peer snapshot of rank 1 at step 20"):
        held.get(20, 1)
    assert held.get(30, 0) is packs[30]
    assert held.discard_after(20) == [30] and held.drop_before(30) == [20]
    assert held.nbytes() == 0 and held.steps() == []


def brute_force_rollback(
    alive: set[int],
    held: Mapping[int, Mapping[int, set[int]]],
    own: Mapping[int, set[int]],
    world_size: int,
    max_step: int,
) -> int | None:
    def survives(rank: int, step: int) -> bool:
        if rank in alive and step in own.get(rank, set()):
            return True
        return any(
            step in wards.get(rank, set()) for holder, wards in held.items() if holder in alive
        )

    good = [s for s in range(max_step + 1) if all(survives(r, s) for r in range(world_size))]
    return max(good, default=None)


@st.composite
def holdings(draw: st.DrawFn) -> tuple[set[int], dict, dict, int]:
    world = draw(st.integers(1, 6))
    ranks = st.integers(0, world - 1)
    steps = st.sets(st.integers(0, 5), max_size=3)
    alive = draw(st.sets(ranks))
    own = {r: draw(steps) for r in draw(st.sets(ranks))}
    held = {h: draw(st.dictionaries(ranks, steps, max_size=3)) for h in draw(st.sets(ranks))}
    return alive, held, own, world


@settings(max_examples=200, deadline=None)
@given(holdings())
def test_peer_rollback_step_matches_brute_force(case: tuple[set[int], dict, dict, int]) -> None:
    alive, held, own, world = case
    assert peer_rollback_step(alive, held, own, world) == brute_force_rollback(
        alive, held, own, world, max_step=5
    )


def test_peer_rollback_step_rejects_unknown_ranks() -> None:
    with pytest.raises(ValueError, match=r"ranks \[4\] outside a job of 4"):
        peer_rollback_step({0, 4}, {}, {}, 4)
    with pytest.raises(ValueError, match="world_size"):
        peer_rollback_step(set(), {}, {}, 0)


def test_a_ring_of_peer_snapshots_rolls_everyone_back_exactly() -> None:
    """Snapshots at 10 and 20 everywhere, the one at 30 half taken; then two workers of
    stage 0 die (the whole stage group): everyone returns to step 20 bit for bit."""
    top = Topology(2, 2)
    node_of = place(top, ["a", "b"])
    mapping = buddies(top, node_of)
    workers = {r: make_worker(r) for r in range(top.world_size)}
    stores = {r: PeerSnapshots() for r in range(top.world_size)}
    expected: dict[int, dict[str, object]] = {}
    for step in (10, 20, 30):
        for rank, (module, optimizer) in workers.items():
            train(module, optimizer, 10, seed=rank * 1000 + step)
            packed = pack_state(ws(module, optimizer, step))
            stores[rank].put(step, rank, packed)  # its own copy
            if step < 30 or rank in (0, 1):  # the exchange of step 30 is cut short
                stores[mapping[rank]].put(step, rank, packed)  # its buddy's copy
            if step == 20:
                expected[rank] = state_copy(module, optimizer)
    dead = set(top.stage_group(0))
    alive = set(workers) - dead
    own = {r: set(stores[r].steps(rank=r)) for r in alive}
    held = {h: {w: set(s) for w, s in stores[h].holdings().items() if w != h} for h in alive}
    step = peer_rollback_step(alive, held, own, top.world_size)
    assert step == 20
    for rank in workers:
        if rank in alive:
            source = stores[rank].get(step, rank)
        else:  # a replacement gets it from the live buddy
            assert mapping[rank] in alive
            source = stores[mapping[rank]].get(step, rank)
        module, optimizer = make_worker(1000 + rank)
        assert unpack_state(source, ws(module, optimizer)).step == 20
        assert_same(expected[rank], state_copy(module, optimizer))
    for s in stores.values():
        s.discard_after(step)
        assert max(s.steps(), default=0) <= 20
