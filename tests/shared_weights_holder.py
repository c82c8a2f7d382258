"""A process whose engine keeps its weights in a shared arena (EngineConfig.shared_weights_dir),
for tests/test_shared_weights.py: `python -m tests.shared_weights_holder RENDEZVOUS MODEL_DIR [DTYPE [DEVICE [QUANTIZATION]]]`.

Prints one JSON line once its engine is up ({"loaded_here", "sum"}, or {"error"}), then answers
commands on stdin, one JSON line each: "sum" (the parameters' float64 sum), "fill NAME VALUE"
(writes a parameter in place: the test's proof that the memory is shared), "tokens" (greedy
tokens of a fixed prompt), "exit"."""
from __future__ import annotations

import json
import sys

import torch

from engine.llm import LLM
from tandem.types import SamplingParams

PROMPT = [1, 5, 9, 2, 7]


def checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def main() -> int:
    rendezvous, model_dir = sys.argv[1], sys.argv[2]
    dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    quantization = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "none" else None
    try:
        llm = LLM(model_dir, dtype=dtype, device=device, shared_weights_dir=rendezvous, num_kv_blocks=64,
                  quantization=quantization)
    except ValueError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 2
    shared = llm.engine.shared_weights
    params = dict(llm.engine.model.named_parameters())
    print(json.dumps({"loaded_here": shared.loaded_here, "sum": checksum(llm.engine.model)}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            break
        if cmd[0] == "fill":
            params[cmd[1]].data.fill_(float(cmd[2]))
        if cmd[0] == "tokens":
            out = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            print(json.dumps({"tokens": out[0].token_ids}), flush=True)
            continue
        print(json.dumps({"sum": checksum(llm.engine.model)}), flush=True)
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
