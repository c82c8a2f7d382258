"""The paged KV layout's own read ceiling: the decode kernel's gather, with no attention math.

    python3 bench/gather_ceiling.py [--order sequential] [--out FILE]

A Triton kernel reads what stage 1 of `tandem_kernels.decode_attention` reads, on the same grid
((sequence, KV head, split), the split count from its `choose_splits`) and through the same
block table, K and V tiles of `block_n` tokens of one KV head, and folds them into an XOR of
32-bit words (one ALU op per 4 bytes, so the loads are all it does). Timed in GB/s beside the
decode kernel on the same caches and the device copy, for bf16 and FP8 caches and two layouts
of a block:

- `nhd`: the engine's, [blocks, block_size, kv_heads, head_dim]: a program reads one head's row
  of each slot, 128 bytes (FP8) or 256 (bf16) a slot, kv_heads rows apart;
- `hnd`: [blocks, kv_heads, block_size, head_dim]: a block's slots contiguous for each head, one
  run of block_size rows (vLLM's and FlashInfer's HND layout).

The gather's loads go straight to registers (Triton stages through shared memory only loads
that feed a dot), and with ~60 registers an SM holds 8 of its programs at FP8 rows (4 at bf16):
more bytes in flight than the decode kernel keeps (compiled for sm_90 by Triton 3.6, read with
bench/kernel_ir.py's `report`). If the decode kernel reads near the nhd gather, the layout is
what bounds it and hnd says what a layout change could give; if the gather is far faster, the
kernel's own loop is the limit. The decode kernel addresses its caches through their strides, so
it is timed on the hnd storage too (viewed in the engine's index order): what the kernel itself
would read after a layout change.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tandem_kernels.decode_stage1 import _program_split  # noqa: E402
from tandem_kernels.triton_common import first_tile_blocks, next_tile_blocks  # noqa: E402

LAYOUTS = ("nhd", "hnd")


@triton.jit
def _gather_kv(k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr,
               c_s0, c_s1, c_s2, bt_s0,
               WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               MIN_PARTITION: tl.constexpr, AHEAD: tl.constexpr):
    """XOR of every 32-bit word of K and V that stage 1's program (b, kvh, split) reads; the
    caches are int32 views, c_s0 / c_s1 / c_s2 their block / slot / head strides in words."""
    b, kvh, split, _, start, end = _program_split(ctx_ptr, MIN_PARTITION, BLOCK_N)
    w = tl.arange(0, WORDS)
    acc = tl.zeros([BLOCK_N, WORDS], tl.int32)
    bt_row = bt_ptr + b * bt_s0
    blk_next = first_tile_blocks(bt_row, start, end, BLOCK_N, BLOCK_SIZE, AHEAD)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs < end
        blk, blk_next = next_tile_blocks(blk_next, bt_row, n0, end, BLOCK_N, BLOCK_SIZE, AHEAD)
        rows = (blk * c_s0 + (offs % BLOCK_SIZE) * c_s1 + kvh * c_s2)[:, None] + w[None, :]
        k = tl.load(k_ptr + rows, mask=n_mask[:, None], other=0)
        v = tl.load(v_ptr + rows, mask=n_mask[:, None], other=0)
        acc = acc ^ k ^ v
    folded = tl.xor_sum(tl.xor_sum(acc, 1), 0)
    tl.store(out_ptr + (b * tl.num_programs(1) + kvh) * tl.num_programs(2) + split, folded)


def as_layout(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """An engine-layout cache [blocks, block_size, kv_heads, head_dim] as `layout`'s storage,
    viewed back in the engine's index order (same values at the same indices)."""
    if layout == "nhd":
        return cache
    if layout == "hnd":
        return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    raise ValueError(f"layout: one of {LAYOUTS}, got {layout!r}")


