"""One copy of a model's weights for the workers on one device.

Where a prefill and a decode worker share a GPU, each would load the weights: two copies, and
on an 80 GB card the decode worker's K/V loses what the second copy takes (BENCHMARKS.md §35).
Workers given the same rendezvous directory keep one copy instead:

- the first to come loads its model as usual, moves every parameter and buffer (the rotary
  cache, FP8 unit scales: fixed at build like the weights) into an *arena* (one block
  of memory another process can map: a memfd for host memory, `engine.cuda_vmm.DeviceMemory`
  on a GPU) and serves the arena on a Unix socket in the directory;
- a worker that comes after builds its model without weights (on the meta device), asks a
  serving worker for the arena, receives it as a file descriptor (SCM_RIGHTS) with its
  manifest, maps it and binds its parameters and buffers to views of it; it then serves the
  arena too.

The memory lives while any process maps it, so either worker may be killed and restarted: the
survivor keeps the weights and hands them to the newcomer. A lock file orders the workers that
come at once (the second waits while the first loads). The manifest names every tensor (name,
shape, dtype, byte offset; parameters, then buffers, in module order) and what the weights are
(`identity`: the model, its dtype and quantization); a newcomer whose own differs refuses the
arena with an error naming the first difference, as loading a second copy would overfill a
device sized for one.

The tensors are read-only once shared: no worker writes its parameters or buffers after loading.
"""
from __future__ import annotations

import fcntl
import json
import logging
import math
import mmap
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

ALIGN = 256  # every parameter starts at a multiple (the widest vector load a kernel makes)
CONNECT_TIMEOUT_S = 5.0
MAX_HEADER = 1 << 24  # a manifest's bytes at most (a 1,000-layer model's names fit)
MAX_SOCKET_PATH = 107  # sockaddr_un's sun_path, less its terminating NUL


@dataclass(frozen=True)
class Entry:
    """One tensor's place in the arena."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # str(torch.dtype), e.g. "torch.bfloat16"
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Manifest:
    """What an arena holds: `identity` (what the weights are), `entries` and the bytes in all."""

    identity: dict[str, Any]
    entries: tuple[Entry, ...]
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"identity": self.identity, "nbytes": self.nbytes,
                "entries": [[e.name, list(e.shape), e.dtype, e.offset] for e in self.entries]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "Manifest":
        entries = tuple(Entry(n, tuple(int(d) for d in s), t, int(o)) for n, s, t, o in doc["entries"])
        return cls(dict(doc["identity"]), entries, int(doc["nbytes"]))

    def difference(self, other: "Manifest") -> str | None:
        """The first way `other` differs from this manifest, in words; None when they are equal."""
        for key in sorted(set(self.identity) | set(other.identity)):
            if self.identity.get(key) != other.identity.get(key):
                return f"{key} {other.identity.get(key)!r} where this worker has {self.identity.get(key)!r}"
        if len(self.entries) != len(other.entries):
            return f"{len(other.entries)} tensors (parameters and buffers) where this worker has {len(self.entries)}"
        for mine, theirs in zip(self.entries, other.entries):
            if mine != theirs:
                return (f"tensor {theirs.name} {list(theirs.shape)} {theirs.dtype} where this worker has "
                        f"{mine.name} {list(mine.shape)} {mine.dtype}")
        return None


def plan(model: nn.Module, identity: dict[str, Any]) -> Manifest:
    """The arena layout of `model`'s parameters and buffers (the rotary cache, FP8 unit scales:
    values fixed at build, read-only like the weights), meta or real: only shapes and dtypes are
    read."""
    entries, at = [], 0
    for name, ((owner, attr), *_) in _tensor_holders(model).items():
        t = getattr(owner, attr)
        at = -(-at // ALIGN) * ALIGN
        e = Entry(name, tuple(t.shape), str(t.dtype), at)
        entries.append(e)
        at += e.nbytes
    return Manifest(dict(identity), tuple(entries), max(at, 1))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"shared weights: unknown dtype {name!r} in a manifest")
    return dtype


class Arena:
    """Memory for a manifest's bytes that other processes can map: host memory (a memfd) or a
    GPU's (`engine.cuda_vmm.DeviceMemory`). Made here (`fd` None) or mapped from a received
    descriptor (this object takes it). `tensor` is a uint8 view; `export_fd` a descriptor to send."""

    def __init__(self, device: torch.device, nbytes: int, fd: int | None = None) -> None:
        self.device, self.nbytes = device, nbytes
        if device.type == "cuda":
            from engine.cuda_vmm import DeviceMemory

            self._mem: Any = DeviceMemory(device, nbytes, fd)
            self.tensor = self._mem.tensor
            return
        if device.type != "cpu":
            raise ValueError(f"shared weights: a cpu or cuda device, got {device}")
        if fd is None:
            if not hasattr(os, "memfd_create"):
                raise ValueError("shared_weights_dir: weights shared in host memory need Linux (memfd_create)")
            fd = os.memfd_create("tandem-weights", os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
        elif os.fstat(fd).st_size < nbytes:
            os.close(fd)
            raise ValueError(f"shared weights: the received arena holds fewer than its manifest's {nbytes} bytes")
        self._fd = fd
        self._mem = mmap.mmap(fd, nbytes)
        self.tensor = torch.frombuffer(self._mem, dtype=torch.uint8, count=nbytes)

    def export_fd(self) -> int:
        """A new descriptor of this memory for another process (the caller closes it)."""
        return self._mem.export_fd() if self.device.type == "cuda" else os.dup(self._fd)

    def view(self, e: Entry) -> torch.Tensor:
        """Entry `e`'s bytes as a tensor of its shape and dtype."""
        return self.tensor[e.offset:e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape)


