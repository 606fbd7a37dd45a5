"""One module per ``sharegpu`` subcommand (see :mod:`sharegpu.cli`)."""
