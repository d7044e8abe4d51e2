"""A userspace TCP relay that adds latency, for the GEN -> CTX KV path in the fault tests.

The kernel here has no ``sch_netem``, so latency cannot come from ``tc``. This relay listens on one address and
forwards to another, delaying every chunk by ``--delay-s`` in each direction (a one-way delay; a request/answer
exchange pays it twice), or, with ``--blackhole-answers``, forwards the request and drops every byte of the
answer: a partition that falls after GEN's request crossed, while CTX's KV is on its way. It prints one line
per connection (``connection N``) so a test can see that traffic went through it.

    python -m tests.reliability.latency_relay --listen 127.0.0.1:9001 --target 10.231.5.2:9001 --delay-s 0.1
"""

from __future__ import annotations

import argparse
import asyncio


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, drop: bool) -> None:
    try:
        while chunk := await reader.read(1 << 16):
            if drop:
                continue
            if delay_s:
                await asyncio.sleep(delay_s)
            writer.write(chunk)
            await writer.drain()
    except OSError:
        pass
    finally:
        if not drop:
            writer.close()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--blackhole-answers", action="store_true")
    args = parser.parse_args()
    listen_host, listen_port = args.listen.rsplit(":", 1)
    target_host, target_port = args.target.rsplit(":", 1)
    count = 0

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        nonlocal count
        count += 1
        print(f"connection {count}", flush=True)
        upstream_reader, upstream_writer = await asyncio.open_connection(target_host, int(target_port))
        await asyncio.gather(_pump(client_reader, upstream_writer, args.delay_s, False),
                             _pump(upstream_reader, client_writer, args.delay_s, args.blackhole_answers))

    server = await asyncio.start_server(handle, listen_host, int(listen_port))
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
