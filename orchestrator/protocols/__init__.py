"""The wires the orchestrator speaks to workers, each implementing ``base.WorkerProtocol`` (``registry`` detects
which one a worker speaks), and the schedules that are a protocol's own (``choice`` picks one per request)."""
