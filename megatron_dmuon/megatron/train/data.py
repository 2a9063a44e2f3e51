"""Token data of the main job: train windows and a held-out validation split.

The corpus is the Python standard library's source as bytes, every ``.py`` file under its
directory (its packages and tests included, site-/dist-packages not: ~31 MB on Python 3.11), on
every machine; or a Megatron indexed dataset (``--data-path PREFIX``). (The top-level modules alone
are 4.7 MB: 800 iterations of 16k tokens went through them 2.8 times, and the validation loss then
measured memorization more than optimization; docs/quality.md.) ``--split`` cuts it as Megatron-LM's flag does, by
weight, in order: ``95,5`` keeps the last 5% apart for validation (for the stdlib bytes: the files
last in name order; for an indexed dataset: its last documents, at least one); ``90,5,5`` trains on
the first 90%, validates on the next 5% and never reads the last 5% (the test share). Training draws
random windows from the train part only; validation reads fixed, evenly spaced windows of the
validation part, the same ones at every evaluation, so validation losses compare across runs and
optimizers.

The train windows form one sequence, as Megatron's sampler's: sample k's window is a function of
(--seed, k) alone, and iteration i's global batch is the samples [consumed, consumed + --global-batch-size)
where ``consumed`` counts the samples of the iterations before it; each DP rank takes its slice of
each global batch (Megatron's MegatronPretrainingSampler order). So one rank and two see the same
global batches, and a resume at another DP size or another global batch continues the same sequence.
"""
from __future__ import annotations

import functools
import glob
import math
import os
import sysconfig

import numpy as np
import torch


def parse_split(text: str) -> tuple[float, float, float]:
    """``'95,5'`` or ``'969,30,1'`` (Megatron's train,valid[,test] weights) -> (train, valid, test)
    shares, in that order over the data. The test share is held out and never read. ValueError
    names the flag."""
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
    return weights[0] / total, weights[1] / total, (weights[2] if len(weights) == 3 else 0.0) / total


def split_bounds(size: int, text: str, whole_units: bool = False) -> tuple[range, range]:
    """(train, valid) index ranges of ``size`` tokens (or documents, ``whole_units``) under --split: the
    train share first, then the validation share, then the test share, which is never read. With
    2 weights the validation share ends at the data's end (the last 5% of ``95,5``). Documents: a
    non-zero share gets at least one, and validation leaves the train share at least one."""
    train_share, valid_share, test_share = parse_split(text)
    count = (lambda share: round(size * share)) if whole_units else (lambda share: int(size * share))
    end = size if not test_share else count(train_share + valid_share)
    n_valid = count(valid_share)
    if whole_units and valid_share:
        n_valid = min(max(1, n_valid), end - 1)
    n_valid = max(n_valid, 0)
    n_train = count(train_share) if valid_share or test_share else end
    if whole_units:
        n_train = max(1, n_train)
    n_train = max(0, min(n_train, end - n_valid))
    return range(0, n_train), range(end - n_valid, end)


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
    """Why the default data's split cannot serve the run (None: it can), from the files' sizes alone
    (the start-up checks run it without reading the corpus): the train share must be longer than one
    window, and the validation share must hold one where validation runs (--eval-iters > 0)."""
    total = sum(os.path.getsize(f) for f in stdlib_files())
    train, valid = split_bounds(total, args.split)
    return split_problem(args, len(train), len(valid))


def split_problem(args, n_train: int, n_valid: int):
    """Why train / validation shares of these token counts cannot serve the run, naming the flags."""
    if n_train < args.seq_length + 2:
        return (f"the train split has {n_train} tokens; need more than --seq-length {args.seq_length} (lower "
                "--seq-length, or give more data / a larger train weight in --split)")
    if args.eval_iters and n_valid < args.seq_length + 1:
        return (f"--split {args.split} leaves {n_valid} validation tokens, fewer than one window (--seq-length "
                f"{args.seq_length} + 1), and validation runs (--eval-iters {args.eval_iters}): give the validation "
                "share (the second weight) more data, or pass --eval-iters 0 to train without validation")
    return None


def stdlib_bytes() -> torch.Tensor:
    """The corpus as a uint8 tensor (windows are widened to int64 when they are cut)."""
    data = b"".join(open(f, "rb").read() for f in stdlib_files())
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


DATA_FILE_LIMIT = 1 << 50  # a bound no real .bin reaches (the regular-file check is what matters here)


