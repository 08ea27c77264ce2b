"""Content addresses of KV blocks and the choices of the prefix cache (policy: pure functions).

A full block of ``block_size`` tokens is addressed by a chained hash: the hash of its parent
(the block before it; :data:`ROOT` for the first) and its own token ids. Two sequences whose
first ``j`` blocks have the same tokens therefore have the same ``j`` hashes, whatever their
trajectory or request id, and can share those blocks' KV. blake2b with a 128-bit digest: a
collision between two different prefixes is not a practical concern (Python's ``hash`` would
give 64 bits, and is only stable within one process).
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Iterable, Sequence

ROOT = b"ainfer-pd/kv/v1"
"""Parent hash of a sequence's first block."""


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of a full block with token ids ``tokens`` following a block hashed ``parent``."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain_hashes(tokens: Sequence[int], block_size: int, num_tokens: int, parent: bytes = ROOT,
                 start_block: int = 0) -> list[bytes]:
    """Hashes of the full blocks ``start_block ..`` of ``tokens`` lying within the first
    ``num_tokens`` tokens (``parent`` is the hash of block ``start_block - 1``)."""
    out = []
    for j in range(start_block, num_tokens // block_size):
        parent = block_hash(parent, tokens[j * block_size:(j + 1) * block_size])
        out.append(parent)
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def best_tail(candidates: Iterable[tuple[int, tuple[int, ...]]], rest: Sequence[int]) -> tuple[int, int] | None:
    """The cached block to adopt after a sequence's last shared full block: among
    ``candidates`` (block id, the token ids it holds) under that parent, the one sharing the
    longest prefix with ``rest`` (the sequence's next tokens, at most one block, within the
    reuse limit); ties go to the lower block id. Returns (block, tokens kept) or None."""
    best: tuple[int, int] | None = None
    for b, toks in candidates:
        m = common_prefix(toks, rest)
        if m > 0 and (best is None or m > best[1] or (m == best[1] and b < best[0])):
            best = (b, m)
    return best


def worth_waiting(blocks_to_share: int, block_size: int, min_tokens: int) -> bool:
    """Whether a turn waits for a sibling that is writing its next ``blocks_to_share`` prompt blocks
    (sharing them once that pass completed) instead of computing them in the same epoch."""
    return blocks_to_share > 0 and blocks_to_share * block_size >= min_tokens


def release_order(blocks: Sequence[int]) -> list[int]:
    """Order in which a sequence's blocks join the LRU of unreferenced blocks: last block
    first, so under pressure a chain loses its tail before its head (a prefix stays useful;
    a chain missing its first block is useless)."""
    return list(reversed(blocks))
