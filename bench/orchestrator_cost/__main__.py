"""``python -m bench.orchestrator_cost``: the benchmark's command (``bench.orchestrator_cost.benchmark.main``)."""

import sys

from bench.orchestrator_cost.benchmark import main

sys.exit(main())
