"""Regenerate the gRPC stubs in `tandem/_proto/` from `protos/tandem/v1/*.proto`.

Run `python -m tandem.protos_build` after editing a .proto file and commit the result;
tests/test_protos_fresh.py fails while the committed stubs are stale. Needs grpcio-tools.
"""
from __future__ import annotations

import argparse
import logging
import re
import shutil
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
OUT_DIR = Path(__file__).resolve().parent / "_proto"
# The generated modules' import path for the proto package `tandem.v1`.
PACKAGE = "tandem._proto"

_INIT_DOC = {
    "": ('"""Generated gRPC stubs for the tandem.v1 protos. '
         'Regenerate with `python -m tandem.protos_build`; never edit by hand."""\n'),
    "tandem": '"""Generated code; see tandem/_proto/__init__.py."""\n',
    "tandem/v1": '"""Generated code; see tandem/_proto/__init__.py."""\n',
}
# protoc writes `from tandem.v1 import x_pb2 as ...`, which would resolve against the
# top-level `tandem` package; rewrite it to the generated package's real location.
_IMPORT_RE = re.compile(r"^(from|import) tandem\.v1(\b)", re.MULTILINE)
# protoc's `<Service>Servicer` classes answer every RPC with NotImplementedError; tandem.wire builds
# the servicer bases instead (every RPC abstract, from the service descriptors), so they are dropped.
_SERVICER_RE = re.compile(r"^class (\w+Servicer)(?:\(object\))?:\n(?:(?:[ \t].*)?\n)*", re.MULTILINE)


def _drop_servicers(text: str) -> str:
    return _SERVICER_RE.sub(r"# \1: see tandem.wire (an abstract base built from the service descriptor).\n\n\n", text)


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto under `proto_root`, relative to it, in a stable order."""
    return sorted(p.relative_to(proto_root) for p in proto_root.rglob("*.proto"))


def build(out_dir: Path = OUT_DIR, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Generate *_pb2.py, *_pb2.pyi and *_pb2_grpc.py into `out_dir` (replacing its contents).

    Returns the written files relative to `out_dir`. Raises RuntimeError when protoc fails.
    """
    from grpc_tools import protoc  # dev dependency; imported here so `import tandem` stays light

    files = proto_files(proto_root)
    if not files:
        raise RuntimeError(f"no .proto files under {proto_root}")
    include = Path(protoc.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory() as tmp:
        gen = Path(tmp) / "gen"
        gen.mkdir()
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{include}",
            f"--python_out={gen}",
            f"--pyi_out={gen}",
            f"--grpc_python_out={gen}",
            *(str(f) for f in files),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
        for path in sorted(gen.rglob("*.py*")):
            text = _IMPORT_RE.sub(rf"\1 {PACKAGE}.tandem.v1\2", path.read_text(encoding="utf-8"))
            if path.name.endswith("_pb2_grpc.py"):
                text = _drop_servicers(text)
            path.write_text(text, encoding="utf-8")
        for sub, doc in _INIT_DOC.items():
            (gen / sub).mkdir(parents=True, exist_ok=True)
            (gen / sub / "__init__.py").write_text(doc, encoding="utf-8")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        shutil.copytree(gen, out_dir)
    written = sorted(p.relative_to(out_dir) for p in out_dir.rglob("*") if p.is_file())
    logger.info("wrote %d files into %s", len(written), out_dir)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output package directory")
    args = parser.parse_args(argv)
    for rel in build(args.out):
        print(args.out / rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
