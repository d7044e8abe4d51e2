"""The socket a front end serves on, bound before anything slow starts.

A port picked as free and bound only when uvicorn starts stays free for as long as the engine takes to load: tens of
seconds for vLLM, during which any process on the host (the other worker's vLLM, for one, binding ports of its own)
may take it, and the worker then dies at the end of its start-up. So the worker and the orchestrator bind their
socket first, and ``up``, which picks the ports, binds them itself and hands each child its socket
(``--listen-fd``). A bound socket that is not yet listening refuses connections, so health checks see a server that
is not up, as before.
"""

from __future__ import annotations

import socket


def bound_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: any free one), not listening yet: uvicorn's server calls
    ``listen``. ``reuse_port``: several front-end processes bind the same port (SO_REUSEPORT), each its own socket.

    A given port is bound as uvicorn binds it, with SO_REUSEADDR, so that a server restarted while its last
    connections are in TIME_WAIT starts at once. A port picked by the kernel has no such past, and is bound
    without it: on Linux, sockets that all set SO_REUSEADDR may share a port as long as none listens, so only
    then does the reservation hold against every other bind until the server listens."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if port != 0:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def inherited_socket(fd: int) -> socket.socket:
    """The bound TCP socket a parent passed in file descriptor ``fd``; ValueError if ``fd`` is not one."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ValueError(f"--listen-fd {fd}: not an open socket ({exc.strerror})") from None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.detach()
        raise ValueError(f"--listen-fd {fd}: not a TCP socket")
    if sock.getsockname()[1] == 0:
        sock.detach()
        raise ValueError(f"--listen-fd {fd}: the socket is not bound")
    sock.set_inheritable(False)  # a process this one starts (and execs) must not hold the port open after it
    return sock


def address(sock: socket.socket) -> tuple[str, int]:
    host, port = sock.getsockname()[:2]
    return str(host), int(port)
