"""Event-loop lag seen from outside: one thread per server sends ``GET /health`` every ``interval`` ms over a
keep-alive connection and records how long the answer took (``/health`` does almost nothing, so its latency is
the wait for the server's loop plus ~0.3 ms of loopback HTTP).

``python -m bench.driver.prober --target NAME=URL ... --out FILE``; it stops on SIGTERM, after ``--max-s``, or
once every target has ``--samples`` samples. With ``--ready-file`` it creates that file once a SIGTERM would be
honoured, so a caller waits for it instead of guessing a start-up time.
"""

from __future__ import annotations

import http.client
import json
import signal
import sys
import threading
import time
from pathlib import Path

from bench.driver.common import arguments


def probe(url: str, interval_s: float, stop: threading.Event, samples: list[list[float | None]],
          count: int | None = None) -> None:
    host, _, port = url.removeprefix("http://").partition(":")
    connection: http.client.HTTPConnection | None = None
    next_at = time.perf_counter()
    while not stop.is_set() and (count is None or len(samples) < count):
        sent_at = time.time()
        started = time.perf_counter()
        try:
            if connection is None:
                connection = http.client.HTTPConnection(host, int(port), timeout=10)
            connection.request("GET", "/health")
            response = connection.getresponse()
            response.read()
            samples.append([sent_at, (time.perf_counter() - started) * 1e3])
        except (OSError, http.client.HTTPException):
            samples.append([sent_at, None])
            if connection is not None:
                connection.close()
            connection = None
        next_at += interval_s
        delay = next_at - time.perf_counter()
        if delay > 0:
            stop.wait(delay)
        else:
            next_at = time.perf_counter()  # a slow answer: do not fire a burst to catch up
    if connection is not None:
        connection.close()


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--target", action="append", default=[], help="NAME=http://127.0.0.1:PORT")
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--max-s", type=float, default=600.0)
    parser.add_argument("--samples", type=int, default=None, help="stop once every target has this many samples")
    parser.add_argument("--ready-file", default=None, help="created once probing has started")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    targets = dict(t.split("=", 1) for t in args.target)
    for url in targets.values():
        if not url.startswith(("http://127.", "http://localhost")):
            parser.error(f"{url}: the prober only talks to loopback")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    samples: dict[str, list[list[float | None]]] = {name: [] for name in targets}
    threads = [threading.Thread(target=probe, args=(url, args.interval_ms / 1e3, stop, samples[name], args.samples),
                                daemon=True)
               for name, url in targets.items()]
    for thread in threads:
        thread.start()
    if args.ready_file:
        Path(args.ready_file).touch()
    give_up_at = time.monotonic() + args.max_s
    while any(t.is_alive() for t in threads) and not stop.is_set() and time.monotonic() < give_up_at:
        stop.wait(0.05)
    stop.set()
    for thread in threads:
        thread.join(timeout=15)
    Path(args.out).write_text(json.dumps(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
