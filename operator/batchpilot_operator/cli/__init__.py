"""The command line: batchpilot-operator and its subcommands."""
