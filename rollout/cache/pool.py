"""The paged KV cache: one tensor of fixed-size pages for every layer's keys and values."""

from __future__ import annotations

import torch


class KVPool:
    """`num_pages` pages for sequences plus one scratch page (index `scratch_page`, never handed out):
    padding rows of a CUDA-graph batch write their k/v there and attend to it."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.dtype, self.device = num_kv_heads, head_dim, dtype, device
        self.scratch_page = num_pages
        self.data: torch.Tensor | None = None
        self.allocate()

    @property
    def shape(self) -> tuple[int, ...]:
        # [layer, k|v, page, slot in page, kv head, head dim]
        return (self.num_layers, 2, self.num_pages + 1, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize

    def allocate(self) -> None:
        self.data = torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def free(self) -> None:
        self.data = None

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v caches of one layer: [num_pages, page_size, Hkv, D] each."""
        return self.data[layer, 0], self.data[layer, 1]

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v caches of one layer indexed by slot: [num_pages * page_size, Hkv, D] each."""
        k, v = self.layer(layer)
        return k.flatten(0, 1), v.flatten(0, 1)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_flat, v_flat = self.flat(layer)
        k_flat.index_copy_(0, slots, k.to(self.dtype))
        v_flat.index_copy_(0, slots, v.to(self.dtype))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
