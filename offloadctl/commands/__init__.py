"""One module per ``offloadctl`` subcommand."""
