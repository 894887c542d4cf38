"""FastDeploy's version."""

__version__ = "2.0.0.dev0"

# The vLLM release whose API, flags and metric names FastDeploy follows (COMPAT.md).
VLLM_COMPAT_VERSION = "0.33"
