"""`python -m entrypoints ...` is the `tandem` command (child processes of `tandem up` run this way)."""
import sys

from entrypoints.cli import main

sys.exit(main())
