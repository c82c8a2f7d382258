"""The cluster token on Tandem's ZMQ links: ZMQ's PLAIN handshake, checked by a ZAP handler.

Every transport (zmq, and the ZMQ control channels of nccl and cuda_ipc) opens its connections
with ZMQ sockets; a receiver binds, senders connect. When the receiver is given the cluster
token, its socket is a PLAIN server and this module's ZAP handler (one thread per ZMQ context)
checks the password each connecting sender presents during the ZMTP handshake against the token,
in constant time. A sender with no token or another one never completes the handshake: no frame
of it reaches the receiver (nothing is parsed from an unauthenticated peer), its sends wait and
time out (`KVTransferError` / `SendResult(ok=False)`), and the receiver logs and counts the
refusal (`connections_refused` in its stats). A sender given the token uses PLAIN as a client.
Both sides must agree: a token on one side only fails the handshake as well.

The tensor-parallel link between a worker's ranks (`worker.tp_link`) uses the same two calls on
each of its sockets; `label` names the link in the refusal log.

PLAIN sends the token in the clear, like the gRPC metadata does on a link without TLS: on a
network others can read, protect the KV links (a private network, WireGuard, or a service
mesh). The token authenticates connections; it does not encrypt the KV bytes.

Threads: `ZapHandler` runs one daemon thread that owns its REP socket and ends when its context
is terminated (ETERM). `secure_server(sock, token)` and `secure_client(sock, token)` are called
before bind / connect, from the thread that owns the socket.
"""
from __future__ import annotations

import hmac
import itertools
import logging
import threading
import time
import weakref

import zmq

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
USERNAME = b"tandem"
REFUSAL_LOG_S = 60.0  # a refused peer is warned about at most once this often
_domains = itertools.count()
_handlers: weakref.WeakKeyDictionary[zmq.Context, ZapHandler] = weakref.WeakKeyDictionary()
_handlers_lock = threading.Lock()


class ZapHandler:
    """Answers ZAP requests for every PLAIN server socket of one context; each socket has its
    own domain and token (`register`). Counts refusals per domain (`refused(domain)`)."""

    def __init__(self, context: zmq.Context) -> None:
        self._tokens: dict[str, bytes] = {}
        self._labels: dict[str, str] = {}
        self._refused: dict[str, int] = {}
        self._logged: dict[tuple[str, str], tuple[float | None, int]] = {}  # (label, peer) -> last warning, quiet since
        self._lock = threading.Lock()
        self._sock = context.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        # The socket moves to the handler thread here (Thread.start() is the memory barrier).
        threading.Thread(target=self._run, name="zmq-auth", daemon=True).start()

    def register(self, token: str, label: str) -> str:
        domain = f"tandem-{next(_domains)}"
        with self._lock:
            self._tokens[domain] = token.encode()
            self._labels[domain] = label
            self._refused[domain] = 0
        return domain

    def refused(self, domain: str) -> int:
        with self._lock:
            return self._refused.get(domain, 0)

    def _run(self) -> None:
        sock = self._sock
        try:
            while True:
                try:
                    msg = sock.recv_multipart()
                except zmq.ContextTerminated:
                    return
                sock.send_multipart(self._answer(msg))
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ETERM:
                logger.exception("kv auth handler stopped")
        finally:
            sock.close(linger=0)

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        # ZAP request: version, request id, domain, address, identity, mechanism, credentials...
        if len(msg) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = msg[:6]
        creds = msg[6:]
        with self._lock:
            want = self._tokens.get(domain.decode(errors="replace"))
        ok = (want is not None and mechanism == b"PLAIN" and len(creds) == 2
              and hmac.compare_digest(creds[1], want))
        if ok:
            return [version, request_id, b"200", b"OK", USERNAME, b""]
        with self._lock:
            key = domain.decode(errors="replace")
            if key in self._refused:
                self._refused[key] += 1
            label = self._labels.get(key, "ZMQ")
        peer = address.decode(errors="replace") or "?"
        self._log_refusal(label, peer)
        return [version, request_id, b"400", b"bad cluster token", b"", b""]

    def _log_refusal(self, label: str, peer: str) -> None:
        """A warning for the first refusal of a peer, then at most one per REFUSAL_LOG_S with
        the count since (a peer without the token retries every ~100 ms). Handler thread only."""
        now = time.monotonic()
        last, quiet = self._logged.get((label, peer), (None, 0))
        if last is not None and now - last < REFUSAL_LOG_S:
            self._logged[(label, peer)] = (last, quiet + 1)
            return
        self._logged[(label, peer)] = (now, 0)
        more = f" ({quiet} more since the last warning)" if quiet else ""
        logger.warning("refused a %s connection from %s: missing or wrong cluster token%s", label, peer, more)


def _handler(context: zmq.Context) -> ZapHandler:
    with _handlers_lock:
        handler = _handlers.get(context)
        if handler is None:
            handler = _handlers[context] = ZapHandler(context)
        return handler


class ServerAuth:
    """What `secure_server` set up on one receiver socket: `refused` counts refused peers."""

    def __init__(self, handler: ZapHandler | None, domain: str = "") -> None:
        self._handler, self._domain = handler, domain

    @property
    def enabled(self) -> bool:
        return self._handler is not None

    @property
    def refused(self) -> int:
        return self._handler.refused(self._domain) if self._handler is not None else 0


def secure_server(sock: zmq.Socket, token: str | None, label: str = "KV") -> ServerAuth:
    """Before `bind`: with a token, make `sock` a PLAIN server whose peers must present it
    (`label`: what the refusal log calls this link)."""
    if not token:
        return ServerAuth(None)
    handler = _handler(sock.context)
    domain = handler.register(token, label)
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    return ServerAuth(handler, domain)


def secure_client(sock: zmq.Socket, token: str | None) -> None:
    """Before `connect`: with a token, present it in the PLAIN handshake."""
    if not token:
        return
    sock.setsockopt(zmq.PLAIN_USERNAME, USERNAME)
    sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
