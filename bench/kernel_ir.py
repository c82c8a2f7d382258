"""What Triton builds for the attention kernels on a Hopper GPU, from any machine (no GPU needed).

    python bench/kernel_ir.py [--batch 384 --ctx 1024] [--tuning JSON ...] [--dump DIR] [--pdl] [--rotary]
    (at --batch 8 or below, the four decode GEMVs of tandem_kernels.gemv too)

The decode kernel is reported at its cache's default tuning, then at the tuning the engine picks
for --batch where that differs (FP8 caches' FP8_WIDE_TUNING at full batches), then at each --tuning.

Each kernel is compiled for sm_90 as its launch would specialize it (the launchers'
`stage1_launch` / `extend_launch` on tensors of the meta device give the arguments and constants),
and reported: registers and spilled bytes (cuobjdump on the cubin), shared memory, the programs an
SM can hold, the instructions a warp issues in an iteration of its KV loop by the unit they use
(`loop_mix`, from the SASS), and how its KV loop is pipelined: `staged_tiles`, the K/V tiles Triton keeps in
shared memory, and `groups_in_flight`, the copy groups a loop iteration leaves in flight when it
waits before a tile's math (0: every tile's copies are awaited before its math; the load never
overlaps the program's own compute). The decode kernel's FP8 slowness (BENCHMARKS.md §14) was
found this way: one staged tile, nothing in flight.

The report follows Triton's IR of the installed version, so read it beside that version.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

HOPPER = ("cuda", 90, 32)
SM_REGISTERS = 65536  # per SM on sm_90
SM_SHARED = 233472  # bytes of shared memory an SM can give its programs (228 KB)
SM_WARPS = 64
SM_PROGRAMS = 32

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}


def specialize(kernel, args: list, consts: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for triton's ASTSource, as a launch with `args` would
    specialize: pointers 16-byte aligned, integers equal to 1 folded, integers divisible by 16
    marked so (except the kernel's do_not_specialize ones), floats fp32."""
    names = [n for n in kernel.arg_names if n not in consts]
    if len(names) != len(args):
        raise ValueError(f"{kernel.__name__}: {len(args)} positional args for {len(names)} parameters")
    generic = {kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
    signature, constexprs, attrs = {}, {}, {}
    for name, value in zip(names, args):
        index = (kernel.arg_names.index(name),)
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[value.dtype]
            attrs[index] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, int):
            if name not in generic and value == 1:
                signature[name] = "constexpr"
                constexprs[index] = 1
                continue
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if name not in generic and value % 16 == 0:
                attrs[index] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"{name}: cannot specialize {type(value).__name__}")
    for name, value in consts.items():
        if name in kernel.arg_names:
            signature[name] = "constexpr"
            constexprs[(kernel.arg_names.index(name),)] = value
    return signature, constexprs, attrs


