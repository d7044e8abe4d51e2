"""The orchestrator: OpenAI endpoints for clients, the CTX-first two-step flow, worker pools."""
