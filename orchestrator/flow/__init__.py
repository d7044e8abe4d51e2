"""The two-step flow: where a prompt is prefilled, then the schedule its pair of workers runs, step by step.

``disagg_flow.DisaggFlow`` is the entry point; the steps a schedule composes are in ``steps``."""
