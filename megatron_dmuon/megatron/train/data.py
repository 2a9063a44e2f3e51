"""Token data of the main job: train windows and a held-out validation split.

The corpus is the Python standard library's source as bytes, every ``.py`` file under its
directory (its packages and tests included, site-/dist-packages not: ~31 MB on Python 3.11), on
every machine; or a Megatron indexed dataset (``--data-path PREFIX``). (The top-level modules alone
are 4.7 MB: 800 iterations of 16k tokens went through them 2.8 times, and the validation loss then
measured memorization more than optimization; docs/quality.md.) ``--split`` cuts it as Megatron-LM's flag does, by
weight: ``95,5`` keeps the last 5% apart for validation (for the stdlib bytes: the files last in
name order; for an indexed dataset: its last documents, at least one). Training draws random
windows from the train part only; validation reads fixed, evenly spaced windows of the held-out
part, the same ones at every evaluation, so validation losses compare across runs and optimizers.
"""
from __future__ import annotations

import functools
import glob
import math
import os
import sysconfig

import numpy as np
import torch


def parse_split(text: str) -> tuple[float, float]:
    """``'95,5'`` or ``'969,30,1'`` (Megatron's train,valid[,test] weights) -> (train, valid) shares.
    The test share is held out and never read. ValueError names the flag."""
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise ValueError(f"--split {text!r}: give 2 or 3 comma-separated weights, e.g. 95,5") from None
    if len(weights) not in (2, 3) or any(not 0 <= w < math.inf for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {text!r}: give 2 or 3 finite non-negative weights (train,valid[,test]) with a "
                         "positive sum, e.g. 95,5")
    if weights[0] <= 0:
        raise ValueError(f"--split {text!r}: the train weight must be > 0")
    total = sum(weights)
    return weights[0] / total, weights[1] / total


def stdlib_files() -> list:
    return list(_stdlib_files())


@functools.lru_cache(maxsize=None)
def _stdlib_files() -> tuple:
    """Listed once per process: every rank's start-up checks (the split's size) and its data read
    it (the recursive glob costs ~0.5 s of CPU, paid by each rank of every run)."""
    root = sysconfig.get_paths()["stdlib"]
    return tuple(sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                        if "site-packages" not in f and "dist-packages" not in f))


def train_split_problem(args):
    """Why the default data's train split is too short for one window (None: long enough), from the
    files' sizes alone: the start-up checks run it without reading the corpus."""
    train_share, valid_share = parse_split(args.split)
    total = sum(os.path.getsize(f) for f in stdlib_files())
    n_train = int(total * train_share) if valid_share else total
    if n_train < args.seq_length + 2:
        return (f"the train split has {n_train} tokens; need more than --seq-length {args.seq_length} (lower "
                "--seq-length, or give more data / a larger train weight in --split)")
    return None


def stdlib_bytes() -> torch.Tensor:
    """The corpus as a uint8 tensor (windows are widened to int64 when they are cut)."""
    data = b"".join(open(f, "rb").read() for f in stdlib_files())
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def check_indexed_dataset(prefix: str) -> None:
    """The .bin/.idx pair exists, the index reads, and the .bin holds every token the index lists."""
    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise ValueError(f"--data-path {prefix}: {prefix + ext} does not exist")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    class Checked(IndexedDataset):
        def __del__(self):  # Megatron's __del__ fails on an object whose index did not read (a stray report)
            if hasattr(self, "index"):
                super().__del__()

    try:
        ds = Checked(prefix)
    except Exception as e:  # noqa: BLE001 - any reader failure is an unreadable index
        raise ValueError(f"--data-path {prefix}: cannot read {prefix}.idx ({type(e).__name__}: {e})") from None
    index = ds.index
    if not np.issubdtype(index.dtype, np.integer):
        raise ValueError(f"--data-path {prefix}: {prefix}.idx says its tokens are {np.dtype(index.dtype).name}, not "
                         "integer token ids: preprocess the data into an integer-token indexed dataset")
    if len(index.sequence_lengths) == 0:
        raise ValueError(f"--data-path {prefix}: {prefix}.idx lists no documents")
    need = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size
    have = os.path.getsize(prefix + ".bin")
    if have < need:
        raise ValueError(f"--data-path {prefix}: {prefix}.bin is truncated ({have} bytes; {prefix}.idx needs {need})")


