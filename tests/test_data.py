"""Tests of the deterministic language-model data in `parallelism.workloads.data`."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import parallelism.workloads.data as data_module
from parallelism.workloads.data import LMBatches, TokenCorpus


@pytest.fixture(scope="module")
def stdlib() -> TokenCorpus:
    return TokenCorpus.stdlib(max_bytes=2_000_000)


@pytest.fixture
def text_corpus(tmp_path: Path) -> TokenCorpus:
    path = tmp_path / "story.txt"
    path.write_bytes(bytes(range(256)) * 40)
    return TokenCorpus.from_path(path, val_fraction=0.25)


def _batches(corpus: TokenCorpus, **kwargs: int) -> LMBatches:
    args = {"seq_len": 16, "microbatch_size": 3, "microbatches": 4, "seed": 0, **kwargs}
    return LMBatches(corpus, **args)


def _forget_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process look like a fresh worker that has loaded no corpus yet."""
    monkeypatch.setattr(data_module, "_LOADED", {})


# ---- the standard-library corpus --------------------------------------------------------


def test_stdlib_corpus_is_bytes_within_budget(stdlib: TokenCorpus) -> None:
    assert stdlib.vocab_size == 256
    assert stdlib.train.dtype == np.uint8 and stdlib.train.ndim == 1
    assert len(stdlib.train) + len(stdlib.val) <= 2_000_000
    assert len(stdlib.train) > 1_500_000
    assert 0.01 < len(stdlib.val) / len(stdlib.train) < 0.2
    assert len(stdlib.fingerprint) == 64
    assert "standard library" in stdlib.source


def test_stdlib_validation_is_whole_files_disjoint_from_training() -> None:
    train_files, val_files, count = data_module._select_stdlib(2_000_000, 0.05)
    corpus = TokenCorpus.stdlib(max_bytes=2_000_000, val_fraction=0.05)
    assert len(train_files) + len(val_files) == count
    assert len(val_files) == count // 20  # every 20th file
    assert bytes(corpus.val) == b"\n".join(val_files)
    assert bytes(corpus.train) == b"\n".join(train_files)
    # The file lists never include installed packages.
    _, names = data_module._stdlib_files()
    assert names == sorted(names)
    assert not any("site-packages" in n or "dist-packages" in n for n in names)


def test_stdlib_rejects_too_small_budget_and_bad_fraction() -> None:
    with pytest.raises(ValueError, match="too few to hold out"):
        TokenCorpus.stdlib(max_bytes=100)
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\), got 1.5"):
        TokenCorpus.stdlib(val_fraction=1.5)
    with pytest.raises(ValueError, match="max_bytes must be a positive integer"):
        TokenCorpus.stdlib(max_bytes=0)


# ---- user files --------------------------------------------------------------------------


def test_from_text_file_is_bytes_split_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "notes.md"
    payload = b"hello world, " * 100
    path.write_bytes(payload)
    corpus = TokenCorpus.from_path(path, val_fraction=0.1)
    assert corpus.vocab_size == 256
    assert len(corpus.val) == 130
    assert bytes(corpus.train) + bytes(corpus.val) == payload


def test_from_bin_file_is_uint16_tokens(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.uint16) * 50
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    corpus = TokenCorpus.from_path(path, val_fraction=0.1)
    assert corpus.train.dtype == np.uint16
    assert corpus.vocab_size == 49951  # largest id + 1
    assert np.array_equal(np.concatenate([corpus.train, corpus.val]), tokens)
    assert TokenCorpus.from_path(path, vocab_size=50257).vocab_size == 50257
    with pytest.raises(ValueError, match="token id 49950, outside the vocabulary of size 1000"):
        TokenCorpus.from_path(path, vocab_size=1000)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(ValueError, match="odd number of bytes"):
        TokenCorpus.from_path(odd)


