"""What ``entrypoints.http`` relies on of uvicorn outside its documented API (the list in the package's docstring),
checked on the installed uvicorn: each name exists and behaves as the package uses it. A uvicorn release that
changes one fails here, by name, rather than somewhere in a protocol or a server test."""

from __future__ import annotations

import asyncio
import inspect
import socket
import threading
from typing import Any, ClassVar

import uvicorn

from entrypoints.http import server as tick_server
from entrypoints.http.protocol import GuardedProtocol, guarded_protocol
from entrypoints.http.server import TickServer
from tests.waiting import eventually


async def hello(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def config(**options: Any) -> uvicorn.Config:
    return uvicorn.Config(hello, host="127.0.0.1", port=0, log_level="warning", lifespan="off", ws="none", **options)


def test_config_loads_the_app_and_holds_the_settings_the_protocol_reads() -> None:
    loaded = config(root_path="/root", timeout_keep_alive=7, reset_contextvars=True)
    assert loaded.loaded is False
    assert (loaded.root_path, loaded.timeout_keep_alive, loaded.reset_contextvars) == ("/root", 7, True)
    loaded.load()
    assert loaded.loaded is True
    assert loaded.loaded_app is not None and callable(loaded.loaded_app)
    assert config().reset_contextvars is False  # uvicorn's opt-in, off unless asked


def test_server_state_holds_what_the_protocol_shares_with_the_server() -> None:
    state = uvicorn.Server(config()).server_state
    assert state.connections == set() and isinstance(state.connections, set)
    assert state.tasks == set() and isinstance(state.tasks, set)
    assert state.default_headers == [] and isinstance(state.default_headers, list)
    assert state.total_requests == 0


def test_the_server_has_the_loop_and_flags_the_tick_server_overrides_or_reads() -> None:
    plain = uvicorn.Server(config())
    # Plain attributes that __init__ sets (``TickServer`` makes ``should_exit`` a property its setter wakes on).
    assert vars(plain)["should_exit"] is False and vars(plain)["started"] is False
    assert inspect.iscoroutinefunction(uvicorn.Server.main_loop)
    assert list(inspect.signature(uvicorn.Server.on_tick).parameters) == ["self", "counter"]
    assert inspect.iscoroutinefunction(uvicorn.Server.on_tick)
    assert TickServer(config()).should_exit is False


def test_on_tick_rebinds_the_default_headers_when_the_counter_is_a_multiple_of_ten() -> None:
    # ``cycle.default_header_lines`` caches the header lines by the list's identity: a list renewed in place would
    # keep an old date.
    server = uvicorn.Server(config())
    server.config.load()

    async def ticks() -> None:
        state = server.server_state
        before = state.default_headers
        assert await server.on_tick(tick_server._DATE_EVERY) is False
        renewed = state.default_headers
        assert renewed is not before and [name for name, _ in renewed][:1] == [b"date"]
        assert await server.on_tick(tick_server._DATE_EVERY + 1) is False
        assert state.default_headers is renewed  # not on other counters
        server.should_exit = True
        assert await server.on_tick(tick_server._DATE_EVERY + 2) is True

    asyncio.run(ticks())


class Recording(GuardedProtocol):
    """The guarded protocol, recording how uvicorn's factory calls it and whether the server's stop calls
    ``shutdown`` on it."""

    calls: ClassVar[list[set[str]]] = []
    shut: ClassVar[list[bool]] = []

    def __init__(self, **arguments: Any) -> None:
        Recording.calls.append(set(arguments))
        super().__init__(**arguments)

    def shutdown(self) -> None:
        Recording.shut.append(True)
        super().shutdown()


def test_the_protocol_factory_is_called_with_config_server_state_and_app_state_and_shut_down_on_stop() -> None:
    Recording.calls.clear()
    Recording.shut.clear()
    protocol = guarded_protocol()
    recording = type("Recording", (Recording, protocol), {})
    server = TickServer(config(http=recording))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    assert eventually(lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
        answer = b""
        while not answer.endswith(b"ok"):
            answer += sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert eventually(lambda: len(server.server_state.connections) == 1)
        (connection,) = server.server_state.connections
        assert isinstance(connection, Recording)
        server.should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert Recording.calls == [{"config", "server_state", "app_state", "_loop"}]
    assert Recording.shut == [True]  # the idle kept connection was told, and closed
