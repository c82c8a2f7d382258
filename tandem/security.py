"""Who may talk to a Tandem cluster: the cluster token, the public API key, TLS, KV-push vouchers.

Threat model. An attacker can reach the cluster's ports (another process on the host, another
host on the network) but holds neither the cluster token nor, when one is set, the API key, and
cannot read the processes' files or environment. Every process of one cluster holds the same
token and trusts the others: the token is the trust boundary, not a per-process identity. On a
link without TLS an on-path attacker can read the token (as any bearer secret), so use TLS (or a
private network) where the network is not trusted. Defaults bind loopback.

- **Cluster token** (`generate_token`, `load_token`): `tandem up` generates one per cluster and
  hands it to every child in its environment (`TOKEN_ENV`, never on a command line `ps` shows);
  compose and Kubernetes mount it as a file (`--auth-token-file`, or `TOKEN_FILE_ENV`). Every
  internal RPC carries it in the `TOKEN_HEADER` metadata (`token_metadata`): the worker services,
  the gateway's Admin service and reflection; `AuthInterceptor` answers UNAUTHENTICATED without
  it. The supervisor socket and the ZMQ handshake of the KV links and of the tensor-parallel
  link between a worker's ranks (`kvtransfer.auth`) check it too.
  Health stays open (orchestrator probes carry no metadata; it tells only SERVING or not).
- **API key** (`--api-key`): when set, the public `tandem.v1.Tandem` service and the HTTP API
  require `authorization: Bearer <key>` (`bearer_metadata`), as vLLM's `--api-key` does.
- **TLS** (`server_credentials`, `add_port`, `channel`): optional server certificate and key for
  any gRPC port, and a CA for the clients of it (SDK, gateway -> worker, agent -> gateway).
- **KV-push vouchers** (`kv_voucher`, `check_kv_voucher`): a prefill worker pushes a prompt's KV
  to whatever address its Prefill request names, so a request that could name any address
  would let its sender receive the prompt's KV or aim the worker's traffic at a third party.
  The gateway signs the target it took from its registry's decode worker (the request id, the
  reservation id, the decode worker's id and its KV address) with a key derived from the token
  (HMAC-SHA256); the prefill worker refuses a target whose voucher does not verify. Without a
  token (the standalone loopback mode) nothing is signed and nothing is checked.

Secrets are compared in constant time (`hmac.compare_digest`). Nothing here imports torch.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc

logger = logging.getLogger(__name__)

TOKEN_ENV = "TANDEM_AUTH_TOKEN"
TOKEN_FILE_ENV = "TANDEM_AUTH_TOKEN_FILE"
API_KEY_ENV = "TANDEM_API_KEY"
TOKEN_HEADER = "x-tandem-cluster-token"
AUTHORIZATION = "authorization"
HEALTH_SERVICE = "grpc.health.v1.Health"
MIN_TOKEN_CHARS = 16
_REFUSAL_LOG_EVERY_S = 10.0

Metadata = tuple[tuple[str, str], ...]


# ---------------------------------------------------------------- tokens

def generate_token() -> str:
    """A fresh cluster token: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def write_token_file(path: str | Path, token: str) -> Path:
    """Write `token` to `path`, readable by its owner only (created 0600, then renamed in)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    tmp.replace(path)
    return path


def read_secret_file(path: str | Path, flag: str = "auth-token-file") -> str:
    """The secret in `path` (surrounding whitespace dropped); ValueError naming `flag` when the
    file is missing, empty or shorter than MIN_TOKEN_CHARS. Warns when others may read it."""
    p = Path(path)
    try:
        text = p.read_text().strip()
        mode = p.stat().st_mode
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if len(text) < MIN_TOKEN_CHARS:
        raise ValueError(f"{flag}: {str(path)!r} holds {len(text)} characters; a token needs at least "
                         f"{MIN_TOKEN_CHARS} (make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    if mode & (stat.S_IRWXG | stat.S_IRWXO) and not p.is_symlink():  # Kubernetes mounts Secrets through links
        logger.warning("%s: %s is readable by other users (chmod 600 it)", flag, path)
    return text


def load_token(path: str | Path | None = None) -> str | None:
    """The cluster token: from `path` (the --auth-token-file flag), else from the file named by
    $TANDEM_AUTH_TOKEN_FILE, else $TANDEM_AUTH_TOKEN, else None (no token: internal RPCs open)."""
    if path:
        return read_secret_file(path)
    if os.environ.get(TOKEN_FILE_ENV):
        return read_secret_file(os.environ[TOKEN_FILE_ENV], TOKEN_FILE_ENV)
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token and len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{TOKEN_ENV}: a token needs at least {MIN_TOKEN_CHARS} characters")
    return token or None


def load_api_key(value: str | None) -> str | None:
    """The public API key: the --api-key value, else $TANDEM_API_KEY, else None (public port open).
    A value starting with '@' names a file holding the key (keeps it off the command line)."""
    value = value or os.environ.get(API_KEY_ENV) or None
    if value and value.startswith("@"):
        return read_secret_file(value[1:], "api-key")
    return value


def same_secret(given: str | bytes | None, expected: str) -> bool:
    """Whether `given` equals `expected`, compared in constant time."""
    if given is None:
        return False
    if isinstance(given, str):
        given = given.encode()
    return hmac.compare_digest(given, expected.encode())


def token_metadata(token: str | None) -> Metadata:
    """gRPC metadata carrying the cluster token (empty without one)."""
    return ((TOKEN_HEADER, token),) if token else ()


def bearer_metadata(api_key: str | None) -> Metadata:
    """gRPC metadata carrying an API key as a bearer token (empty without one)."""
    return ((AUTHORIZATION, f"Bearer {api_key}"),) if api_key else ()


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


# ---------------------------------------------------------------- KV-push vouchers

def _voucher_key(token: str) -> bytes:
    return hmac.new(token.encode(), b"tandem kv-push voucher v1", hashlib.sha256).digest()


def kv_voucher(token: str | None, request_id: str, reservation_id: int, decode_worker_id: str,
               kv_address: str) -> str:
    """The gateway's signature over one KV push target ("" without a token)."""
    if not token:
        return ""
    msg = "\x1f".join((request_id, str(int(reservation_id)), decode_worker_id, kv_address)).encode()
    return hmac.new(_voucher_key(token), msg, hashlib.sha256).hexdigest()


