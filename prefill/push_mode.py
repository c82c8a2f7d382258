"""When a prefill worker pushes a prompt's KV (`--kv-push`), the one rule that rank 0's
`KvPusher` and every other tensor-parallel rank's `FollowerPusher` apply.

- `layer`: each layer's K/V as soon as that layer ran in the step that computes the prompt's
  last chunk, so the transfer overlaps the rest of the forward (worth it between GPUs, where the
  bytes take time to move).
- `step`: every layer at once after the last layer ran: one burst, and the decode worker's
  copies come after the prefill's forward instead of between its layers (on a GPU the two
  workers share, each of those copies is a switch between two processes).
"""
from __future__ import annotations

from worker.config import check_kv_push

__all__ = ["check_kv_push", "layers_due", "named_layers"]


def layers_due(layer: int, num_layers: int, mode: str) -> range:
    """The layers to push once `layer` (of `num_layers`) has run in the pushing step."""
    if mode == "layer":
        return range(layer, layer + 1)
    check_kv_push(mode)
    return range(num_layers) if layer == num_layers - 1 else range(0)  # "step"


def named_layers(layers: range) -> str:
    """`layers` as an error message names them: "layer 3", "layers 0-31"."""
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
