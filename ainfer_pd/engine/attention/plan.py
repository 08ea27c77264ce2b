"""Launch plans of the paged kernels: pure functions of shapes known on the host.

A plan depends only on host-known shapes (padded key length, dtype), never on device values,
so a CUDA graph bucket always replays the plan it was captured with.
"""
from __future__ import annotations

from dataclasses import dataclass


#: Most KV splits of one decode row. A row with more than ``MAX_DECODE_SPLITS * split_keys`` keys
#: gets longer splits (its keys over this count), so the partial-output buffer and the grid of a
#: graph captured for the whole context stay bounded: ``B x H x 64 x hd`` fp32 (134 MB at B = 128,
#: 32 heads of 128) however long ``max_context_len`` is. Up to 16K keys a split is ``split_keys``.
MAX_DECODE_SPLITS = 64


@dataclass(frozen=True, slots=True)
class DecodePlan:
    num_splits: int       # grid splits: enough for the longest row the launch covers
    split_keys: int       # keys per split, the least (a multiple of block_n)
    block_n: int
    num_warps: int
    num_stages: int
    max_splits: int = MAX_DECODE_SPLITS     # a row never has more splits than this

    def row_split_keys(self, ctx: int) -> int:
        """Keys per split of a row of ``ctx`` keys (the kernels' ``_split_len``): a function of
        the row alone, so a row's result is the same in every batch, bucket and graph."""
        per = -(-(-(-ctx // self.max_splits)) // self.block_n) * self.block_n
        return max(per, self.split_keys)


VERIFY_TILE_ROWS = 32
"""The most query rows (a group's rows x the GQA group's heads) of one verify decode program's tile."""


def verify_group_width(rows_per_turn: int, gqa_group: int) -> int:
    """The rows of one turn a verify decode program attends together (reading the turn's keys once for
    all of them): the turn's rows, as many as ``VERIFY_TILE_ROWS`` query rows hold (Qwen3-30B-A3B's 8
    heads a KV head: 4 rows; a turn of 5 rows is then two groups)."""
    return max(1, min(rows_per_turn, VERIFY_TILE_ROWS // gqa_group))


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    heavy_first: bool = True
    """Launch the query tiles with the most keys first (causal: a sequence's last tiles), so the
    grid's last wave holds the shortest programs, not the longest (the tail FlashAttention's
    kernels avoid the same way); False: in sequence order."""
    own_keys_tma: bool = False
    """The pass's own keys and values are read contiguous through TMA descriptors, by
    :mod:`.triton_prefill_tma` (the cached prefix through the block table); needs Hopper or newer
    and a 16-bit pool. False: every key through the block table (``paged_prefill_kernel``)."""


def decode_plan(max_keys: int, *, block_n: int = 64, split_keys: int = 256, num_warps: int = 2,
                num_stages: int = 2, max_splits: int = MAX_DECODE_SPLITS) -> DecodePlan:
    """Split every row's keys at fixed positions (multiples of ``split_keys``; past
    ``max_splits x split_keys`` keys, multiples of the row's own ``row_split_keys``).

    The split boundaries never depend on the batch (rows, the longest row, the graph bucket),
    so a row's result is bitwise the same in any batch, eager or replayed: splits beyond a
    row's length are empty and merge with weight exactly 0. The partial outputs cost
    ``16 / split_keys`` of the KV bytes (6% at 256 keys a split). Programs are (row, KV head,
    split): one row of the Qwen3-30B-A3B shape (4 KV heads) at 5K keys has 80 programs at 256
    keys a split, against 20 at 1024, which left most of the 132 SMs idle (34 us a layer against
    a 2.5 us KV bound; H200, docs/RESULTS.md "GPU data path"). block_n, warps and stages
    from the H200 sweep.
    """
    split_keys = -(-split_keys // block_n) * block_n
    num_splits = min(max_splits, max(1, -(-max_keys // split_keys)))
    return DecodePlan(num_splits, split_keys, block_n, num_warps, num_stages, max_splits)


#: Query tokens of a prefill pass from which it takes the long tile (:func:`prefill_plan`) on a
#: device without TMA (the paged kernel's 128 x 128 tile is measured from 4K only).
LONG_PREFILL_TOKENS = 4096

#: Query tokens from which a pass on a TMA device reads its own keys through tensor descriptors
#: (:mod:`.triton_prefill_tma`, the long tile), where its cached keys are no more than its new ones.
#: The P graphs' 2,048-token bucket is one: its captured prologue keeps the roped keys in static
#: buffers, so a replayed pass and the eager one of its tokens run the same kernel
#: (``engine/runtime/prefill_graphs.py``).
TMA_PREFILL_TOKENS = 2048

#: New tokens a sequence (on average over the pass) from which a pass whose cached keys outnumber its
#: new ones takes the paged kernel's long tile.
LONG_CACHED_ROWS = 1024


def prefill_plan(head_dim: int, fp32: bool, tokens: int = 0, kv_fp8: bool = False, tma: bool = False,
                 cached: int = 0, seqs: int = 1) -> PrefillPlan:
    """Tile shape of the varlen prefill kernel for a pass of ``tokens`` query tokens over ``cached``
    keys already in the pool, in ``seqs`` sequences (shared memory bounds the fp32 tiles). On a 16-bit
    pool, 128 x 128 on 8 warps, 3 stages:

    * with ``tma`` (the device has TMA: Hopper or newer) from :data:`TMA_PREFILL_TOKENS` new tokens, where
      ``cached <= tokens``: the pass's own keys read through tensor descriptors (:mod:`.triton_prefill_tma`;
      H100, a layer: fresh 2K 0.1173 against the paged 64 x 64 kernel's 0.1357 ms, 4K 0.3232 against the
      paged long tile's 0.4297, 8K 1.0535 against 1.4499; 2,048 on 2,048 cached 0.3098 against 0.3180 /
      0.3343 for the paged 128 / 64 tiles);
    * where the cached keys outnumber the new ones and a sequence has :data:`LONG_CACHED_ROWS` new tokens
      or more (on average), the paged kernel's long tile (H100 at b7142b0, ``kernel_sweep.py --sections
      prefilltmac``: 2,048 on 4,096 / 8,000 cached 0.4808 / 0.8033 ms against TMA's 0.4924 / 0.8597 and
      64 x 64's 0.5231 / 0.8762; 1,024 on 4,096 0.2325 against 0.2484 / 0.2519; two 575-token
      continuations on 1,500 keep 64 x 64, 0.140 against 0.146);
    * from :data:`LONG_PREFILL_TOKENS` on, the paged long tile (H100 sweep: 4K 0.435 against 0.449 ms,
      8K 1.480 against 1.575 for 64 x 64);

    else 64 x 64 on 4 warps (best at 575 on 1,500: 0.141 against 0.148 ms; on the H200 best or within 1%
    at 4K and 575 + 1,500; an FP8 pool's long tile is not measured)."""
    if fp32:
        return PrefillPlan(32, 32, 4, 1)
    if head_dim <= 128 and not kv_fp8:
        if tma and tokens >= TMA_PREFILL_TOKENS and cached <= tokens:
            return PrefillPlan(128, 128, 8, 3, own_keys_tma=True)
        if tokens >= LONG_PREFILL_TOKENS or (cached > tokens and tokens >= LONG_CACHED_ROWS * max(seqs, 1)):
            return PrefillPlan(128, 128, 8, 3)
    return PrefillPlan(64, 64, 4, 2)
