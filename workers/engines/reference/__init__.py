"""Pure-numpy reference engine for llama-architecture GGUF models (SmolLM2-135M-Instruct by default).

The modules here are a library: model file loading, tokenizer, forward pass and sampler, with no
web or asyncio code, so the serving layers can drive them from any execution model.
"""
