"""`python -m mpress ...` is the `mpress` console command."""

import sys

try:  # Ctrl-C while torch is imported: one line and 130, as once `main` runs
    from mpress.cli import main
except KeyboardInterrupt:
    print("mpress: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
