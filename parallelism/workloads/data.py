"""Real, deterministic language-model data for the built-in workloads.

`TokenCorpus` is a token stream split into a training part and a held-out validation
part: by default the Python standard library's own ``.py`` sources read as bytes (present
on every machine, so a job needs no download), or a user's file (text, nanoGPT ``.bin``
or ``.npy``). `LMBatches` draws language-model batches from it as a pure function of
``(step, replica, microbatch)``, which is what lets recovery re-run a step with exactly
the same data: the data cursor is just the step number.

[Note: shipping a corpus to workers]
Workers receive the corpus by pickle, once per worker process. Pickling it sends only a
recipe (where the tokens come from and with which arguments) and the fingerprint of the
tokens; the receiving process rebuilds the tokens on first use, keeps them in a
per-process cache keyed by fingerprint (so the many objects that refer to one corpus
share one copy), and checks the fingerprint, so two machines whose files differ can never
silently train on different data.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from parallelism.checks import check_fraction, check_index, check_positive_int

_SPLITS = {"train": 0, "val": 1}
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

# Tokens already loaded in this process, by fingerprint: (train, val).
_LOADED: dict[str, tuple[np.ndarray, np.ndarray]] = {}
_LOADED_LOCK = threading.Lock()


class TokenCorpus:
    """Tokens for language modelling, split into train and held-out validation parts.

    Build one with `TokenCorpus.stdlib` or `TokenCorpus.from_path`. ``train`` and ``val``
    are read-only 1-D integer arrays (``uint8`` for byte-level text, ``uint16`` for a
    ``.bin`` file, the file's dtype for ``.npy``); every id is in ``0..vocab_size-1``.
    Pickling is cheap (see [Note: shipping a corpus to workers]).
    """

    def __init__(
        self,
        recipe: tuple[str, dict[str, Any]],
        *,
        train: np.ndarray,
        val: np.ndarray,
        vocab_size: int,
        source: str,
    ) -> None:
        # Private: use the classmethods. ``recipe`` = (loader name in _LOADERS, its kwargs).
        self._recipe = recipe
        self.vocab_size = vocab_size
        self.source = source
        self.fingerprint = _fingerprint(train, val, vocab_size)
        with _LOADED_LOCK:
            _LOADED.setdefault(self.fingerprint, (train, val))

    # -- construction ------------------------------------------------------------------

    @classmethod
    def stdlib(cls, max_bytes: int = 8_000_000, val_fraction: float = 0.05) -> TokenCorpus:
        """Byte-level corpus (vocab 256) of the Python standard library's ``.py`` sources.

        Files are taken in sorted order of their path relative to the standard library
        (``site-packages``/``dist-packages`` excluded), joined by ``b"\\n"``, up to
        ``max_bytes`` in all. Validation is whole files, evenly spaced in that order
        (with 0.05, every 20th file), so train and validation never share a file.

        Raises:
            ValueError: if ``max_bytes`` is not a positive integer, ``val_fraction`` is
                not in (0, 1), or too few files are selected to give both parts.
        """
        check_positive_int("max_bytes", max_bytes)
        check_fraction("val_fraction", val_fraction, open_low=True, open_high=True)
        kwargs: dict[str, Any] = {"max_bytes": max_bytes, "val_fraction": val_fraction}
        return cls(("stdlib", kwargs), **_load_stdlib(max_bytes, val_fraction))

    @classmethod
    def from_path(
        cls,
        path: str | os.PathLike[str],
        val_fraction: float = 0.05,
        vocab_size: int | None = None,
    ) -> TokenCorpus:
        """Tokens from a user's file or directory; validation is the last ``val_fraction``.

        - ``.bin``: ``uint16`` token ids (nanoGPT's format);
        - ``.npy``: a 1-D integer array of token ids;
        - a directory: every ``*.txt`` file in it (not recursive), sorted, joined by
          ``b"\\n"``, as bytes;
        - anything else: the file's bytes (vocabulary 256).

        ``vocab_size`` defaults to 256 for bytes and to the largest id + 1 otherwise; pass
        the model's vocabulary size when the data may not use its last ids. A relative
        path is kept relative, so that it resolves against each worker's working
        directory (``ray job submit --working-dir``).

        Raises:
            ValueError: if the path does not exist, the data is empty or too small to give
                both parts, or an id is negative or ``>= vocab_size``.
        """
        check_fraction("val_fraction", val_fraction, open_low=True, open_high=True)
        if vocab_size is not None:
            check_positive_int("vocab_size", vocab_size)
        kwargs: dict[str, Any] = {
            "path": os.fspath(path),
            "val_fraction": val_fraction,
            "vocab_size": vocab_size,
        }
        return cls(("path", kwargs), **_load_path(**kwargs))

    # -- tokens (loaded lazily after unpickling) ---------------------------------------

    @property
    def train(self) -> np.ndarray:
        """Training tokens, 1-D."""
        return self._tokens()[0]

    @property
    def val(self) -> np.ndarray:
        """Validation tokens, 1-D."""
        return self._tokens()[1]

    def _tokens(self) -> tuple[np.ndarray, np.ndarray]:
        tokens = _LOADED.get(self.fingerprint)
        if tokens is not None:
            return tokens
        with _LOADED_LOCK:
            tokens = _LOADED.get(self.fingerprint)
            if tokens is None:
                tokens = self._reload()
                _LOADED[self.fingerprint] = tokens
        return tokens

    def _reload(self) -> tuple[np.ndarray, np.ndarray]:
        kind, kwargs = self._recipe
        try:
            loaded = _LOADERS[kind](**kwargs)
        except ValueError as err:
            raise RuntimeError(
                f"cannot rebuild the token corpus ({self.source}) in this process: {err}. "
                "Pass a data file that is present at the same path on every node."
            ) from err
        train, val = loaded["train"], loaded["val"]
        found = _fingerprint(train, val, loaded["vocab_size"])
        if found != self.fingerprint:
            raise RuntimeError(
                f"the token data differs between machines: this process built {self.source} "
                f"with fingerprint {found[:16]}, but the corpus was created with "
                f"{self.fingerprint[:16]} (a different Python standard library, or a data file "
                "that differs between nodes). Pass a data file that is identical on every "
                "node (TokenCorpus.from_path)."
            )
        return train, val

    # -- pickling ------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {
            "recipe": self._recipe,
            "vocab_size": self.vocab_size,
            "source": self.source,
            "fingerprint": self.fingerprint,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._recipe = state["recipe"]
        self.vocab_size = state["vocab_size"]
        self.source = state["source"]
        self.fingerprint = state["fingerprint"]

    def __repr__(self) -> str:
        return (
            f"TokenCorpus({self.source}, vocab_size={self.vocab_size}, "
            f"fingerprint={self.fingerprint[:12]})"
        )


class LMBatches:
    """Deterministic language-model batches: a pure function of (step, replica, microbatch).

    Every microbatch is ``microbatch_size`` windows of ``seq_len + 1`` tokens at random
    offsets, drawn from a generator seeded by ``(seed, split, step, replica, microbatch)``
    alone -- never from a stream whose state depends on what was drawn before -- so a step
    re-run after a failure sees exactly the data it saw the first time. Inputs are the
    first ``seq_len`` tokens of each window, targets the last ``seq_len``.

    Raises:
        ValueError: if a size is not a positive integer, ``seed`` is negative, or a window
            of ``seq_len + 1`` tokens does not fit in the train or validation part.
    """

    def __init__(
        self,
        corpus: TokenCorpus,
        *,
        seq_len: int,
        microbatch_size: int,
        microbatches: int,
        seed: int = 0,
    ) -> None:
        for name, value in (
            ("seq_len", seq_len),
            ("microbatch_size", microbatch_size),
            ("microbatches", microbatches),
        ):
            check_positive_int(name, value)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        for split, tokens in (("train", corpus.train), ("val", corpus.val)):
            if seq_len + 1 > len(tokens):
                raise ValueError(
                    f"seq_len + 1 = {seq_len + 1} tokens do not fit in the {split} part of "
                    f"{corpus.source} ({len(tokens)} tokens); use a shorter seq_len or more data"
                )
        self.corpus = corpus
        self.seq_len = seq_len
        self.microbatch_size = microbatch_size
        self.microbatches = microbatches
        self.seed = seed

    def microbatch(
        self, step: int, replica: int, microbatch: int, *, split: str = "train"
    ) -> tuple[Tensor, Tensor]:
        """One microbatch: ``(inputs, targets)``, each ``[microbatch_size, seq_len]`` int64.

        Raises:
            ValueError: if ``split`` is not ``"train"`` or ``"val"``, ``step`` or
                ``replica`` is negative, or ``microbatch`` is outside
                ``0..microbatches-1``.
        """
        if split not in _SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        check_index("step", step)
        check_index("replica", replica)
        check_index("microbatch", microbatch, self.microbatches)
        tokens = self.corpus.train if split == "train" else self.corpus.val
        key = [self.seed, _SPLITS[split], int(step), int(replica), int(microbatch)]
        rng = np.random.default_rng(np.random.SeedSequence(key))
        starts = rng.integers(0, len(tokens) - self.seq_len, size=self.microbatch_size)
        windows = tokens[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int64)
        return (
            torch.from_numpy(np.ascontiguousarray(windows[:, :-1])),
            torch.from_numpy(np.ascontiguousarray(windows[:, 1:])),
        )

    def __call__(self, step: int, replica: int, num_replicas: int) -> tuple[Tensor, Tensor]:
        """The replica's batch for ``step``: its microbatches concatenated along dim 0.

        Shape ``[microbatches * microbatch_size, seq_len]``; ``torch.chunk(x, microbatches)``
        gives the microbatches back. The batch does not depend on ``num_replicas``, which
        is only checked.

        Raises:
            ValueError: if ``replica`` is outside ``0..num_replicas-1`` or ``step`` is
                negative.
        """
        return self._batch(step, replica, num_replicas, "train")

    def validation(self, index: int, replica: int, num_replicas: int) -> tuple[Tensor, Tensor]:
        """Validation batch ``index`` of a replica, drawn from the held-out part.

        Raises:
            ValueError: if ``replica`` is outside ``0..num_replicas-1`` or ``index`` is
                negative.
        """
        return self._batch(index, replica, num_replicas, "val")

    def _batch(
        self, step: int, replica: int, num_replicas: int, split: str
    ) -> tuple[Tensor, Tensor]:
        check_positive_int("num_replicas", num_replicas)
        check_index("replica", replica, num_replicas)
        parts = [self.microbatch(step, replica, mb, split=split) for mb in range(self.microbatches)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def __repr__(self) -> str:
        return (
            f"LMBatches({self.corpus!r}, seq_len={self.seq_len}, "
            f"microbatch_size={self.microbatch_size}, microbatches={self.microbatches}, "
            f"seed={self.seed})"
        )


# ---- loaders (each returns the keyword arguments of TokenCorpus.__init__ but recipe) -----


def _stdlib_files() -> tuple[Path, list[str]]:
    """The standard library directory and its ``.py`` files, relative, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        rel = Path(dirpath).relative_to(root)
        found.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    return root, sorted(found)


def _select_stdlib(max_bytes: int, val_fraction: float) -> tuple[list[bytes], list[bytes], int]:
    """Contents of the train files and the validation files, and how many files were read."""
    root, files = _stdlib_files()
    train: list[bytes] = []
    val: list[bytes] = []
    budget = max_bytes
    count = 0
    for index, name in enumerate(files):
        if budget <= 0:
            break
        data = (root / name).read_bytes()[:budget]
        budget -= len(data) + 1  # +1: the separator
        # Evenly spaced: file i is held out when the running share of held-out files
        # would otherwise fall below val_fraction.
        is_val = math.floor((index + 1) * val_fraction) > math.floor(index * val_fraction)
        (val if is_val else train).append(data)
        count += 1
    return train, val, count


def _load_stdlib(max_bytes: int, val_fraction: float) -> dict[str, Any]:
    train_files, val_files, count = _select_stdlib(max_bytes, val_fraction)
    root = sysconfig.get_paths()["stdlib"]
    if not val_files or not train_files:
        raise ValueError(
            f"max_bytes={max_bytes} selects {count} standard library files, too few to hold "
            f"out a val_fraction={val_fraction} of them; raise max_bytes or val_fraction"
        )
    train = np.frombuffer(b"\n".join(train_files), dtype=np.uint8)
    val = np.frombuffer(b"\n".join(val_files), dtype=np.uint8)
    return {
        "train": train,
        "val": val,
        "vocab_size": 256,
        "source": f"Python standard library sources at {root} ({count} files, "
        f"{len(train) + len(val)} bytes)",
    }


def _load_path(path: str, val_fraction: float, vocab_size: int | None) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data file {path} does not exist (resolved to {p.absolute()})")
    tokens: np.ndarray
    if p.is_dir():
        texts = sorted(p.glob("*.txt"))
        if not texts:
            raise ValueError(f"data directory {path} holds no *.txt files")
        tokens = np.frombuffer(b"\n".join(t.read_bytes() for t in texts), dtype=np.uint8)
        kind, default_vocab = f"{len(texts)} text files in {path}", 256
    elif p.suffix == ".bin":
        if p.stat().st_size % 2:
            raise ValueError(
                f"data file {path} has an odd number of bytes; a .bin file holds uint16 token ids"
            )
        tokens = (
            np.asarray(np.memmap(p, dtype=np.uint16, mode="r"))
            if p.stat().st_size
            else np.zeros(0, dtype=np.uint16)
        )
        kind, default_vocab = f"uint16 token file {path}", None
    elif p.suffix == ".npy":
        tokens = np.asarray(np.load(p, mmap_mode="r", allow_pickle=False))
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(
                f"data file {path} holds a {tokens.dtype} array of shape {tokens.shape}; "
                "expected a 1-D integer array of token ids"
            )
        kind, default_vocab = f"token array {path}", None
    else:
        tokens = np.frombuffer(p.read_bytes(), dtype=np.uint8)
        kind, default_vocab = f"text file {path}", 256
    if len(tokens) == 0:
        raise ValueError(f"data file {path} is empty")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0:
        raise ValueError(f"data file {path} holds a negative token id ({low})")
    vocab = vocab_size if vocab_size is not None else (default_vocab or high + 1)
    if high >= vocab:
        raise ValueError(
            f"data file {path} holds token id {high}, outside the vocabulary of size {vocab}; "
            "pass a larger vocab_size"
        )
    n_val = max(1, round(len(tokens) * val_fraction))
    n_train = len(tokens) - n_val
    if n_train < 2 or n_val < 2:
        raise ValueError(
            f"data file {path} has only {len(tokens)} tokens, too few for a train part and a "
            f"val_fraction={val_fraction} validation part of at least 2 tokens each"
        )
    return {
        "train": tokens[:n_train],
        "val": tokens[n_train:],
        "vocab_size": vocab,
        "source": f"{kind} ({len(tokens)} tokens)",
    }


_LOADERS: dict[str, Callable[..., dict[str, Any]]] = {"stdlib": _load_stdlib, "path": _load_path}


def _fingerprint(train: np.ndarray, val: np.ndarray, vocab_size: int) -> str:
    digest = hashlib.sha256()
    header = f"checkfree-tokens/v1 vocab={vocab_size} dtype={train.dtype.str} "
    digest.update(f"{header}train={len(train)} val={len(val)}\n".encode())
    for part in (train, val):
        digest.update(np.ascontiguousarray(part).data)
    return digest.hexdigest()
