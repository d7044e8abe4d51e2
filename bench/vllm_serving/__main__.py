"""``python -m bench.vllm_serving``: the benchmark's command (``bench.vllm_serving.benchmark.main``)."""

import sys

from bench.vllm_serving.benchmark import main

sys.exit(main())
