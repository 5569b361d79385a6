"""Service discovery behind one small interface: static | nacos | k8s (headless-Service DNS) | file."""

from __future__ import annotations

import enum
import logging
import sys
from dataclasses import dataclass, field

from pdserve.node_runtime.discovery.base import Discovery, DiscoveryAuthError, DiscoveryError, Member, Role
from pdserve.node_runtime.discovery.static import StaticDiscovery


class DiscoveryKind(enum.StrEnum):
    """Where members are found (`--discovery`; members equal their strings)."""

    STATIC = "static"
    NACOS = "nacos"
    K8S = "k8s"
    FILE = "file"


KINDS = tuple(k.value for k in DiscoveryKind)
NACOS_SECRET_FLAGS = ("--nacos-password", "--nacos-secret-key")
"""Flags whose value `ps` would show; each also comes from $PDSERVE_<FLAG> or a --<flag>-file."""

log = logging.getLogger("pdserve.discovery")


def _read_secret(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            # only the line end: a mounted Secret may or may not end in a newline, while a space can
            # be part of a password
            value = f.read().rstrip("\r\n")
    except OSError as e:
        raise ValueError(f"cannot read {flag} {path}: {e.strerror}") from None
    if not value:
        raise ValueError(f"{flag} {path} is empty")
    return value


@dataclass(frozen=True)
class DiscoveryConfig:
    """How a process finds (router) or announces (nodes) cluster members."""

    discovery: str = "static"
    """Membership source: static (the --prefill/--decode lists), nacos, k8s or file (--members-file)."""
    prefill: str = ""
    """static: comma-separated prefill HOST:PORT list."""
    decode: str = ""
    """static: comma-separated decode HOST:PORT list."""
    nacos_server: str = "127.0.0.1:8848"
    """nacos: server HOST:PORT or https://HOST:PORT, comma-separated for several."""
    nacos_namespace: str = ""
    """nacos: namespace id."""
    nacos_service: str = "pdserve"
    """nacos: service name prefix."""
    nacos_username: str = ""
    """nacos: user to log in as (Nacos auth); needs a password."""
    nacos_password: str = field(default="", repr=False)
    """nacos: that user's password (kept out of repr, never logged; visible in `ps` as a flag: prefer
    the env or --nacos-password-file)."""
    nacos_password_file: str = ""
    """nacos: file holding the password instead (one line)."""
    nacos_access_key: str = ""
    """nacos: access key; requests are signed with the secret key."""
    nacos_secret_key: str = field(default="", repr=False)
    """nacos: secret key of --nacos-access-key (kept out of repr, never logged; visible in `ps` as a
    flag: prefer the env or --nacos-secret-key-file)."""
    nacos_secret_key_file: str = ""
    """nacos: file holding the secret key instead (one line)."""
    nacos_tls_ca: str = ""
    """nacos: CA bundle (PEM) that signed the https:// server's certificate (unset: the system's CAs)."""
    k8s_prefill_service: str = ""
    """k8s: headless service of prefill nodes: NAME:PORT (A records) or NAME / _PORTNAME._tcp.NAME
    (SRV records: port from the Service)."""
    k8s_decode_service: str = ""
    """k8s: headless service of decode nodes (same forms as --k8s-prefill-service)."""
    members_file: str = ""
    """file: a JSON file {"prefill": [HOST:PORT, ...], "decode": [...]}, re-read whenever it changes
    (pdserve up --planner slo rewrites it as it starts and stops nodes)."""

    def __post_init__(self) -> None:
        if self.discovery not in KINDS:
            raise ValueError(f"discovery must be one of {', '.join(KINDS)}, got {self.discovery!r}")
        if self.discovery == DiscoveryKind.NACOS:
            self._check_nacos()
        if self.discovery == DiscoveryKind.FILE and not self.members_file:
            raise ValueError("--discovery file needs --members-file")

    def nacos_secret(self, name: str) -> str:
        """`password` or `secret_key`: the flag's (or env's) value, else its file's content without the
        line end (read now), else ""."""
        value, path = getattr(self, f"nacos_{name}"), getattr(self, f"nacos_{name}_file")
        flag = "--nacos-" + name.replace("_", "-")
        if value and path:
            env = "$PDSERVE_NACOS_" + name.upper()
            raise ValueError(f"give {flag} ({env}) or {flag}-file, not both")
        return _read_secret(path, f"{flag}-file") if path else value

    def _check_nacos(self) -> None:
        """Refuse half-given credentials at start, naming the flag (never a value)."""
        password, secret_key = self.nacos_secret("password"), self.nacos_secret("secret_key")
        if self.nacos_username and not password:
            raise ValueError(
                "--nacos-username needs a password: $PDSERVE_NACOS_PASSWORD, --nacos-password-file or --nacos-password"
            )
        if password and not self.nacos_username:
            raise ValueError("a Nacos password (--nacos-password, its -file or env) needs --nacos-username")
        if self.nacos_access_key and not secret_key:
            raise ValueError(
                "--nacos-access-key needs a secret key: $PDSERVE_NACOS_SECRET_KEY, --nacos-secret-key-file "
                "or --nacos-secret-key"
            )
        if secret_key and not self.nacos_access_key:
            raise ValueError("a Nacos secret key (--nacos-secret-key, its -file or env) needs --nacos-access-key")
        servers = [s.strip() for s in self.nacos_server.split(",")]
        for server in servers:
            scheme, sep, rest = server.rpartition("://")
            # the SDK reads `scheme://host:port` and `host[:port]`; a scheme without a port breaks it
            if sep and (scheme.lower() not in ("http", "https") or not rest.rpartition(":")[2].isdigit()):
                raise ValueError(f"--nacos-server {server!r}: expected HOST[:PORT] or http(s)://HOST:PORT")
        if self.nacos_tls_ca:
            if not any(s.lower().startswith("https://") for s in servers):
                raise ValueError("--nacos-tls-ca needs an https:// --nacos-server")
            try:
                with open(self.nacos_tls_ca, "rb"):
                    pass
            except OSError as e:
                raise ValueError(f"cannot read --nacos-tls-ca {self.nacos_tls_ca}: {e.strerror}") from None


def warn_secrets_in_argv(argv: list[str]) -> None:
    """Warn about a Nacos secret given as a flag: every user of the machine can read a command line."""
    for flag in NACOS_SECRET_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            env = "$PDSERVE_" + flag.lstrip("-").replace("-", "_").upper()
            log.warning("%s puts a secret on the command line, where `ps` shows it; use %s or %s-file", flag, env, flag)


def discovery_from_config(config: DiscoveryConfig) -> Discovery:
    """The Discovery that `config` describes; a nacos one contacts the server on its first call, not here."""
    if config.discovery == DiscoveryKind.NACOS:
        from pdserve.node_runtime.discovery.nacos import NacosDiscovery

        warn_secrets_in_argv(sys.argv)  # here, because both the router and the nodes pass through
        return NacosDiscovery(
            config.nacos_server,
            config.nacos_namespace,
            config.nacos_service,
            username=config.nacos_username,
            password=config.nacos_secret("password"),
            access_key=config.nacos_access_key,
            secret_key=config.nacos_secret("secret_key"),
            tls_ca=config.nacos_tls_ca,
        )
    if config.discovery == DiscoveryKind.K8S:
        from pdserve.node_runtime.discovery.k8s import K8sDnsDiscovery

        return K8sDnsDiscovery({"prefill": config.k8s_prefill_service, "decode": config.k8s_decode_service})
    if config.discovery == DiscoveryKind.FILE:
        from pdserve.node_runtime.discovery.file import FileDiscovery

        return FileDiscovery(config.members_file)
    return StaticDiscovery.from_lists(config.prefill, config.decode)


__all__ = [
    "DiscoveryKind",
    "Role",
    "Discovery",
    "DiscoveryAuthError",
    "DiscoveryConfig",
    "DiscoveryError",
    "Member",
    "StaticDiscovery",
    "discovery_from_config",
    "warn_secrets_in_argv",
]
