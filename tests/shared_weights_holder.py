"""A process that holds a tiny model's weights through engine.shared_weights, for
tests/test_shared_weights.py: `python -m tests.shared_weights_holder RENDEZVOUS MODEL_DIR [DTYPE]`.

Prints one JSON line once its model is up ({"loaded_here", "sum"}), then answers commands on
stdin, one JSON line each: "sum" (the parameters' float64 sum), "fill NAME VALUE" (writes a
parameter in place: the test's proof that the memory is shared), "exit"."""
from __future__ import annotations

import json
import sys

import torch

from engine.config import ModelConfig, parse_dtype
from engine.shared_weights import load_shared
from engine.weights import load_model, model_without_weights


def checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def main() -> int:
    rendezvous, model_dir = sys.argv[1], sys.argv[2]
    dtype = parse_dtype(sys.argv[3] if len(sys.argv) > 3 else "float32", "dtype")
    config, device = ModelConfig.from_dir(model_dir), torch.device("cpu")
    identity = {"model": model_dir, "dtype": str(dtype), "quantization": None}
    try:
        shared = load_shared(rendezvous, identity, device,
                             build=lambda: model_without_weights(config, dtype, device, "auto"),
                             load=lambda: load_model(model_dir, config, dtype, device, "auto"))
    except ValueError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 2
    params = dict(shared.model.named_parameters())
    print(json.dumps({"loaded_here": shared.loaded_here, "sum": checksum(shared.model)}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            break
        if cmd[0] == "fill":
            params[cmd[1]].data.fill_(float(cmd[2]))
        print(json.dumps({"sum": checksum(shared.model)}), flush=True)
    shared.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
