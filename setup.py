"""FastDeploy package set-up: ``pip install -e .`` (after requirements/cpu.txt)."""

import os
import re
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def read_requirements(name: str) -> list[str]:
    out = []
    with open(os.path.join(HERE, "requirements", name), encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line.startswith("-r "):
                out.extend(read_requirements(line[3:].strip()))
            elif line:
                out.append(line)
    return out


def prebuild_kernels() -> None:
    """Compile the C++ kernels (csrc/cpu) into FastDeploy's cache now rather than at first use.

    Runs ``python -m fastdeploy._C`` in the target environment: pip builds in an isolated
    environment without Paddle, so the child drops that isolation (PYTHONPATH and
    PYTHONNOUSERSITE) to see the packages requirements/cpu.txt installed. Best effort: a
    failure is reported and the install goes on; the first process that needs the kernels
    retries, and falls back to plain Paddle ops if they still cannot be built.
    """
    if os.environ.get("FD_SKIP_KERNEL_BUILD") == "1":
        return
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    env["PYTHONPATH"] = HERE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "fastdeploy._C"], cwd=HERE, env=env, capture_output=True, text=True, check=False
        )
    except OSError as e:
        print(f"FastDeploy: kernels not pre-built ({e}); they build on first use.", file=sys.stderr)
        return
    if proc.returncode != 0:
        print(f"FastDeploy: kernels not pre-built; they build on first use.\n{proc.stderr[-2000:]}", file=sys.stderr)


class BuildPyWithKernels(build_py):
    """build_py (also run by editable installs) followed by the kernels' pre-build."""

    def run(self) -> None:
        super().run()
        prebuild_kernels()


with open(os.path.join(HERE, "fastdeploy", "version.py"), encoding="utf-8") as f:
    VERSION = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)

setup(
    name="fastdeploy",
    version=VERSION,
    description="LLM serving on PaddlePaddle, a drop-in replacement for vLLM",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["fastdeploy", "fastdeploy.*"]),
    include_package_data=True,
    install_requires=read_requirements("cpu.txt"),
    extras_require={"test": read_requirements("test.txt")},
    entry_points={"console_scripts": ["fastdeploy=fastdeploy.entrypoints.cli.main:main"]},
    cmdclass={"build_py": BuildPyWithKernels},
)
