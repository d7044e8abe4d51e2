"""TensorRT-LLM's side of the shared wire: its config file, the lifecycle v1 models and attempt identity, and its
``x-trtllm-disagg-auth`` signatures, used by both the orchestrator and the workers."""
