"""`python -m entrypoints ...` is the `tandem` command (child processes of `tandem up` run this way)."""
import sys

from entrypoints.cluster import die_with_parent

die_with_parent()

from entrypoints.cli import main  # noqa: E402

sys.exit(main())
