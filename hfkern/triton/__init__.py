"""Triton kernels over the array dimension, one module per op family.

Each family module holds its kernels and launchers and registers the
launchers as the ``triton`` implementations of its ``hfkern`` ops with
``hfkern._backend.implements``; the registry imports every module of this
package the first time the ``triton`` backend is considered for a call, so
``import hfkern`` never imports triton. No module here imports ``hfkern.ops``
(the layer above); shared facts come from ``hfkern._array``, ``_dtypes`` and
``_device``, and the launch helpers from :mod:`._common`.

Launchers take CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` is set
before triton is imported (Triton's interpreter, used by the CPU test suite).
"""
