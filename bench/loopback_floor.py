"""The floor under the orchestrator's cost: what it costs a process just to move a request's bytes through loopback
TCP, with nothing else done.

``python -m bench.loopback_floor``. Three processes: a sender, the middle one (measured), a sink. For each size the
middle process receives the bytes with ``recv_into`` a buffer allocated once and sends them on with ``sendall``
(blocking sockets, no event loop, no parsing), round after round; its CPU per round (utime + stime, from
``os.times``) is the floor for a proxy that moves that many bytes in and out. The sizes are the orchestrator's at
131,072 tokens (bench.orchestrator_cost): metadata-only moves the client's 524 KB body in and on to CTX; the b64
relay moves ~1.2 MB in (the body, then CTX's 699 KB answer) and ~1.2 MB out (to CTX, then to GEN).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from bench.driver.common import arguments
from bench.driver.report import markdown_table

SIZES = {"metadata-only at 131k (524 KB in, 524 KB out)": 524_366,
         "b64 relay at 131k (1.2 MB in, 1.2 MB out)": 524_366 + 699_052}
ROUNDS = 300


def _sink(listener: socket.socket, size: int) -> None:
    connection, _ = listener.accept()
    buffer = memoryview(bytearray(size))
    while True:
        got = 0
        while got < size:
            n = connection.recv_into(buffer[got:])
            if not n:
                return
            got += n
        connection.sendall(b"k")


def _middle(listener: socket.socket, sink_address: tuple[str, int], size: int, rounds: int, out: int) -> None:
    inbound, _ = listener.accept()
    outbound = socket.create_connection(sink_address)
    buffer = memoryview(bytearray(size))
    start = os.times()
    for _ in range(rounds):
        got = 0
        while got < size:
            got += inbound.recv_into(buffer[got:])
        outbound.sendall(buffer)
        outbound.recv(1)
        inbound.sendall(b"k")
    end = os.times()
    cpu_ms = ((end.user - start.user) + (end.system - start.system)) * 1e3 / rounds
    os.write(out, f"{cpu_ms:.4f}".encode())


def measure(size: int, rounds: int = ROUNDS) -> float:
    """The middle process's CPU per round, ms."""
    front, back = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    read_end, write_end = os.pipe()
    children = []
    for role in ("sink", "middle"):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's own coverage is not collected
            try:
                if role == "sink":
                    _sink(back, size)
                else:
                    _middle(front, back.getsockname(), size, rounds, write_end)
            finally:
                os._exit(0)
        children.append(pid)
    payload = os.urandom(size)
    with socket.create_connection(front.getsockname()) as sender:
        for _ in range(rounds):
            sender.sendall(payload)
            sender.recv(1)
    os.waitpid(children[1], 0)
    result = float(os.read(read_end, 64).decode())
    os.kill(children[0], 9)
    os.waitpid(children[0], 0)
    for closable in (front, back):
        closable.close()
    os.close(read_end)
    os.close(write_end)
    return result


def run(rounds: int = ROUNDS) -> dict[str, Any]:
    """The floor at every size: the middle process's CPU ms per request."""
    return {"benchmark": "loopback_floor", "rounds": rounds,
            "sizes": [{"name": name, "bytes": size, "cpu_ms": measure(size, rounds)} for name, size in SIZES.items()]}


def tables(result: dict[str, Any]) -> str:
    rows = [[s["name"], f"{s['bytes']:,}", f"{s['cpu_ms']:.2f}"] for s in result["sizes"]]
    return markdown_table(["bytes moved", "bytes each way", "CPU ms per request (floor)"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    print(tables(run(args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
