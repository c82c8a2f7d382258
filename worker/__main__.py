"""`python -m worker --role prefill|decode|both --model DIR ...` (`tandem worker --role both`)."""
from __future__ import annotations

import sys

from worker.server import main as _main


def main(argv: list[str] | None = None) -> int:
    return _main(argv, prog="tandem worker")


if __name__ == "__main__":
    sys.exit(main())
