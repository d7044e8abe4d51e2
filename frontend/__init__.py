"""What the orchestrator and the workers share: wire models, the token codec, SSE framing, errors, config, CLI."""
