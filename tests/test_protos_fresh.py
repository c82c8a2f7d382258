"""The committed stubs in tandem/_proto/ must equal a fresh `python -m tandem.protos_build`."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tandem import protos_build

pytest.importorskip("grpc_tools")


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_committed_stubs_match_a_fresh_build(tmp_path: Path) -> None:
    fresh_dir = tmp_path / "_proto"
    protos_build.build(fresh_dir)
    fresh = _files(fresh_dir)
    committed = _files(protos_build.OUT_DIR)
    hint = "stale generated stubs: run `python -m tandem.protos_build` and commit tandem/_proto/"
    assert sorted(committed) == sorted(fresh), hint
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"{hint} (differs: {stale})"


def test_every_proto_has_stubs_importable_from_the_package() -> None:
    for rel in protos_build.proto_files():
        stem = rel.with_suffix("").as_posix().replace("/", ".")
        for suffix in ("_pb2", "_pb2_grpc"):
            module = importlib.import_module(f"{protos_build.PACKAGE}.{stem}{suffix}")
            assert module.__name__.startswith("tandem._proto.tandem.v1.")
            # protoc's servicer bases (every RPC raising NotImplementedError) are dropped: tandem.wire's stand in
            assert not [n for n in dir(module) if n.endswith("Servicer")], module.__name__
    pb2 = importlib.import_module(f"{protos_build.PACKAGE}.tandem.v1.worker_pb2")
    # worker.proto imports tandem.proto: the import must resolve inside the generated package.
    assert pb2.DESCRIPTOR.dependencies[0].name == "tandem/v1/tandem.proto"


def test_generated_imports_are_package_relative() -> None:
    for path in protos_build.OUT_DIR.rglob("*.py*"):
        text = path.read_text(encoding="utf-8")
        assert "from tandem.v1 import" not in text, path
        assert "import tandem.v1" not in text, path
