"""`python -m prefill --model DIR --port P --kv-transport zmq ...` (`tandem prefill`): a prefill worker."""
from __future__ import annotations

import sys

from worker.server import main as _main


def main(argv: list[str] | None = None) -> int:
    return _main(argv, role="prefill", prog="tandem prefill")


if __name__ == "__main__":
    sys.exit(main())