def gather_checksums(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, splits: int, block_n: int = 64, min_partition: int = 64,
                     num_stages: int = 2, ahead: bool = False) -> torch.Tensor:
    """[batch, kv_heads, splits] int32: each program's XOR of the K and V words it read. The
    caches are indexed [blocks, block_size, kv_heads, head_dim] (any strides with head_dim
    contiguous, e.g. from `as_layout`), the same dtype, whole 32-bit words a row."""
    if k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share dtype and strides, head_dim contiguous")
    row_bytes = k_cache.shape[-1] * k_cache.element_size()
    if row_bytes % 4:
        raise ValueError(f"a head's row must be whole 32-bit words, got {row_bytes} bytes")
    per = 4 // k_cache.element_size()  # elements a word
    if any(st % per for st in k_cache.stride()[:3]):
        raise ValueError("the caches' block, slot and head strides must be whole 32-bit words")
    kw, vw = _words(k_cache), _words(v_cache)
    bsz, hk = block_tables.shape[0], k_cache.shape[2]
    out = torch.empty((bsz, hk, splits), dtype=torch.int32, device=k_cache.device)
    s0, s1, s2, _ = (st // per for st in k_cache.stride())
    _gather_kv[(bsz, hk, splits)](kw, vw, block_tables, context_lens, out, s0, s1, s2, block_tables.stride(0),
                                  WORDS=row_bytes // 4, BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[1],
                                  MIN_PARTITION=max(min_partition, block_n), AHEAD=ahead and num_stages > 2,
                                  num_warps=4, num_stages=num_stages)
    return out


def _words(cache: torch.Tensor) -> torch.Tensor:
    """The cache's storage as int32 words from its first element (its strides over 4 / element
    size index them)."""
    per = 4 // cache.element_size()
    left = cache.untyped_storage().nbytes() // cache.element_size() - cache.storage_offset()
    flat = torch.as_strided(cache, (left // per * per,), (1,), cache.storage_offset())
    return flat.view(torch.uint8).view(torch.int32)


def reference_checksums(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor) -> torch.Tensor:
    """[batch, kv_heads]: the XOR of the words of every K and V row of each sequence's context
    (what the splits of `gather_checksums` together read)."""
    bsz, hk, bs = block_tables.shape[0], k_cache.shape[2], k_cache.shape[1]
    out = [[0] * hk for _ in range(bsz)]
    for b in range(bsz):
        for t in range(int(context_lens[b])):
            blk = int(block_tables[b, t // bs])
            for c in (k_cache, v_cache):
                words = c[blk, t % bs].contiguous().view(torch.uint8).view(torch.int32).cpu()  # [kv_heads, words]
                for h in range(hk):
                    for word in words[h].tolist():
                        out[b][h] ^= word  # Python's XOR of negative ints is two's complement's
    return torch.tensor(out, dtype=torch.int32)


def measure(order: str) -> list[list]:
    """Rows [cache, layout, batch, ctx, block_n, stages, ahead, GB/s, the decode kernel's GB/s on
    the same caches (its default tuning), copy GB/s]."""
    from bench.kernel_bench import Shapes, bench_ms, ceilings, paged_kv
    from tandem_kernels import decode_attention as da
    from tandem_kernels.triton_common import num_sms

    copy = round(ceilings(Shapes(tokens=256, inter=256))["copy_gbps"])
    rows: list[list] = []
    for batch, ctx in ((384, 1024), (64, 4096), (512, 1536)):
        s = Shapes(decode_batch=batch, decode_ctx=ctx)
        for cache in (torch.bfloat16, torch.float8_e4m3fn):
            kc, vc, table, cl = paged_kv([ctx] * batch, s, cache, "cuda", order=order)
            tuning = da.default_tuning(cache)
            splits = da.choose_splits(batch, s.hk, table.shape[1] * s.block_size, num_sms(kc.device), tuning)
            moved = 2 * batch * ctx * s.hk * s.d * kc.element_size()
            q = torch.randn(batch, s.hq, s.d, device="cuda", dtype=torch.bfloat16)
            for layout in LAYOUTS:
                k, v = as_layout(kc, layout), as_layout(vc, layout)
                decode = round(moved / bench_ms(lambda: da.paged_decode_attention(q, k, v, table, cl, s.d ** -0.5),
                                                reps=30) / 1e6)
                for block_n, stages, ahead in ((64, 2, False), (64, 3, True), (64, 4, True), (128, 3, True)):
                    def fn(k=k, v=v, block_n=block_n, stages=stages, ahead=ahead):
                        return gather_checksums(k, v, table, cl, splits, block_n, tuning.min_partition, stages, ahead)
                    try:
                        gbps = round(moved / bench_ms(fn, reps=30) / 1e6)
                    except Exception as exc:  # a configuration that does not fit
                        gbps = repr(exc)[:80]
                    rows.append([str(cache).split(".")[-1], layout, batch, ctx, block_n, stages, ahead, gbps,
                                 decode, copy])
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                del k, v
            del kc, vc
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--order", default="sequential", choices=("random", "sequential"),
                   help="where each sequence's blocks lie (bench.kernel_bench.paged_kv)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("gather_ceiling times the GPU; tests/test_kernels.py checks the kernel on the CPU", file=sys.stderr)
        return 2
    res = {"command": "python3 bench/gather_ceiling.py " + " ".join(sys.argv[1:]),
           "device": torch.cuda.get_device_name(),
           "rows [cache, layout, batch, ctx, block_n, stages, ahead, gather GB/s, decode GB/s, copy GB/s]":
               measure(a.order)}
    print(json.dumps(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