def move_into(model: nn.Module, manifest: Manifest, arena: Arena) -> None:
    """Copy each of `model`'s parameters and buffers into its place in `arena` and make it a view
    of that place (the original's memory is freed as it goes; the caller empties torch's cache)."""
    bind(model, manifest, arena, copy=True)


def bind(model: nn.Module, manifest: Manifest, arena: Arena, copy: bool = False) -> None:
    """Make each of `model`'s parameters and buffers a view of its place in `arena`, first copying
    its values there where `copy` (else they are the arena's: meta tensors of a model built
    without weights). Every one must have an entry (the manifests were compared); a tensor two
    modules hold (tied) is one entry, and both get the view."""
    entries = {e.name: e for e in manifest.entries}
    with torch.no_grad():
        for name, holders in _tensor_holders(model).items():
            e = entries.get(name)
            if e is None:
                raise ValueError(f"shared weights: the arena has no tensor {name}")
            view = arena.view(e)
            owner, attr = holders[0]
            old = owner._parameters[attr] if attr in owner._parameters else owner._buffers[attr]
            if copy:
                view.copy_(old.data)
            new = nn.Parameter(view, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else view
            for owner, attr in holders:
                (owner._parameters if attr in owner._parameters else owner._buffers)[attr] = new


def _tensor_holders(model: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """Each parameter's, then each buffer's, full name (its first holder's) -> every (module,
    attribute) that holds it, in module order."""
    by_id: dict[int, list[tuple[nn.Module, str]]] = {}
    names: dict[int, str] = {}
    for kind in ("_parameters", "_buffers"):
        for prefix, module in model.named_modules(remove_duplicate=False):
            for attr, t in getattr(module, kind).items():
                if t is None:
                    continue
                names.setdefault(id(t), f"{prefix}.{attr}" if prefix else attr)
                if (module, attr) not in by_id.setdefault(id(t), []):
                    by_id[id(t)].append((module, attr))
    return {names[i]: holders for i, holders in by_id.items()}


class Rendezvous:
    """The directory where workers sharing one device's weights find each other: a lock file,
    and one Unix socket per serving worker (`<pid>.sock`)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        if len(str(self.dir.resolve() / f"{2**22}.sock")) > MAX_SOCKET_PATH:
            raise ValueError(f"shared_weights_dir: {str(directory)!r} is too long for the Unix sockets it holds "
                             f"(at most {MAX_SOCKET_PATH} bytes with a socket's name); choose a shorter path")
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._server: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Held while a worker finds or makes the arena (flock: released if the worker dies)."""
        with open(self.dir / "lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def fetch(self) -> tuple[Manifest, int] | None:
        """The manifest and a descriptor of the arena from a live serving worker; None when none
        answers (sockets of dead workers are removed on the way)."""
        for path in sorted(self.dir.glob("*.sock")):
            if path.name == f"{os.getpid()}.sock":
                continue
            try:
                return _request(path)
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink(missing_ok=True)  # its worker is gone
            except (OSError, ValueError) as exc:
                logger.warning("shared weights: %s did not answer (%s)", path, exc)
        return None

    def serve(self, manifest: Manifest, arena: Arena) -> None:
        """Answer every later worker with `manifest` and a descriptor of `arena`, from a thread."""
        path = self.dir / f"{os.getpid()}.sock"
        path.unlink(missing_ok=True)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        server.listen(8)
        self._server = server
        header = json.dumps(manifest.to_json()).encode()

        def run() -> None:
            while not self._closed:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return  # closed
                with conn:
                    try:
                        fd = arena.export_fd()
                    except (OSError, RuntimeError) as exc:  # the asker is told by the closed connection
                        logger.error("shared weights: could not export the arena (%s)", exc)
                        continue
                    try:  # the descriptor rides on the header's length; the header follows
                        socket.send_fds(conn, [len(header).to_bytes(8, "little")], [fd])
                        conn.sendall(header)
                    except OSError as exc:
                        logger.warning("shared weights: a worker left before its arena was sent (%s)", exc)
                    finally:
                        os.close(fd)

        self._thread = threading.Thread(target=run, name="shared-weights", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving: the socket goes, so no newcomer asks this process any more."""
        self._closed = True
        if self._server is not None:
            self._server.close()
            (self.dir / f"{os.getpid()}.sock").unlink(missing_ok=True)


def _request(path: Path) -> tuple[Manifest, int]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(CONNECT_TIMEOUT_S)
        conn.connect(str(path))
        msg, fds, _, _ = socket.recv_fds(conn, 8, 1)
        if not fds:
            raise ValueError("no descriptor came with the manifest")
        try:
            size = int.from_bytes(msg + _read_exactly(conn, 8 - len(msg)), "little")
            if not 0 < size <= MAX_HEADER:
                raise ValueError(f"a manifest of {size} bytes")
            return Manifest.from_json(json.loads(_read_exactly(conn, size))), fds[0]
        except (OSError, ValueError, KeyError, TypeError):
            os.close(fds[0])
            raise


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ValueError("the serving worker closed the connection")
        out += chunk
    return out


@dataclass
class SharedWeights:
    """A model whose parameters live in a shared arena, and whether this process loaded them."""

    model: nn.Module
    manifest: Manifest
    arena: Arena
    rendezvous: Rendezvous
    loaded_here: bool

    def close(self) -> None:
        """Stop handing the arena to newcomers; this process keeps its mapping (the model uses it)."""
        self.rendezvous.close()


def load_shared(directory: str | Path, identity: dict[str, Any], device: torch.device,
                build: Callable[[], nn.Module], load: Callable[[], nn.Module]) -> SharedWeights:
    """The model with its weights in the arena of `directory`: mapped from a serving worker when
    one answers (`build()` makes the model's modules on the meta device, its manifest must match
    the arena's), else loaded here (`load()`, the usual loader) and moved into a new arena. Either
    way this process then serves the arena. ValueError naming the difference when a serving
    worker's weights are not this worker's."""
    rv = Rendezvous(directory)
    with rv.locked():
        found = rv.fetch()
        if found is not None:
            theirs, fd = found
            model = build()
            mine = plan(model, identity)
            diff = mine.difference(theirs)
            if diff is not None:
                os.close(fd)
                raise ValueError(f"shared weights in {rv.dir}: the serving worker's model has {diff}; "
                                 "give the workers that share a device the same --model, --dtype and --quantization")
            arena = Arena(device, theirs.nbytes, fd)
            bind(model, theirs, arena)
            loaded_here, manifest = False, theirs
        else:
            model = load()
            manifest = plan(model, identity)
            arena = Arena(device, manifest.nbytes)
            move_into(model, manifest, arena)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the copies the arena replaced
            loaded_here = True
        rv.serve(manifest, arena)
    logger.info("shared weights: %.2f GiB %s %s (%s)", manifest.nbytes / 2**30,
                "loaded here into" if loaded_here else "mapped from", rv.dir, device)
    return SharedWeights(model, manifest, arena, rv, loaded_here)


__all__ = ["ALIGN", "Arena", "Entry", "Manifest", "Rendezvous", "SharedWeights", "bind", "load_shared", "move_into",
           "plan"]
