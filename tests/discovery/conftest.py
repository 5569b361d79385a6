"""Fixtures of the discovery tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def sdk_logs(monkeypatch) -> None:
    """The SDK's records reach caplog: its constructor turns propagation off when it finds no handler
    at all (a process that has not configured logging), whatever ran earlier in this process."""
    monkeypatch.setattr(logging.getLogger("nacos.client"), "propagate", True)
