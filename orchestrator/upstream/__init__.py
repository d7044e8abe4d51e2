"""The orchestrator's HTTP client to its workers: the interface (``base``), its two implementations (``httptools``,
the default, and ``aiohttp``), and the one place that chooses between them (``choice``).

This file imports nothing, so that importing the interface does not load the client libraries."""