def compile_for_hopper(kernel, args: list, consts: dict):
    """The kernel compiled for sm_90 (no device needed) as a launch with `args` and `consts` would."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = dict(consts)
    options = {k: consts.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in consts}
    signature, constexprs, attrs = specialize(kernel, args, consts)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget(*HOPPER), options=options)


def pipelining(ttgir: str) -> dict:
    """How the KV loop is staged, from the TTGIR: the most tiles any multi-buffered shared
    allocation holds (1 when loads are staged singly, 0 when nothing is copied asynchronously),
    and the copy groups each in-loop wait leaves in flight."""
    # multi-buffered allocations: what ttg.memdesc_index takes one stage of
    buffers = [int(n) for n in re.findall(r"ttg\.memdesc_index [^:]*: !ttg\.memdesc<(\d+)x", ttgir)]
    copies = "async_copy_global_to_local" in ttgir
    waits = [int(n) for n in re.findall(r"ttg\.async_wait %[^{]*\{num = (\d+) : i32\}", ttgir)]
    return {"staged_tiles": max(buffers, default=1 if copies else 0), "groups_in_flight": sorted(set(waits))}


def cuobjdump(compiled, flag: str) -> str | None:
    """What the cuobjdump shipped with Triton prints for the kernel's cubin with `flag`; None
    where this Triton ships none."""
    from triton.backends.nvidia import compiler as nv

    tool = Path(nv.__file__).parent / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True).stdout


def resources(compiled) -> dict:
    """Registers a thread and spilled (local) bytes from the cubin, shared memory from Triton,
    and the programs an SM can hold by each limit."""
    regs = local = None
    m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", cuobjdump(compiled, "--dump-resource-usage") or "")
    if m:
        regs, local = int(m.group(1)), int(m.group(2))
    warps, shared = compiled.metadata.num_warps, compiled.metadata.shared
    limits = {"warps": SM_WARPS // warps, "shared": SM_SHARED // shared if shared else SM_PROGRAMS}
    if regs:
        limits["registers"] = SM_REGISTERS // (regs * 32 * warps)
    return {"registers": regs, "spilled_bytes": local, "shared_bytes": shared, "warps": warps,
            "programs_per_sm": min(SM_PROGRAMS, *limits.values()),
            "limited_by": min(limits, key=limits.get)}


# SASS opcodes grouped by the unit they keep busy, for loop_mix.
OPCODE_CLASSES = {
    "mma": ("HMMA", "HGMMA", "QGMMA", "IMMA"),
    "convert": ("F2FP", "F2F", "I2F", "F2I", "I2FP", "F2IP"),
    "exp": ("MUFU",),
    "float": ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "HADD2", "HMUL2", "HFMA2", "HMNMX2"),
    "integer": ("IMAD", "IADD3", "LEA", "SHF", "LOP3", "ISETP", "VIADD", "SEL", "PRMT", "IABS", "IMNMX", "UIADD3",
                "UISETP", "ULEA", "UIMAD", "USHF", "ULOP3", "USEL", "VIMNMX"),
    "shared": ("LDS", "LDSM", "STS"),
    "global": ("LDG", "LDGSTS", "STG", "LDGDEPBAR", "DEPBAR"),
    "shuffle": ("SHFL",),
}


def loop_mix(compiled) -> dict:
    """The SASS of the kernel's longest loop (the code from a backward branch's target to the
    branch: the pipelined KV loop), counted by opcode class (OPCODE_CLASSES; anything else is
    "other"): instructions a warp issues per iteration. Empty where cuobjdump is missing."""
    sass = cuobjdump(compiled, "-sass")
    if sass is None:
        return {}
    code = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(m.group(1), 16), at) for at, text in code
             if (m := re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)) and int(m.group(1), 16) < at]
    if not loops:
        return {}
    start, end = max(loops, key=lambda span: span[1] - span[0])
    counts = dict.fromkeys([*OPCODE_CLASSES, "other"], 0)
    for at, text in code:
        if start <= at <= end:
            opcode = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
            kind = next((k for k, ops in OPCODE_CLASSES.items() if opcode in ops), "other")
            counts[kind] += 1
    return {"loop_instructions": sum(counts.values()), "loop_mix": counts}


def decode_stage1(cache: torch.dtype, batch: int, ctx: int, tuning=None, hq: int = 32, hk: int = 8,
                  d: int = 128, block_size: int = 16, sms: int = 132, pdl: bool = False, rotary: bool = False):
    """The decode kernel's stage 1 for a Llama-3.1-8B-shaped batch, compiled (see module doc);
    `pdl`: as launched with programmatic dependent launch (tandem_kernels.triton_common.pdl_enabled);
    `rotary`: as rotary_store_and_decode launches it (q, k and v views of one qkv row)."""
    from tandem_kernels import decode_attention as da

    meta = dict(device="meta")
    blocks = batch * -(-ctx // block_size)
    qkv = torch.empty(batch, (hq + 2 * hk) * d, dtype=torch.bfloat16, **meta)
    q, k, v = (y.view(batch, -1, d) for y in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    if not rotary:
        q = torch.empty(batch, hq, d, dtype=torch.bfloat16, **meta)
    kc = torch.empty(blocks, block_size, hk, d, dtype=cache, **meta)
    table = torch.empty(batch, -(-ctx // block_size), dtype=torch.int32, **meta)
    lens = torch.empty(batch, dtype=torch.int32, **meta)
    positions = torch.empty(batch, dtype=torch.int64, **meta)
    step = da.StepKV(k, v, positions, torch.empty(131072, d, dtype=torch.float32, **meta), positions, d, True)
    tuning = tuning or da.default_tuning(cache)
    splits = da.choose_splits(batch, hk, table.shape[1] * block_size, sms, tuning)
    out = torch.empty_like(q)
    partial = torch.empty(batch, hq, splits, d, dtype=torch.float32, **meta) if splits > 1 else None
    lse = torch.empty(batch, hq, splits, dtype=torch.float32, **meta) if splits > 1 else None
    _, args, consts = da.stage1_launch(q, kc, torch.empty_like(kc), table, lens, d ** -0.5, 1.0, 1.0, tuning, splits,
                                       out, partial, lse, step if rotary else None)
    consts.update(PDL=pdl, launch_pdl=pdl)
    return compile_for_hopper(da.stage1_kernel(tuning), args, consts)


def extend(cache: torch.dtype, tokens: int, prefix: int, hq: int = 32, hk: int = 8, d: int = 128,
           block_size: int = 16, new_kv: bool = False):
    """The extend kernel for one sequence of `tokens` new tokens after `prefix`, compiled;
    `new_kv`: reading the new tokens' K/V from views of a qkv row, as the model passes them."""
    from tandem_kernels import extend_attention as ea

    meta = dict(device="meta")
    blocks = -(-(tokens + prefix) // block_size)
    q = torch.empty(tokens, hq, d, dtype=torch.bfloat16, **meta)
    kc = torch.empty(blocks, block_size, hk, d, dtype=cache, **meta)
    table = torch.empty(1, blocks, dtype=torch.int32, **meta)
    qsl = torch.empty(2, dtype=torch.int32, **meta)
    lens = torch.empty(1, dtype=torch.int32, **meta)
    new = None
    if new_kv:
        qkv = torch.empty(tokens, (hq + 2 * hk) * d, dtype=torch.bfloat16, **meta)
        new = tuple(x.view(tokens, hk, d) for x in qkv[:, hq * d:].split(hk * d, dim=-1))
    _, args, consts = ea.extend_launch(q, kc, torch.empty_like(kc), table, qsl, lens, d ** -0.5, 1.0, 1.0,
                                       torch.empty_like(q), new)
    return compile_for_hopper(ea._extend_kernel, args, consts)


def silu_and_mul_fp8(rows: int, inter: int, deferred: bool, persist: int = 0):
    """The SiLU-and-multiply + FP8 quantize kernel over [rows, 2 * inter] bf16 products, compiled
    (`deferred`: with an FP8 GEMM's scales to apply as it loads; `persist` > 0: the persistent
    loop, see silu_fp8_shape)."""
    from tandem_kernels import activation as act

    meta = dict(device="meta")
    x = torch.empty(rows, 2 * inter, dtype=torch.bfloat16, **meta)
    q = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, **meta)
    scale = torch.empty(rows, 1, dtype=torch.float32, **meta)
    xc = torch.empty(2 * inter, dtype=torch.float32, **meta)
    args = [x, q, scale, scale, xc if deferred else scale, x.stride(0), inter, rows]
    consts, _ = act.silu_fp8_consts({**act.silu_fp8_shape(inter), "PERSIST": persist}, deferred)
    consts.update(SOFT_ROUND=False, PDL=False)
    return compile_for_hopper(act._silu_and_mul_fp8_kernel, args, consts)


