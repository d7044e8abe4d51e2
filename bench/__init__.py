"""Benchmarks of the prompt path, the GEN worker, the whole system under load and the reference engine.

Run everything with ``.venv/bin/python -m bench.run_all [--quick]``; see docs/benchmarks.md. Nothing here is a
timed unit test: tests/bench/ only checks that each benchmark runs at a tiny size and returns well-formed results.
"""
