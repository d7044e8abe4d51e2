"""TensorRT-LLM on the orchestrator's side: its context-first wire (v0), lifecycle v1's control calls and grants,
and the two schedules that are its own (context first under v1, generation first), for trtllm-serve workers."""