def _split_tokens(args) -> tuple[torch.Tensor, torch.Tensor]:
    """(train tokens, validation tokens) of the corpus the flags name."""
    train_share, valid_share = parse_split(args.split)
    if args.data_path:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        ds = IndexedDataset(args.data_path)
        docs = [torch.from_numpy(ds[i].astype("int64")) for i in range(len(ds))]
        n_valid = 0 if valid_share == 0 else min(len(docs) - 1, max(1, round(len(docs) * valid_share)))
        n_train = max(1, round(len(docs) * train_share)) if valid_share else len(docs)
        n_train = min(n_train, len(docs) - n_valid)
        train = torch.cat(docs[:n_train])
        valid = torch.cat(docs[len(docs) - n_valid:]) if n_valid else train[:0]
        top = max(int(train.max()), int(valid.max()) if valid.numel() else -1)  # (int64 windows)
        if top >= args.vocab_size:
            raise ValueError(f"--vocab-size {args.vocab_size} is smaller than the dataset's max token id {top}; "
                             "raise --vocab-size")
        low = min(int(train.min()), int(valid.min()) if valid.numel() else 0)
        if low < 0:
            raise ValueError(f"--data-path {args.data_path}: the dataset holds a negative token id ({low}); token "
                             "ids must be in [0, --vocab-size): preprocess the data again")
        return train, valid
    if args.vocab_size < 256:
        raise ValueError("--vocab-size must be >= 256 for the byte-level default data")
    tokens = stdlib_bytes()
    n_valid = int(tokens.numel() * valid_share)
    n_train = int(tokens.numel() * train_share) if valid_share else tokens.numel()
    return tokens[:n_train], tokens[tokens.numel() - n_valid:]


class TokenSource:
    """Random (seq+1)-token train windows, deterministic per (iteration, rank, micro-batch), and
    fixed validation windows."""

    def __init__(self, args):
        self.seq = args.seq_length
        self.tokens, self.valid_tokens = _split_tokens(args)
        if self.tokens.numel() < self.seq + 2:
            raise ValueError(f"the train split has {self.tokens.numel()} tokens; need more than --seq-length "
                             f"{self.seq} (lower --seq-length, or give more data / a larger train weight in --split)")
        self.seed = args.seed

    def batch(self, it, rank, micro, mbs):
        g = torch.Generator().manual_seed(self.seed * 7919 + it * 104729 + rank * 1299709 + micro)
        starts = torch.randint(0, self.tokens.numel() - self.seq - 1, (mbs,), generator=g)
        return torch.stack([self.tokens[s:s + self.seq + 1] for s in starts.tolist()]).long()

    def has_validation(self) -> bool:
        return self.valid_tokens.numel() >= self.seq + 1

    def validation_batches(self, count: int, batch_size: int) -> list:
        """``count`` batches of ``batch_size`` windows spread evenly over the held-out tokens (the
        whole validation set; windows overlap when it is small). The same on every call."""
        span = self.valid_tokens.numel() - self.seq - 1
        total = count * batch_size
        starts = [0 if total == 1 else round(i * span / (total - 1)) for i in range(total)]
        windows = torch.stack([self.valid_tokens[s:s + self.seq + 1] for s in starts]).long()
        return list(windows.split(batch_size))


_SOURCES = {}


def token_source(args) -> TokenSource:
    """The run's data (read once per process: the checks and the job share it)."""
    key = (args.data_path, args.split, args.seq_length, args.vocab_size, args.seed)
    if key not in _SOURCES:
        _SOURCES[key] = TokenSource(args)
    return _SOURCES[key]
