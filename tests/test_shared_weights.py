"""engine/shared_weights.py: one copy of the weights for the processes on one device, kept while
any of them lives; engine/weights.py model_without_weights builds what load_model builds."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.quant import apply_quantization
from engine.shared_weights import ALIGN, Arena, Manifest, plan
from engine.weights import load_model, model_without_weights

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "glm4"])
def test_model_without_weights_has_the_loaded_models_parameters(tiny_models, family, quantization):
    config = ModelConfig.from_dir(tiny_models[family])
    loaded = load_model(tiny_models[family], config, torch.float32, torch.device("cpu"))
    apply_quantization(loaded, quantization)
    empty = model_without_weights(config, torch.float32, quantization=quantization)
    assert all(t.is_meta for t in [*empty.parameters(), *empty.buffers()])
    ident = {"model": family}
    assert plan(empty, ident).difference(plan(loaded, ident)) is None
    assert "cos_sin_cache" in [e.name for e in plan(empty, ident).entries]  # buffers are shared too
    if quantization:
        assert any(p.dtype == torch.float8_e4m3fn for p in empty.parameters())


def test_plan_aligns_every_parameter_and_names_the_first_difference(tiny_models):
    config = ModelConfig.from_dir(tiny_models["llama"])
    model = model_without_weights(config, torch.float32)
    m = plan(model, {"model": "a", "dtype": "torch.float32"})
    assert [e.name for e in m.entries] == [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    assert all(e.offset % ALIGN == 0 for e in m.entries)
    assert all(a.offset + a.nbytes <= b.offset for a, b in zip(m.entries, m.entries[1:]))
    assert m.nbytes == m.entries[-1].offset + m.entries[-1].nbytes
    assert Manifest.from_json(json.loads(json.dumps(m.to_json()))) == m
    other = plan(model_without_weights(config, torch.bfloat16), {"model": "a", "dtype": "torch.float32"})
    assert "tensor embed_tokens.weight" in m.difference(other) and "torch.bfloat16" in m.difference(other)
    assert "dtype 'torch.bfloat16'" in m.difference(plan(model, {"model": "a", "dtype": "torch.bfloat16"}))


def test_a_host_arena_mapped_from_its_descriptor_is_the_same_memory():
    a = Arena(torch.device("cpu"), 4096)
    b = Arena(torch.device("cpu"), 4096, a.export_fd())
    a.tensor[100:108] = torch.arange(8, dtype=torch.uint8)
    assert torch.equal(b.tensor[100:108], torch.arange(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="fewer than"):
        Arena(torch.device("cpu"), 8192, a.export_fd())


class Holder:
    """tests/shared_weights_holder.py in a process of its own."""

    def __init__(self, rendezvous: Path, model_dir: Path, dtype: str = "float32", device: str = "cpu",
                 quantization: str | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.shared_weights_holder", str(rendezvous),
                                      str(model_dir), dtype, device, quantization or "none"], cwd=REPO, env=env,
                                     text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.first = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"holder exited with {self.proc.wait(timeout=30)}"
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def test_processes_share_one_copy_that_outlives_whoever_loaded_it(tiny_models, tmp_path):
    rv, model_dir = tmp_path / "rv", tiny_models["llama"]
    a = Holder(rv, model_dir)
    holders = [a]
    try:
        assert a.first["loaded_here"] is True
        b = Holder(rv, model_dir)
        holders.append(b)
        assert b.first == {"loaded_here": False, "sum": a.first["sum"]}
        # One copy: a write through one process is what the other reads.
        changed = a.ask("fill norm.weight 3.0")["sum"]
        assert changed != a.first["sum"]
        assert b.ask("sum")["sum"] == changed
        # kill -9 of the process that loaded the weights: the other keeps them and hands them on.
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(timeout=30)
        assert b.ask("sum")["sum"] == changed
        c = Holder(rv, model_dir)
        holders.append(c)
        assert c.first == {"loaded_here": False, "sum": changed}
        assert not (rv / f"{a.proc.pid}.sock").exists()  # the dead one's socket is gone
        # Weights of another dtype are refused, naming the difference (loading a second copy
        # would overfill a device sized for one).
        d = Holder(rv, model_dir, "bfloat16")
        holders.append(d)
        assert "dtype 'torch.float32' where this worker has 'torch.bfloat16'" in d.first["error"]
        assert "--dtype" in d.first["error"]
    finally:
        for h in holders:
            h.stop()


def test_the_first_process_loads_when_every_socket_is_stale(tiny_models, tmp_path):
    rv, model_dir = tmp_path / "rv", tiny_models["llama"]
    a = Holder(rv, model_dir)
    a.stop()  # killed: its socket file stays behind
    assert list(rv.glob("*.sock"))
    b = Holder(rv, model_dir)
    try:
        assert b.first["loaded_here"] is True and b.first["sum"] == a.first["sum"]
        assert [p.name for p in rv.glob("*.sock")] == [f"{b.proc.pid}.sock"]
    finally:
        b.stop()


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_an_engine_on_mapped_weights_decodes_as_one_with_its_own(tiny_models, tmp_path, quantization):
    """Greedy tokens of an engine whose weights another process loaded (and quantized) equal a
    plain engine's, and the loading process's own."""
    from engine.llm import LLM
    from tandem.types import SamplingParams

    from tests.shared_weights_holder import PROMPT

    model_dir = tiny_models["qwen3"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=64, quantization=quantization)
    plain = LLM(str(model_dir), **kw).generate([PROMPT], params)[0].token_ids
    a = Holder(tmp_path / "rv", model_dir, quantization=quantization)
    try:
        assert a.first["loaded_here"] is True
        mapped = LLM(str(model_dir), **kw, shared_weights_dir=str(tmp_path / "rv"))
        try:
            assert mapped.engine.shared_weights.loaded_here is False
            model = mapped.engine.model
            assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
            assert mapped.generate([PROMPT], params)[0].token_ids == plain
            assert a.ask("tokens")["tokens"] == plain
        finally:
            mapped.close()
    finally:
        a.stop()


def test_shared_weights_flags_are_checked():
    from engine.config import EngineConfig
    from worker.config import build_parser, config_from_args

    with pytest.raises(ValueError, match="shared_weights_dir"):
        EngineConfig(model_path="m", shared_weights_dir="")
    with pytest.raises(ValueError, match="shared_weights_charged"):
        EngineConfig(model_path="m", shared_weights_dir="d", shared_weights_charged="no")
    args = build_parser("decode").parse_args(["--model", "m", "--shared-weights-uncharged"])
    with pytest.raises(ValueError, match="--shared-weights-uncharged: only with --shared-weights-dir"):
        config_from_args(args, "decode")
    args = build_parser("decode").parse_args(["--model", "m", "--shared-weights-dir", "/r", "--shared-weights-uncharged"])
    engine = config_from_args(args, "decode").engine
    assert engine.shared_weights_dir == "/r" and engine.shared_weights_charged is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the cuMem arena)")
def test_gpu_processes_share_one_copy_that_outlives_whoever_loaded_it(tiny_models, tmp_path):
    """On a GPU: the arena is a cuMem allocation passed as a file descriptor; a write through one
    process is read by the other, it outlives the loader's kill -9, and greedy tokens of the
    process that mapped it equal a plain engine's."""
    from engine.llm import LLM
    from tandem.types import SamplingParams

    from tests.shared_weights_holder import PROMPT

    rv, model_dir = tmp_path / "rv", tiny_models["llama"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = LLM(str(model_dir), dtype="bfloat16", device="cuda", num_kv_blocks=64).generate([PROMPT], params)
    holders = [Holder(rv, model_dir, "bfloat16", "cuda")]
    try:
        a = holders[0]
        assert a.first["loaded_here"] is True
        b = Holder(rv, model_dir, "bfloat16", "cuda")
        holders.append(b)
        assert b.first == {"loaded_here": False, "sum": a.first["sum"]}
        assert b.ask("tokens")["tokens"] == plain[0].token_ids
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(timeout=30)
        assert b.ask("tokens")["tokens"] == plain[0].token_ids
        c = Holder(rv, model_dir, "bfloat16", "cuda")
        holders.append(c)
        assert c.first == {"loaded_here": False, "sum": a.first["sum"]}
        changed = c.ask("fill norm.weight 2.0")["sum"]
        assert changed != a.first["sum"] and b.ask("sum")["sum"] == changed
    finally:
        for h in holders:
            h.stop()


def test_a_rendezvous_path_too_long_for_a_socket_names_the_field(tmp_path):
    from engine.shared_weights import Rendezvous

    with pytest.raises(ValueError, match="shared_weights_dir: .* too long"):
        Rendezvous(tmp_path / ("d" * 120))


def test_the_driver_structs_have_cudas_layout():
    """engine/cuda_vmm.py's ctypes mirrors of cuda.h (64-bit): CUmemAllocationProp is 32 bytes
    with its location at 8 and allocFlags at 24; CUmemAccessDesc 12, its flags at 8."""
    import ctypes

    from engine import cuda_vmm

    assert ctypes.sizeof(cuda_vmm._AllocationProp) == 32
    assert cuda_vmm._AllocationProp.location.offset == 8 and cuda_vmm._AllocationProp.allocFlags.offset == 24
    assert ctypes.sizeof(cuda_vmm._AccessDesc) == 12 and cuda_vmm._AccessDesc.flags.offset == 8
    with pytest.raises(ValueError, match="needs a CUDA device"):
        cuda_vmm.DeviceMemory(torch.device("cpu"), 1)
    # Where CUDA runs (the GPU test's machines: an H100 shares), a GPU that can; without it, none.
    assert cuda_vmm.can_share(0) is torch.cuda.is_available()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the cuMem arena)")
def test_gpu_memory_whose_mapping_fails_gives_back_the_memory_and_its_descriptor(monkeypatch):
    """A DeviceMemory that cannot be mapped raises naming the call and leaves nothing behind:
    neither the allocation (the device's free memory comes back) nor the exported descriptor."""
    import os

    from engine import cuda_vmm

    nbytes = 256 << 20
    probe = cuda_vmm.DeviceMemory(torch.device("cuda"), 1)  # the context and the driver, first
    probe.close()
    torch.cuda.synchronize()
    free_before, fds_before = torch.cuda.mem_get_info()[0], len(os.listdir("/proc/self/fd"))
    lib = cuda_vmm._driver()
    monkeypatch.setattr(lib, "cuMemMap", lambda *args: 2)  # CUDA_ERROR_OUT_OF_MEMORY, nothing mapped
    with pytest.raises(RuntimeError, match="cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY"):
        cuda_vmm.DeviceMemory(torch.device("cuda"), nbytes)
    monkeypatch.undo()
    torch.cuda.synchronize()
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert torch.cuda.mem_get_info()[0] > free_before - nbytes // 2  # the 256 MiB came back
