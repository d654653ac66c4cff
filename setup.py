"""hfkern build script.

Pure Python in this build: the CUDA backend's extension ``hfkern._C`` (pybind11,
raw pointers, no torch ABI, built with CMake) does not exist yet, so there is
nothing to compile. The version ranges are the ones the test suite runs on
(README.md, "Versions and compile checks").
"""

from setuptools import find_packages, setup

setup(
    name="hfkern",
    version="0.1.0",
    description="Horizontally fused training: B models as one array model, with array kernels",
    packages=find_packages(include=["hfkern", "hfkern.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11,<2.14", "numpy"],
    extras_require={
        "triton": ["triton>=3.6,<3.10"],
        "demo": ["scikit-learn", "tqdm", "rich"],
        "test": ["pytest", "scikit-learn", "tqdm", "rich", "triton>=3.6,<3.10"],
    },
)
