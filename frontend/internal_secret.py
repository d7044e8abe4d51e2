"""The deployment secret: what proves a caller is one of this deployment's own processes.

One shared token (``DISAGG_INTERNAL_TOKEN``) guards everything between our processes. Every other secret (the ZMQ
CURVE key pair, the prefix chain's key) is derived from it with HMAC-SHA256 under a purpose label, so none leads back
to the token or to another purpose's value. Without a token the internal surface is open, and a process listening
beyond loopback says so once (``warn_if_exposed``)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import pathlib
import secrets
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

INTERNAL_TOKEN_ENV = "DISAGG_INTERNAL_TOKEN"
# Or a file that holds it (a Docker or Kubernetes secret mounted as a file; compose's generated token): read at
# start-up into the process's environment when the variable itself is not set, so every part that reads the variable
# (and every child process) sees the same token.
INTERNAL_TOKEN_FILE_ENV = "DISAGG_INTERNAL_TOKEN_FILE"
INTERNAL_TOKEN_HEADER = "x-disagg-internal-token"
# A token shorter than this is refused at start-up: it would be guessable by anyone who can reach a port.
MIN_TOKEN_LENGTH = 16

_log = logging.getLogger("disagg_serve.security")


class InternalSecretError(ValueError):
    """The configured deployment secret is unusable (too short)."""


@dataclass(frozen=True, slots=True)
class InternalSecret:
    token: str = field(repr=False)

    def __post_init__(self) -> None:
        # Sent as an HTTP header value: visible ASCII only (a token read from a file with its newline would make
        # every internal call fail far from here).
        if not all("!" <= ch <= "~" for ch in self.token):
            raise InternalSecretError(f"{INTERNAL_TOKEN_ENV} must be visible ASCII characters only (no spaces, "
                                      "newlines or other characters)")
        if len(self.token) < MIN_TOKEN_LENGTH:
            raise InternalSecretError(
                f"{INTERNAL_TOKEN_ENV} must be at least {MIN_TOKEN_LENGTH} characters (e.g. `openssl rand -hex 32`)"
            )

    def accepts(self, presented: str | None) -> bool:
        """Whether ``presented`` (a header's value; None when absent) is this token. Constant time."""
        return presented is not None and hmac.compare_digest(presented.encode(), self.token.encode())

    def headers(self) -> dict[str, str]:
        """The header that proves this process is one of the deployment's, for its calls to the others."""
        return {INTERNAL_TOKEN_HEADER: self.token}

    def derive(self, purpose: str) -> bytes:
        """32 bytes for one purpose, unrelated to every other purpose's and to the token itself."""
        return hmac.new(self.token.encode(), purpose.encode(), hashlib.sha256).digest()

    def curve_keypair(self) -> tuple[bytes, bytes]:
        """(public, secret) Z85 CURVE keys for the KV-event sockets, the same in every process of the deployment."""
        secret = z85.encode(self.derive("kv-events/curve-secret-key"))
        return zmq.curve_public(secret), secret


def internal_secret_from_env(environ: dict[str, str] | None = None) -> InternalSecret | None:
    """The deployment secret from ``DISAGG_INTERNAL_TOKEN``; None when unset or empty."""
    # Surrounding whitespace (a Secret made with --from-file keeps its newline) is no part of the token.
    token = (os.environ if environ is None else environ).get(INTERNAL_TOKEN_ENV, "").strip()
    return InternalSecret(token) if token else None


def load_token_file(environ: os._Environ[str] | dict[str, str] | None = None) -> None:
    """Set ``DISAGG_INTERNAL_TOKEN`` from the file ``DISAGG_INTERNAL_TOKEN_FILE`` names, unless it is set already.
    A named file that cannot be read or is empty is an error: a deployment that meant to protect itself must not
    start open."""
    env = os.environ if environ is None else environ
    path = env.get(INTERNAL_TOKEN_FILE_ENV, "")
    if env.get(INTERNAL_TOKEN_ENV) or not path:
        return
    try:
        token = pathlib.Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise InternalSecretError(f"{INTERNAL_TOKEN_FILE_ENV}={path} cannot be read: {exc.strerror}") from exc
    if not token:
        raise InternalSecretError(f"{INTERNAL_TOKEN_FILE_ENV}={path} is empty")
    env[INTERNAL_TOKEN_ENV] = token


def write_token_file(path: pathlib.Path) -> bool:
    """Create ``path`` holding a new token (64 hex digits from ``secrets``, readable by its owner only), unless it
    exists: a deployment keeps its secret across restarts. Returns whether it wrote one. The file appears whole or
    not at all (written aside, then renamed)."""
    if path.exists():
        return False
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        # Created unreadable to others from the first byte, not chmod-ed afterwards.
        descriptor = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(secrets.token_hex(32))
        aside.replace(path)
    except OSError as exc:
        raise InternalSecretError(f"cannot write a deployment secret to {path}: {exc.strerror}") from exc
    return True


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` keeps a port reachable from this machine only."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: assume it resolves beyond this machine


def warn_if_exposed(secret: InternalSecret | None, host: str, what: str) -> bool:
    """Log one warning when ``what`` listens beyond loopback with no deployment secret; returns whether it did."""
    if secret is not None or is_loopback(host):
        return False
    _log.warning(
        "%s listens on %s without %s: its internal routes and sockets are open to anyone who can reach them; "
        "set the same secret on every process of the deployment (docs/reliability.md, threat model)",
        what, host, INTERNAL_TOKEN_ENV,
    )
    return True
