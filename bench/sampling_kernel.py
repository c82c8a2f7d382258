"""The filtered sampler's kernel against the sort it replaces, on the GPU, at a real vocabulary.

    python bench/sampling_kernel.py [--batch 1,8,32,128] [--vocab 128256] [--tilings 2048/8192/16,4096/4096/8] [--out FILE]

For each batch size and filter (temperature only; top_p 0.95; top_k 50 + top_p 0.9; min_p
0.05), µs a call of `tandem_kernels.sampling.sample_filtered` at each tiling (CHUNK/BLOCK/NUM_WARPS:
columns a first-pass program, columns a finishing program loads at once, its warps) and of `tandem_kernels.reference.sample_filtered` on the same device (the sorted rule in
torch ops: what a top-p row cost before), on bf16 logits shaped like a model's (a few likely
tokens over a long tail) and fresh Exponential(1) noise. Device time: 20 calls queued behind a sleeping kernel, between CUDA events, after 3 untimed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FILTERS = {"temperature": dict(top_p=2.0, k=0, min_p=0.0), "top_p": dict(top_p=0.95, k=0, min_p=0.0),
           "top_k_top_p": dict(top_p=0.9, k=50, min_p=0.0), "min_p": dict(top_p=2.0, k=0, min_p=0.05)}


def _time_us(fn, reps: int = 20) -> float:
    """Device µs a call: `reps` calls queued behind a sleeping kernel (so the host's launch work
    is done before the device starts them), timed between events around them."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(50_000_000)  # ~25-30 ms at the H100's clock: longer than queueing the calls
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return round(a.elapsed_time(b) * 1e3 / reps, 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,8,32,128")
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--tilings", default="2048/8192/16,4096/4096/8",
                   help="CHUNK/BLOCK/NUM_WARPS, comma-separated")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from tandem_kernels import reference, sampling

    dev = torch.device("cuda")
    rows_out = []
    for batch in (int(b) for b in a.batch.split(",")):
        # Model-like logits: a heavy head over a Gaussian tail, as a trained LM's next-token rows.
        x = torch.randn(batch, a.vocab, device=dev) * 2.0
        head = torch.randint(0, a.vocab, (batch, 20), device=dev)
        x.scatter_(1, head, torch.rand(batch, 20, device=dev) * 6 + 8)
        x = x.to(torch.bfloat16)
        noise = torch.empty(batch, a.vocab, device=dev).exponential_()
        temperature = torch.full((batch,), 0.8, device=dev)
        for name, f in FILTERS.items():
            top_p = torch.full((batch,), f["top_p"], device=dev)
            min_p = torch.full((batch,), f["min_p"], device=dev)
            if f["k"]:
                kth = x.topk(f["k"], dim=1).values[:, -1].float()
            else:
                kth = torch.full((batch,), float("-inf"), device=dev)
            args = (x, temperature, kth, top_p, min_p, noise)
            row = {"batch": batch, "filter": name,
                   "sorted_torch_us": _time_us(lambda: reference.sample_filtered(*args))}
            want = reference.sample_filtered(*args)
            for tiling in a.tilings.split(","):
                sampling.CHUNK, sampling.BLOCK, sampling.NUM_WARPS = (int(v) for v in tiling.split("/"))
                got = sampling.sample_filtered(*args)
                row[f"kernel_{tiling}_us"] = _time_us(lambda: sampling.sample_filtered(*args))
                row[f"kernel_{tiling}_agrees"] = round(float((got == want).float().mean()), 3)
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    if a.out:
        Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                                           "rows": rows_out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
