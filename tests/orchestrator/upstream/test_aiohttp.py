"""aiohttp's exceptions, translated to the project's own errors in one place (the behaviour against real workers is
in test_base.py, run for every transport)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey

from frontend.errors import UpstreamError, UpstreamTimeoutError, UpstreamUnavailableError
from orchestrator.upstream.aiohttp import translate_aiohttp_error

_KEY = ConnectionKey("w", 1, False, True, None, None, None)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (aiohttp.ConnectionTimeoutError("t"), UpstreamTimeoutError),
        (aiohttp.SocketTimeoutError("t"), UpstreamTimeoutError),
        (TimeoutError(), UpstreamTimeoutError),
        (aiohttp.ClientConnectorError(_KEY, ConnectionRefusedError(111, "refused")), UpstreamUnavailableError),
        # A connection lost under a request is an upstream failure, but not proof the worker is gone.
        (aiohttp.ServerDisconnectedError(), UpstreamError),
        (aiohttp.ClientOSError(104, "reset"), UpstreamError),
        (aiohttp.ClientPayloadError("p"), UpstreamError),
    ],
)
def test_aiohttp_errors_are_translated(error: aiohttp.ClientError | TimeoutError,
                                       expected: type[UpstreamError]) -> None:
    translated = translate_aiohttp_error(error, "http://w:1")
    assert type(translated) is expected
    assert "http://w:1" in translated.message