def check_kv_voucher(token: str | None, voucher: str, request_id: str, reservation_id: int,
                     decode_worker_id: str, kv_address: str) -> bool:
    """Whether `voucher` is the gateway's signature of this target (always True without a token)."""
    if not token:
        return True
    return same_secret(voucher, kv_voucher(token, request_id, reservation_id, decode_worker_id, kv_address))


# ---------------------------------------------------------------- server side

class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call's credentials before its handler runs (grpc.aio servers).

    - `open_services` (default: health) need nothing;
    - `public_services` need `authorization: Bearer <api_key>` when `api_key` is set;
    - every other service (the internal ones, and reflection) needs the cluster token in the
      `x-tandem-cluster-token` metadata when `token` is set.
    A call without the right credential ends with UNAUTHENTICATED before its request is parsed.
    """

    def __init__(self, token: str | None, api_key: str | None = None, public_services: Iterable[str] = (),
                 open_services: Iterable[str] = (HEALTH_SERVICE,)) -> None:
        self.token = token
        self.api_key = api_key
        self.public = frozenset(public_services)
        self.open = frozenset(open_services)
        self.refused = 0
        self._last_log = 0.0

    def _refusal(self, method: str, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """Why the call must be refused, or None when it may go on."""
        service = method.lstrip("/").partition("/")[0]
        if service in self.open:
            return None
        md = {k: v for k, v in (metadata or ())}
        if service in self.public:
            if self.api_key is None or same_secret(bearer_token(md.get(AUTHORIZATION)), self.api_key):
                return None
            return "missing or wrong API key (send 'authorization: Bearer <key>')"
        if self.token is None or same_secret(md.get(TOKEN_HEADER), self.token):
            return None
        return f"missing or wrong cluster token ({TOKEN_HEADER}) for an internal service"

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        why = self._refusal(details.method, details.invocation_metadata)
        handler = await continuation(details)
        if why is None or handler is None:
            return handler
        self.refused += 1
        now = time.monotonic()
        if now - self._last_log > _REFUSAL_LOG_EVERY_S:
            self._last_log = now
            logger.warning("refused %s: %s (%d refused so far)", details.method, why, self.refused)
        return _refusing_handler(handler, why)


def _refusing_handler(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # pragma: no cover (makes this an async generator)

    raw = {"request_deserializer": None, "response_serializer": None}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, **raw)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming, **raw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, **raw)
    return grpc.stream_stream_rpc_method_handler(streaming, **raw)


def _read(path: str | Path, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {str(path)!r}: {exc.strerror or exc}") from None


def check_tls_pair(cert: str | None, key: str | None, flag: str = "tls-cert") -> None:
    """ValueError unless both or neither of a certificate and its key are given."""
    if bool(cert) != bool(key):
        raise ValueError(f"{flag}: give both --tls-cert and --tls-key (or neither)")


def server_credentials(cert: str | Path, key: str | Path, client_ca: str | Path | None = None) -> grpc.ServerCredentials:
    """TLS for a gRPC server from PEM files; with `client_ca`, clients must present a certificate
    it signed (mutual TLS)."""
    pair = [(_read(key, "tls-key"), _read(cert, "tls-cert"))]
    if client_ca:
        return grpc.ssl_server_credentials(pair, root_certificates=_read(client_ca, "tls-client-ca"),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def add_port(server: grpc.aio.Server | grpc.Server, address: str, cert: str | None = None,
             key: str | None = None, client_ca: str | None = None) -> int:
    """Bind `address` with TLS when `cert` and `key` are given, in plaintext otherwise; returns
    the port (0 when it cannot bind, as grpc does)."""
    check_tls_pair(cert, key)
    if cert and key:
        return server.add_secure_port(address, server_credentials(cert, key, client_ca))
    return server.add_insecure_port(address)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def warn_if_exposed(role: str, host: str, token: str | None, tls: bool) -> None:
    """Log what an operator should know when a server binds beyond loopback unprotected."""
    if is_loopback(host):
        return
    if token is None:
        logger.warning("%s binds %s without a cluster token: anyone who reaches the port may call its "
                       "internal RPCs (give --auth-token-file)", role, host)
    elif not tls:
        logger.warning("%s binds %s without TLS: the cluster token travels in the clear", role, host)


# ---------------------------------------------------------------- client side

def channel_credentials(ca: str | Path | None = None, cert: str | Path | None = None,
                        key: str | Path | None = None) -> grpc.ChannelCredentials:
    """TLS credentials for a channel: trust `ca` (None: the system's roots); with `cert` and
    `key`, present a client certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "tls-ca") if ca else None,
        private_key=_read(key, "tls-client-key") if key else None,
        certificate_chain=_read(cert, "tls-client-cert") if cert else None)


def channel(target: str, *, tls_ca: str | None = None, tls: bool = False,
            options: Sequence[tuple[str, Any]] | None = None, aio: bool = False) -> Any:
    """A sync (or, with `aio`, grpc.aio) channel to `target`: TLS when `tls_ca` is given or `tls`
    is set (system roots), plaintext otherwise."""
    opts = list(options or [])
    mod = grpc.aio if aio else grpc
    if tls_ca or tls:
        return mod.secure_channel(target, channel_credentials(tls_ca), options=opts)
    return mod.insecure_channel(target, options=opts)
