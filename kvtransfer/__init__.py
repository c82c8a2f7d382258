"""KV transfer between prefill and decode workers: one interface, transports chosen by name.

`get_transport("zmq").create_sender()` on the prefill side, `.create_receiver(sink)` on the
decode side; the contract is in `kvtransfer.base`, the wire format in `kvtransfer.frames`,
a ready sink over cache tensors in `kvtransfer.sinks`. Importing this package loads no torch.
"""
from __future__ import annotations

from kvtransfer.base import (
    KVReceiver,
    KVSender,
    KVSink,
    KVTransferError,
    SendResult,
    TransferResult,
    Transport,
    available_transports,
    get_transport,
    register_builtin,
    register_transport,
)

__all__ = [
    "KVReceiver",
    "KVSender",
    "KVSink",
    "KVTransferError",
    "SendResult",
    "TransferResult",
    "Transport",
    "available_transports",
    "get_transport",
    "register_builtin",
    "register_transport",
]
