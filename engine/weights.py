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
    with torch.device(device), default_dtype(dtype):
        model = CausalLM(config)
    model.cos_sin_cache = model.cos_sin_cache.to(device=device, dtype=torch.float32)
    if load_format == "dummy":
        init_dummy_weights(model, draw_device=dummy_draw_device)
    else:
        load_safetensors(model, Path(model_dir))
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
    if target.endswith("gate_up_proj.weight"):  # GLM ships it merged
        return Placement(target, 0, None, tuple(f"{target}#{off}" for off, _ in gate_up.values()))
    return Placement(target, 0, None, (target,))


def expected_keys(param_names: Iterable[str], cfg: ModelConfig) -> set[str]:
    """What a complete checkpoint's Placements cover, for a model with these parameters."""
    qkv, gate_up = _merged_offsets(cfg)
    keys: set[str] = set()
    for name in param_names:
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            keys |= {f"{name}#{off}" for off, _ in qkv.values()}
        elif name.endswith("gate_up_proj.weight"):
            keys |= {f"{name}#{off}" for off, _ in gate_up.values()}
        else:
            keys.add(name)
    return keys


def stream_checkpoint(model_dir: Path, cfg: ModelConfig, param_names: Iterable[str],
                      ) -> Iterator[tuple[str, Placement, torch.Tensor]]:
    """(checkpoint name, Placement, tensor) for every tensor the model keeps, one tensor in host
    memory at a time; ValueError naming the tensor for one with no place, and at the end for
    tensors the checkpoint lacks."""
    names = set(param_names)
    loaded: set[str] = set()
    for name, tensor in _iter_tensors(safetensors_files(model_dir)):
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
