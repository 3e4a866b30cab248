"""Plain-torch attention over the paged cache: the CPU path and the reference for faster backends.

Gathering whole pages also gathers slots past each request's length, which hold whatever an earlier
request (or earlier weights) left there, NaN included. A mask alone does not stop those: softmax
weights of 0 times a stale NaN value is still NaN. So stale keys and values are replaced by zeros
before attention, and the mask keeps positions past the length out of the softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout.attention.base import AttentionBackend, AttnBatch


class TorchNativeBackend(AttentionBackend):
    def begin(self, batch: AttnBatch) -> tuple[AttnBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        dev = batch.seq_lens.device
        B, S = batch.batch_size, self.kv.page_size
        max_pages = -(-batch.max_seq_len // S)
        # kv_slots: [B, K] flat cache slot of each context position (K = max_pages * page_size)
        pages = batch.page_table[:, :max_pages].long()
        kv_slots = (pages.unsqueeze(-1) * S + torch.arange(S, device=dev)).reshape(B, -1)
        # mask: [B, 1, Q, K] True where query j may attend position p (causal, inside the request)
        q_pos = batch.seq_lens.unsqueeze(1) - torch.tensor(batch.q_lens, device=dev).unsqueeze(1)
        q_pos = q_pos + torch.arange(batch.max_q_len, device=dev)
        kv_pos = torch.arange(kv_slots.shape[1], device=dev)
        live = kv_pos.unsqueeze(0) < batch.seq_lens.unsqueeze(1)  # [B, K]: written by this request
        mask = (kv_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)) & live.unsqueeze(1)
        return batch, kv_slots, mask.unsqueeze(1), live.view(B, -1, 1, 1)

    def forward(self, q, k, v, layer, meta):
        batch, kv_slots, mask, live = meta
        self.kv.store(layer, batch.slot_mapping, k, v)
        k_cache, v_cache = self.kv.flat(layer)
        Q, H = batch.max_q_len, self.num_heads
        Hkv = k_cache.shape[1]
        # gather each request's context: [B, Hkv, K, D], stale slots zeroed (see the module docstring)
        keys = torch.where(live, k_cache[kv_slots], 0).transpose(1, 2)
        vals = torch.where(live, v_cache[kv_slots], 0).transpose(1, 2)
        if Hkv != H:
            keys = keys.repeat_interleave(H // Hkv, dim=1)
            vals = vals.repeat_interleave(H // Hkv, dim=1)
        qp = _pad(q, batch, Q).transpose(1, 2)  # [B, H, Q, D]
        out = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=mask, scale=self.sm_scale)
        return _unpad(out.transpose(1, 2), batch)


def _pad(x: torch.Tensor, batch: AttnBatch, q: int) -> torch.Tensor:
    if batch.decode:
        return x.unsqueeze(1)
    out = x.new_zeros(batch.batch_size, q, *x.shape[1:])
    for b, chunk in enumerate(x.split(batch.q_lens)):
        out[b, : chunk.shape[0]] = chunk
    return out


def _unpad(x: torch.Tensor, batch: AttnBatch) -> torch.Tensor:
    if batch.decode:
        return x.squeeze(1)
    return torch.cat([x[b, :n] for b, n in enumerate(batch.q_lens)])
