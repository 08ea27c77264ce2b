"""Model runner: builds flat batches and executes model segments on a device.

The runner never awaits: it offers synchronous functions that a stream executes
(``embed``, ``attn_route``, ``experts``, ``head``, ``decode``). The engine's P task
and D loop decide when each is enqueued.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from ..attention import DecodeMeta, ForwardBatch, PrefillSeq, lead_offsets, select_backend
from ..attention.backend import resolve_kernel_backend
from ..attention.kv_fp8 import new_kv_pool
from ...hf.kv_scales import kv_scales_for
from ..kv.kv_cache import KVCacheManager
from ..kv.residency import collect_device_memory, release_kv_state
from ..model.model import MoETransformer, SegmentState, build_model
from ..model.seen_masks import SeenMasks
from .prefill_graphs import prefill_graph_buckets
from .runner_sections import RunnerSections
from .stream_leases import cuda_stream_key, give_back, take
from ...phase import Phase, PhaseContext
from ..loop.state import Turn
from .tensor_parallel import LOCAL

log = logging.getLogger("ainfer_pd.runner")


@dataclass(slots=True)
class BatchPlan:
    """A built batch and the turns its logits rows belong to."""

    fb: ForwardBatch
    prefill: list[tuple[Turn, int, int]]      # (turn, start position, tokens)
    decode: list[Turn]
    logit_turns: list[Turn]                   # owner of each logits row
    replay: "PrefillBinding | None" = None
    """A P pass replayed through the captured P graphs (``device.prefill_graphs``); None: eager."""
    drafts: list[list[int]] | None = None
    """A verify batch (speculative decoding): decode row i runs 1 + len(drafts[i]) positions, its
    last token then its drafts (``logit_turns`` then owns each position's logits row)."""

    @property
    def num_tokens(self) -> int:
        return int(self.fb.input_ids.shape[0])


class Replayed:
    """The segment state of a replayed P pass: the state lives in the P graphs' static buffers."""

    __slots__ = ("binding", "routing")

    def __init__(self, binding) -> None:
        self.binding = binding
        self.routing = None              # nothing to notify: replay is used only without expert parallelism


class ModelRunner:
    def __init__(self, sections: RunnerSections, device: torch.device, kv: KVCacheManager,
                 tp_shard: tuple[int, int] | None = None) -> None:
        self.sections = RunnerSections.expect(sections)    # the config sections it reads
        self.device = device
        self.kv = kv
        mc = sections.model
        from .expert_parallel import expert_shard
        if mc.fp8_dense and tp_shard is not None and tp_shard[1] > 1:
            from ...errors import UnsupportedOptionError
            raise UnsupportedOptionError("model.fp8_dense with attention tensor parallelism (ATP > 1) is not built: "
                                         "the FP8 q/k/v and o projections are not split by heads (without fp8_dense "
                                         "they are in the model dtype and shard as usual)", key="fp8_dense")
        self.model: MoETransformer = build_model(mc, device, experts=expert_shard(sections), mtp=sections.spec.mtp)
        if tp_shard is not None:                     # attention TP: this rank's heads (and their KV) only
            from .tensor_parallel import shard_attention_
            shard_attention_(self.model, *tp_shard)
        # [layers, 2, S, Hk, hd] with S = (num_blocks + 1) * block_size: the last block is scratch,
        # written by padded graph rows and warm-up passes (its first slot), never allocated.
        # Hk = this rank's KV heads (the model's: a TP shard holds num_kv_heads / ATP).
        self.scratch_block = kv.alloc.num_blocks
        self.scratch_slot = self.scratch_block * kv.block_size
        self.model.pad_slot = self.scratch_slot      # padding rows (graph buckets, replicas) route nowhere
        self.routed = None
        """Per-slot expert ids (routing replay), allocated with the KV pool when ``cache.routed_experts``."""
        if sections.cache.routed_experts:
            from ..model.routed_experts import RoutedExpertsCache
            self.routed = RoutedExpertsCache(mc, (kv.alloc.num_blocks + 1) * kv.block_size, device)
            self.model.routing_sink = self.routed
        self.kv_cache = self.new_kv_cache()
        dc = sections.device
        self.model.attn_backend = select_backend(dc.attention_backend, device, mc.head_dim)
        self.moe_backend = resolve_kernel_backend("moe_backend", dc.moe_backend, device)
        if self.moe_backend == "triton":
            from ..fused_moe import fused_experts, fused_softmax_route
            self.model.expert_kernel = fused_experts
            self.model.route_kernel = fused_softmax_route
            if mc.quantization == "fp8":      # the FP8 kernels: imported here only (CPU runs never need Triton)
                from ..model.linear import Fp8Kernels
                from ..quant.fp8_ops import fp8_linear, fused_experts_fp8, select_fp8_linear
                linear = select_fp8_linear(device) if mc.fp8_dense else fp8_linear     # FP8 dense projections only
                self.model.fp8_kernels = Fp8Kernels(linear=linear, experts=fused_experts_fp8)
        log.info("attention backend %s, MoE backend %s", self.model.attn_backend.name, self.moe_backend)
        self.graphs = None
        self.pgraphs = None
        """The P graphs (:mod:`.prefill_graphs`), captured on P's stream where P can replay."""
        self._phase_streams: dict = {}          # Phase -> CUDA stream, where no device stream is given
        self.decode_paths: dict[str, int] = {"graph": 0, "eager-no-graphs": 0, "eager-past-graphs": 0}
        """D iterations by the path they took (runner.decode)."""
        self.ep = None                 # P's ExpertParallel when experts are spread over ranks
        self.seen_masks = SeenMasks()
        """The D loop's repetition-penalty masks on the device (:mod:`..model.seen_masks`; empty until
        a penalized row decodes), used on the D stream only."""

    def new_kv_cache(self) -> Tensor:
        """The KV pool, zeroed: ``[layers, 2, (num_blocks + 1) * block_size, Hk, hd]`` (layers: the MTP one
        too; Hk: this rank's KV heads, the model's own: a TP shard's num_kv_heads / ATP) in ``cache.kv_dtype`` (FP8:
        with the model's per-layer K / V scales, made once and kept across sleeps), and the
        routed-experts buffer beside it, when kept."""
        mc, kv, kvd, n = self.sections.model, self.kv, self.sections.cache.kv_dtype, len(self.model.layers)
        if self.routed is not None:
            self.routed.allocate()
        self.model.kv_scales = kv_scales_for(self.model, self.sections.cache, self.device)    # FP8: kept once made
        return new_kv_pool((n, 2, (kv.alloc.num_blocks + 1) * kv.block_size, self.model.cfg.num_kv_heads,
                            mc.head_dim), kvd, mc.torch_dtype, self.device)

    # ------------------------------------------------------------------ batches
    def build(self, prefill: list[tuple[Turn, int, int]], decode: list[Turn],
              ahead: list[int] | None = None, drafts: list[list[int]] | None = None) -> BatchPlan:
        """Host-side metadata for a flat batch: prefill chunks first, then decode rows.
        ``ahead[i]`` = 1: decode row i's last token is still on the device (the overlapped D loop):
        it is fed at position seq_len, and its input id is a placeholder the launch fills in.
        ``drafts[i]`` (a verify batch, not with ``ahead``): decode row i also feeds its drafts, each a
        decode row of its own at the next position (:meth:`_verify_rows`)."""
        ids: list[int] = []
        pos: list[int] = []
        write: list[Tensor] = []
        seqs: list[PrefillSeq] = []
        rows: list[int] = []
        logit_turns: list[Turn] = []
        self._prefill_rows(prefill, ids, pos, write, seqs, rows, logit_turns)
        if drafts is None:
            decode_meta, host_write = self._decode_rows(decode, ahead, ids, pos, rows, logit_turns)
        else:
            decode_meta, host_write = self._verify_rows(decode, drafts, ids, pos, rows, logit_turns)
        if host_write:
            write.append(torch.tensor(host_write, dtype=torch.int64))
        d = self.device
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=d),
            positions=torch.tensor(pos, dtype=torch.int64, device=d),
            write_slots=torch.cat(write).to(d) if write else torch.zeros(0, dtype=torch.int64, device=d),
            prefill=seqs, decode=decode_meta,
            logits_rows=torch.tensor(rows, dtype=torch.int64, device=d),
            block_size=self.kv.block_size,
        )
        plan = BatchPlan(fb, prefill, decode, logit_turns, drafts=drafts)
        if self.pgraphs is not None and not decode:
            plan.replay = self.pgraphs.binding(fb)
        return plan

    def _prefill_rows(self, prefill: list[tuple[Turn, int, int]], ids: list[int], pos: list[int],
                      write: list[Tensor], seqs: list[PrefillSeq], rows: list[int],
                      logit_turns: list[Turn]) -> None:
        """Append the prefill chunks' rows (and the logits row of each prompt that completes)."""
        for turn, start, n in prefill:
            q0 = len(ids)
            ids.extend(turn.prompt[start:start + n])
            pos.extend(range(start, start + n))
            blocks = self.kv.block_ids(turn.tid, start + n)        # host [ceil((start + n) / bs)]
            write.append(self.kv.slots(turn.tid, start, start + n))     # the new keys are written
            seqs.append(PrefillSeq(q0, n, start + n, block_ids=blocks))
            if start + n == len(turn.prompt):        # prompt complete: its last row gives the first token
                rows.append(q0 + n - 1)
                logit_turns.append(turn)

    def _decode_rows(self, decode: list[Turn], ahead: list[int] | None, ids: list[int], pos: list[int],
                     rows: list[int], logit_turns: list[Turn]) -> tuple[DecodeMeta | None, list[int]]:
        """Append one row per decode turn; their metadata and host write slots (None, [] without
        decode rows)."""
        decode_meta = None
        host_write = []
        if decode:
            lens = [t.seq_len + a for t, a in zip(decode, ahead)] if ahead else [t.seq_len for t in decode]
            bs = self.kv.block_size
            nb = -(-max(lens) // bs)
            for t, n in zip(decode, lens):
                p = n - 1                              # position of the token being fed
                ids.append(t.out_tokens[-1] if n == t.seq_len else 0)
                pos.append(p)
                host_write.append(self.kv.slot_of(t.tid, p))
                rows.append(len(ids) - 1)
                logit_turns.append(t)
            table = self.kv.block_table([t.tid for t in decode], nb)
            decode_meta = DecodeMeta(None, torch.tensor(lens, dtype=torch.int64, device=self.device),
                                     block_table=table.to(self.device), block_size=bs)
        return decode_meta, host_write

    def _verify_rows(self, decode: list[Turn], drafts: list[list[int]], ids: list[int], pos: list[int],
                     rows: list[int], logit_turns: list[Turn]) -> tuple[DecodeMeta | None, list[int]]:
        """Append 1 + len(drafts[i]) rows per decode turn: its last token at position seq_len - 1,
        then draft j at seq_len - 1 + j, each a decode row whose context ends at its own position
        (a layer writes every row's key before it attends; the paged decode kernel reads a turn's keys
        once for its rows, ``DecodeMeta.lead_off``).
        The positions lie inside the turn's reservation (the speculator drafts at most the tokens
        left less one); a rejected draft's KV is never marked written, the next pass overwrites it."""
        if not decode:
            return None, []
        bs, lens, tids, host_write = self.kv.block_size, [], [], []
        for t, d in zip(decode, drafts):
            n = t.seq_len
            for j, tok in enumerate([t.out_tokens[-1], *d]):
                ids.append(tok)
                pos.append(n - 1 + j)
                host_write.append(self.kv.slot_of(t.tid, n - 1 + j))
                lens.append(n + j)
                tids.append(t.tid)
                rows.append(len(ids) - 1)
                logit_turns.append(t)
        table = self.kv.block_table(tids, -(-max(lens) // bs))
        W = self.sections.verify_width           # the lengths and lead offsets: one host-to-device copy
        lead = lead_offsets([1 + len(d) for d in drafts], W)
        both = torch.tensor([lens, lead], dtype=torch.int64, device=self.device)
        return DecodeMeta(None, both[0], block_table=table.to(self.device), block_size=bs, lead_off=both[1],
                          group_width=W), host_write

    # ------------------------------------------------------------------ segments (run on a stream)
    def embed(self, plan: BatchPlan) -> SegmentState | Replayed:
        if plan.replay is not None:
            plan.replay.embed()
            return Replayed(plan.replay)
        return self.model.embed_tokens(plan.fb)

    def attn_route(self, layer: int, st: SegmentState | Replayed, plan: BatchPlan) -> SegmentState | Replayed:
        if type(st) is Replayed:
            st.binding.attn_route(layer, self.kv_cache[layer])
            return st
        return self.model.attn_route(layer, st, plan.fb, self.kv_cache[layer])

    def attention(self, layer: int, st: SegmentState, plan: BatchPlan) -> Tensor:
        """The attention output over this rank's heads (a partial sum under TP) [T, D]."""
        return self.model.attention(layer, st, plan.fb, self.kv_cache[layer])

    def after_attention(self, layer: int, st: SegmentState, o: Tensor, plan: BatchPlan) -> SegmentState:
        return self.model.after_attention(layer, st, o, plan.fb)

    def notify(self, ctx: PhaseContext, st: SegmentState):
        """Start the expert exchange of this layer (peers learn the shape); None without EP
        and for a dense layer (no routing: nothing is exchanged, on every rank alike)."""
        return None if self.ep is None or st.routing is None else self.ep.notify(ctx, st.routing)

    def experts(self, layer: int, st: SegmentState, ctx: PhaseContext, notified=None) -> SegmentState:
        """Routed + shared experts; with EP the data moves now (after counts and permit)."""
        if type(st) is Replayed:
            st.binding.experts(layer)
            return st
        fn = (ctx.comm.hooks or LOCAL).experts
        if notified is not None:
            ep = self.ep
            fn = lambda x, r, i: ep.finish(ctx, notified, x, r, i)      # noqa: E731
        return self.model.experts(layer, st, fn)

    after_layers = None
    """Run by the P walk after the last layer's experts, ``(st, plan, ctx)`` (the MTP catch-up:
    :class:`~.mtp_runner.MtpRunner`); None: nothing runs there."""

    def head(self, st: SegmentState | Replayed, plan: BatchPlan) -> Tensor:
        if type(st) is Replayed:
            return st.binding.head()
        return self.model.head(st, plan.fb.logits_rows)

    def forward(self, plan: BatchPlan, ctx: PhaseContext) -> Tensor:
        """Every segment back to back (mixed batches; decode when no graph fits)."""
        return self.forward_fb(plan.fb, ctx)

    def forward_fb(self, fb: ForwardBatch, ctx: PhaseContext) -> Tensor:
        if ctx.phase is Phase.PREFILL and self.pgraphs is not None:
            binding = self.pgraphs.binding(fb)
            if binding is not None:                  # the P graphs, segment by segment
                binding.embed()
                for layer in range(self.sections.model.num_layers):
                    binding.attn_route(layer, self.kv_cache[layer])
                    binding.experts(layer)
                return binding.head()
        h = ctx.comm.hooks or LOCAL                  # the phase's own hooks (multi-rank), else local
        return self.model.forward_batch(fb, self.kv_cache, h.experts, h.attn_reduce, h.gather)

    def decode(self, plan: BatchPlan, ctx: PhaseContext) -> Tensor:
        """One D iteration: CUDA-graph replay when a bucket fits, else eager. The path taken is
        counted in ``decode_paths`` (``graph``, ``eager-no-graphs``, ``eager-past-graphs``)."""
        out = None if self.graphs is None else self.graphs.try_run(plan.fb, *self.graph_inputs(plan))
        if out is not None:
            self.decode_paths["graph"] += 1
            return out
        self.decode_paths["eager-no-graphs" if self.graphs is None else "eager-past-graphs"] += 1
        return self.forward(plan, ctx)

    def graph_inputs(self, plan: BatchPlan) -> tuple:
        """What a decode graph replay takes beside the batch (:meth:`.cuda_graphs.DecodeGraphs.try_run`)."""
        return ()

    def capture_decode_graphs(self, ctx: PhaseContext) -> int:
        """CUDA only: capture decode graphs for the configured buckets."""
        from .cuda_graphs import graph_buckets
        s = self.sections
        dc, mc = s.device, s.model
        if mc.dtype != "bfloat16" and self.moe_backend != "triton":
            log.warning("CUDA graphs with the torch MoE path need bf16 experts (grouped GEMM); %s decodes eagerly",
                        mc.dtype)
            return 0
        # a verify pass has 1 + K rows per turn
        rows = s.scheduler.max_decode_batch * (1 + s.spec.num_draft_tokens if s.spec.enabled else 1)
        sizes, ctxs = graph_buckets(dc.graph_batch_sizes, rows, dc.graph_context_tiers,
                                    dc.graph_max_context, mc.max_context_len)
        if ctxs[-1] < mc.max_context_len:
            log.warning("decode graphs cover %d of the model's %d context tokens (device.graph_max_context): rows "
                        "past %d decode eagerly, host-bound (about 24 ms an iteration whatever the batch on the "
                        "H200 Qwen3-30B-A3B shape, against 4-20 ms replayed)", ctxs[-1], mc.max_context_len, ctxs[-1])
        self.graphs = self.new_decode_graphs(sizes, ctxs, ctx)
        self.graphs.capture_all()
        return len(self.graphs.graphs)

    def new_decode_graphs(self, sizes: tuple[int, ...], ctxs: tuple[int, ...], ctx: PhaseContext):
        """The decode graph set of this runner's passes (not captured yet)."""
        from .cuda_graphs import DecodeGraphs
        return DecodeGraphs(self, sizes, ctxs, self.scratch_slot, ctx, self.phase_stream(ctx))

    def phase_stream(self, ctx: PhaseContext) -> torch.cuda.Stream:
        """The CUDA stream ``ctx``'s graphs are captured on (:func:`.cuda_graphs.phase_capture`): its
        stream's own CUDA stream on a device, else (a runner driven without one: benchmarks) a stream
        this runner keeps for that phase. Never one stream for two phases."""
        if ctx.stream is not None:
            return ctx.stream.device.cuda_stream(ctx.stream.name)
        if ctx.phase not in self._phase_streams:
            idx = torch.device(self.device).index          # "cuda" alone: the current device's streams
            idx = (torch.cuda.current_device() if torch.cuda.is_available() else 0) if idx is None else idx
            self._phase_streams[ctx.phase] = take(cuda_stream_key(idx, 0), lambda: torch.cuda.Stream(device=idx))
        return self._phase_streams[ctx.phase]

    def prefill_graphs_refusal(self) -> str | None:
        """Why P passes cannot replay captured graphs here (None: they can)."""
        dc, mc, sc = self.sections.device, self.sections.model, self.sections.scheduler
        if not dc.prefill_graphs or not prefill_graph_buckets(dc.prefill_graph_tokens, sc.max_prefill_tokens):
            return "off (device.prefill_graphs / prefill_graph_tokens)"
        if self.device.type != "cuda":
            return "no CUDA device"
        if mc.dtype == "float32":
            return "fp32 model (the oracle path stays eager)"
        if self.model.attn_backend is None or self.model.attn_backend.name != "triton" or self.moe_backend != "triton":
            return "needs the triton attention and MoE backends"
        if self.ep is not None or not self.model.holds_all_experts or self.model.tp_shard[1] != 1:
            return "P is not local (expert parallelism or attention TP)"
        if self.routed is not None:
            return "routing replay records in the eager pass"
        return None

    def capture_prefill_graphs(self, ctx: PhaseContext) -> int:
        """CUDA only: capture the P graphs of every token bucket (:mod:`.prefill_graphs`) on the P
        phase ``ctx``'s stream; 0 and a log line saying why when P cannot replay here."""
        from .prefill_graphs import PrefillGraphs
        why = self.prefill_graphs_refusal()
        if why is not None:
            log.info("P passes run eagerly: %s", why)
            return 0
        sc = self.sections
        buckets = prefill_graph_buckets(sc.device.prefill_graph_tokens, sc.scheduler.max_prefill_tokens)
        self.pgraphs = PrefillGraphs(self.model, lambda: self.kv_cache, buckets, self.scratch_slot, self.device,
                                     self.phase_stream(ctx))
        self.pgraphs.capture_all()
        return len(self.pgraphs.graphs)

    def release_cuda(self) -> None:  # pragma: no cover - CUDA only
        """Give the device memory back (no work in flight), to the driver too: the process's next
        worker sizes its pool on the whole card (:func:`~..kv.residency.collect_device_memory`)."""
        release_kv_state(self)
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for s in self._phase_streams.values():       # the next runner's GEMMs reuse their cuBLAS workspaces
            give_back(cuda_stream_key(s.device_index, 0), s)
        self._phase_streams.clear()
        collect_device_memory(self.device)

    def release_prefill_graphs(self) -> None:
        if self.pgraphs is not None:
            self.pgraphs.release()
        self.pgraphs = None

    @property
    def num_layers(self) -> int:
        return self.sections.model.num_layers


def graph_captures(runner: ModelRunner, dctx: PhaseContext, pctx: PhaseContext) -> tuple:
    """Each phase's graph capture, D's then P's, as (its context, the runner's capture, the stream
    item's label, "D.capture" / "P.capture"): each is submitted on its phase's own stream and
    launcher, one after the other (engine start, wake; :func:`.cuda_graphs.phase_capture`)."""
    return tuple((ctx, capture, f"{ctx.stream.name}.capture")
                 for ctx, capture in ((dctx, runner.capture_decode_graphs), (pctx, runner.capture_prefill_graphs)))
