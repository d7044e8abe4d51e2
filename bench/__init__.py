"""Benchmarks: small single-purpose modules over one shared driver and one report writer.

- ``bench.common``: the driver: servers as real subprocesses, waited on until healthy and always stopped; the
  parser every command starts from. ``bench.machine`` reads the machine and each process's CPU from /proc;
  ``bench.figures`` has the statistics; ``bench.load_point`` runs one closed-loop load point (warm-up, window,
  tail) with the load generator and the prober as processes; ``bench.py_spy`` profiles a process during one.
- ``bench.report``: the writer: JSON, markdown tables, verdicts, the generated blocks of docs/benchmarks.md (their
  markers name the command that writes them) and ``--docs``; ``bench.plots`` draws every PNG.
- One benchmark, one command (``python -m bench.<name>``); a large one keeps its runs and command in
  ``<name>.py`` and reads its result back in ``<name>_report.py``.

Run the page's benchmarks with ``.venv/bin/python -m bench.run_all [--quick]``; see docs/benchmarks.md. Nothing
here is a timed unit test: tests/bench/ only checks that each benchmark runs at a tiny size and returns well-formed
results.
"""
