"""A small byte-level byte-pair-encoding tokenizer, trained locally (no downloads).

Text is split into chunks (identifier-like words with an optional leading space, digit runs,
punctuation runs, whitespace runs), each chunk is UTF-8 bytes, and the most frequent adjacent
pair is merged repeatedly until ``vocab_size`` tokens exist (256 byte tokens + merges). Merges
never cross chunk boundaries. Training keeps pair counts incrementally (pair → chunks index and
a lazy max-heap), so a few thousand merges over megabytes of text take seconds.
"""

from __future__ import annotations

import heapq
import json
import re
from collections import Counter, defaultdict

CHUNK_PATTERN = re.compile(r" ?[A-Za-z_]+| ?[0-9]+| ?[^\sA-Za-z_0-9]+|\n[ \t]*|[ \t]+|\s")


def chunks(text: str) -> list[str]:
    out = CHUNK_PATTERN.findall(text)
    return out


class BytePairTokenizer:
    def __init__(self, merges: list[tuple[int, int]]):
        self.merges = [tuple(m) for m in merges]
        self.ranks = {pair: i for i, pair in enumerate(self.merges)}
        self.vocab_size = 256 + len(self.merges)
        self._cache: dict[str, list[int]] = {}

    # -------------------------------------------------------------------------- training
    @classmethod
    def train(cls, text: str, vocab_size: int) -> "BytePairTokenizer":
        if vocab_size < 256:
            raise ValueError(f"vocab_size must be ≥ 256 (the byte alphabet), got {vocab_size}")
        counts = Counter(chunks(text))
        words = [list(w.encode("utf-8")) for w in counts]
        freq = list(counts.values())
        pair_count: dict[tuple[int, int], int] = defaultdict(int)
        where: dict[tuple[int, int], set[int]] = defaultdict(set)
        for wi, w in enumerate(words):
            for pair in zip(w, w[1:]):
                pair_count[pair] += freq[wi]
                where[pair].add(wi)
        heap = [(-c, pair) for pair, c in pair_count.items()]
        heapq.heapify(heap)
        merges: list[tuple[int, int]] = []
        while len(merges) < vocab_size - 256 and heap:
            neg, pair = heapq.heappop(heap)
            if pair_count.get(pair, 0) != -neg or -neg <= 0:
                continue  # stale heap entry
            new_id = 256 + len(merges)
            merges.append(pair)
            touched: dict[tuple[int, int], int] = {}
            for wi in list(where.pop(pair, ())):
                w, f = words[wi], freq[wi]
                for p in zip(w, w[1:]):
                    pair_count[p] -= f
                    touched[p] = pair_count[p]
                merged, i = [], 0
                while i < len(w):
                    if i + 1 < len(w) and (w[i], w[i + 1]) == pair:
                        merged.append(new_id)
                        i += 2
                    else:
                        merged.append(w[i])
                        i += 1
                words[wi] = merged
                for p in zip(merged, merged[1:]):
                    pair_count[p] += f
                    touched[p] = pair_count[p]
                    where[p].add(wi)
            pair_count.pop(pair, None)
            for p in touched:
                if p != pair and pair_count.get(p, 0) > 0:
                    heapq.heappush(heap, (-pair_count[p], p))
        return cls(merges)

    # -------------------------------------------------------------------------- encoding
    def _encode_chunk(self, chunk: str) -> list[int]:
        cached = self._cache.get(chunk)
        if cached is not None:
            return cached
        ids = list(chunk.encode("utf-8"))
        while len(ids) > 1:
            best = min(
                ((self.ranks.get(p, len(self.ranks)), i) for i, p in enumerate(zip(ids, ids[1:]))),
                default=(len(self.ranks), -1),
            )
            rank, i = best
            if rank == len(self.ranks):
                break
            ids = ids[:i] + [256 + rank] + ids[i + 2 :]
        self._cache[chunk] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for c in chunks(text):
            out.extend(self._encode_chunk(c))
        return out

    def decode(self, ids: list[int]) -> str:
        table = [bytes([b]) for b in range(256)]
        for a, b in self.merges:
            table.append(table[a] + table[b])
        return b"".join(table[i] for i in ids).decode("utf-8", errors="replace")

    # ----------------------------------------------------------------------- persistence
    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"merges": self.merges}, f)

    @classmethod
    def load(cls, path: str) -> "BytePairTokenizer":
        with open(path) as f:
            return cls([tuple(m) for m in json.load(f)["merges"]])
