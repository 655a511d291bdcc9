"""Tests of the click-log data in `parallelism.workloads.clicks`: the generator and the Criteo
reader."""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import math
import pickle
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from parallelism.workloads.clicks import ClickBatch, ClickDataset, ClickLogs, criteo, read_criteo
from parallelism.workloads.clicks import cache as click_cache
from parallelism.workloads.dlrm import ShardLayout, roc_auc

ROWS = (500, 300, 100, 20)


def _logs(**kwargs: object) -> ClickLogs:
    args: dict[str, object] = {"dense_features": 3, "batch_size": 64, "microbatches": 2, "seed": 1}
    args.update(kwargs)
    return ClickLogs(ROWS, **args)  # type: ignore[arg-type]


def _equal(a: ClickBatch, b: ClickBatch) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in ((a.dense, b.dense), (a.sparse, b.sparse), (a.labels, b.labels))
    )


# ---- the generator ---------------------------------------------------------------------


def test_batches_are_pure_functions_of_step_replica_microbatch() -> None:
    logs = _logs()
    batch = logs(3, 1, 2)
    assert batch.dense.shape == (128, 3) and batch.sparse.shape == (128, 4)
    assert batch.sparse.dtype == torch.int64 and batch.labels.dtype == torch.float32
    assert _equal(batch, logs(3, 1, 2))
    assert _equal(batch, ClickBatch.cat(logs(3, 1, 2).chunk(2)))
    assert _equal(batch.chunk(2)[1], logs.microbatch(3, 1, 1))
    assert not _equal(batch, logs(3, 0, 2)) and not _equal(batch, logs(4, 1, 2))
    assert not _equal(batch, logs.validation(3, 1, 2))
    revived = pickle.loads(pickle.dumps(logs))
    assert revived._cache is None and _equal(revived(3, 1, 2), batch)
    for t, n in enumerate(ROWS):
        assert int(batch.sparse[:, t].min()) >= 0 and int(batch.sparse[:, t].max()) < n


def test_ids_are_zipf_and_hot_rows_spread_over_shards() -> None:
    logs = _logs(batch_size=4000, microbatches=1)
    ids = logs(0, 0, 1).sparse[:, 0]
    counts = torch.bincount(ids, minlength=ROWS[0]).sort(descending=True).values
    # Zipf(1.05) over 500 ids: the top 1% of ids take roughly a third of the lookups.
    assert 0.2 < float(counts[:5].sum()) / 4000 < 0.5
    assert int((counts > 0).sum()) > 200
    layout = ShardLayout(ROWS, 4)
    share = torch.bincount(layout.owner(0, ids), minlength=4).float() / len(ids)
    assert float(share.min()) > 0.1  # the permutation scatters the hot ids


def test_planted_truth_is_learnable_signal() -> None:
    logs = _logs(signal=2.0)
    heldout = logs.heldout(8000)
    assert _equal(heldout, logs.heldout(8000))
    assert 0.15 < float(heldout.labels.mean()) < 0.45
    assert roc_auc(logs.truth_logits(heldout), heldout.labels) > 0.8
    weak = _logs(signal=0.2).heldout(8000)
    assert roc_auc(_logs(signal=0.2).truth_logits(weak), weak.labels) < 0.6


def test_generator_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"table_rows\[1\]"):
        ClickLogs((5, 0), dense_features=1, batch_size=1)
    with pytest.raises(ValueError, match="zipf_alpha"):
        ClickLogs((5,), dense_features=1, batch_size=1, zipf_alpha=0)
    with pytest.raises(ValueError, match=r"microbatch must be an integer in \[0, 2\)"):
        _logs().microbatch(0, 0, 2)
    with pytest.raises(ValueError, match=r"replica must be an integer in \[0, 2\)"):
        _logs()(0, 2, 2)
    with pytest.raises(ValueError, match="split"):
        _logs().microbatch(0, 0, 0, split="test")


# ---- Criteo ----------------------------------------------------------------------------


def _criteo_line(label: int, dense: list[str], cats: list[str]) -> str:
    return "\t".join([str(label), *dense, *cats])


