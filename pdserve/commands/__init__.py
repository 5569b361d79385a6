"""Subcommands of the `pdserve` CLI, one module each (see pdserve/cli.py)."""
