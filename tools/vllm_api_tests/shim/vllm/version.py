"""vLLM's version module, answered for FastDeploy: /version reports FastDeploy's version."""

from fastdeploy.version import __version__  # noqa: F401

# FastDeploy follows vLLM 0.33's API (COMPAT.md); the hidden-metrics escape hatch takes the
# previous minor version of that release.
__version_tuple__ = (0, 33, 0)


def _prev_minor_version() -> str:
    return f"{__version_tuple__[0]}.{__version_tuple__[1] - 1}"


def _prev_minor_version_was(version_str: str) -> bool:
    return version_str == _prev_minor_version()
