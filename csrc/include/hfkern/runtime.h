// runtime.h: what the binding asks the CUDA runtime (or the emulator), in
// plain C++ so that the pybind11 translation unit never includes CUDA headers.
#pragma once

#include <string>

namespace hfkern {

struct RuntimeInfo {
  bool emulated;          // the host grid emulator, not the CUDA runtime
  int runtime_version;    // cudaRuntimeGetVersion (the statically linked cudart); 0 emulated
  int driver_version;     // cudaDriverGetVersion; 0 emulated or without a driver
  int device_count;       // devices this runtime sees; 0 emulated
  std::string error;      // why the runtime cannot be used, or ""
};

RuntimeInfo runtime_info();

// Makes `device` current for this runtime's calling thread (our statically
// linked runtime keeps its own current device, apart from torch's).
void set_device(int device);

}  // namespace hfkern
