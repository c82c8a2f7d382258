"""`tandem gateway ...` (`python -m entrypoints gateway`): run the Tandem gateway (see gateway.server for the flags)."""
from __future__ import annotations

import sys

from gateway.server import main

if __name__ == "__main__":
    sys.exit(main())