def test_read_criteo_hash_mode(tmp_path: Path) -> None:
    rows = [1000 + t for t in range(26)]
    lines = [
        _criteo_line(1, [str(i) for i in range(13)], [f"{0xABC0 + t:08x}" for t in range(26)]),
        _criteo_line(0, ["", "-3", *["7"] * 11], ["" for _ in range(26)]),
    ]
    path = tmp_path / "day_0.tsv"
    path.write_text("\n".join(lines) + "\n")
    batch = read_criteo(path, rows)
    assert batch.labels.tolist() == [1.0, 0.0]
    assert batch.dense[0].tolist() == pytest.approx([math.log1p(i) for i in range(13)])
    assert batch.dense[1, :2].tolist() == [0.0, 0.0]  # missing, and negative clamped
    assert batch.sparse[0].tolist() == [(0xABC0 + t) % rows[t] for t in range(26)]
    assert batch.sparse[1].tolist() == [0] * 26
    assert len(read_criteo(path, rows, max_lines=1)) == 1


def test_read_criteo_round_trips_generated_logs_in_index_mode(tmp_path: Path) -> None:
    logs = ClickLogs(ROWS, dense_features=2, batch_size=50, seed=4)
    batch = logs(0, 0, 1)
    path = tmp_path / "clicks.tsv"
    with path.open("w") as f:
        for i in range(len(batch)):
            dense = [str(int(abs(x) * 10)) for x in batch.dense[i].tolist()]
            cats = [str(v) for v in batch.sparse[i].tolist()]
            f.write(_criteo_line(int(batch.labels[i]), dense, cats) + "\n")
    read = read_criteo(path, ROWS, categorical="index", dense_features=2)
    assert torch.equal(read.sparse, batch.sparse)
    assert torch.equal(read.labels, batch.labels)
    dataset = ClickDataset(read, batch_size=8, seed=0, val_fraction=0.2)
    a, b = dataset(5, 1, 2), dataset(5, 1, 2)
    assert _equal(a, b) and len(a) == 8
    held = dataset.heldout(10)
    assert _equal(
        held.chunk(1)[0],
        ClickBatch(dense=read.dense[40:50], sparse=read.sparse[40:50], labels=read.labels[40:50]),
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("1\t2\t3", "3 tab-separated fields, expected 6"),
        ("2\t1\t1\t1\t1\t1", "label '2' is not 0 or 1"),
        ("1\tx\t1\t1\t1\t1", "integer feature I1 = 'x' is not an integer"),
        ("1\t1\t1\tzz\t1\t1", "categorical feature C1 = 'zz' is not hexadecimal"),
    ],
)
def test_read_criteo_names_the_bad_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.tsv"
    path.write_text("1\t1\t1\t1\t1\t1\n" + line + "\n")
    with pytest.raises(ValueError, match=f"{path}:2: {message}"):
        read_criteo(path, (5, 5, 5), dense_features=2)


def test_read_criteo_rejects_ids_out_of_range_anywhere_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ids.tsv"
    good = "1\t4\t0\t1\t2"
    path.write_text("\n".join([good] * 50 + ["0\t1\t0\t1\t9"]) + "\n")  # the last line is bad
    with pytest.raises(
        ValueError, match=r"ids.tsv:51: categorical feature C3 = 9 is outside its table of 3 rows"
    ):
        read_criteo(path, (3, 3, 3), categorical="index", dense_features=1)
    with pytest.raises(ValueError, match="not a decimal row index"):
        path.write_text("1\t4\t0\t1\tff\n")
        read_criteo(path, (3, 3, 3), categorical="index", dense_features=1)
    with pytest.raises(ValueError, match="does not exist"):
        read_criteo(tmp_path / "missing.tsv", (3,))
    with pytest.raises(ValueError, match="categorical must be"):
        read_criteo(path, (3,), categorical="raw")
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds no samples"):
        read_criteo(empty, (3,))


# ---- Criteo at scale: streaming, the cache, shipping a recipe -------------------------

CRITEO_ROWS = [1000 + 37 * t for t in range(26)]


