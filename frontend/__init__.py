"""What the orchestrator and the workers share: wire models, the token codec, SSE framing, errors, config, metrics.

It imports no service (orchestrator/, workers/) and no entry point."""
