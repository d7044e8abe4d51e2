"""The worker's side of TensorRT-LLM's disaggregated wire: its CTX and whole answers, its msgpack bodies, generation
first, and lifecycle protocol v1 (grants on GEN, context artifacts on CTX, their checks, settings and routes)."""
