"""The FP8 checkpoint formats users have, read from config.json's `quantization_config`.

- "fp8" (vLLM / AutoFP8 / llm-compressor exports and transformers' FP8 format): e4m3 `weight`
  with a per-tensor `weight_scale`, or with `weight_block_size` [bn, bk] block scales named
  `weight_scale_inv` ([ceil(N/bn), ceil(K/bk)]); skipped modules in `ignored_layers` or
  `modules_to_not_convert`.
- "fbgemm_fp8": e4m3 `weight`, per-channel `weight_scale` [N, 1]; `modules_to_not_convert`.
- "compressed-tensors" with format "float-quantized" (or "naive-quantized" 8-bit float weights):
  e4m3 `weight`, `weight_scale` per tensor ([1]) or per channel ([N, 1]) or per block
  (strategy "block", `block_structure` [bn, bk]); skipped modules in `ignore` (names, or
  "re:" regular expressions).

Static `input_scale`s are not used: activations are quantized per token at run time, as the
dynamic schemes do (a per-token scale is never coarser than a calibrated per-tensor one).
Block scales are folded into per-channel scales at load (one more e4m3 rounding per weight).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Checkpoint tensors that belong to a quantized projection but that the model does not keep.
UNUSED_SUFFIXES = ("input_scale", "input_scale_ub", "weight_zero_point", "input_zero_point", "output_scale")


@dataclass(frozen=True)
class Fp8CheckpointFormat:
    """What an FP8 checkpoint's tensors are: the name of the weight scale, block shape (None: per
    tensor or per channel, told apart by the scale's shape), and which modules stay unquantized."""

    method: str
    scale_name: str = "weight_scale"
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()

    def ignored(self, module: str) -> bool:
        """Whether checkpoint module `module` (e.g. "model.layers.0.mlp.down_proj") is unquantized."""
        short = module.removeprefix("model.")
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module) or re.fullmatch(pattern[3:], short):
                    return True
            elif pattern in (module, short) or module.endswith("." + pattern):
                return True
        return False


def checkpoint_fp8_format(raw_config: dict[str, Any]) -> Fp8CheckpointFormat | None:
    """The FP8 format of a checkpoint's config.json (as a dict), None for an unquantized one;
    ValueError naming `quantization_config` for a quantization this engine cannot load."""
    qc = raw_config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
        block = qc.get("weight_block_size")
        if block is not None:
            return Fp8CheckpointFormat("fp8", "weight_scale_inv", _block(block, "weight_block_size"), ignore)
        return Fp8CheckpointFormat("fp8", "weight_scale", None, ignore)
    if method == "fbgemm_fp8":
        return Fp8CheckpointFormat("fbgemm_fp8", "weight_scale", None, tuple(qc.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(f"config.json: quantization_config quant_method {method!r} is not supported "
                     "(FP8 checkpoints are: 'fp8', 'fbgemm_fp8', 'compressed-tensors' float-quantized)")


def _block(value: Any, field: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"config.json: quantization_config {field} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _compressed_tensors(qc: dict[str, Any]) -> Fp8CheckpointFormat:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if fmt not in ("float-quantized", "naive-quantized") or not groups:
        raise ValueError(f"config.json: compressed-tensors format {fmt!r} is not supported (float-quantized FP8 is)")
    block = None
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ValueError(f"config.json: compressed-tensors group {name!r} has {w.get('num_bits')}-bit "
                             f"{w.get('type')} weights; only 8-bit float (e4m3) weights are supported")
        strategy = w.get("strategy", "tensor")
        if strategy == "block":
            block = _block(w.get("block_structure"), f"config_groups.{name}.weights.block_structure")
        elif strategy not in ("tensor", "channel"):
            raise ValueError(f"config.json: compressed-tensors weight strategy {strategy!r} is not supported "
                             "(tensor, channel, block are)")
    return Fp8CheckpointFormat("compressed-tensors", "weight_scale", block, tuple(qc.get("ignore") or ()))
