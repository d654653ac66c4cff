"""hfkern build script.

Pure Python for now; the CUDA extension ``hfkern._C`` (pybind11, raw pointers,
no torch ABI) is added by the CUDA backend and built with CMake when
``HFKERN_BUILD_CUDA=1``.
"""

from setuptools import find_packages, setup

setup(
    name="hfkern",
    version="0.1.0",
    description="Horizontally fused training: B models as one array model, with array kernels",
    packages=find_packages(include=["hfkern", "hfkern.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "triton": ["triton>=3.0"],
        "demo": ["scikit-learn", "tqdm", "rich"],
        "test": ["pytest", "scikit-learn", "tqdm", "rich", "triton>=3.0"],
    },
)
