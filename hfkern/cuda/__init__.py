"""The CUDA backend: hand-written kernels in csrc/, bound by ``hfkern._C``.

``hfkern._C`` is a pybind11 module whose functions take raw device addresses,
sizes, dtype codes and a stream handle, and link only the CUDA runtime
(statically): it knows nothing of torch, so one build serves every supported
torch version. The modules of this package check every tensor (device, dtype,
shape, layout, alignment) before an address crosses, and register themselves
as the ``cuda`` implementation of their ``hfkern`` ops (``hfkern._backend``
imports every public module here when the cuda backend is first considered).

``hfkern._C_emu`` is the same kernel sources built as host C++ against the grid
emulator (csrc/emu/): it takes host addresses and runs the kernels on the CPU,
so the kernels are executed and checked without a GPU. Each family module
offers its launchers on the emulator through ``emulated(op)``; the registry
never routes to it.
"""
