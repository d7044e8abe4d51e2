"""``python -m bench.prompt_path``: the benchmark's command (``bench.prompt_path.benchmark.main``)."""

import sys

from bench.prompt_path.benchmark import main

sys.exit(main())
