"""Flags generated from config fields (`pdserve.commands.config_flags`): help and default come from
the one field, and the commands that use them build the config the field describes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from pdserve.cli import build_parser
from pdserve.commands.config_flags import config_flag, field_docs, plain_flag
from pdserve.commands.node_common import node_config
from pdserve.commands.router import router_config
from pdserve.node_runtime.node_config import NodeOptions, TransferOptions
from pdserve.router.deadlines import Deadlines


@dataclass(frozen=True)
class Sample:
    ratio: float = 0.5
    """Share of the load, at most 100% of it."""
    enabled: bool = False
    """Whether it runs."""
    limit: int | None = None
    """Most items (unset: no limit)."""
    name: str = ""
    """What it is called (unset: nothing)."""
    undocumented: int = 3


def _help(parser: argparse.ArgumentParser, dest: str) -> str:
    return next(a.help for a in parser._actions if a.dest == dest) or ""


def test_help_is_the_docstring_and_the_real_default():
    p = argparse.ArgumentParser()
    config_flag(p, Sample, "ratio")
    config_flag(p, Sample, "enabled")
    config_flag(p, Sample, "limit", type=int)
    assert _help(p, "ratio") == "Share of the load, at most 100%% of it (default 0.5)"  # %-escaped for argparse
    assert "100% of it (default 0.5)" in p.format_help()
    assert _help(p, "enabled") == "Whether it runs (default off)"
    assert _help(p, "limit") == "Most items (unset: no limit)."  # a None default is the docstring's to explain
    args = p.parse_args(["--ratio", "0.25", "--enabled", "on"])
    assert (args.ratio, args.enabled, args.limit) == (0.25, True, None)  # unset: None, the field's default applies
    with pytest.raises(SystemExit):
        p.parse_args(["--enabled", "yes"])


def test_flag_forms_keep_their_argparse_shape():
    """Switches, other names and dests, a parser default kept for commands that read the namespace,
    a default the command states itself, an optional number's type from its annotation."""
    p = argparse.ArgumentParser()
    switch = config_flag(p, Sample, "enabled", action="store_true")
    both = config_flag(p, Sample, "enabled", "--with-it", dest="with_it", action=argparse.BooleanOptionalAction)
    kept = config_flag(p, Sample, "ratio", "--share", dest="share", keep_default=True)
    config_flag(p, Sample, "limit", stated_default=7)
    config_flag(p, Sample, "name")
    plain_flag(p, "--count", type=int, default=2, help="how many")
    assert getattr(switch, "config_field") == (Sample, "enabled") and kept.dest == "share"
    assert _help(p, "enabled") == "Whether it runs (default off)" and both.help == "Whether it runs (default off)"
    assert _help(p, "limit") == "Most items (unset: no limit) (default 7)"
    assert _help(p, "name") == "What it is called (unset: nothing)."  # an empty default, like None, is the docstring's
    assert _help(p, "count") == "how many (default 2)"
    args = p.parse_args(["--enabled", "--no-with-it", "--limit", "3"])
    assert (args.enabled, args.with_it, args.share, args.limit, args.name, args.count) == (True, False, 0.5, 3, None, 2)
    assert p.parse_args([]).enabled is None  # unset: the field's default applies


def test_a_field_without_a_docstring_cannot_become_a_flag():
    with pytest.raises(TypeError, match="undocumented has no docstring"):
        config_flag(argparse.ArgumentParser(), Sample, "undocumented")


def test_docstrings_are_read_through_base_classes():
    assert "cluster_tls_cert" in field_docs(NodeOptions)  # declared on its base, ClusterTLSOptions
    assert field_docs(TransferOptions)["kv_timeout"].startswith("Seconds a KV transfer")


def test_generated_node_and_router_flags_reach_their_configs():
    parser = build_parser()
    node = node_config(
        parser.parse_args(["decode", "--kv-timeout", "7", "--kv-reuse", "off", "--rdma-qps", "3"]), "decode"
    )
    assert (node.transfer.kv_timeout, node.node.kv_reuse, node.transfer.rdma_qps) == (7.0, False, 3)
    default = node_config(parser.parse_args(["decode"]), "decode")
    assert default.node.kv_reuse is NodeOptions.kv_reuse and default.transfer.kv_timeout == TransferOptions.kv_timeout
    router = router_config(parser.parse_args(["router", "--hung-after", "4", "--routing", "wrr"]))
    assert (router.cluster.deadlines.hung_after, router.cluster.routing) == (4.0, "wrr")
    assert router_config(parser.parse_args(["router"])).cluster.deadlines.hung_after == Deadlines.hung_after
