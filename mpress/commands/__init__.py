"""One module per `mpress` subcommand (see `mpress/cli.py`)."""
