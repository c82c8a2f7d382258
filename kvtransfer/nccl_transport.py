"""NCCL transport: KV blocks GPU to GPU through torch.distributed point-to-point, headers over ZMQ.

Same contract as every transport (`kvtransfer.base`); what differs is where the bytes go. Each
layer message is a `FrameHeader` (request id, layer, source/destination block ids, dtype,
shape, sequence number; checksums left 0, since NCCL and TCP deliver intact bytes and hashing
device memory would need a host copy) sent over ZMQ, followed by one payload, K's bytes then V's
(gathered into one buffer), through `send`/`recv` of a two-rank process group. Layers of one
transfer that are already queued when the sender's channel thread gets to them travel together:
one FRAME message with a header part per layer, one payload holding each layer's K and V in
header order (up to `nccl_send_channel.COALESCE_MAX_BYTES`), so a burst of layers costs one
message's host work instead of one per layer. Commit and abort are headers only. The
receiver checks each header (sequence, layer, dtype, shape, destination blocks) before writing
the received payload into the sink; a payload whose header fails the checks is still received
(into a scratch buffer, then dropped), so the pair's stream of sends stays matched.

Channel = one sender process talking to one receiver process. On the first `open()` towards a
receiver address the sender's channel thread connects a ZMQ DEALER (identity = channel id) to
the receiver's ROUTER and says hello; the receiver answers with the backend it uses and the
address of the TCPStore it hosts; both then build the channel's pair group over
`PrefixStore("tandem-kv/<channel id>", store)`:

    rank 0 = the sender (prefill process), rank 1 = the receiver (decode process), world 2.

Pair groups are built directly from the store (no `init_process_group`), so they leave the
process's default group to tensor parallelism, and one decode process can hold a channel per
prefill process that talks to it. NCCL itself makes a two-rank communicator per
send/recv pair even inside a larger group, so nothing is lost against one big world.

1 P + 1 D: one channel, P is rank 0 and D rank 1 of its group.
TP P -> TP D (same TP size T, KV heads sharded the same way): rank r of D runs its own receiver
(its own address) over its cache shard, which holds KV heads [r*H/T, (r+1)*H/T); rank r of P
sends its shard of every layer to D's rank r, so there are T independent channels, P_r = rank 0
and D_r = rank 1 in each. Seen as one world this is 2T ranks with P_r = r and D_r = T + r, each
sending only to its partner. Blocks ids are the same on every rank of a worker (one scheduler
allocates them), so the destination block ids the gateway hands P apply to every shard.

Backends: "nccl" (CUDA payloads, no host copy: the sender gathers blocks on the device, the
receiver receives on the device and copies into its cache) or "gloo" (CPU, used by the tests).
The receiver picks (nccl when its cache is on a GPU) and announces it; a sender built with
`backend=` refuses a receiver that announces another. NVLink multicast stays off: anything
that creates an NCCL group here first sets NCCL_NVLS_ENABLE=0 and, unless already set,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1.

Overlap: with NCCL both channel threads run on CUDA streams of their own, so a send waits only
for its layer's gather (not for the compute queued after it) and a receive never waits behind
the decode engine's kernels; the engine's stream is ordered after each write instead. Up to
`max_inflight_layers` layers per channel are in flight on both ends, so the wait for one
layer's completion overlaps the next layers' transfer.

Failure: a channel is the unit of failure. A header that cannot be sent, or a payload not
completed within the timeout, breaks the channel: its group is aborted, its transfers fail
(the receiver reports them at their deadlines), and the sender's next `open` to that address
builds a new channel with a new group. NCCL's own watchdog timeout is set far above the
transport's (it would end the whole process), so the transport's abort always comes first.
"""
from __future__ import annotations

from kvtransfer.base import Transport, register_transport
from kvtransfer.nccl_group import ensure_nccl_env
from kvtransfer.nccl_receiver import NcclReceiver
from kvtransfer.nccl_sender import NcclSender

__all__ = ["NCCL_TRANSPORT", "NcclReceiver", "NcclSender", "ensure_nccl_env"]

NCCL_TRANSPORT = Transport(name="nccl", sender_cls=NcclSender, receiver_cls=NcclReceiver)
register_transport(NCCL_TRANSPORT)
