"""Worker protocols the orchestrator speaks, one module each, all implementing ``orchestrator.worker_protocol``."""
