"""The C++ kernels must be built wherever they can be: a broken build fails here, not silently slower."""

import numpy as np
import pytest

from fastdeploy import _C, envs
from fastdeploy import _custom_ops as ops


def pytest_collection_modifyitems(config, items):
    """Skip the kernel tests (only) when the kernels were turned off on purpose (FD_CPU_KERNELS=0)."""
    if envs.cpu_kernels_enabled():
        return
    skip = pytest.mark.skip(reason="FD_CPU_KERNELS=0")
    for item in items:
        if "tests/csrc/" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def kernels():
    """Registers the kernels; fails with the build log's tail when they did not build."""
    assert ops.has("fd_paged_attention"), _C.failure_reason()


def bf16_round(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bf16 (round to nearest even) and widened back, as the kernels store them."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)
