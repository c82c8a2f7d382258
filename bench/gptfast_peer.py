"""A batch-1 decode peer written the gpt-fast way: a plain PyTorch Llama, a static KV cache
preallocated for max_seq_len, an eager prefill and a `torch.compile(mode="reduce-overhead",
fullgraph=True)` decode step of one token (greedy). It measures what our engine's batch-1 decode
should beat on the same GPU, in the same run, on the same weights.

    python bench/gptfast_peer.py --model DIR [--load-format dummy] [--prompt-len 128] [--steps 200]

Weights: `engine.weights.load_model` builds our engine's CausalLM (dummy weights drawn exactly as
the engine draws them, or the checkpoint's), and `GptFastLlama.from_engine_model` takes its
tensors without copying (qkv stays merged as gpt-fast's `wqkv`; `w1` / `w3` are the two row halves
of the merged gate_up weight). Only plain Llama-style models (no biases, no q/k norms, rotate-half
RoPE over the whole head) are accepted; anything else is a ValueError naming the field.

Timing (`time_decode`): prefill the prompt, `warmup` decode steps (compilation and CUDA-graph
capture happen there), then `steps` decode steps between two CUDA events; ms per token is their
elapsed time over `steps`. That includes the host's work between steps, as our engine's
`decode_b1` (bench/h200_bench.py) does with its wall clock around synchronized steps.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.config import ModelConfig  # noqa: E402

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerArgs:
    """The model's shape, as gpt-fast's ModelArgs holds it."""

    vocab_size: int
    dim: int
    intermediate_size: int
    n_layer: int
    n_head: int
    n_local_heads: int  # KV heads
    head_dim: int
    norm_eps: float

    @classmethod
    def from_config(cls, c: ModelConfig) -> "PeerArgs":
        for name, bad in (("qkv_bias", c.qkv_bias), ("qk_norm", c.qk_norm), ("sandwich_norm", c.sandwich_norm),
                          ("rope_interleaved", c.rope_interleaved),
                          ("partial_rotary_factor", c.rotary_dim != c.head_dim),
                          ("sliding_window", c.sliding_window is not None)):
            if bad:
                raise ValueError(f"{name}: the gpt-fast peer runs plain Llama models only ({c.model_type} sets it)")
        return cls(c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
                   c.head_dim, c.rms_norm_eps)


class KVCache(nn.Module):
    """Static cache [batch, kv_heads, max_seq_len, head_dim]; `update` writes rows at input_pos."""

    def __init__(self, max_batch_size: int, max_seq_len: int, n_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # input_pos: [T]; k, v: [B, H, T, D]
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k
        v_out[:, :, input_pos] = v
        return k_out, v_out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).type_as(x)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (the Hugging Face Llama layout). x: [B, T, H, D]; cos, sin: [T, D/2]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, a: PeerArgs) -> None:
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = a.n_head, a.n_local_heads, a.head_dim
        self.wqkv = nn.Linear(a.dim, (a.n_head + 2 * a.n_local_heads) * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_head * a.head_dim, a.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                input_pos: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)  # q: [B, T, heads, head_dim]
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, head_dim]
        k, v = self.kv_cache.update(input_pos, k, v)  # [B, kv_heads, max_seq_len, head_dim]
        rep = self.n_head // self.n_local_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, q_size))


class FeedForward(nn.Module):
    def __init__(self, a: PeerArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.intermediate_size, bias=False)
        self.w3 = nn.Linear(a.dim, a.intermediate_size, bias=False)
        self.w2 = nn.Linear(a.intermediate_size, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a: PeerArgs) -> None:
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a)
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x, cos, sin, mask, input_pos):
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class GptFastLlama(nn.Module):
    """forward(idx [B, T], input_pos [T]) -> float32 logits [B, T, vocab]; `setup_caches` first."""

    def __init__(self, a: PeerArgs) -> None:
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(TransformerBlock(a) for _ in range(a.n_layer))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.max_seq_len = 0

    def setup_caches(self, max_batch_size: int, max_seq_len: int, inv_freq: torch.Tensor) -> None:
        """Preallocate every layer's KV cache, the causal mask and the RoPE table for max_seq_len."""
        w = self.output.weight
        self.max_seq_len = max_seq_len
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, max_seq_len, self.args.n_local_heads,
                                               self.args.head_dim, w.dtype, w.device)
        freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=w.device),
                            inv_freq.to(device=w.device, dtype=torch.float32))  # [S, D/2]
        self.register_buffer("rope_cos", freqs.cos(), persistent=False)
        self.register_buffer("rope_sin", freqs.sin(), persistent=False)
        self.register_buffer("causal_mask", torch.tril(torch.ones(max_seq_len, max_seq_len, dtype=torch.bool,
                                                                  device=w.device)), persistent=False)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        mask = self.causal_mask[None, None, input_pos]  # [1, 1, T, S]
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x)).float()

    @classmethod
    def from_engine_model(cls, model: nn.Module, config: ModelConfig) -> "GptFastLlama":
        """The peer over the tensors of our engine's CausalLM `model` (shared, not copied)."""
        a = PeerArgs.from_config(config)
        for i, layer in enumerate(model.layers):
            for name, lin in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                              ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
                if type(lin) is not nn.Linear or lin.bias is not None:
                    raise ValueError(f"layers.{i}.{name}: the peer needs plain bf16/fp32 linear weights without "
                                     "bias (no quantization)")
        i_size = a.intermediate_size
        state = {"tok_embeddings.weight": model.embed_tokens.weight, "norm.weight": model.norm.weight,
                 "output.weight": (model.embed_tokens if model.lm_head is None else model.lm_head).weight}
        for i, layer in enumerate(model.layers):
            gate_up = layer.mlp.gate_up_proj.weight  # [2I, dim]: gate rows, then up rows
            state.update({
                f"layers.{i}.attention.wqkv.weight": layer.self_attn.qkv_proj.weight,
                f"layers.{i}.attention.wo.weight": layer.self_attn.o_proj.weight,
                f"layers.{i}.feed_forward.w1.weight": gate_up[:i_size],
                f"layers.{i}.feed_forward.w3.weight": gate_up[i_size:],
                f"layers.{i}.feed_forward.w2.weight": layer.mlp.down_proj.weight,
                f"layers.{i}.attention_norm.weight": layer.input_layernorm.weight,
                f"layers.{i}.ffn_norm.weight": layer.post_attention_layernorm.weight,
            })
        with torch.device("meta"):
            peer = cls(a)
        peer.load_state_dict(state, strict=True, assign=True)
        return peer.eval().requires_grad_(False)


