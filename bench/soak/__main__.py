"""``python -m bench.soak``: the benchmark's command (``bench.soak.benchmark.main``)."""

import sys

from bench.soak.benchmark import main

sys.exit(main())
