"""Kernel dispatch (placeholder until the Triton kernels land): every op is the torch reference."""
from kernels.reference import (  # noqa: F401
    extend_attention,
    fused_add_rms_norm,
    paged_decode_attention,
    rms_norm,
    rotary_and_store_kv,
    silu_and_mul,
    store_kv,
)