def load_peer(model_dir: str | Path, dtype: torch.dtype, device: torch.device | str,
              load_format: str = "auto") -> tuple[GptFastLlama, ModelConfig]:
    """The peer with the weights our engine loads from `model_dir` (dummy: drawn as the engine draws them)."""
    from engine.weights import load_model

    config = ModelConfig.from_dir(model_dir)
    PeerArgs.from_config(config)  # refuse before loading weights
    model = load_model(model_dir, config, dtype, torch.device(device), load_format)
    return GptFastLlama.from_engine_model(model, config), config


def prefill(model: GptFastLlama, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """idx [1, T] at input_pos [T] -> the next token [1, 1] (greedy)."""
    return model(idx, input_pos)[:, -1:].argmax(dim=-1)


def decode_one_token(model: GptFastLlama, cur: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """cur [1, 1] at input_pos [1] -> the next token [1, 1] (greedy)."""
    return model(cur, input_pos)[:, -1:].argmax(dim=-1)


class PeerDecoder:
    """gpt-fast's generate loop over one sequence. compile=True compiles the decode step with
    `mode="reduce-overhead", fullgraph=True` (CUDA graphs) and gpt-fast's inductor settings;
    compile=False (CPU tests) runs it eagerly. Not thread-safe; one sequence at a time."""

    def __init__(self, model: GptFastLlama, config: ModelConfig, max_seq_len: int, compile: bool = True) -> None:
        from engine.rope import inv_frequencies

        self.model = model
        model.setup_caches(1, max_seq_len, inv_frequencies(config))
        self.device = model.output.weight.device
        self.decode_step = decode_one_token
        if compile:
            import torch._inductor.config as inductor_config

            inductor_config.coordinate_descent_tuning = True  # as gpt-fast's generate.py sets them
            inductor_config.triton.unique_kernel_names = True
            inductor_config.fx_graph_cache = True
            self.decode_step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)

    def _check_len(self, n: int) -> None:
        if n > self.model.max_seq_len:
            raise ValueError(f"max_seq_len: {n} positions asked of a cache of {self.model.max_seq_len}")

    def _decode(self, cur: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """One step at input_pos [1]; then input_pos += 1 in place, as gpt-fast's loop does."""
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):  # gpt-fast's decode backend
            nxt = self.decode_step(self.model, cur, input_pos).clone()  # the graph's output is reused
        input_pos += 1
        return nxt

    def _prefill(self, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor([prompt], device=self.device, dtype=torch.int64)
        cur = prefill(self.model, idx, torch.arange(len(prompt), device=self.device))
        return cur, torch.tensor([len(prompt)], device=self.device, dtype=torch.int64)

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy: the prompt's first max_new_tokens continuation tokens."""
        if not prompt or max_new_tokens < 1:
            raise ValueError("prompt: needs at least one token and max_new_tokens >= 1")
        self._check_len(len(prompt) + max_new_tokens)
        cur, input_pos = self._prefill(prompt)
        out = [int(cur.item())]
        for _ in range(max_new_tokens - 1):
            cur = self._decode(cur, input_pos)
            out.append(int(cur.item()))
        return out

    @torch.no_grad()
    def time_decode(self, prompt: list[int], warmup: int, steps: int) -> float:
        """ms per decode token over `steps` steps after `warmup` (see the module docstring)."""
        self._check_len(len(prompt) + warmup + steps + 1)
        cur, input_pos = self._prefill(prompt)
        for _ in range(warmup):
            cur = self._decode(cur, input_pos)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            cur = self._decode(cur, input_pos)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps


def measure(model_dir: str | Path, prompt: list[int], warmup: int, steps: int, load_format: str = "dummy",
            dtype: torch.dtype = torch.bfloat16) -> dict:
    """Load the peer on the GPU and time its batch-1 decode; max_seq_len = what the run needs,
    rounded up to 8 (gpt-fast sizes its cache to prompt + new tokens)."""
    import time

    t = time.perf_counter()
    model, config = load_peer(model_dir, dtype, "cuda", load_format)
    load_s = time.perf_counter() - t
    need = len(prompt) + warmup + steps + 1
    decoder = PeerDecoder(model, config, max_seq_len=-(-need // 8) * 8)
    t = time.perf_counter()
    ms = decoder.time_decode(prompt, warmup, steps)
    return {"gptfast_b1_ms_per_token": round(ms, 3), "prompt_len": len(prompt), "warmup_steps": warmup,
            "timed_steps": steps, "max_seq_len": decoder.model.max_seq_len, "load_s": round(load_s, 1),
            "compile_and_run_s": round(time.perf_counter() - t, 1), "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory (config.json; weights unless --load-format dummy)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="dummy")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gptfast_peer: timing needs a CUDA device", file=sys.stderr)
        return 2
    print(json.dumps(measure(a.model, list(range(100, 100 + a.prompt_len)), a.warmup, a.steps, a.load_format)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
