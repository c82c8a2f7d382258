"""cuda_ipc transport: KV blocks between a prefill and a decode worker on one host, through memory both map.

Same contract as every transport (`kvtransfer.base`); what differs is that payloads never go
through a socket. The sender stages each layer's K and V into a lease (a run of slots) of a
staging pool that the receiver maps, and sends only the header over ZMQ: the usual
`FrameHeader` (request id, layer, block ids, dtype, shape, sequence number, checksums) plus the
layer's extent (lease id, first slot, slot count). The receiver checks the header and the
extent against its expectations and the pool, copies the slot into its sink, and releases the
lease, which frees the slots for the sender's next layers. A pool with no free run makes
`send_layer` wait (backpressure), at most `send_timeout_s`.

Pools (`kvtransfer.ipc_pool`), one per channel (one sender process to one receiver), made on
the channel's first layer where that layer's cache lives:
  host caches   a file in /dev/shm mapped by both processes; the sender hashes each layer
                (xxh64) and the receiver verifies it before writing, as with the zmq transport.
                The file is unlinked as soon as the receiver has mapped it, so nothing is left
                behind when either process dies.
  GPU caches    one device buffer exported with CUDA IPC, and an interprocess event per slot
                that the receiver's stream waits on before it reads the slot
                (`kvtransfer.ipc_cuda`; works across two GPUs of one host). Not hashed.

Control link (`kvtransfer.ipc_wire`): the sender's DEALER (identity = channel id, IMMEDIATE,
send timeout) connects to the receiver's ROUTER; hello, then the pool's description, then
frames; the receiver answers mapped / release / refuse. Ordering on the one connection keeps
each request's sequence numbers meaningful. Addresses are ZMQ endpoints (tcp:// or ipc://),
but both ends must be on one host: a receiver elsewhere cannot map the pool and refuses it.

Failure: the channel is the unit of failure. A header that cannot be sent in time, a refusal,
or the receiver's goodbye (sent when it closes) breaks the channel: its transfers fail, its
waiting `send_layer` calls raise at once, and the next `open` to that receiver builds a new
channel with a new pool. A receiver process that dies, or closes, also ends the connection,
which breaks the channel at once; a send that cannot go out times out. On the receiver, a bad
header or extent fails only its transfer; the lease is released anyway. A sender that closes
says goodbye and the receiver unmaps its pool; one that dies without a goodbye leaves its pool
mapped in the receiver until the receiver closes.

Test hook: a sender built with corrupt_once=True, or created while TANDEM_KV_CORRUPT_ONCE=1 is
set, flips one byte of its first non-empty host-pool layer after computing the checksum.
"""
from __future__ import annotations

from kvtransfer.base import Transport, register_transport
from kvtransfer.ipc_receiver import IpcReceiver
from kvtransfer.ipc_sender import CORRUPT_ENV, IpcSender

__all__ = ["CORRUPT_ENV", "IPC_TRANSPORT", "IpcReceiver", "IpcSender"]

IPC_TRANSPORT = Transport(name="cuda_ipc", sender_cls=IpcSender, receiver_cls=IpcReceiver)
register_transport(IPC_TRANSPORT)
