"""Triton kernels over the array dimension, and their launchers.

Only kernels and launchers live here: no modules, no autograd, no dispatch.
``hfkern/ops/*`` registers the launchers as the ``triton`` implementations of
the ``hfkern`` ops. Importing this package imports triton; hfkern imports it
only when a Triton implementation first runs.

Launchers take CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` is set
before triton is imported (Triton's interpreter, used by the CPU test suite).
"""
