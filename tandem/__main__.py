"""`python -m tandem ...` is the `tandem` command (child processes of `tandem up` run this way)."""
import sys

from tandem.cli import main

sys.exit(main())
