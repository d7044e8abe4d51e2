"""The deployment secret as read at start-up: surrounding whitespace is no part of it (a Secret made from a file keeps
its newline, which as a header value would make every internal call fail), what is not visible ASCII is refused, and
a token file is read only where the variable is unset."""

from __future__ import annotations

import pathlib

import pytest

from frontend.internal_secret import (
    INTERNAL_TOKEN_ENV,
    INTERNAL_TOKEN_FILE_ENV,
    InternalSecret,
    InternalSecretError,
    internal_secret_from_env,
    load_token_file,
    write_token_file,
)

TOKEN = "0123456789abcdef" * 2


def test_a_token_with_its_files_newline_is_the_token() -> None:
    secret = internal_secret_from_env({INTERNAL_TOKEN_ENV: TOKEN + "\n"})
    assert secret is not None and secret.accepts(TOKEN) and secret.headers() == {"x-disagg-internal-token": TOKEN}


@pytest.mark.parametrize("token", [TOKEN[:8] + " " + TOKEN[8:], TOKEN + "\r\nx-injected: 1", TOKEN + "é"])
def test_a_token_that_is_no_header_value_is_refused(token: str) -> None:
    with pytest.raises(InternalSecretError, match="visible ASCII"):
        InternalSecret(token)


def test_the_token_file_is_read_where_the_variable_is_unset(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "token"
    assert write_token_file(path) and not write_token_file(path)  # written once, then kept
    environ = {INTERNAL_TOKEN_FILE_ENV: str(path)}
    load_token_file(environ)
    assert environ[INTERNAL_TOKEN_ENV] == path.read_text()
    mine = {INTERNAL_TOKEN_ENV: TOKEN, INTERNAL_TOKEN_FILE_ENV: str(path)}
    load_token_file(mine)
    assert mine[INTERNAL_TOKEN_ENV] == TOKEN  # the variable wins
    with pytest.raises(InternalSecretError, match="cannot be read"):
        load_token_file({INTERNAL_TOKEN_FILE_ENV: str(tmp_path / "missing")})
