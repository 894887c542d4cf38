class EngineDeadError(Exception):
    """Placeholder of vLLM's exception (only constructed by vLLM-internal tests)."""
