"""The engine core's local channel and the KV transfer endpoint, from a hostile peer's side.

Nothing that crosses the channel or the KV transfer is ever unpickled: checked in the source (no module on those
paths imports a pickle-like loader) and in behaviour (a pickled frame whose unpickling would leave a file behind
leaves nothing). A malformed frame must cost only the channel that sent it, never the core that every front end
of the worker shares. The KV transfer server hands KV out only to the holder of the one-time key.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import pathlib
import pickle
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pybase64
import pytest

from frontend.sampling import SamplingParams
from tests.workers.engines.reference.cluster import RefCluster, reference_cluster
from workers.engines.reference.engine import ReferenceEngine
from workers.engines.reference.ipc import ChannelClosed, read_frame_blocking, send_frame_blocking
from workers.engines.reference.options import ReferenceOptions
from workers.engines.request import GenerationRequest

REFERENCE = pathlib.Path(__file__).resolve().parents[4] / "workers" / "engines" / "reference"
BOUNDARY_MODULES = ["ipc.py", "core.py", "engine.py", "kv_store.py", "kv_fetch.py", "kv_handoff.py"]
_SYNC_PING = 424242
UNSAFE_LOADERS = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib",
                  "multiprocessing.connection"}


# -- the source: no pickle-like loader anywhere on the boundary -----------------------------------------------------
@pytest.mark.parametrize("module", BOUNDARY_MODULES)
def test_no_module_on_the_channel_or_the_kv_path_imports_a_pickle_loader(module: str) -> None:
    tree = ast.parse((REFERENCE / module).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
    assert not imported & UNSAFE_LOADERS, imported & UNSAFE_LOADERS
    assert not any(name.split(".")[0] in {"pickle", "_pickle", "dill", "cloudpickle", "marshal"} for name in imported)
    calls = [ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)]
    # numpy's loaders can unpickle object arrays; the channel uses frombuffer on raw int32 bytes only.
    assert not [c for c in calls if c in ("np.load", "numpy.load", "np.loads", "eval", "exec")]
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.keyword) and n.arg == "allow_pickle"]


# -- behaviour: a live engine core and its socket ---------------------------------------------------------------------
@pytest.fixture
async def engine(tiny_path: pathlib.Path) -> AsyncIterator[ReferenceEngine]:
    core = ReferenceEngine(ReferenceOptions(model_path=str(tiny_path), served_model_name="tiny", blas_threads=1))
    await core.start()
    try:
        yield core
    finally:
        await core.aclose()


def _socket_path(engine: ReferenceEngine) -> str:
    assert engine._workdir is not None
    return str(engine._workdir / "core.sock")


def _send_raw_frame(path: str, header: bytes, payload: bytes = b"") -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(struct.pack("<II", len(header), len(payload)) + header + payload)
    return sock


async def _until_handled(sock: socket.socket) -> None:
    """Synchronise with the core, not the clock: the core handles a channel's frames in order, so a ping sent
    after the frame under test is answered only once that frame was handled. A channel the core closed ends
    the wait too (its frame never reached the core)."""
    def wait() -> None:
        sock.settimeout(60)
        with contextlib.suppress(OSError):
            send_frame_blocking(sock, {"op": "ping", "ping": _SYNC_PING})
        with contextlib.suppress(ChannelClosed, OSError):
            while True:
                header, _ = read_frame_blocking(sock)
                if header.get("op") == "pong" and header.get("ping") == _SYNC_PING:
                    return

    await asyncio.to_thread(wait)


async def _still_serves(engine: ReferenceEngine) -> None:
    assert await engine.health()
    prompt = engine.get_tokenizer().encode("Hello")
    request = GenerationRequest("after-attack", prompt, SamplingParams(max_tokens=3, temperature=0.0,
                                                                       ignore_eos=True))
    outputs = [o async for o in engine.generate(request)]
    assert sum(len(o.token_ids) for o in outputs) == 3


class _Canary:
    """Unpickling this would create a file: proof that nothing was unpickled if the file never appears."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[pathlib.Path]]:
        return (pathlib.Path.touch, (self.path,))


