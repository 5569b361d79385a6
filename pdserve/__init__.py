"""pdserve: the CLI application (`pdserve.cli`, `pdserve.commands`); generated protos live in pdserve.v1."""
