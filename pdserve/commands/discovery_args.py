"""The discovery flags of the router and the nodes, one per DiscoveryConfig field."""

from __future__ import annotations

import argparse
import dataclasses

from pdserve.commands.config_flags import config_flag
from pdserve.node_runtime.discovery import KINDS, DiscoveryConfig


def add_discovery_args(p: argparse.ArgumentParser) -> None:
    """--discovery and its kinds' settings; unset flags are None (the field's default applies)."""
    for field in dataclasses.fields(DiscoveryConfig):
        config_flag(p, DiscoveryConfig, field.name, choices=KINDS if field.name == "discovery" else None)
