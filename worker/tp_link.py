"""The side channel between a tensor-parallel worker's rank 0 and its other ranks (ZMQ, loopback).

The process group carries the model's steps in lockstep; this link carries what is not part
of a step: each rank's hello (its KV receiver address), rank 0's requests to the other ranks
(a decode worker's `expect` / `cancel` of a transfer, acknowledged), and the other ranks'
per-transfer results (a prefill rank's SendResult, a decode rank's TransferResult), which
rank 0 combines with its own.

Sockets: rank 0 binds one PULL that every other rank's PUSH connects to (hellos, acks,
results); each other rank binds a PULL for rank 0's commands, to which rank 0 connects one
PUSH per rank once it has the rank's hello. Every socket is either receive-only and owned by
one thread, or send-only behind a lock, so no ZMQ socket is ever used by two threads at once.
Messages are multipart [kind, JSON body].

Authentication: given the worker's cluster token (`auth_token`), every socket of the link, in
both directions, requires it in ZMQ's PLAIN handshake, checked in constant time
(`kvtransfer.auth`, as on the KV links): a peer without it, or with another, never completes
the handshake, so not one of its frames is delivered; each end counts the peers it refused
(`refused`). Rank 0 hands its token to `RankLink`; the other ranks load the same one the same
way (`entrypoints.tp_follower`), never from a command line. Without a token the link is open to
whoever reaches it on loopback.
"""
from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from kvtransfer import KVTransferError
from kvtransfer.auth import secure_client, secure_server

logger = logging.getLogger(__name__)

# follower -> rank 0
HELLO, ACK, RESULT, BYE = "hello", "ack", "result", "bye"
# rank 0 -> follower
EXPECT, CANCEL = "expect", "cancel"

POLL_MS = 100
AUTH_LABEL = "TP link"  # names the link in kvtransfer.auth's refusal log
OnMessage = Callable[[str, dict[str, Any]], None]


def _encode(kind: str, body: dict[str, Any]) -> list[bytes]:
    return [kind.encode(), json.dumps(body, separators=(",", ":")).encode()]


def _decode(frames: list[bytes]) -> tuple[str, dict[str, Any]]:
    if len(frames) != 2:
        raise ValueError(f"tp link message: expected 2 frames, got {len(frames)}")
    body = json.loads(frames[1])
    if not isinstance(body, dict):
        raise ValueError("tp link message: body is not a JSON object")
    return frames[0].decode(), body


