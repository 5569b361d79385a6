"""--discovery file: the router follows a members file that `pdserve up --planner slo` rewrites."""

from __future__ import annotations

import os

import pytest

from pdserve.node_runtime.discovery import DiscoveryConfig, DiscoveryError, discovery_from_config
from pdserve.node_runtime.discovery.file import FileDiscovery, write_members


def addresses(d: FileDiscovery, role: str) -> list[str]:
    return [m.address for m in d.members(role)]


async def test_members_follow_the_file_and_a_bad_rewrite_keeps_the_last_view(tmp_path):
    path = str(tmp_path / "members.json")
    write_members(path, ["127.0.0.1:1"], ["127.0.0.1:2", "127.0.0.1:3"])
    d = discovery_from_config(DiscoveryConfig(discovery="file", members_file=path))
    assert isinstance(d, FileDiscovery)
    await d.check()
    assert addresses(d, "prefill") == ["127.0.0.1:1"] and addresses(d, "decode") == ["127.0.0.1:2", "127.0.0.1:3"]
    write_members(path, ["127.0.0.1:1", "127.0.0.1:4"], ["127.0.0.1:2"])
    assert addresses(d, "prefill") == ["127.0.0.1:1", "127.0.0.1:4"] and addresses(d, "decode") == ["127.0.0.1:2"]
    with open(path, "w") as f:  # a hand edit gone wrong: the cluster is not emptied
        f.write('{"decode": [')
    assert addresses(d, "decode") == ["127.0.0.1:2"]
    os.remove(path)
    assert addresses(d, "prefill") == ["127.0.0.1:1", "127.0.0.1:4"]


@pytest.mark.parametrize(
    "text,says",
    [(None, "cannot read --members-file"), ("[1]", "expected"), ('{"decode": [5]}', "decode must be a list")],
)
async def test_a_missing_or_malformed_file_is_refused_at_start_naming_the_flag(tmp_path, text, says):
    path = tmp_path / "members.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(DiscoveryError, match=says):
        await FileDiscovery(str(path)).check()


def test_file_discovery_needs_its_file():
    with pytest.raises(ValueError, match="--members-file"):
        DiscoveryConfig(discovery="file")