# A Llama-3.1-8B layer's decode GEMVs: (outputs, inputs, norm in front, SiLU-and-multiply behind);
# kernel_bench --gemv-sweep times the same.
GEMV_SHAPES = {"qkv": (6144, 4096, True, False), "o_proj": (4096, 4096, False, False),
               "gate_up": (28672, 4096, True, True), "down": (4096, 14336, False, False)}


GEMV_GPU = "NVIDIA H100 80GB HBM3"  # whose tilings (gemv_tilings.DEVICE_TILINGS) the GEMVs build with: all four fuse there


def gemv(projection: str, rows: int, pdl: bool, fields: dict | None = None, gpu: str = GEMV_GPU,
         fp8: bool = False):
    """The fused decode GEMV of `projection` over `rows` rows, compiled: its tiling on the GPU
    named `gpu` (tandem_kernels.gemv_tilings.base_tiling; `fp8`: over e4m3 weights with a scale
    a row, at the FP8 tiling) with `fields` (GemvTiling's) over it. Returns (compiled, the weights
    a warp multiplies in an iteration of the K loop)."""
    from tandem_kernels import gemv as gm
    from tandem_kernels.gemv_tilings import base_tiling

    n, k, norm, silu = GEMV_SHAPES[projection]
    meta = dict(device="meta", dtype=torch.bfloat16)
    x = torch.empty(rows, k, **meta)
    w = torch.empty(n, k, device="meta", dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    out = torch.empty(rows, n // 2 if silu else n, **meta)
    tiling = dataclasses.replace(base_tiling(projection, gpu, fp8, rows), **(fields or {}))
    norm = norm and not tiling.separate_norm  # the GEMV of normalized rows (the norm its own kernel)
    _, args, consts = gm.gemv_launch(x, w, None, torch.empty_like(x) if norm else None,
                                     torch.empty(k, **meta) if norm else None, 1e-5, silu, tiling,
                                     out, torch.empty_like(x) if norm else None,
                                     torch.empty(n, device="meta", dtype=torch.float32) if fp8 else None)
    consts.update(PDL=pdl, launch_pdl=pdl)
    per_warp = consts["BLOCK_N"] * consts["BLOCK_K"] * (2 if silu else 1) // consts["num_warps"]
    return compile_for_hopper(gm._gemv_kernel, args, consts), per_warp


def argmax(rows: int, dtype: torch.dtype, vocab: int = 128256) -> list:
    """The greedy row argmax's two kernels (tandem_kernels.argmax) over `rows` logits rows of
    `dtype` as argmax_rows launches them, compiled."""
    from tandem_kernels import argmax as am

    meta = dict(device="meta")
    shape = am.launch_shape(vocab)
    chunks = shape["chunks"]
    x = torch.empty(rows, vocab, dtype=dtype, **meta)
    vals = torch.empty(rows, chunks, dtype=torch.float32, **meta)
    idx = torch.empty(rows, chunks, dtype=torch.int32, **meta)
    out = torch.empty(rows, dtype=torch.int64, **meta)
    pdl = dict(PDL=True, launch_pdl=True)
    return [compile_for_hopper(am._argmax_chunks, [x, vals, idx, vocab, vocab, chunks],
                               dict(CHUNK=shape["CHUNK"], num_warps=shape["num_warps"], **pdl)),
            compile_for_hopper(am._argmax_rows, [vals, idx, out, chunks, vocab],
                               dict(CHUNKS_PAD=shape["CHUNKS_PAD"], num_warps=1, **pdl))]


def report(compiled, dump: Path | None = None, name: str = "") -> dict:
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        for kind in ("ttgir", "ptx"):
            (dump / f"{name}.{kind}").write_text(compiled.asm[kind])
    return {**resources(compiled), **pipelining(compiled.asm["ttgir"]), **loop_mix(compiled)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=384)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--tuning", action="append", default=None, metavar="JSON",
                   help="also report the decode kernel with these DecodeTuning fields over the default (repeatable)")
    p.add_argument("--dump", default=None, metavar="DIR", help="write each kernel's TTGIR and PTX here")
    p.add_argument("--pdl", action="store_true", help="the decode kernel as launched with programmatic dependent launch")
    p.add_argument("--rotary", action="store_true",
                   help="the decode kernel as rotary_store_and_decode launches it (rotary and the step's K/V store inside)")
    p.add_argument("--gemv-tiling", action="append", default=None, metavar="JSON",
                   help="at --batch <= 8, also report each GEMV with these GemvTiling fields over its own (repeatable)")
    p.add_argument("--only-gemv", action="store_true", help="only the fused decode GEMVs (--batch <= 8)")
    p.add_argument("--gemv-fp8", action="store_true", help="the fused decode GEMVs over e4m3 weights, at the FP8 tiles")
    a = p.parse_args()
    from tandem_kernels import decode_attention as da, extend_attention as ea
    from tandem_kernels.triton_common import interpreting

    if interpreting():
        print("kernel_ir compiles for the GPU: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    dump = Path(a.dump) if a.dump else None
    rows = []
    for cache in () if a.only_gemv else (torch.bfloat16, torch.float8_e4m3fn):
        label = _DTYPES[cache]
        at_batch = da.default_tuning(cache, a.batch * 8, 132)  # the engine's pick at --batch (8 KV heads, H100/H200)
        extra = [] if at_batch == da.default_tuning(cache) else [json.dumps(dataclasses.asdict(at_batch))]
        for fields in [None, *extra, *(a.tuning or [])]:
            tuning = da.default_tuning(cache)
            if fields is not None:
                tuning = dataclasses.replace(tuning, **json.loads(fields))
            name = f"decode_{label}" + ("" if fields is None else f"_{len(rows)}")
            rows.append({"kernel": "decode_stage1", "cache": label, "tuning": dataclasses.asdict(tuning),
                         "pdl": a.pdl, "rotary": a.rotary, "name": name,
                         **report(decode_stage1(cache, a.batch, a.ctx, tuning, pdl=a.pdl, rotary=a.rotary), dump, name)})
            print(json.dumps(rows[-1]), flush=True)
        saved = ea.BLOCKS_AHEAD
        for ahead, new_kv in ((False, False), (True, False), (cache in saved, True)):
            ea.BLOCKS_AHEAD = frozenset({cache} if ahead else ())
            try:
                rows.append({"kernel": "extend", "cache": label, "blocks_ahead": ahead, "new_kv": new_kv,
                             **report(extend(cache, 8192, 0, new_kv=new_kv), dump,
                                      f"extend_{label}_{int(ahead)}" + "_new" * new_kv)})
            finally:
                ea.BLOCKS_AHEAD = saved
            print(json.dumps(rows[-1]), flush=True)
    for deferred, persist in () if a.only_gemv else ((False, 0), (True, 0), (False, 1)):  # 8B MLP: 14,336 outputs
        rows.append({"kernel": "silu_and_mul_fp8", "cache": "", "deferred": deferred, "persistent": bool(persist),
                     **report(silu_and_mul_fp8(a.batch, 14336, deferred, persist), dump,
                              f"silu_fp8_{int(deferred)}_{persist}")})
        print(json.dumps(rows[-1]), flush=True)
    for dtype in () if a.only_gemv else (torch.bfloat16, torch.float32):  # logits as the sampler gets them
        for stage, compiled in enumerate(argmax(a.batch, dtype), 1):
            rows.append({"kernel": f"argmax_stage{stage}", "cache": _DTYPES[dtype], **resources(compiled)})
            print(json.dumps(rows[-1]), flush=True)
    from tandem_kernels.ops import GEMV_MAX_ROWS

    if a.batch <= GEMV_MAX_ROWS:  # decode batches the fused GEMVs take
        for i, fields in enumerate([None, *(a.gemv_tiling or [])]):
            for projection in GEMV_SHAPES:
                name = f"gemv_{projection}" + ("" if fields is None else f"_{i}")
                extra = {} if fields is None else json.loads(fields)
                compiled, per_warp = gemv(projection, a.batch, a.pdl, extra, fp8=a.gemv_fp8)
                row = report(compiled, dump, name)
                if row.get("loop_instructions"):  # the longest loop: the K loop but for qkv (its norm's)
                    row["loop_instructions_a_weight"] = round(row["loop_instructions"] / per_warp, 3)
                rows.append({"kernel": "gemv", "cache": "e4m3" if a.gemv_fp8 else "", "projection": projection,
                             "tiling": extra, "pdl": a.pdl, "name": name, **row})
                print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