def criteo_file(path: Path, lines: int, seed: int = 0) -> Path:
    """A Criteo-shaped file with the format's corner cases: empty values, negative and
    beyond-int64 integers, ``0x``-prefixed hashes, empty lines, and ``\n`` then ``\r\n``
    line ends."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(lines):
        dense = [str(v) if v != 7 else "" for v in rng.integers(-5, 2000, 13)]
        if i % 97 == 0:
            dense[0] = str(10**25)
        cats = [f"{v:08x}" if v % 11 else "" for v in rng.integers(0, 2**32, 26)]
        if i % 89 == 0:
            cats[3] = "0xABC"
        out.append("\t".join([str(int(rng.integers(0, 2))), *dense, *cats]))
        if i % 101 == 0:
            out.append("")
    text = "\n".join(out[: lines // 2]) + "\r\n" + "\r\n".join(out[lines // 2 :])
    path.write_bytes(text.encode())
    return path


def _batches_digest(dataset: ClickDataset) -> str:
    digest = hashlib.sha256()
    batches = [dataset(step, replica, 2) for step in range(5) for replica in range(2)]
    batches += [dataset.validation(i, 1, 2) for i in range(3)] + [dataset.heldout(37)]
    for b in batches:
        for t in (b.dense, b.sparse, b.labels):
            digest.update(t.numpy().tobytes())
    return digest.hexdigest()


# Digests of the samples and of a fixed set of batches of criteo_file(..., 3000, seed=5),
# computed with the reader this streaming one replaced (Python lists for the whole file).
OLD_SAMPLES = "50f0208d65b5da862ffb59a18ea52d50232e77fd5e77a1137baa086a07e6c9ae"
OLD_BATCHES = "c5121f56af6f9b1956d76954401d4d96e3de91da5f9aa873850c714425299145"


def test_streaming_reader_gives_the_old_readers_samples_and_batches(tmp_path: Path) -> None:
    path = criteo_file(tmp_path / "day.tsv", 3000, seed=5)
    args: dict[str, Any] = {"batch_size": 16, "microbatches": 2, "seed": 3, "val_fraction": 0.1}
    for chunk_lines in (7, 8192):  # chunk boundaries inside the file, and none
        samples = read_criteo(path, CRITEO_ROWS, chunk_lines=chunk_lines)
        digest = hashlib.sha256()
        for t in (samples.dense, samples.sparse, samples.labels):
            digest.update(t.numpy().tobytes())
        assert len(samples) == 3000 and digest.hexdigest() == OLD_SAMPLES
    assert _batches_digest(ClickDataset(samples, **args)) == OLD_BATCHES
    mapped = ClickDataset.from_criteo(path, CRITEO_ROWS, cache_dir=tmp_path / "cache", **args)
    assert _batches_digest(mapped) == OLD_BATCHES
    assert mapped.samples_fingerprint == ClickDataset(samples, **args).samples_fingerprint


def test_parsing_memory_is_bounded_by_the_chunk_not_the_file(tmp_path: Path) -> None:
    chunk = 256
    sample_bytes = 4 + 4 * 13 + 8 * 26
    peaks = []
    for lines in (2000, 8000):
        path = criteo_file(tmp_path / f"{lines}.tsv", lines)
        fmt = criteo.criteo_format(CRITEO_ROWS, "hash", 13, None)
        tracemalloc.start()
        try:
            meta = click_cache.criteo_cache(
                str(path), fmt, str(tmp_path / "cache"), chunk_lines=chunk
            )
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert meta["samples"] == lines
    # Two chunks of arrays (the one written, the one filled), the 1 MiB read to key the
    # cache, and one line's strings; the file's samples as numpy arrays would be 2.1 MB,
    # and as the old reader's Python lists (its peak) 12 MB.
    bound = 2 * chunk * sample_bytes + (1 << 20) + 256 * 1024
    assert peaks[1] < bound < 8000 * sample_bytes, (peaks, bound)
    assert peaks[1] < 1.1 * peaks[0], peaks  # four times the file, the same peak


def test_dataset_pickles_as_a_recipe_and_rebuilds_where_the_cache_is_missing(
    tmp_path: Path,
) -> None:
    sizes = []
    for lines in (500, 5000):
        path = criteo_file(tmp_path / f"{lines}.tsv", lines)
        dataset = ClickDataset.from_criteo(
            path, CRITEO_ROWS, batch_size=8, seed=1, cache_dir=tmp_path / "cache"
        )
        sizes.append(len(pickle.dumps(dataset)))
    assert max(sizes) < 1024 and abs(sizes[1] - sizes[0]) < 8, sizes  # digits of the count
    expected = dataset(4, 1, 2)
    # Another machine: no samples mapped in the process, no cache on its disk.
    click_cache._LOADED.clear()
    (tmp_path / "cache").rename(tmp_path / "elsewhere")
    revived = pickle.loads(pickle.dumps(dataset))
    assert _equal(revived(4, 1, 2), expected)
    assert len(list((tmp_path / "cache" / "criteo").glob("*/meta.json"))) == 1
    # The cache is reused, not parsed again.
    click_cache._LOADED.clear()
    again = ClickDataset.from_criteo(
        path, CRITEO_ROWS, batch_size=8, seed=1, cache_dir=tmp_path / "cache"
    )
    assert again.samples_fingerprint == dataset.samples_fingerprint
    # A machine whose file differs refuses to train on it.
    click_cache._LOADED.clear()
    path.write_bytes(path.read_bytes().replace(b"\n1\t", b"\n0\t", 1))
    with pytest.raises(RuntimeError, match="differs between machines"):
        pickle.loads(pickle.dumps(dataset))(0, 0, 1)
    path.unlink()
    click_cache._LOADED.clear()
    with pytest.raises(RuntimeError, match="present at the same path on every node"):
        pickle.loads(pickle.dumps(dataset))(0, 0, 1)


def test_every_parse_error_names_the_line_and_leaves_no_cache(tmp_path: Path) -> None:
    path = criteo_file(tmp_path / "day.tsv", 1500)
    lines = path.read_bytes().split(b"\n")
    cache = tmp_path / "cache"
    # 1-based line numbers past several chunks of 64 lines; the file has empty lines too.
    for number, bad, message in [
        (1234, lambda line: line[:9] + b"\xff\xfe" + line[11:], "invalid UTF-8 at byte 10"),
        (1400, lambda line: line + b"\t1", "41 tab-separated fields, expected 40"),
        (700, lambda line: b"x" + line[1:], "label 'x' is not 0 or 1"),
        (801, lambda line: line.replace(b"\t", b"\t1.5\t", 1), "41 tab-separated fields"),
        (
            999,
            lambda line: b"\t".join([*line.split(b"\t")[:1], b"1.5", *line.split(b"\t")[2:]]),
            "integer feature I1 = '1.5' is not an integer",
        ),
        (
            60,
            lambda line: b"\t".join([*line.split(b"\t")[:15], b"xyz", *line.split(b"\t")[16:]]),
            "categorical feature C2 = 'xyz' is not hexadecimal",
        ),
    ]:
        broken = list(lines)
        body = broken[number - 1].removesuffix(b"\r")
        broken[number - 1] = bad(body) + broken[number - 1][len(body) :]
        path.write_bytes(b"\n".join(broken))
        where = f"{path}:{number}: {message}"
        with pytest.raises(ValueError, match=where):
            read_criteo(path, CRITEO_ROWS, chunk_lines=64)
        with pytest.raises(ValueError, match=where):
            ClickDataset.from_criteo(path, CRITEO_ROWS, batch_size=4, cache_dir=cache)
        assert {p.suffix for p in (cache / "criteo").iterdir()} == {".lock"}  # no partial cache


def test_concurrent_builders_parse_once_and_a_held_lock_is_a_bounded_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = criteo_file(tmp_path / "day.tsv", 600)
    cache = tmp_path / "cache"
    parses = []
    real = click_cache.criteo_chunks

    def counted(*args: Any) -> Any:
        parses.append(1)
        return real(*args)

    monkeypatch.setattr(click_cache, "criteo_chunks", counted)
    found: list[str] = []

    def build() -> None:
        dataset = ClickDataset.from_criteo(path, CRITEO_ROWS, batch_size=4, cache_dir=cache)
        found.append(dataset.samples_fingerprint)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(found) == 4 and len(set(found)) == 1 and len(parses) == 1
    # A writer that died mid-parse leaves a partial folder; the next writer removes it.
    (key_lock,) = (cache / "criteo").glob("*.lock")
    key = key_lock.name.removesuffix(".lock")
    path.write_bytes(path.read_bytes() + b"\n")  # another mtime and size: another key
    monkeypatch.setattr(click_cache, "_LOCK_WAIT", datetime.timedelta(seconds=0.5))
    new_key = click_cache._cache_key(path, criteo.criteo_format(CRITEO_ROWS, "hash", 13, None))
    assert new_key != key
    (cache / "criteo" / f"{new_key}.partial-dead").mkdir()
    with (cache / "criteo" / f"{new_key}.lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ValueError, match=r"another process has held .* while parsing"):
            ClickDataset.from_criteo(path, CRITEO_ROWS, batch_size=4, cache_dir=cache)
    ClickDataset.from_criteo(path, CRITEO_ROWS, batch_size=4, cache_dir=cache)
    assert not list((cache / "criteo").glob("*.partial-*")) and len(parses) == 2
