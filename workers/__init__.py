"""The CTX / GEN / aggregated OpenAI worker: HTTP front end, request model, and the engines behind it."""
