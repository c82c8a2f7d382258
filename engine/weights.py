"""Build a CausalLM on a device and fill it: Hugging Face safetensors or PyTorch *.bin checkpoints
(single or sharded; safetensors win when a directory has both) or dummy weights."""
from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import LOAD_FORMATS, ModelConfig
from engine.model import CausalLM
from engine.quant.formats import UNUSED_SUFFIXES, Fp8CheckpointFormat, checkpoint_fp8_format

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Modules built inside get `dtype` parameters (torch's default float dtype, restored after)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    dummy_draw_device: torch.device | None = None,
) -> CausalLM:
    """A CausalLM on `device` filled from the checkpoint, or with dummy weights drawn on
    `dummy_draw_device` (default `device`; see init_dummy_weights)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: must be one of {LOAD_FORMATS}, got {load_format!r}")
    fp8 = checkpoint_fp8_format(config.raw)  # an FP8 checkpoint loads as FP8 (engine/quant)
    with torch.device(device), default_dtype(dtype):
        model = CausalLM(config)
    model.cos_sin_cache = model.cos_sin_cache.to(device=device, dtype=torch.float32)
    if load_format == "dummy":
        init_dummy_weights(model, draw_device=dummy_draw_device)
        if fp8 is not None:
            from engine.quant.fp8 import apply_quantization

            apply_quantization(model, "fp8")
    elif fp8 is not None:
        load_fp8_safetensors(model, Path(model_dir), fp8)
    else:
        load_safetensors(model, Path(model_dir))
    return model.eval().requires_grad_(False)


def model_without_weights(config: ModelConfig, dtype: torch.dtype, load_format: str = "auto",
                          quantization: str | None = None) -> CausalLM:
    """The CausalLM that load_model (then `quantization`, as Engine applies it) makes, with its
    parameters and buffers on the meta device (no memory, no values): the modules a process binds
    to the tensors another process loaded (engine/shared_weights.py)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: must be one of {LOAD_FORMATS}, got {load_format!r}")
    fp8 = checkpoint_fp8_format(config.raw)
    with torch.device("meta"), default_dtype(dtype):
        model = CausalLM(config)
    from engine.quant.fp8 import QUANTIZATIONS, convert_to_fp8

    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: must be one of {QUANTIZATIONS} or None, got {quantization!r}")
    if fp8 is not None and load_format != "dummy":  # as load_fp8_safetensors converts
        convert_to_fp8(model, quantize_weights=False, skip=lambda name: _fp8_skipped(name, fp8))
    if quantization is not None or (fp8 is not None and load_format == "dummy"):  # as apply_quantization
        convert_to_fp8(model, quantize_weights=False)
    return model.eval().requires_grad_(False)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint files of `model_dir`: its safetensors, else its PyTorch *.bin files
    (`pytorch_model.bin` or the shards of `pytorch_model.bin.index.json`)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors")) or pytorch_bin_files(model_dir)
    if not files:
        raise ValueError(f"model_path: no *.safetensors or *.bin weights in {model_dir} "
                         "(use load_format='dummy' for random weights)")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"model_path: shard files listed in the index are missing: {missing}")
    return files


