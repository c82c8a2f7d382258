"""The `tandem` command: `up`, `gateway`, `prefill`, `decode`, `worker`, `generate`, `bench`, `convert`, `health`.

Each subcommand imports its service lazily, so `tandem generate` never loads torch.
"""
from __future__ import annotations

import argparse
import sys

USAGE = """usage: tandem COMMAND [ARGS]

commands:
  up         start a local cluster (gateway + prefill + decode workers) and supervise it
  gateway    run the public gateway
  prefill    run a prefill worker
  decode     run a decode worker
  worker     run a worker with --role prefill|decode|both
  agent      run the infra agent (drains, restarts, isolates unhealthy workers)
  generate   send one request to a running cluster
  bench      run a load benchmark against a running cluster
  convert    convert a checkpoint (llama2c) to a Hugging Face directory
  health     exit 0 when a gateway or worker's gRPC health check says SERVING

`tandem COMMAND --help` shows each command's options; `tandem --version` the version.
"""


def version() -> str:
    """The installed package's version (pyproject.toml's when run from a checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("tandem")
    except PackageNotFoundError:
        import re
        from pathlib import Path

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return found.group(1) if found else "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version", "version"):
        print(f"tandem {version()}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "up":
        from entrypoints.launcher import main as run
    elif cmd == "gateway":
        from entrypoints.gateway import main as run
    elif cmd == "prefill":
        from entrypoints.worker import prefill_main as run
    elif cmd == "decode":
        from entrypoints.worker import decode_main as run
    elif cmd == "worker":
        from entrypoints.worker import main as run
    elif cmd == "agent":
        from agent.main import main as run
    elif cmd == "generate":
        return generate_main(rest)
    elif cmd == "bench":
        from loadgen.command import main as run
    elif cmd == "convert":
        from engine.convert.llama2c import main_convert as run
    elif cmd == "health":
        from entrypoints.health import main as run
    else:
        print(f"tandem: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return int(run(rest) or 0)


def generate_main(argv: list[str]) -> int:
    from tandem.client import Client
    from tandem.errors import TandemError
    from tandem.types import Tier

    p = argparse.ArgumentParser(prog="tandem generate", description="Send one request to a Tandem gateway.")
    p.add_argument("prompt")
    p.add_argument("--target", default="127.0.0.1:50051", help="gateway HOST:PORT")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--tier", default="standard", choices=[t.name.lower() for t in Tier])
    p.add_argument("--stream", action="store_true", help="print text as it arrives")
    p.add_argument("--timeout", type=float, default=None, help="seconds")
    p.add_argument("--api-key", default=None,
                   help="the gateway's API key (sent as a bearer token); @FILE reads it (default: $TANDEM_API_KEY)")
    p.add_argument("--tls-ca", default=None, help="PEM CA that signed the gateway's certificate (uses TLS)")
    p.add_argument("--tls", action="store_true", help="use TLS with the system's CA roots")
    a = p.parse_args(argv)
    kw = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
              stop=a.stop, tier=Tier.parse(a.tier), timeout=a.timeout)
    try:
        from tandem.security import load_api_key

        with Client(a.target, api_key=load_api_key(a.api_key), tls_ca=a.tls_ca, tls=a.tls) as client:
            if a.stream:
                last = None
                for chunk in client.stream(a.prompt, **kw):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    last = chunk
                sys.stdout.write("\n")
                if last is not None and last.usage is not None:
                    print(f"[{last.finish_reason}] {last.usage}", file=sys.stderr)
            else:
                out = client.generate(a.prompt, **kw)
                print(out.text)
                print(f"[{out.finish_reason}] {out.usage}", file=sys.stderr)
    except TandemError as e:
        print(f"tandem generate: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"tandem generate: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