async def test_a_pickled_frame_is_never_unpickled_and_the_core_keeps_serving(
    engine: ReferenceEngine, tmp_path: pathlib.Path
) -> None:
    canary = tmp_path / "unpickled"
    evil = pickle.dumps(_Canary(canary))
    for header, payload in ((evil, b""), (b'{"op": "ping", "ping": 1}', evil)):
        sock = _send_raw_frame(_socket_path(engine), header, payload)
        await _until_handled(sock)
        sock.close()
    await _still_serves(engine)
    assert not canary.exists()


async def test_a_frame_that_is_not_json_closes_only_that_channel(engine: ReferenceEngine) -> None:
    sock = _send_raw_frame(_socket_path(engine), b"\x80\x04not json")
    sock.settimeout(60)
    try:
        def drain() -> None:
            for _ in range(10):  # the ready frame first, then the end of the channel
                read_frame_blocking(sock)

        with pytest.raises(ChannelClosed):
            await asyncio.to_thread(drain)
    finally:
        sock.close()
    await _still_serves(engine)


@pytest.mark.parametrize("header", [b"[1, 2]", b'"text"', b'{"op": "abort"}'], ids=["array", "string", "abort-no-id"])
async def test_a_malformed_json_frame_does_not_kill_the_core(engine: ReferenceEngine, header: bytes) -> None:
    sock = _send_raw_frame(_socket_path(engine), header)
    await _until_handled(sock)
    sock.close()
    assert engine._process is not None and engine._process.poll() is None
    await _still_serves(engine)


# -- the KV transfer endpoint ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_cluster(tiny_path: pathlib.Path) -> Any:
    with reference_cluster(ReferenceOptions(model_path=str(tiny_path), served_model_name="tiny",
                                            blas_threads=1)) as cluster:
        yield cluster


def _parked_handoff(cluster: RefCluster) -> tuple[str, str]:
    body = {"model": cluster.model, "prompt": "Hello there", "max_tokens": 8, "temperature": 0,
            "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 1}}
    reply = httpx.post(cluster.ctx.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    state = orjson.loads(pybase64.b64decode(reply.json()["choices"][0]["disaggregated_params"]
                                            ["encoded_opaque_state"]))
    return str(state["kv_url"]), str(state["key"])


def _kv_entries(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(next(line for line in text.splitlines() if line.startswith("disagg_kv_store_entries ")).split()[1])


def test_the_kv_endpoint_refuses_requests_without_the_one_time_key(tiny_cluster: RefCluster) -> None:
    kv_url, key = _parked_handoff(tiny_cluster)
    assert kv_url.startswith("http://127.0.0.1:")
    for headers in ({}, {"X-KV-Key": ""}, {"X-KV-Key": "guess"}, {"X-KV-Key": key[:-1]},
                    {"Authorization": f"Bearer {key}"}):
        refused = httpx.get(kv_url, headers=headers, timeout=10)
        assert refused.status_code == 403, headers
        assert key not in refused.text
        assert len(refused.content) < 200  # an explanation, never KV bytes
    base = kv_url.rsplit("/kv/", 1)[0]
    assert httpx.get(base + "/kv/no-such-entry", headers={"X-KV-Key": key}, timeout=10).status_code == 404
    assert httpx.get(base + "/", timeout=10).status_code == 404
    assert httpx.post(kv_url, headers={"X-KV-Key": key}, timeout=10).status_code == 501  # GET only
    assert _kv_entries(tiny_cluster.ctx.url) == 1  # the refusals consumed nothing
    taken = httpx.get(kv_url, headers={"X-KV-Key": key}, timeout=10)
    assert taken.status_code == 200
    assert taken.headers["content-type"] == "application/octet-stream"
    assert len(taken.content) > 1000
    assert httpx.get(kv_url, headers={"X-KV-Key": key}, timeout=10).status_code == 404  # one time only
    assert _kv_entries(tiny_cluster.ctx.url) == 0