def test_from_npy_file(tmp_path: Path) -> None:
    tokens = np.arange(200, dtype=np.int32) % 17
    path = tmp_path / "ids.npy"
    np.save(path, tokens)
    corpus = TokenCorpus.from_path(path, val_fraction=0.25)
    assert corpus.vocab_size == 17
    assert np.array_equal(corpus.val, tokens[150:])
    np.save(path, tokens - 1)
    with pytest.raises(ValueError, match=r"negative token id \(-1\)"):
        TokenCorpus.from_path(path)
    np.save(path, tokens.reshape(10, 20))
    with pytest.raises(ValueError, match="expected a 1-D integer array"):
        TokenCorpus.from_path(path)


def test_from_directory_joins_sorted_text_files(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"B" * 50)
    (tmp_path / "a.txt").write_bytes(b"A" * 50)
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    corpus = TokenCorpus.from_path(tmp_path, val_fraction=0.1)
    assert bytes(corpus.train) + bytes(corpus.val) == b"A" * 50 + b"\n" + b"B" * 50
    assert "2 text files" in corpus.source
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"holds no \*\.txt files"):
        TokenCorpus.from_path(empty)


def test_from_path_bad_input(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match=re.escape(f"data file {missing} does not exist")):
        TokenCorpus.from_path(missing)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        TokenCorpus.from_path(empty)
    small = tmp_path / "small.txt"
    small.write_bytes(b"abc")
    with pytest.raises(ValueError, match="only 3 tokens"):
        TokenCorpus.from_path(small)
    big = tmp_path / "big.txt"
    big.write_bytes(b"\xff" * 100)
    with pytest.raises(ValueError, match="token id 255, outside the vocabulary of size 128"):
        TokenCorpus.from_path(big, vocab_size=128)


# ---- batches -----------------------------------------------------------------------------


def test_microbatch_shape_and_shift(stdlib: TokenCorpus) -> None:
    inputs, targets = _batches(stdlib).microbatch(5, 1, 2)
    assert inputs.shape == targets.shape == (3, 16)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.is_contiguous() and targets.is_contiguous()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    # Every row is a real window of the training text.
    text = bytes(stdlib.train)
    for row_in, row_t in zip(inputs, targets, strict=True):
        window = bytes(row_in.tolist()) + bytes(row_t[-1:].tolist())
        assert window in text


def test_batches_are_a_pure_function_of_their_coordinates(stdlib: TokenCorpus) -> None:
    a, b = _batches(stdlib), _batches(stdlib)
    first = a.microbatch(3, 1, 2)
    b.microbatch(0, 0, 0)  # drawing other batches first must not matter
    again = b.microbatch(3, 1, 2)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    for other in [(4, 1, 2), (3, 0, 2), (3, 1, 3)]:
        assert not torch.equal(first[0], a.microbatch(*other)[0])
    assert not torch.equal(first[0], a.microbatch(3, 1, 2, split="val")[0])
    assert not torch.equal(first[0], _batches(stdlib, seed=1).microbatch(3, 1, 2)[0])


def test_call_concatenates_microbatches_in_order(stdlib: TokenCorpus) -> None:
    batches = _batches(stdlib)
    inputs, targets = batches(7, 1, 2)
    assert inputs.shape == (12, 16)
    for mb, (chunk_in, chunk_t) in enumerate(
        zip(torch.chunk(inputs, 4), torch.chunk(targets, 4), strict=True)
    ):
        expected = batches.microbatch(7, 1, mb)
        assert torch.equal(chunk_in, expected[0]) and torch.equal(chunk_t, expected[1])
    # The number of replicas is checked, but a replica's batch does not depend on it.
    assert torch.equal(batches(7, 1, 4)[0], inputs)
    val_in, _ = batches.validation(7, 1, 2)
    assert torch.equal(val_in[:3], batches.microbatch(7, 1, 0, split="val")[0])


