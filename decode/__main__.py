"""`python -m decode --model DIR --port P ...` (`tandem decode`): a decode worker."""
from __future__ import annotations

import sys

from worker.server import main as _main


def main(argv: list[str] | None = None) -> int:
    return _main(argv, role="decode", prog="tandem decode")


if __name__ == "__main__":
    sys.exit(main())
