"""pytest fixtures for the server tests (import them into a test module by name)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .daemon import CLIENT_TIMEOUT, Daemon, shared_daemon


@pytest.fixture(scope="session")
def daemon() -> Iterator[Daemon]:
    d = shared_daemon()
    yield d
    # the shared daemon must have survived every test that used it
    assert d.proc.poll() is None, "the daemon died:\n" + "".join(d.log[-40:])


@pytest.fixture()
def openai_client(daemon: Daemon):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(
        base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT
    )


@pytest.fixture()
def anthropic_client(daemon: Daemon):  # type: ignore[no-untyped-def]
    import anthropic

    return anthropic.Anthropic(
        base_url=daemon.url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT
    )
