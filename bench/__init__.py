"""Benchmarks, grouped by benchmark: each measures one claim of docs/benchmarks.md against a baseline of the same run.

- ``driver/``: what every benchmark runs on: servers as real subprocesses (``common``), the machine and CPU from /proc
  (``machine``), bodies, the load generator, the event-loop prober, one closed-loop load point, py-spy profiles, a
  real Redis server, and the writer of JSON, tables, plots and the page's generated blocks (``report``, ``plots``).
- ``peers/``: what the benchmarks measure ours against: mock workers, a pass-through proxy, the Rust gateways, vLLM.
- A larger benchmark is a folder (``benchmark.py`` its runs and command, ``report.py`` its tables and block, run as
  ``python -m bench.<folder>``); a small one is one module. ``python -m bench.run_all`` runs them (run_all.py).
"""
