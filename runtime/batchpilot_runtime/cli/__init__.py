"""The command line: batchpilot-runtime and its subcommands."""
