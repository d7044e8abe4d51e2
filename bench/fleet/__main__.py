"""``python -m bench.fleet``: the benchmark's command (``bench.fleet.benchmark.main``)."""

import sys

from bench.fleet.benchmark import main

sys.exit(main())