def pytorch_bin_files(model_dir: Path) -> list[Path]:
    """PyTorch checkpoint shards (`pytorch_model*.bin`, or as listed by their index); [] if none."""
    index = model_dir / "pytorch_model.bin.index.json"
    if index.is_file():
        return sorted({model_dir / f for f in json.loads(index.read_text()).get("weight_map", {}).values()})
    return sorted(f for f in model_dir.glob("*.bin") if f.name not in ("training_args.bin", "optimizer.bin"))


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        if f.suffix == ".bin":
            yield from _iter_bin(f)
            continue
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def _iter_bin(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one PyTorch checkpoint file, memory-mapped and loaded without unpickling
    code (`weights_only`); ValueError naming the file for anything else."""
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises pickle / runtime errors of many kinds
        raise ValueError(f"weights: cannot load {path.name} as a PyTorch checkpoint: {exc}") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"weights: {path.name} holds a {type(state).__name__}, not a state dict")
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            yield name, tensor


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor goes: rows [row_offset, row_offset + rows) of parameter
    `target` of the (merged) model (rows None: the whole parameter), satisfying `keys` of
    `expected_keys`."""

    target: str
    row_offset: int
    rows: int | None
    keys: tuple[str, ...]


def _merged_offsets(cfg: ModelConfig) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    qkv = {"q_proj": (0, cfg.q_size), "k_proj": (cfg.q_size, cfg.kv_size), "v_proj": (cfg.q_size + cfg.kv_size, cfg.kv_size)}
    gate_up = {"gate_proj": (0, cfg.intermediate_size), "up_proj": (cfg.intermediate_size, cfg.intermediate_size)}
    return qkv, gate_up


def checkpoint_placement(name: str, cfg: ModelConfig) -> Placement | None:
    """The Placement of checkpoint tensor `name`, or None for a tensor the model does not keep
    (rotary tables, a tied lm_head)."""
    if "rotary_emb" in name:
        return None
    target = name.removeprefix("model.")
    if target == "lm_head.weight" and cfg.tie_word_embeddings:
        return None
    qkv, gate_up = _merged_offsets(cfg)
    parts = target.split(".")
    for merged, offsets in (("qkv_proj", qkv), ("gate_up_proj", gate_up)):
        if len(parts) >= 2 and parts[-2] in offsets:
            off, rows = offsets[parts[-2]]
            target = ".".join(parts[:-2] + [merged, parts[-1]])
            return Placement(target, off, rows, (f"{target}#{off}",))
    if target.endswith(("gate_up_proj.weight", "gate_up_proj.weight_scale")):  # GLM ships it merged
        return Placement(target, 0, None, tuple(f"{target}#{off}" for off, _ in gate_up.values()))
    return Placement(target, 0, None, (target,))


def expected_keys(param_names: Iterable[str], cfg: ModelConfig) -> set[str]:
    """What a complete checkpoint's Placements cover, for a model with these parameters."""
    qkv, gate_up = _merged_offsets(cfg)
    keys: set[str] = set()
    for name in param_names:
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias", "qkv_proj.weight_scale")):
            keys |= {f"{name}#{off}" for off, _ in qkv.values()}
        elif name.endswith(("gate_up_proj.weight", "gate_up_proj.weight_scale")):
            keys |= {f"{name}#{off}" for off, _ in gate_up.values()}
        else:
            keys.add(name)
    return keys


def stream_checkpoint(model_dir: Path, cfg: ModelConfig, param_names: Iterable[str],
                      fp8: Fp8CheckpointFormat | None = None) -> Iterator[tuple[str, Placement, torch.Tensor]]:
    """(checkpoint name, Placement, tensor) for every tensor the model keeps, one tensor in host
    memory at a time; ValueError naming the tensor for one with no place, and at the end for
    tensors the checkpoint lacks. An FP8 checkpoint streams only with its format `fp8` (its
    weight scales are placed as `<projection>.weight_scale`, static input scales skipped)."""
    if fp8 is None and cfg.raw.get("quantization_config"):
        raise ValueError("quantization: this checkpoint is quantized (config.json quantization_config); FP8 "
                         "checkpoints load into a whole model in one process, not with tensor parallelism (--tp > 1)")
    names = set(param_names)
    loaded: set[str] = set()
    for name, tensor in _iter_tensors(safetensors_files(model_dir)):
        if fp8 is not None:
            suffix = name.rsplit(".", 1)[-1]
            if suffix in UNUSED_SUFFIXES:
                continue
            if suffix == fp8.scale_name:
                name = name[: -len(suffix)] + "weight_scale"
        placement = checkpoint_placement(name, cfg)
        if placement is None:
            continue
        if placement.target not in names:
            raise ValueError(f"weights: checkpoint tensor {name!r} has no place in a {cfg.model_type} model")
        yield name, placement, tensor
        loaded.update(placement.keys)
    missing = sorted(expected_keys(names, cfg) - loaded)
    if missing:
        raise ValueError(f"weights: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def load_safetensors(model: CausalLM, model_dir: Path) -> None:
    """Copy every checkpoint tensor into the (merged) parameter it belongs to; fail on gaps."""
    params = dict(model.named_parameters())
    for name, placement, tensor in stream_checkpoint(model_dir, model.config, params):
        param = params[placement.target].data
        dest = param if placement.rows is None else param.narrow(0, placement.row_offset, placement.rows)
        if dest.shape != tensor.shape:
            raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)


def load_fp8_safetensors(model: CausalLM, model_dir: Path, fp8: Fp8CheckpointFormat) -> None:
    """Load an FP8 checkpoint (engine/quant/formats.py): the projections it quantized become
    Fp8Linear and take its e4m3 weights; per-tensor scales fill each merged part's rows of the
    per-channel `weight_scale`, per-channel ones copy, block ones are folded in at the end."""
    from engine.quant.fp8 import convert_to_fp8, quantize_weight_per_channel

    convert_to_fp8(model, quantize_weights=False, skip=lambda name: _fp8_skipped(name, fp8))
    params = dict(model.named_parameters())
    blocks: list[tuple[str, Placement, torch.Tensor]] = []
    for name, placement, tensor in stream_checkpoint(model_dir, model.config, params, fp8):
        param = params[placement.target].data
        dest = param if placement.rows is None else param.narrow(0, placement.row_offset, placement.rows)
        if placement.target.endswith(".weight_scale"):
            if fp8.block is not None:
                blocks.append((name, placement, tensor))
            elif tensor.numel() in (1, dest.numel()):
                dest.copy_(tensor.float().reshape(-1).expand(dest.shape))
            else:
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}; expected one scale per "
                                 f"tensor or {dest.numel()} (one per output channel)")
            continue
        if dest.shape != tensor.shape:
            raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        if (param.dtype == torch.float8_e4m3fn) != (tensor.dtype == torch.float8_e4m3fn):
            raise ValueError(f"weights: {name!r} is {tensor.dtype} where the model holds {param.dtype} "
                             "(quantization_config's ignored modules disagree with the checkpoint)")
        dest.copy_(tensor)
    for name, placement, scales in blocks:  # weights ~= q * block scale: requantize per channel
        weight = params[placement.target.removesuffix("_scale")].data
        rows = placement.rows if placement.rows is not None else weight.shape[0]
        w = weight.narrow(0, placement.row_offset, rows)
        (bn, bk), k = fp8.block, w.shape[1]
        if tuple(scales.shape) != (-(-rows // bn), -(-k // bk)):
            raise ValueError(f"weights: {name!r} has shape {tuple(scales.shape)}, expected block scales "
                             f"{(-(-rows // bn), -(-k // bk))} for a [{rows}, {k}] weight in {bn}x{bk} blocks")
        s = scales.to(w.device, torch.float32).repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :k]
        q, channel_scale = quantize_weight_per_channel(w.float() * s)
        w.copy_(q)
        params[placement.target].data.narrow(0, placement.row_offset, rows).copy_(channel_scale)
    if weight_device(model).type == "cuda":
        torch.cuda.empty_cache()  # the unquantized modules' memory goes back before the KV cache is sized
    logger.info("loaded FP8 checkpoint (%s%s)", fp8.method, f", {fp8.block[0]}x{fp8.block[1]} blocks" if fp8.block else "")


def weight_device(model: CausalLM) -> torch.device:
    return model.embed_tokens.weight.device


_MERGED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _fp8_skipped(name: str, fp8: Fp8CheckpointFormat) -> bool:
    """Whether model projection `name` (e.g. "layers.0.self_attn.qkv_proj") is one the checkpoint
    left unquantized; ValueError when it quantized only some parts of a merged projection."""
    if fp8.ignored(f"model.{name}"):
        return True
    prefix, leaf = name.rsplit(".", 1)
    flags = [fp8.ignored(f"model.{prefix}.{part}") for part in _MERGED_PARTS.get(leaf, (leaf,))]
    if any(flags) and not all(flags):
        raise ValueError(f"quantization_config: {name} is merged from {_MERGED_PARTS[leaf]}, of which only some "
                         "are quantized; quantize all or none of them")
    return all(flags)


def init_dummy_weights(model: CausalLM, seed: int = 0, std: float = 0.02, draw_device: torch.device | None = None) -> None:
    """Deterministic random weights (same seed ⇒ same model on the same device type); norms stay 1.

    The draws come from a generator on `draw_device` (default: the model's device), one
    parameter at a time, so a model held on the host gets the values a device-resident model
    would, while the device holds one parameter at most.
    """
    model_device = model.embed_tokens.weight.device
    draw_device = torch.device(draw_device) if draw_device is not None else model_device
    gen = torch.Generator(device=draw_device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
        elif draw_device == model_device:
            p.data.normal_(0.0, std, generator=gen)
        else:
            p.data.copy_(torch.empty(p.shape, dtype=p.dtype, device=draw_device).normal_(0.0, std, generator=gen))
