"""``disagg-serve bench``: a load generator a user points at any OpenAI-compatible server.

The request driver (``load``) and the statistics (``statistics``) are also what ``python -m bench.loadgen`` runs
for the project's own figures: one implementation, packaged here because ``bench/`` is not installed.
"""
