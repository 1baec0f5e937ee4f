"""`python -m mpress ...` is the `mpress` console command."""

import sys

from mpress.cli import main

sys.exit(main())
