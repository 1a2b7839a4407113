"""Paged attention on top of torch scaled_dot_product_attention.

New K/V rows are written into the per-layer block pool with one index_copy_ (slot mapping);
then each sequence's context is gathered from its block table in one indexing op per layer
for the whole batch and attended with SDPA. Sequences of different lengths are padded to the
longest one with a boolean mask; sliding-window layers use a second mask that also hides keys
a window or more behind the query (`windowed`). GQA is handled by folding the query-head
groups into the query-length axis, so K/V are never repeated per head. model_runner.py builds
the metadata. Decode passes on the CPU skip the gather where the kernel of cpu_decode_attention.c
could be built: it reads each sequence's blocks in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitserve_workers.engine.layers.cpu_decode_attention import DecodeBatch, decode_attention

_TORCH_VERSION = tuple(int(p) for p in torch.__version__.split(".")[:2])
_SDPA_HAS_GQA = _TORCH_VERSION >= (2, 5)


@dataclass
class AttentionMetadata:
    """Shapes and indices for one forward pass, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) per new token
    batch_size: int  # B sequences
    max_q: int  # Q: longest query (new tokens) of any sequence
    kv_len: int  # L: longest context (cached + new) of any sequence
    # [B, blocks] block ids, padded with 0 (masked out); None on the fresh-causal path.
    block_tables: torch.Tensor | None = None
    # [B, 1, Q, L] True = attend; None when every sequence has the same full context.
    attn_mask: torch.Tensor | None = None
    # [T] position of each flat token in the padded [B * Q] layout; None when T == B * Q.
    pad_index: torch.Tensor | None = None
    # Every sequence is a whole prompt of the same length with nothing cached: attend to the
    # freshly computed K/V with is_causal (no gather, no explicit mask).
    causal_fresh: bool = False
    # For the sliding-window layers, when some query is a window or more past a key it could
    # otherwise see: the same pass with the window in its mask. None: the window cuts nothing.
    windowed: AttentionMetadata | None = None
    # Decode on the CPU with the kernel built (cpu_decode_attention.py): each sequence's
    # length (and window start) with its block table, which the kernel reads the pool with
    # instead of gathering. None: the torch path.
    cpu_decode: DecodeBatch | None = None
    _grouped_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def grouped_mask(self, groups: int) -> torch.Tensor | None:
        """The mask with each query row repeated per head group ([B, 1, G * Q, L])."""
        if self.attn_mask is None or self.max_q == 1 or groups == 1:
            return self.attn_mask
        if groups not in self._grouped_masks:
            self._grouped_masks[groups] = self.attn_mask.repeat(1, 1, groups, 1)
        return self._grouped_masks[groups]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k/v: [T, kv_heads, head_dim] into the pools [blocks, block_size, kv_heads, head_dim]."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, head_dim]; k/v: [T, kv_heads, head_dim] (new tokens, RoPE applied).
    Returns [T, heads * head_dim]."""
    T, H, D = q.shape
    kvH = k.shape[1]
    G = H // kvH
    B, Q, L = meta.batch_size, meta.max_q, meta.kv_len
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)

    if meta.causal_fresh:
        qb = q.view(B, Q, H, D).transpose(1, 2)
        kb = k.view(B, Q, kvH, D).transpose(1, 2)
        vb = v.view(B, Q, kvH, D).transpose(1, 2)
        if _SDPA_HAS_GQA:
            out = F.scaled_dot_product_attention(
                qb, kb, vb, is_causal=True, scale=scale, enable_gqa=G > 1
            )
        else:
            kb = kb.repeat_interleave(G, dim=1)
            vb = vb.repeat_interleave(G, dim=1)
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        return out.transpose(1, 2).reshape(T, H * D)

    assert meta.block_tables is not None
    if meta.cpu_decode is not None:
        return decode_attention(meta.cpu_decode, q, k_cache, v_cache, scale)
    # One gather per layer for the whole batch: [B * blocks, bs, kvH, D] -> [B, L, kvH, D].
    # index_select on flat block ids is ~10x cheaper than advanced indexing on CPU.
    flat = meta.block_tables.view(-1)
    kc = k_cache.index_select(0, flat).view(B, -1, kvH, D)[:, :L].transpose(1, 2)
    vc = v_cache.index_select(0, flat).view(B, -1, kvH, D)[:, :L].transpose(1, 2)

    if meta.pad_index is not None:
        qp = q.new_zeros(B * Q, H, D)
        qp.index_copy_(0, meta.pad_index, q)
    else:
        qp = q
    if Q == 1:
        qg = qp.view(B, kvH, G, D)
    else:
        qg = qp.view(B, Q, kvH, G, D).permute(0, 2, 3, 1, 4).reshape(B, kvH, G * Q, D)
    out = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=meta.grouped_mask(G), scale=scale)
    if Q == 1:
        out = out.reshape(B, H * D)
    else:
        out = out.view(B, kvH, G, Q, D).permute(0, 3, 1, 2, 4).reshape(B * Q, H * D)
    if meta.pad_index is not None:
        out = out.index_select(0, meta.pad_index)
    return out
