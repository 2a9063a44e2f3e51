"""The Python standard library's source as a language-modelling corpus, split over agents.

Files ``<stdlib>/*.py`` are sorted by name; every 20th file is held out for validation; the
rest are cut into N contiguous groups of about equal token count, one per agent. Agents thus
see different modules (heterogeneous local objectives — e.g. agent 0 gets ``__future__`` …
``codecs``, agent 7 ``tokenize`` … ``zipimport``), measured by the mean symmetric KL divergence
between agents' unigram distributions. The BPE tokenizer is trained on the training files only.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import sys
import sysconfig

import torch

from bpe import BytePairTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CACHE = os.path.join(HERE, "_data")


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def read_files(directory: str) -> list[tuple[str, str]]:
    paths = sorted(glob.glob(os.path.join(directory, "*.py")))
    if not paths:
        raise FileNotFoundError(f"no *.py files under {directory}")
    return [(os.path.basename(p), open(p, encoding="utf-8", errors="replace").read()) for p in paths]


def mean_symmetric_kl(parts: list[torch.Tensor], vocab_size: int) -> float:
    """Mean over agent pairs of KL(p‖q) + KL(q‖p) of unigram token distributions (add-one smoothing)."""
    dists = []
    for tokens in parts:
        counts = torch.bincount(tokens.long(), minlength=vocab_size).double() + 1.0
        dists.append(counts / counts.sum())
    total, pairs = 0.0, 0
    for i in range(len(dists)):
        for j in range(i + 1, len(dists)):
            p, q = dists[i], dists[j]
            total += float((p * (p / q).log()).sum() + (q * (q / p).log()).sum())
            pairs += 1
    return total / max(pairs, 1)


def build_corpus(num_agents: int, vocab_size: int, directory: str | None = None, cache_dir: str = DEFAULT_CACHE) -> dict:
    """Token streams per agent + validation stream; cached as a .pt keyed by the inputs."""
    directory = directory or stdlib_dir()
    files = read_files(directory)
    digest = hashlib.sha1("".join(name + str(len(text)) for name, text in files).encode()).hexdigest()[:10]
    cache = os.path.join(cache_dir, f"stdlib_{digest}_v{vocab_size}_n{num_agents}.pt")
    if os.path.exists(cache):
        return torch.load(cache)
    val_files = [f for i, f in enumerate(files) if i % 20 == 10]
    train_files = [f for i, f in enumerate(files) if i % 20 != 10]
    tokenizer = BytePairTokenizer.train("".join(t for _, t in train_files), vocab_size)
    encoded = [(name, tokenizer.encode(text)) for name, text in train_files]
    total = sum(len(ids) for _, ids in encoded)
    parts, names, current, current_names, done = [], [], [], [], 0
    for name, ids in encoded:
        current.extend(ids)
        current_names.append(name)
        done += len(ids)
        if len(parts) < num_agents - 1 and done >= total * (len(parts) + 1) / num_agents:
            parts.append(current)
            names.append(current_names)
            current, current_names = [], []
    parts.append(current)
    names.append(current_names)
    val = [i for _, text in val_files for i in tokenizer.encode(text)]
    data = {
        "source": f"{directory} ({sys.version.split()[0]})",
        "vocab_size": vocab_size,
        "merges": tokenizer.merges,
        "agent_tokens": [torch.tensor(p, dtype=torch.int16) for p in parts],
        "agent_files": names,
        "val_tokens": torch.tensor(val, dtype=torch.int16),
        "val_files": [n for n, _ in val_files],
        "bytes": sum(len(t.encode()) for _, t in files),
    }
    data["heterogeneity_sym_kl"] = mean_symmetric_kl(data["agent_tokens"], vocab_size)
    os.makedirs(cache_dir, exist_ok=True)
    torch.save(data, cache)
    return data


def sample_windows(tokens: torch.Tensor, count: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` random windows of ``length + 1`` tokens (inputs + shifted targets), int64."""
    starts = torch.randint(0, tokens.numel() - length - 1, (count,), generator=gen)
    return torch.stack([tokens[s : s + length + 1] for s in starts.tolist()]).long()


def fixed_windows(tokens: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """``count`` evenly spaced windows (the validation set; deterministic)."""
    stride = max(1, (tokens.numel() - length - 1) // count)
    return torch.stack([tokens[i * stride : i * stride + length + 1] for i in range(count)]).long()


def describe(data: dict) -> str:
    sizes = [int(t.numel()) for t in data["agent_tokens"]]
    return (
        f"{data['source']}: {data['bytes'] / 1e6:.2f} MB, vocab {data['vocab_size']}, "
        f"train tokens per agent {sizes}, val tokens {int(data['val_tokens'].numel())}, "
        f"heterogeneity (mean sym-KL of unigrams) {data['heterogeneity_sym_kl']:.3f}; "
        f"chars/token ≈ {math.nan if not sizes else data['bytes'] / (sum(sizes) + data['val_tokens'].numel()):.2f}"
    )


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="build (or find) the cached stdlib corpus")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args()
    corpus = build_corpus(args.agents, args.vocab)
    print(describe(corpus))
    print("cache:", sorted(glob.glob(os.path.join(DEFAULT_CACHE, f"stdlib_*_v{args.vocab}_n{args.agents}.pt"))))
