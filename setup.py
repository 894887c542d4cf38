"""FastDeploy package set-up: ``pip install -e .`` (after requirements/cpu.txt)."""

import os
import re

from setuptools import find_packages, setup

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
)
