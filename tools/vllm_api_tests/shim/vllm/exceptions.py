class VLLMValidationError(ValueError):
    """Placeholder of vLLM's exception class (the tests that raise it use vLLM's protocol classes)."""
