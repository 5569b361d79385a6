"""Nacos credentials never leak and are never half-given: secrets stay out of logs (the SDK's own
records included, at DEBUG), reprs, errors and --help; half-given credentials are refused at start,
naming the flag; secrets can come from files. The protocol itself (login, tokens, signatures, TLS,
refusals) is in test_nacos_auth.py.
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

import pytest

from pdserve.commands.discovery_args import add_discovery_args
from pdserve.node_runtime.discovery import DiscoveryConfig, discovery_from_config
from pdserve.node_runtime.discovery.nacos import NacosDiscovery
from tests.discovery.nacos_auth_standin import (
    ACCESS_KEY,
    DECODE,
    LOGIN,
    PASSWORD,
    SECRET_KEY,
    serving,
    standin,
    until,
    USER,
)


async def test_secrets_stay_out_of_logs_reprs_and_help(caplog, monkeypatch, sdk_logs):
    caplog.set_level(logging.DEBUG)
    handler = standin(users={USER: PASSWORD}, keys={ACCESS_KEY: SECRET_KEY})
    with serving(handler) as server:
        config = DiscoveryConfig(
            discovery="nacos",
            nacos_server=server,
            nacos_service="t",
            nacos_username=USER,
            nacos_password=PASSWORD,
            nacos_access_key=ACCESS_KEY,
            nacos_secret_key=SECRET_KEY,
        )
        node = discovery_from_config(config)
        assert isinstance(node, NacosDiscovery)
        node.heartbeat = 0.2
        router = discovery_from_config(config)
        try:
            await node.register(DECODE)
            await until(lambda: any(path.endswith("/beat") for _, path, _ in handler.seen), "an SDK heartbeat")
            await router.start()
            await until(lambda: all(t.done() for t in router._tasks), "the subscriptions")
        finally:
            await router.stop()
            await node.stop()
    sdk_lines = [r.getMessage() for r in caplog.records if r.name == "nacos.client"]
    # not vacuous: the SDK did log the login URL and the token, and they were scrubbed
    assert any(LOGIN in line and "password=***" in line for line in sdk_lines)
    assert any("AccessToken: ***" in line for line in sdk_lines)
    logged = caplog.text + "\n".join(sdk_lines)
    for secret in (PASSWORD, SECRET_KEY, "pa+ss%26w%C3%B6rd%3D1%25", *handler.tokens):
        assert secret not in logged
    assert handler.tokens and all(p.get("signature") for _, path, p in handler.seen if path != LOGIN)

    shown = repr(config) + str(config)
    assert PASSWORD not in shown and SECRET_KEY not in shown and USER in shown

    from pdserve.node_runtime.config import new_parser

    monkeypatch.setenv("PDSERVE_NACOS_PASSWORD", PASSWORD)
    monkeypatch.setenv("PDSERVE_NACOS_SECRET_KEY", SECRET_KEY)
    parser = new_parser(prog="pdserve").add_subparsers().add_parser("decode")  # a command's parser, as the CLI's
    add_discovery_args(parser)
    shown_help = io.StringIO()
    with contextlib.redirect_stdout(shown_help), pytest.raises(SystemExit):
        parser.parse_args(["--help"])  # as `pdserve decode --help` (configargparse adds env names when parsing)
    text = shown_help.getvalue()
    assert "PDSERVE_NACOS_PASSWORD" in text and PASSWORD not in text and SECRET_KEY not in text
    # the environment is how the secrets arrive (no `ps` exposure): the generic PDSERVE_<FLAG> mapping
    args = parser.parse_args(["--discovery", "nacos", "--nacos-username", USER, "--nacos-access-key", ACCESS_KEY])
    assert (args.nacos_password, args.nacos_secret_key) == (PASSWORD, SECRET_KEY)

    from pdserve.node_runtime.discovery import warn_secrets_in_argv

    caplog.clear()
    warn_secrets_in_argv(["pdserve", "router", f"--nacos-password={PASSWORD}", "--nacos-secret-key", SECRET_KEY])
    assert "--nacos-password puts a secret on the command line" in caplog.text
    assert "--nacos-secret-key puts a secret" in caplog.text and "$PDSERVE_NACOS_SECRET_KEY" in caplog.text
    assert PASSWORD not in caplog.text and SECRET_KEY not in caplog.text


@pytest.mark.parametrize(
    "fields, flag",
    [
        ({"nacos_username": USER}, "--nacos-username needs a password"),
        ({"nacos_password": PASSWORD}, "needs --nacos-username"),
        ({"nacos_access_key": ACCESS_KEY}, "--nacos-access-key needs a secret key"),
        ({"nacos_secret_key": SECRET_KEY}, "needs --nacos-access-key"),
        ({"nacos_tls_ca": "/etc/hostname"}, "--nacos-tls-ca needs an https:// --nacos-server"),
        ({"nacos_server": "https://nacos.example"}, "expected HOST"),
    ],
)
def test_half_given_settings_are_refused_naming_the_flag(fields, flag):
    with pytest.raises(ValueError, match=flag) as refused:
        DiscoveryConfig(discovery="nacos", **fields)
    assert PASSWORD not in str(refused.value) and SECRET_KEY not in str(refused.value)
    DiscoveryConfig(discovery="static", **fields)  # only a nacos process reads them


def test_secrets_from_files(tmp_path: Path):
    password_file, key_file, empty = tmp_path / "password", tmp_path / "sk", tmp_path / "empty"
    password_file.write_text(PASSWORD + "\n")
    key_file.write_text(SECRET_KEY)
    empty.write_text("\n")
    config = DiscoveryConfig(
        discovery="nacos",
        nacos_username=USER,
        nacos_password_file=str(password_file),
        nacos_access_key=ACCESS_KEY,
        nacos_secret_key_file=str(key_file),
    )
    assert (config.nacos_secret("password"), config.nacos_secret("secret_key")) == (PASSWORD, SECRET_KEY)
    with pytest.raises(ValueError, match="--nacos-password-file .* is empty"):
        DiscoveryConfig(discovery="nacos", nacos_username=USER, nacos_password_file=str(empty))
    with pytest.raises(ValueError, match="cannot read --nacos-secret-key-file"):
        DiscoveryConfig(discovery="nacos", nacos_access_key=ACCESS_KEY, nacos_secret_key_file=str(tmp_path / "no"))
    with pytest.raises(ValueError, match="not both"):
        DiscoveryConfig(
            discovery="nacos", nacos_username=USER, nacos_password="x", nacos_password_file=str(password_file)
        )