def check_indexed_dataset(prefix: str) -> None:
    """The .bin/.idx pair exists, the index reads, and the .bin holds exactly the tokens the index lists."""
    if not prefix.strip():
        raise ValueError(f"--data-path {prefix!r} names no dataset: give the prefix of a Megatron indexed dataset "
                         "(PREFIX.bin and PREFIX.idx), or leave --data-path out for the default data")
    from megatron_dmuon.files import check_regular_file

    for ext in (".bin", ".idx"):
        if not os.path.lexists(prefix + ext):
            hint = ""
            if prefix.endswith((".bin", ".idx")) and os.path.isfile(prefix[:-4] + ".bin"):
                hint = f": --data-path takes the prefix without the extension, --data-path {prefix[:-4]}"
            raise ValueError(f"--data-path {prefix}: {prefix + ext} does not exist{hint}")
        # a FIFO, a device, a directory or an empty file named before Megatron's reader maps it (an empty
        # .bin was reported as an unreadable .idx, then by a stray __del__ traceback: [bad-input-5])
        if check_regular_file(prefix + ext, f"--data-path {prefix}:", limit=DATA_FILE_LIMIT) == 0:
            raise ValueError(f"--data-path {prefix}: {prefix + ext} is empty (0 bytes): rebuild the pair with "
                             "Megatron-LM's preprocess tool (tools/preprocess_data.py)")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    class Checked(IndexedDataset):
        def __del__(self):  # Megatron's __del__ fails on an object whose index did not read (a stray report)
            if hasattr(self, "index"):
                super().__del__()

    ds = Checked.__new__(Checked)
    try:
        ds.__init__(prefix)
    except Exception as e:  # noqa: BLE001 - any reader failure: the file it was reading is unreadable
        failed = f"{prefix}.bin" if hasattr(ds, "index") else f"{prefix}.idx"  # (the index is read first)
        raise ValueError(f"--data-path {prefix}: cannot read {failed} ({type(e).__name__}: {e})") from None
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
    if have > need:  # an index of another (shorter) .bin, or a .bin appended to: the tokens past it never train
        raise ValueError(f"--data-path {prefix}: {prefix}.idx and {prefix}.bin disagree: the index lists "
                         f"{len(index.sequence_lengths)} documents in {need} bytes, the .bin holds {have}; rebuild the "
                         "pair with Megatron-LM's preprocess tool (tools/preprocess_data.py)")


def _split_tokens(args) -> tuple[torch.Tensor, torch.Tensor]:
    """(train tokens, validation tokens) of the corpus the flags name (split_bounds: the test share is
    never read)."""
    if args.data_path:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        ds = IndexedDataset(args.data_path)
        train_docs, valid_docs = split_bounds(len(ds), args.split, whole_units=True)
        read = lambda docs: torch.cat([torch.from_numpy(ds[i].astype("int64")) for i in docs]) \
            if len(docs) else torch.zeros(0, dtype=torch.int64)  # noqa: E731
        train, valid = read(train_docs), read(valid_docs)
        read_parts = [t for t in (train, valid) if t.numel()]
        top = max((int(t.max()) for t in read_parts), default=-1)
        low = min((int(t.min()) for t in read_parts), default=0)
        if top >= args.vocab_size:  # (int64 windows)
            raise ValueError(f"--vocab-size {args.vocab_size} is smaller than the dataset's max token id {top}; "
                             "raise --vocab-size")
        if low < 0:
            raise ValueError(f"--data-path {args.data_path}: the dataset holds a negative token id ({low}); token "
                             "ids must be in [0, --vocab-size): preprocess the data again")
        return train, valid
    if args.vocab_size < 256:
        raise ValueError("--vocab-size must be >= 256 for the byte-level default data")
    tokens = stdlib_bytes()
    train, valid = split_bounds(tokens.numel(), args.split)
    return tokens[train.start:train.stop], tokens[valid.start:valid.stop]


_MASK64 = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays: a fixed, well-mixed hash of each element."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_starts(seed: int, first: int, count: int, span: int) -> np.ndarray:
    """Start offsets in [0, span) of train samples first .. first + count - 1: sample k's start is a
    hash of (seed, k) alone (the modulo's bias is below span / 2^64)."""
    with np.errstate(over="ignore"):
        key = _mix64(np.array([(seed + 0x9E3779B97F4A7C15) & _MASK64], dtype=np.uint64))[0]
        index = np.arange(first, first + count, dtype=np.uint64)
        return (_mix64(index * np.uint64(0x9E3779B97F4A7C15) + key) % np.uint64(span)).astype(np.int64)


class TokenSource:
    """Train windows as one sequence of samples (sample k: a function of (--seed, k)), cut into global
    batches by consumed samples and into DP slices and micro-batches as Megatron's sampler does; and
    fixed validation windows."""

    def __init__(self, args):
        self.seq = args.seq_length
        self.tokens, self.valid_tokens = _split_tokens(args)
        problem = split_problem(args, self.tokens.numel(), self.valid_tokens.numel())
        if problem:
            raise ValueError(problem)
        self.seed = args.seed

    def windows(self, first: int, count: int) -> torch.Tensor:
        """Train samples first .. first + count - 1, each seq + 1 tokens."""
        starts = sample_starts(self.seed, first, count, self.tokens.numel() - self.seq - 1)
        return torch.stack([self.tokens[s:s + self.seq + 1] for s in starts.tolist()]).long()

    def micro_batches(self, consumed: int, global_batch: int, dp_size: int, dp_rank: int, mbs: int) -> list:
        """This DP rank's micro-batches of the global batch that starts at sample ``consumed``: in each
        step of micro-batch x DP samples, rank r takes the r-th micro-batch (MegatronPretrainingSampler)."""
        step = mbs * dp_size
        return [self.windows(consumed + m * step + dp_rank * mbs, mbs) for m in range(global_batch // step)]

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
    key = (args.data_path, args.split, args.seq_length, args.vocab_size, args.seed, args.eval_iters)
    if key not in _SOURCES:
        _SOURCES[key] = TokenSource(args)
    return _SOURCES[key]
