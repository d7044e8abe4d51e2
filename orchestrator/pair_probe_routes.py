"""The pair probe's admin routes: run a round now, or read the last one (behind the admin key, as /admin/workers)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.responses import Response

from frontend.auth import require_bearer
from frontend.http import json_response
from orchestrator.pair_probe import PairProbe, PairVerdict


def install_pair_probe_routes(app: FastAPI, probe: PairProbe, admin_key: str | None) -> None:
    def listing(verdicts: list[PairVerdict]) -> Response:
        return json_response({
            "pairs": [verdict.as_json() for verdict in verdicts],
            "kept_out_of_routing": [{"ctx": p.ctx, "gen": p.gen, "cause": p.cause} for p in probe.pairs.failing()],
        })

    @app.post("/admin/pair-probe")
    async def run_pair_probe(request: Request) -> Response:
        """Probe every CTX/GEN pair now (whether or not periodic probing is on) and answer the verdicts."""
        require_bearer(request, admin_key, admin=True)
        return listing(await probe.run())

    @app.get("/admin/pair-probe")
    async def last_pair_probe(request: Request) -> Response:
        """The last round's verdicts, and the pairs kept out of routing now."""
        require_bearer(request, admin_key, admin=True)
        return listing(probe.last)
