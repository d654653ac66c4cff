// runtime.cu: runtime queries for the binding (hfkern/include/hfkern/runtime.h).
#include "hfkern/runtime.h"

#include "hfkern_cuda.h"

namespace hfkern {

#if HFKERN_EMULATED

RuntimeInfo runtime_info() { return {true, 0, 0, 0, ""}; }

void set_device(int) {}

#else

RuntimeInfo runtime_info() {
  RuntimeInfo info{false, 0, 0, 0, ""};
  cudaRuntimeGetVersion(&info.runtime_version);
  cudaDriverGetVersion(&info.driver_version);
  const cudaError_t err = cudaGetDeviceCount(&info.device_count);
  if (err != cudaSuccess) {
    info.device_count = 0;
    info.error = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    cudaGetLastError();  // not sticky: clear it for later calls
  }
  return info;
}

void set_device(int device) { HFKERN_CUDA_CHECK(cudaSetDevice(device)); }

#endif

}  // namespace hfkern
