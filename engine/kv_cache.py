"""The paged KV cache: per-layer K and V pools on the device, and a host pool for swapped-out blocks."""
from __future__ import annotations

import logging

import torch

from engine.config import KV_CACHE_LAYOUTS, ModelConfig
from engine.uploads import upload

logger = logging.getLogger(__name__)


class KVCache:
    """K and V of shape [num_blocks, block_size, num_kv_heads, head_dim] per layer.

    All of it is one allocation, `stacked` [num_layers, 2, num_blocks, *block], so a block of
    every layer moves in one op (swapping to and from the host pool). A block is stored as
    `layout` says: "nhd", [block_size, num_kv_heads, head_dim] (each slot's heads together), or
    "hnd", [num_kv_heads, block_size, head_dim] (each head's slots together: a decode kernel's
    tile of one head is one run of memory; bench/gather_ceiling.py). `layers[i]` is
    (stacked[i, 0], stacked[i, 1]) viewed as [num_blocks, block_size, num_kv_heads, head_dim]
    either way (contiguous for nhd), which is how every kernel and transfer indexes it.
    `dtype` may be torch.float8_e4m3fn (values stored divided by k_scale / v_scale).
    Host swap space is a pinned (on CUDA) pool with the same layout, `num_host_blocks` deep.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_host_blocks: int = 0,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        layout: str = "nhd",
    ) -> None:
        self.num_blocks, self.block_size, self.dtype, self.layout = num_blocks, block_size, dtype, layout
        self.k_scale, self.v_scale = k_scale, v_scale
        if layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_layout: must be one of {KV_CACHE_LAYOUTS}, got {layout!r}")
        heads, dim = config.num_kv_heads, config.head_dim
        block = (block_size, heads, dim) if layout == "nhd" else (heads, block_size, dim)
        self.stacked = torch.zeros((config.num_layers, 2, num_blocks, *block), dtype=dtype, device=device)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self._indexed(kv[0]), self._indexed(kv[1])) for kv in self.stacked]
        self.num_host_blocks = num_host_blocks
        pin = device.type == "cuda"
        host_shape = (config.num_layers, 2, num_host_blocks, *block)
        self.host = torch.zeros(host_shape, dtype=dtype, pin_memory=pin) if num_host_blocks else None

    def _indexed(self, pool: torch.Tensor) -> torch.Tensor:
        """A layer's K or V pool as [num_blocks, block_size, num_kv_heads, head_dim]."""
        return pool.transpose(1, 2) if self.layout == "hnd" else pool

    @staticmethod
    def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
        """What K and V are stored as for --kv-cache-dtype: auto (the model's dtype) or fp8 (e4m3)."""
        return {"auto": model_dtype, "fp8": torch.float8_e4m3fn}[kv_cache_dtype]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem

    def swap_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        src = upload(device_blocks, torch.long, self.stacked.device)
        dst = torch.tensor(host_blocks, dtype=torch.long)
        self.host[:, :, dst] = self.stacked.index_select(2, src).to("cpu")

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        src = torch.tensor(host_blocks, dtype=torch.long)
        dst = upload(device_blocks, torch.long, self.stacked.device)
        blocks = self.host[:, :, src].to(self.stacked.device, non_blocking=True)
        if self.dtype.itemsize == 1:  # torch has no index_copy_ for FP8 dtypes: copy their bytes
            self.stacked.view(torch.uint8).index_copy_(2, dst, blocks.view(torch.uint8))
        else:
            self.stacked.index_copy_(2, dst, blocks)
