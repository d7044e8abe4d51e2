"""Who may reach a worker's internal surface: holders of the deployment secret (``DISAGG_INTERNAL_TOKEN``) and, with
TensorRT-LLM's orchestrator in front, holders of its ``internal_request_auth_key``, proved by its signatures.

Guarded: every ``/_internal/*`` route, and a completion whose ``disaggregated_params`` name where the worker goes
next (``ctx_info_endpoint``, ``encoded_opaque_state``) or post on the generation-first board. With neither secret
configured everything is open (a laptop on loopback). A refusal is a 401 in OpenAI's shape, whatever the route's
own error shape: it says nothing about what the route would have answered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from frontend.errors import AuthenticationError
from frontend.internal_secret import INTERNAL_TOKEN_HEADER, InternalSecret
from frontend.trtllm.auth import TRTLLM_AUTH_HEADER, control_signed, needs_request_signature, request_signed

REFUSED_CODE = "invalid_internal_credentials"


def refused(what: str) -> AuthenticationError:
    return AuthenticationError(f"{what} is for this deployment's own processes: send {INTERNAL_TOKEN_HEADER}"
                               " (DISAGG_INTERNAL_TOKEN)", code=REFUSED_CODE)


class InternalCallers:
    def __init__(self, secret: InternalSecret | None, trtllm_key: str | None = None) -> None:
        self.secret = secret
        self.trtllm_key = trtllm_key

    @property
    def open(self) -> bool:
        """No secret configured: every caller is let in."""
        return self.secret is None and self.trtllm_key is None

    def has_token(self, headers: Mapping[str, str]) -> bool:
        return self.secret is not None and self.secret.accepts(headers.get(INTERNAL_TOKEN_HEADER))

    def require_token(self, headers: Mapping[str, str], what: str) -> None:
        """For what only our own processes call (the hand-off board): the token, when one is configured."""
        if self.secret is not None and not self.has_token(headers):
            raise refused(what)

    def control_allowed_before_body(self, headers: Mapping[str, str]) -> bool | None:
        """A control call, before its body is read: True (let in), False (refused: nothing could prove it), None
        (only TensorRT-LLM's signature of the body can: ``control_signed_body``)."""
        if self.open or self.has_token(headers):
            return True
        return None if self.trtllm_key is not None else False

    def control_signed_body(self, headers: Mapping[str, str], route: str, body: Mapping[str, Any]) -> bool:
        key = self.trtllm_key
        return key is not None and control_signed(key, route, body, headers.get(TRTLLM_AUTH_HEADER))

    def require_for_params(self, headers: Mapping[str, str], params: Mapping[str, Any] | None) -> None:
        """A request whose ``disaggregated_params`` name where the worker goes next comes from an internal caller:
        our token, or TensorRT-LLM's signature of those fields. So does a generation-first context_only request,
        which posts its hand-off on the board for a GEN to take: from anyone else it could hand a GEN its own first
        tokens and KV, or crowd the board. TensorRT-LLM's orchestrator signs no such request, so with its key
        configured one is let in unsigned (its own trust model)."""
        if self.open or self.has_token(headers):
            return
        posts_on_board = (params is not None and params.get("request_type") == "context_only"
                          and params.get("schedule_style") == 1)
        if posts_on_board and self.trtllm_key is None:
            raise refused("a generation-first context_only request")
        if not needs_request_signature(params):
            return
        assert params is not None
        key = self.trtllm_key
        if key is not None and request_signed(key, params, headers.get(TRTLLM_AUTH_HEADER)):
            return
        raise refused("a request carrying ctx_info_endpoint or encoded_opaque_state")