def test_validation_batches_come_from_the_held_out_part(tmp_path: Path) -> None:
    # Training ids are 0..9, validation ids 10..19, so a batch shows where it came from.
    tokens = np.concatenate([np.arange(300) % 10, 10 + np.arange(100) % 10])
    np.save(tmp_path / "ids.npy", tokens)
    corpus = TokenCorpus.from_path(tmp_path / "ids.npy", val_fraction=0.25)
    batches = _batches(corpus, seq_len=8)
    val_in, val_t = batches.validation(0, 0, 1)
    assert val_in.shape == (12, 8)
    assert int(torch.cat([val_in, val_t]).min()) >= 10
    train_in, train_t = batches(0, 0, 1)
    assert int(torch.cat([train_in, train_t]).max()) <= 9


def test_batch_argument_checks(stdlib: TokenCorpus, text_corpus: TokenCorpus) -> None:
    batches = _batches(stdlib)
    with pytest.raises(ValueError, match=r"replica must be an integer in \[0, 2\), got 2"):
        batches(0, 2, 2)
    with pytest.raises(ValueError, match="step must be an integer >= 0, got -1"):
        batches(-1, 0, 1)
    with pytest.raises(ValueError, match=r"microbatch must be an integer in \[0, 4\), got 4"):
        batches.microbatch(0, 0, 4)
    with pytest.raises(ValueError, match="split must be 'train' or 'val'"):
        batches.microbatch(0, 0, 0, split="test")
    with pytest.raises(ValueError, match="microbatch_size must be a positive integer"):
        _batches(stdlib, microbatch_size=0)
    with pytest.raises(ValueError, match="do not fit in the val part"):
        _batches(text_corpus, seq_len=len(text_corpus.val))
    # numpy integers are accepted as coordinates
    numpy_step = batches(np.int64(3), 0, 1)  # type: ignore[arg-type]
    assert torch.equal(numpy_step[0], batches(3, 0, 1)[0])


# ---- pickling ----------------------------------------------------------------------------


def test_pickle_is_small_and_gives_equal_batches(
    stdlib: TokenCorpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = _batches(stdlib)
    blob = pickle.dumps(batches)
    assert len(pickle.dumps(stdlib)) < 10_000 and len(blob) < 10_000
    _forget_loaded(monkeypatch)  # the unpickling side must rebuild the tokens itself
    clone = pickle.loads(blob)
    assert clone.corpus.fingerprint == stdlib.fingerprint
    assert torch.equal(clone(9, 1, 2)[0], batches(9, 1, 2)[0])
    assert data_module._LOADED.keys() == {stdlib.fingerprint}


def test_unpickled_corpus_is_cached_per_process(
    text_corpus: TokenCorpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    _forget_loaded(monkeypatch)
    calls = []
    load = data_module._LOADERS["path"]

    def counting(**kwargs: object) -> dict[str, object]:
        calls.append(kwargs)
        return load(**kwargs)

    monkeypatch.setitem(data_module._LOADERS, "path", counting)
    a, b = pickle.loads(pickle.dumps(text_corpus)), pickle.loads(pickle.dumps(text_corpus))
    assert calls == []  # nothing loads until the tokens are used
    assert a.train is b.train
    assert len(calls) == 1


def test_fingerprint_mismatch_raises(stdlib: TokenCorpus, monkeypatch: pytest.MonkeyPatch) -> None:
    blob = pickle.dumps(stdlib)
    _forget_loaded(monkeypatch)
    real = data_module._select_stdlib

    def other_python(max_bytes: int, val_fraction: float) -> tuple[list[bytes], list[bytes], int]:
        train, val, count = real(max_bytes, val_fraction)
        return [b"# patched\n", *train[1:]], val, count

    monkeypatch.setattr(data_module, "_select_stdlib", other_python)
    clone = pickle.loads(blob)
    with pytest.raises(RuntimeError, match=r"differs between machines.*identical on every node"):
        _ = clone.train


def test_missing_file_on_another_machine_raises_runtime_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"some text " * 50)
    blob = pickle.dumps(TokenCorpus.from_path(path))
    path.unlink()
    _forget_loaded(monkeypatch)
    clone = pickle.loads(blob)
    with pytest.raises(
        RuntimeError, match=r"does not exist.*present at the same path on every node"
    ):
        _ = clone.val
