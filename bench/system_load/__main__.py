"""``python -m bench.system_load``: the benchmark's command (``bench.system_load.benchmark.main``)."""

import sys

from bench.system_load.benchmark import main

sys.exit(main())
