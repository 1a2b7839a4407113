"""ModelRunner: owns the KV block pool tensor and turns a ScheduledBatch into one forward pass.

It builds the flat token inputs, slot mapping, padded block tables and masks (AttentionMetadata)
on the CPU in a few vectorised ops, runs models/llama.py once for the whole batch, streams
prefill KV to on_kv callbacks layer by layer, and returns logits only for the rows that sample.
The KV pool is [layers, 2 (k|v), blocks, block_size, kv_heads, head_dim], preallocated once.
"""

from __future__ import annotations

from collections.abc import Sequence as Sequence_

import torch

from splitserve_workers.engine.layers import cpu_decode_attention
from splitserve_workers.engine.layers.attention import AttentionMetadata
from splitserve_workers.engine.model_config import ModelConfig
from splitserve_workers.engine.models.llama import KVHook, LlamaForCausalLM
from splitserve_workers.engine.sequence import Sequence


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        cpu_decode_kernel: bool = True,
    ) -> None:
        self.model = model
        self.cfg = model_config
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.kv_cache = torch.zeros(
            model_config.num_layers,
            2,
            num_blocks,
            block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype=dtype,
            device=device,
        )
        # Decode attention straight from the block pool on the CPU (layers/cpu_decode_attention);
        # None: the torch path (another device, turned off, or no compiler to build it with).
        lib = cpu_decode_attention.load() if cpu_decode_kernel and device.type == "cpu" else None
        self.decode_kernel = (
            lib
            if lib is not None
            and cpu_decode_attention.supports(
                lib, self.kv_cache[0, 0], model_config.num_heads, model_config.head_dim
            )
            else None
        )

    # ---- slot arithmetic -------------------------------------------------------------------
    def slots(self, block_table: list[int], start: int, n: int) -> torch.Tensor:
        """Flat cache slots of token positions [start, start + n) of one sequence (CPU)."""
        pos = torch.arange(start, start + n)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _flat(self, layer: int, kv: int) -> torch.Tensor:
        return self.kv_cache[layer, kv].view(-1, self.cfg.num_kv_heads, self.cfg.head_dim)

    def read_kv(
        self, layer: int, block_table: list[int], start: int, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.slots(block_table, start, n).to(self.device)
        return self._flat(layer, 0).index_select(0, idx), self._flat(layer, 1).index_select(0, idx)

    def write_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v: [n, kv_heads, head_dim] into `layer`, or [layers, n, kv_heads, head_dim] into
        that many layers from `layer`, at flat cache slots `slots` ([n], on the device): one
        index_copy_ per side however many layers."""
        if k.dim() == 3:
            k, v = k.unsqueeze(0), v.unsqueeze(0)
        n, kvH, D = k.shape[0], self.cfg.num_kv_heads, self.cfg.head_dim
        for side, t in ((0, k), (1, v)):
            pool = self.kv_cache[layer : layer + n, side].view(n, -1, kvH, D)
            pool.index_copy_(1, slots, t.to(self.device))

    # ---- forward passes --------------------------------------------------------------------
    @torch.inference_mode()
    def run_prefill(
        self, seqs: list[Sequence], counts: list[int], all_rows: Sequence_[int] = ()
    ) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
        """Computes KV for tokens [computed, computed + n) of each sequence. Returns logits for
        the sequences whose prompt this pass completes, their indices in seqs, and for each
        index in all_rows the final hidden state of every token it computed ([n, hidden]:
        prompt logprobs)."""
        starts = [s.num_computed_tokens for s in seqs]
        ids = [
            t
            for s, st, n in zip(seqs, starts, counts, strict=True)
            for t in s.token_ids[st : st + n]
        ]
        hidden = self._forward_chunks(
            seqs, starts, counts, ids, self._kv_hook(seqs, starts, counts)
        )
        self.mark_exported(seqs, starts, counts)
        done = [
            i
            for i, (seq, st, n) in enumerate(zip(seqs, starts, counts, strict=True))
            if st + n == seq.num_tokens
        ]
        ends = torch.tensor(counts).cumsum(0) - 1
        rows = ends[done].to(self.device)
        every = [hidden[int(ends[i]) - counts[i] + 1 : int(ends[i]) + 1] for i in all_rows]
        return self.model.compute_logits(hidden.index_select(0, rows)), done, every

    @torch.inference_mode()
    def run_verify(self, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
        """Speculative decoding (speculative.py): each sequence's last token (whose KV is not
        cached yet) and its draft tokens in one pass on top of the cached context; the drafts'
        blocks are already allocated. Returns logits for every row: sum(1 + len(draft))."""
        starts = [s.num_tokens - 1 for s in seqs]
        counts = [1 + len(d) for d in drafts]
        ids = [t for s, d in zip(seqs, drafts, strict=True) for t in (s.token_ids[-1], *d)]
        return self.model.compute_logits(self._forward_chunks(seqs, starts, counts, ids, None))

    def _forward_chunks(
        self,
        seqs: list[Sequence],
        starts: list[int],
        counts: list[int],
        ids: list[int],
        hook: KVHook | None,
    ) -> torch.Tensor:
        """One pass over token positions [starts[b], starts[b] + counts[b]) of each sequence
        (token ids `ids`, flat) on top of its cached context. Returns every row's hidden state."""
        bs = self.block_size
        B = len(seqs)
        Q = max(counts)
        L = max(st + n for st, n in zip(starts, counts, strict=True))
        pos_parts: list[torch.Tensor] = []
        slot_parts: list[torch.Tensor] = []
        nb = -(-L // bs)
        tables = torch.zeros(B, nb, dtype=torch.long)
        for b, (seq, st, n) in enumerate(zip(seqs, starts, counts, strict=True)):
            pos = torch.arange(st, st + n)
            table = torch.tensor(seq.block_table[:nb], dtype=torch.long)
            tables[b, : len(table)] = table
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
        positions = torch.cat(pos_parts)
        slot_mapping = torch.cat(slot_parts)
        uniform = all(n == Q for n in counts)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device),
            batch_size=B,
            max_q=Q,
            kv_len=L,
            causal_fresh=uniform and all(st == 0 for st in starts),
        )
        window = self.cfg.sliding_window
        windowed = window is not None and L > window  # some query is a window past a key
        if not meta.causal_fresh or windowed:
            # Built where attention runs: a [B, Q, L] mask made on the host and copied cost
            # ~12 ms at B=128, Q=5, L=8192 (a speculative pass over long contexts).
            dev = self.device
            n_t = torch.tensor(counts, device=dev)
            qi = torch.arange(Q, device=dev)
            kj = torch.arange(L, device=dev)[None, None, :]
            q_pos = (torch.tensor(starts, device=dev)[:, None] + qi[None, :])[:, :, None]
            pad_rows = (qi[None, :] >= n_t[:, None])[:, :, None]  # attend key 0 only

            def with_mask(mask: torch.Tensor, base: AttentionMetadata) -> AttentionMetadata:
                base.attn_mask = torch.where(pad_rows, kj == 0, mask).unsqueeze(1)
                base.block_tables = tables.to(self.device)
                if not uniform:
                    base.pad_index = torch.cat(
                        [b * Q + torch.arange(n) for b, n in enumerate(counts)]
                    ).to(self.device)
                return base

            if not meta.causal_fresh:
                with_mask(kj <= q_pos, meta)  # [B, Q, L]
            if windowed:
                assert window is not None
                meta.windowed = with_mask(
                    (kj <= q_pos) & (kj > q_pos - window),
                    AttentionMetadata(meta.slot_mapping, B, Q, L),
                )

        return self.model(
            torch.tensor(ids, dtype=torch.long).to(self.device),
            positions.to(self.device),
            self.kv_cache,
            meta,
            hook,
        )

    @torch.inference_mode()
    def run_decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One token per sequence (the last one, whose KV is not cached yet). Returns logits."""
        bs = self.block_size
        B = len(seqs)
        ctx = [s.num_tokens for s in seqs]
        L = max(ctx)
        nb = -(-L // bs)
        # One tensor from padded lists: a per-row torch.tensor + slice copy cost ~10 us each.
        rows = [s.block_table[:nb] for s in seqs]
        tables = torch.tensor([r + [0] * (nb - len(r)) for r in rows], dtype=torch.long)
        ctx_t = torch.tensor(ctx)
        last = ctx_t - 1
        slot_mapping = tables.gather(1, (last // bs).unsqueeze(1)).squeeze(1) * bs + last % bs
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device),
            batch_size=B,
            max_q=1,
            kv_len=L,
            block_tables=tables.to(self.device),
        )
        window = self.cfg.sliding_window
        if self.decode_kernel is not None:
            # The kernel takes each sequence's length (and window start) instead of masks.
            meta.cpu_decode = cpu_decode_attention.decode_batch(self.decode_kernel, tables, ctx_t)
            if window is not None and L > window:
                starts = (ctx_t - window).clamp(min=0)
                meta.windowed = AttentionMetadata(
                    meta.slot_mapping, B, 1, L, meta.block_tables,
                    cpu_decode=cpu_decode_attention.decode_batch(
                        self.decode_kernel, tables, ctx_t, starts
                    ),
                )  # fmt: skip
        elif any(c != L for c in ctx):
            meta.attn_mask = (
                (torch.arange(L)[None, :] < ctx_t[:, None]).view(B, 1, 1, L).to(self.device)
            )
        if self.decode_kernel is None and window is not None and L > window:
            kj = torch.arange(L)[None, :]
            in_window = (kj < ctx_t[:, None]) & (kj >= ctx_t[:, None] - window)
            mask = in_window.view(B, 1, 1, L).to(self.device)
            meta.windowed = AttentionMetadata(
                meta.slot_mapping, B, 1, L, meta.block_tables, attn_mask=mask
            )
        ids = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.long)
        hidden = self.model(ids.to(self.device), last.to(self.device), self.kv_cache, meta)
        return self.model.compute_logits(hidden)

    def _kv_hook(self, seqs: list[Sequence], starts: list[int], counts: list[int]) -> KVHook | None:
        """Per-layer callback streaming each prompt token's KV to its request's on_kv exactly
        once: tokens already in the cache (prefix hits) first, then this pass's new tokens."""
        targets: list[tuple[Sequence, int, int, int]] = []
        offset = 0
        for seq, st, n in zip(seqs, starts, counts, strict=True):
            if seq.on_kv is not None:
                targets.append((seq, offset, st, n))
            offset += n
        if not targets:
            return None

        def hook(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            for seq, off, st, n in targets:
                assert seq.on_kv is not None
                end = min(st + n, seq.num_prompt_tokens)
                first = seq.kv_exported
                if first < st:  # cached prefix not yet exported: read it from the blocks
                    ck, cv = self.read_kv(layer, seq.block_table, first, st - first)
                    seq.on_kv(seq.request_id, layer, first, ck, cv)
                    first = st
                if first < end:
                    a, b = off + first - st, off + end - st
                    seq.on_kv(seq.request_id, layer, first, k[a:b], v[a:b])

        return hook

    @staticmethod
    def mark_exported(seqs: list[Sequence], starts: list[int], counts: list[int]) -> None:
        for seq, st, n in zip(seqs, starts, counts, strict=True):
            if seq.on_kv is not None:
                seq.kv_exported = max(seq.kv_exported, min(st + n, seq.num_prompt_tokens))
