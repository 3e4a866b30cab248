"""Unmerged LoRA in the forward: y = x W^T + s (x A) B, per token, for adapters in fixed slots.

Every adapted linear layer holds one A of shape [in, shards * L * R] and one B per fused shard of shape
[L * R, out] (L = max_loras slots, R = max_lora_rank; an adapter of rank r < R leaves its spare rows
zero, which is exact). A step computes x @ A for all slots at once, multiplies by a per-token mask that
holds the scale of the token's slot on that slot's R columns and 0 elsewhere, then adds mask(xA) @ B
into the shard's columns of the output. Slot 0 is the base model: its mask row is all zeros.

Why this shape: it is a fixed set of dense matmuls whose inputs live in fixed buffers, so a CUDA graph
captured once replays correctly for any mix of adapters (the per-token slots sit in a static buffer)
and a reload is an in-place copy. Its cost grows with L * R, which suits a few adapters of modest rank.
"""

from __future__ import annotations

import torch

from rollout.distributed import TPGroup


class LoraState:
    """What every adapted layer of one step shares: the scale table and this step's per-token mask."""

    def __init__(self, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank = max_loras, max_rank
        width = max_loras * max_rank
        self.scales = torch.zeros(max_loras + 1, width, dtype=dtype, device=device)  # row 0: base
        self.mask: torch.Tensor | None = None
        self.active = False

    def begin(self, token_slots: torch.Tensor | None) -> None:
        """Set the step's per-token slots (int64 [T]); None: no token uses an adapter, skip the work."""
        self.active = token_slots is not None
        self.mask = self.scales[token_slots] if token_slots is not None else None

    def set_scale(self, slot: int, scale: float) -> None:
        R = self.max_rank
        self.scales[slot].zero_()
        self.scales[slot, (slot - 1) * R : slot * R] = scale


class LoraLinear:
    """The adapter slots of one linear layer (fused shards side by side). A plain object, not a module:
    its tensors stay out of the model's parameters, checkpoints and weight syncs."""

    def __init__(
        self,
        state: LoraState,
        in_local: int,
        out_parts: list[list[int]],
        *,
        row_parallel: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ):
        """out_parts: per fused shard, the HF sizes of the head-sharded parts its output stacks (one part
        for a plain matrix; q|k|v for a DeltaNet in_proj_qkv). A column-parallel rank holds its slice of
        every part, as the layer does."""
        self.state, self.tp, self.row_parallel = state, tp, row_parallel
        self.width = state.max_loras * state.max_rank
        self.parts = [list(p) for p in out_parts]
        div = 1 if row_parallel else tp.size
        self.out_locals = [sum(n // div for n in p) for p in self.parts]
        self.offsets = [sum(self.out_locals[:i]) for i in range(len(self.out_locals))]
        self.A = torch.zeros(in_local, len(self.parts) * self.width, dtype=dtype, device=device)
        self.B = [torch.zeros(self.width, n, dtype=dtype, device=device) for n in self.out_locals]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.A, *self.B))

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[:, shard] += (x A_shard * mask) B_shard, in place. Row-parallel layers call it before their
        all-reduce: the partial sums of x A add up across ranks like those of x W."""
        state = self.state
        if not state.active:
            return
        xa = x @ self.A
        W = self.width
        for i, B in enumerate(self.B):
            part = xa[:, i * W : (i + 1) * W] * state.mask
            y.narrow(-1, self.offsets[i], self.out_locals[i]).addmm_(part, B)

    def write(self, slot: int, shard: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Copy one HF module's lora_A [r, in] and lora_B [out, r] into `slot` (None: zeros, the module is
        not adapted), sliced for this TP rank."""
        R, W = self.state.max_rank, self.width
        col = shard * W + (slot - 1) * R
        a_dst = self.A[:, col : col + R]
        b_dst = self.B[shard][(slot - 1) * R : slot * R]
        a_dst.zero_()
        b_dst.zero_()
        if a is None or b is None:
            return
        r = a.shape[0]
        a_t, b_t = a.t(), b.t()  # [in, r], [r, out]
        if self.row_parallel:
            n = self.A.shape[0]
            a_t = a_t.narrow(0, self.tp.rank * n, n)
        else:
            b_t = torch.cat(self._rank_columns(b_t, self.parts[shard]), dim=1)
        a_dst[:, :r].copy_(a_t)
        b_dst[:r].copy_(b_t)

    def _rank_columns(self, b_t: torch.Tensor, parts: list[int]) -> list[torch.Tensor]:
        """This rank's slice of each part of a full [r, out] B^T."""
        pieces, start = [], 0
        for whole in parts:
            n = whole // self.tp.size
            pieces.append(b_t.narrow(1, start + self.tp.rank * n, n))
            start += whole
        return pieces
