"""The vLLM engine: vLLM's ``AsyncLLM`` behind our adapter, its KV connector carrying the CTX -> GEN hand-off.

``checkpoint`` (no vLLM import) turns the packaged SmolLM2 GGUF into a Hugging Face checkpoint vLLM can load;
``engine`` is the adapter; ``sampling`` maps our ``SamplingParams`` onto vLLM's and refuses what does not map.
"""