class RankLink:
    """Rank 0's end. `address` is what the other ranks connect to.

    on_result(rank, body) gets every RESULT message (on the link thread; it must be quick).
    on_tick() runs on the link thread about every POLL_MS (deadline checks).
    auth_token: the cluster token every other rank must present (None: open).
    """

    def __init__(self, world_size: int, host: str = "127.0.0.1", auth_token: str | None = None) -> None:
        self.world_size = world_size
        self._token = auth_token or None
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._auth = secure_server(self._pull, self._token, AUTH_LABEL)
        self._pull.bind(f"tcp://{host}:*")
        self.address = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self.hellos: dict[int, dict[str, Any]] = {}
        self.byes: set[int] = set()
        self.on_result: Callable[[int, dict[str, Any]], None] | None = None
        self.on_tick: Callable[[], None] | None = None
        self._hello_cond = threading.Condition()
        self._push: dict[int, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self._acks: dict[int, tuple[Future, set[int], list[str]]] = {}
        self._acks_lock = threading.Lock()
        self._seq = itertools.count(1)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tp-link", daemon=True)
        self._thread.start()

    # ---- start-up -------------------------------------------------------------------------
    def wait_hellos(self, timeout_s: float, alive: Callable[[], None]) -> dict[int, dict[str, Any]]:
        """Block until every other rank said hello; `alive()` raises when a rank died meanwhile.
        Then connect the command sockets. Returns {rank: hello body}."""
        deadline = time.monotonic() + timeout_s
        with self._hello_cond:
            while len(self.hellos) < self.world_size - 1:
                alive()
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, self.world_size)) - set(self.hellos))
                    raise RuntimeError(f"tp: ranks {missing} did not report ready within {timeout_s:g}s")
                self._hello_cond.wait(min(left, 0.2))
        with self._send_lock:
            for rank, hello in sorted(self.hellos.items()):
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)
                secure_client(sock, self._token)
                sock.connect(hello["command_address"])
                self._push[rank] = sock
        return dict(self.hellos)

    @property
    def refused(self) -> int:
        """Peers refused at rank 0's socket for a wrong cluster token (one without any is turned
        away by ZMQ before the check, uncounted)."""
        return self._auth.refused

    # ---- commands -------------------------------------------------------------------------
    def send(self, kind: str, body: dict[str, Any]) -> None:
        """Send a command to every other rank, no acknowledgement."""
        frames = _encode(kind, body)
        with self._send_lock:
            for sock in self._push.values():
                sock.send_multipart(frames)

    def request(self, kind: str, body: dict[str, Any], timeout_s: float) -> None:
        """Send a command to every other rank and wait until each acknowledged it;
        KVTransferError naming the rank when one refused or did not answer in time."""
        seq = next(self._seq)
        fut: Future = Future()
        waiting = set(self._push)
        errors: list[str] = []
        with self._acks_lock:
            self._acks[seq] = (fut, waiting, errors)
        try:
            self.send(kind, {**body, "seq": seq})
            try:
                fut.result(timeout_s)
            except TimeoutError:
                raise KVTransferError(f"tp: ranks {sorted(waiting)} did not acknowledge {kind} within {timeout_s:g}s")
            if errors:
                raise KVTransferError("; ".join(errors))
        finally:
            with self._acks_lock:
                self._acks.pop(seq, None)

    # ---- the link thread ------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                ready = dict(poller.poll(POLL_MS))
            except zmq.ZMQError:
                return
            if self._pull in ready:
                while True:
                    try:
                        frames = self._pull.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except zmq.ZMQError:
                        return
                    try:
                        self._handle(*_decode(frames))
                    except Exception:
                        logger.exception("tp link: bad message from a rank")
            if self.on_tick is not None:
                try:
                    self.on_tick()
                except Exception:
                    logger.exception("tp link tick failed")

    def _handle(self, kind: str, body: dict[str, Any]) -> None:
        rank = int(body.get("rank", -1))
        if kind == HELLO:
            with self._hello_cond:
                self.hellos[rank] = body
                self._hello_cond.notify_all()
        elif kind == ACK:
            with self._acks_lock:
                entry = self._acks.get(int(body["seq"]))
                if entry is None:
                    return
                fut, waiting, errors = entry
                waiting.discard(rank)
                if body.get("error"):
                    errors.append(f"rank {rank}: {body['error']}")
                if not waiting and not fut.done():
                    fut.set_result(None)
        elif kind == RESULT:
            if self.on_result is not None:
                self.on_result(rank, body)
        elif kind == BYE:
            self.byes.add(rank)
        else:
            logger.warning("tp link: unknown message %r from rank %d", kind, rank)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(2 * POLL_MS / 1000 + 1)
        with self._send_lock:
            for sock in self._push.values():
                sock.close(0)
            self._push.clear()
        self._pull.close(0)
        self._ctx.term()


class FollowerLink:
    """The end of rank `rank` > 0: `send` reports to rank 0 (any thread); commands from rank 0
    run as `on_command(kind, body)` on this link's thread, which acknowledges those that carry
    a `seq` (with the handler's exception text, if it raised). With `auth_token` it presents the
    cluster token to rank 0 and requires it of whoever sends it commands."""

    def __init__(self, rank: int, rank0_address: str, on_command: OnMessage, host: str = "127.0.0.1",
                 auth_token: str | None = None) -> None:
        self.rank = rank
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 2000)
        self._push.setsockopt(zmq.SNDHWM, 0)
        secure_client(self._push, auth_token)
        self._push.connect(rank0_address)
        self._lock = threading.Lock()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._auth = secure_server(self._pull, auth_token, AUTH_LABEL)
        self._pull.bind(f"tcp://{host}:*")
        self.command_address = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._on_command = on_command
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tp-link-{rank}", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> int:
        """Peers refused at this rank's command socket for a wrong cluster token."""
        return self._auth.refused

    def send(self, kind: str, body: dict[str, Any]) -> None:
        frames = _encode(kind, {**body, "rank": self.rank})
        with self._lock:
            if not self._closed.is_set():
                self._push.send_multipart(frames)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                if not poller.poll(POLL_MS):
                    continue
                frames = self._pull.recv_multipart()
            except zmq.ZMQError:
                return
            try:
                kind, body = _decode(frames)
            except ValueError:
                logger.exception("tp link: bad command from rank 0")
                continue
            error = None
            try:
                self._on_command(kind, body)
            except Exception as exc:
                logger.warning("rank %d: %s command failed: %s", self.rank, kind, exc)
                error = str(exc) or repr(exc)
            if "seq" in body:
                self.send(ACK, {"seq": body["seq"], "error": error})

    def close(self) -> None:
        self._closed.set()
        self._thread.join(2 * POLL_MS / 1000 + 1)
        with self._lock:
            self._push.close()
        self._pull.close(0)
        self._ctx.term()
