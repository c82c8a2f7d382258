"""Weight quantization, applied to a built model by rewriting its modules (the model file stays
plain): `apply_quantization(model, "fp8")` after load, or an FP8 checkpoint's own format
(engine/quant/formats.py) read by engine/weights.py."""
from __future__ import annotations

from engine.quant.fp8 import QUANTIZATIONS, Fp8Activation, Fp8Linear, apply_quantization

__all__ = ["QUANTIZATIONS", "Fp8Activation", "Fp8Linear", "apply_quantization"]
