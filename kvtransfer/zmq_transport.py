"""ZMQ transport: KV blocks over tcp:// or ipc:// from host memory; works on any machine and in CI.

Socket pattern: PUSH (sender, connects) -> PULL (receiver, binds). Data flows one way and
many prefill senders fan in to one decode receiver, which PUSH/PULL does natively; ordering on
each connection lets sequence numbers expose a lost message; the send high-water mark gives
backpressure. No reply path is needed: the receiver reports success or failure to its own
worker (and from there to the gateway), never to the sender, so DEALER/ROUTER's identities and
acknowledgements would add a round trip for nothing. The sender sets IMMEDIATE, so a send to
a peer that is not connected waits (and times out) instead of queueing for a receiver that
may never come.

Each message is multipart, [JSON header, K bytes, V bytes] (`kvtransfer.frames`). Payloads go
out with copy=False straight from the staging buffers (CUDA caches are first copied to pinned
host memory) and arrive as ZMQ frames that the sink reads in place. The sender runs one thread
per peer (`zmq_sender`); the receiver one thread (`zmq_receiver`).

Test hook: a sender built with corrupt_once=True, or created while TANDEM_KV_CORRUPT_ONCE=1 is
set, flips one byte of its first non-empty layer after computing the checksum, so the receiver
must reject that transfer; later transfers are sent intact.
"""
from __future__ import annotations

from kvtransfer.base import Transport, register_transport
from kvtransfer.zmq_receiver import ZmqReceiver
from kvtransfer.zmq_sender import CORRUPT_ENV, ZmqSender

__all__ = ["CORRUPT_ENV", "ZMQ_TRANSPORT", "ZmqReceiver", "ZmqSender"]

ZMQ_TRANSPORT = Transport(name="zmq", sender_cls=ZmqSender, receiver_cls=ZmqReceiver)
register_transport(ZMQ_TRANSPORT)
