// bindings.cpp: the pybind11 module hfkern._C (kernels built by nvcc, run on the
// GPU) or hfkern._C_emu (the same kernels built as host C++, run by the grid
// emulator on host memory); HFKERN_MODULE_NAME says which.
//
// Every function takes raw addresses (Python ints), sizes, dtype codes and the
// stream handle; nothing here knows torch, so one build serves every torch
// version. The Python glue (hfkern/cuda/) checks devices, dtypes, shapes,
// layouts and alignment before an address crosses.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "hfkern/batch_norm.h"
#include "hfkern/multi_tensor_step.h"
#include "hfkern/runtime.h"
#include "hfkern/topk.h"

#ifndef HFKERN_MODULE_NAME
#error "HFKERN_MODULE_NAME must be defined (_C or _C_emu)"
#endif
#ifndef HFKERN_CUDA_ARCHITECTURES
#define HFKERN_CUDA_ARCHITECTURES ""
#endif

namespace py = pybind11;

namespace {

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

hfkern::DType dtype_from_code(int code) {
  if (code < 0 || code > 3) throw std::invalid_argument("hfkern: unknown dtype code " + std::to_string(code));
  return static_cast<hfkern::DType>(code);
}

hfkern::StepGroup make_group(uintptr_t tiles, int64_t n_tiles, uintptr_t addrs, uintptr_t gathers,
                             int param_dtype, uintptr_t params, uintptr_t grads, uintptr_t state0,
                             uintptr_t state1, uintptr_t state2, uintptr_t steps, uintptr_t hypers,
                             int64_t hyper_row_stride, int64_t hyper_model_stride, uintptr_t skip) {
  hfkern::StepGroup g;
  g.tiles = ptr<const int64_t>(tiles);
  g.n_tiles = n_tiles;
  g.addrs = ptr<const int64_t>(addrs);
  g.gathers = ptr<const int64_t>(gathers);
  g.param_dtype = dtype_from_code(param_dtype);
  g.params = ptr<void>(params);
  g.grads = ptr<const void>(grads);
  g.state[0] = ptr<float>(state0);
  g.state[1] = ptr<float>(state1);
  g.state[2] = ptr<float>(state2);
  g.steps = ptr<const float>(steps);
  g.hypers = ptr<const float>(hypers);
  g.hyper_row_stride = hyper_row_stride;
  g.hyper_model_stride = hyper_model_stride;
  g.skip = ptr<const uint8_t>(skip);
  return g;
}

// The batch norm's operands as the glue passes them (hfkern/cuda/batch_norm.py):
// a data tensor as (address, dtype code, s_b, s_r0, s_c, s_r1), a per-channel one as
// (address, dtype code, s_b, s_c) with address 0 when absent.
hfkern::BnTensor bn_tensor(const std::array<int64_t, 6>& t) {
  hfkern::BnTensor v;
  v.data = ptr<void>(static_cast<uintptr_t>(t[0]));
  v.dtype = dtype_from_code(static_cast<int>(t[1]));
  v.s_b = t[2];
  v.s_r0 = t[3];
  v.s_c = t[4];
  v.s_r1 = t[5];
  return v;
}

hfkern::BnChannels bn_channels(const std::array<int64_t, 4>& t) {
  hfkern::BnChannels v;
  v.data = ptr<void>(static_cast<uintptr_t>(t[0]));
  v.dtype = dtype_from_code(static_cast<int>(t[1]));
  v.s_b = t[2];
  v.s_c = t[3];
  return v;
}

// (B, R0, C, R1)
hfkern::BnShape bn_shape(const std::array<int64_t, 4>& s) { return {s[0], s[1], s[2], s[3]}; }

// (tr0, tc, tr1, c_inner)
hfkern::BnTile bn_tile(const std::array<int64_t, 4>& t) {
  for (int i = 0; i < 3; ++i)
    if (t[i] < 1 || t[i] > hfkern::kBnMaxThreads)
      throw std::invalid_argument("hfkern: expected tile sizes in [1, " + std::to_string(hfkern::kBnMaxThreads) +
                                  "], got " + std::to_string(t[i]));
  return {static_cast<int>(t[0]), static_cast<int>(t[1]), static_cast<int>(t[2]), t[3] != 0};
}

// (chunk0, chunk1, P, P1)
hfkern::BnChunks bn_chunks(const std::array<int64_t, 4>& c) { return {c[0], c[1], c[2], c[3]}; }

hfkern::BnActivation bn_activation(int code) {
  if (code < 0 || code > 2) throw std::invalid_argument("hfkern: unknown activation code " + std::to_string(code));
  return static_cast<hfkern::BnActivation>(code);
}

}  // namespace

PYBIND11_MODULE(HFKERN_MODULE_NAME, m) {
  m.doc() = "hfkern's CUDA kernels on raw addresses (see hfkern/cuda/)";

  m.attr("EMULATED") = py::bool_(HFKERN_EMULATED_BUILD != 0);
  // The CMAKE_CUDA_ARCHITECTURES the kernels were built for ("80-real;90"), "" emulated.
  m.attr("CUDA_ARCHITECTURES") = py::str(HFKERN_CUDA_ARCHITECTURES);
  py::dict columns;
  columns["tensor"] = int(hfkern::kColTensor);
  columns["model"] = int(hfkern::kColModel);
  columns["offset"] = int(hfkern::kColOffset);
  columns["grad"] = int(hfkern::kColGrad);
  columns["start"] = int(hfkern::kColStart);
  columns["length"] = int(hfkern::kColLength);
  columns["step"] = int(hfkern::kColStep);
  columns["gather"] = int(hfkern::kColGather);
  columns["first"] = int(hfkern::kColFirst);
  columns["tiles"] = int(hfkern::kColTiles);
  columns["columns"] = int(hfkern::kTileColumns);
  m.attr("TILE_COLUMNS") = columns;
  py::dict address_columns;
  address_columns["param"] = int(hfkern::kAddrParam);
  address_columns["grad"] = int(hfkern::kAddrGrad);
  address_columns["state0"] = int(hfkern::kAddrState0);
  address_columns["state1"] = int(hfkern::kAddrState1);
  address_columns["state2"] = int(hfkern::kAddrState2);
  address_columns["step"] = int(hfkern::kAddrStep);
  address_columns["aligned"] = int(hfkern::kAddrAligned);
  address_columns["columns"] = int(hfkern::kAddressColumns);
  m.attr("ADDRESS_COLUMNS") = address_columns;
  m.attr("MAX_GRAD_DIMS") = py::int_(hfkern::kMaxGradDims);
  // The hyperparameter rows the kernels read, in order (hfkern._optim_specs declares them).
  py::dict rows;
  rows["sgd"] = py::make_tuple("lr", "momentum", "dampening", "weight_decay");
  rows["adam"] = py::make_tuple("lr", "beta1", "beta2", "eps", "weight_decay");
  rows["lars"] = py::make_tuple("lr", "momentum", "weight_decay", "trust_coefficient", "eps");
  rows["lamb"] = py::make_tuple("lr", "beta1", "beta2", "eps", "weight_decay", "norm_min", "norm_max");
  m.attr("OPTIMIZER_ROWS") = rows;

  m.def(
      "runtime_info",
      [] {
        const hfkern::RuntimeInfo info = hfkern::runtime_info();
        py::dict d;
        d["emulated"] = info.emulated;
        d["runtime_version"] = info.runtime_version;
        d["driver_version"] = info.driver_version;
        d["device_count"] = info.device_count;
        d["error"] = info.error;
        return d;
      },
      "The linked CUDA runtime's and the driver's versions, the device count and any error.");
  m.def("set_device", &hfkern::set_device, py::arg("device"),
        "Make `device` current for the extension's own CUDA runtime on this thread.");

  m.def(
      "count_steps",
      [](uintptr_t steps, uintptr_t addrs, uintptr_t offsets, int64_t n, int64_t B, uintptr_t skip, int threads,
         uintptr_t stream, uintptr_t counted_by, int64_t counted_stride) {
        py::gil_scoped_release release;
        hfkern::count_steps(ptr<float>(steps), ptr<const int64_t>(addrs), ptr<const int64_t>(offsets), n, B,
                            ptr<const uint8_t>(skip), ptr<const float>(counted_by), counted_stride, threads,
                            ptr<void>(stream));
      },
      py::arg("steps"), py::arg("addrs"), py::arg("offsets"), py::arg("n"), py::arg("B"), py::arg("skip"),
      py::arg("threads"), py::arg("stream"), py::arg("counted_by") = 0, py::arg("counted_stride") = 0);

  // sgd_step / adam_step / lars_step / lamb_step: one dtype group's tile table, the call's
  // address table and the group's gather table (0: none) (a trust-ratio step with `trust`
  // runs its norm pass into `partials` first).
  auto def_step = [&m](const char* name, void (*step)(const hfkern::StepGroup&, const hfkern::StepOptions&, int,
                                                     void*)) {
    m.def(
        name,
        [step](uintptr_t tiles, int64_t n_tiles, uintptr_t addrs, uintptr_t gathers, int param_dtype,
               uintptr_t params, uintptr_t grads, uintptr_t state0, uintptr_t state1, uintptr_t state2,
               uintptr_t steps, uintptr_t hypers, int64_t hyper_row_stride, int64_t hyper_model_stride,
               uintptr_t skip, bool maximize, bool has_weight_decay, bool decoupled_weight_decay, bool momentum,
               bool nesterov, bool amsgrad, int threads, uintptr_t stream, uintptr_t partials, bool trust,
               bool bias_correction) {
          hfkern::StepGroup group =
              make_group(tiles, n_tiles, addrs, gathers, param_dtype, params, grads, state0, state1, state2, steps,
                         hypers, hyper_row_stride, hyper_model_stride, skip);
          group.partials = ptr<float>(partials);
          hfkern::StepOptions options;
          options.maximize = maximize;
          options.has_weight_decay = has_weight_decay;
          options.decoupled_weight_decay = decoupled_weight_decay;
          options.momentum = momentum;
          options.nesterov = nesterov;
          options.amsgrad = amsgrad;
          options.trust = trust;
          options.bias_correction = bias_correction;
          py::gil_scoped_release release;
          step(group, options, threads, ptr<void>(stream));
        },
        py::arg("tiles"), py::arg("n_tiles"), py::arg("addrs"), py::arg("gathers"), py::arg("param_dtype"),
        py::arg("params"), py::arg("grads"),
        py::arg("state0"), py::arg("state1"), py::arg("state2"), py::arg("steps"), py::arg("hypers"),
        py::arg("hyper_row_stride"), py::arg("hyper_model_stride"), py::arg("skip"),
        py::arg("maximize"), py::arg("has_weight_decay"), py::arg("decoupled_weight_decay"),
        py::arg("momentum"), py::arg("nesterov"), py::arg("amsgrad"), py::arg("threads"), py::arg("stream"),
        py::arg("partials") = 0, py::arg("trust") = false, py::arg("bias_correction") = false);
  };
  def_step("sgd_step", &hfkern::sgd_step);
  def_step("adam_step", &hfkern::adam_step);
  def_step("lars_step", &hfkern::lars_step);
  def_step("lamb_step", &hfkern::lamb_step);

  // topk_select's passes over the data (csrc/topk/topk_select.cu; hfkern/cuda/topk.py).
  m.attr("TOPK_CANDIDATES") = py::int_(hfkern::kTopkCandidates);
  m.def(
      "topk_count",
      [](uintptr_t bits, int elem_bytes, int64_t R, int64_t n, uintptr_t candidates, uintptr_t partial, int64_t P,
         int64_t tiles, int64_t mag_mask, int64_t nan_key, int threads, uintptr_t stream) {
        py::gil_scoped_release release;
        hfkern::topk_count(ptr<const void>(bits), elem_bytes, R, n, ptr<const int64_t>(candidates),
                           ptr<int32_t>(partial), P, tiles, mag_mask, nan_key, threads, ptr<void>(stream));
      },
      py::arg("bits"), py::arg("elem_bytes"), py::arg("R"), py::arg("n"), py::arg("candidates"), py::arg("partial"),
      py::arg("P"), py::arg("tiles"), py::arg("mag_mask"), py::arg("nan_key"), py::arg("threads"), py::arg("stream"));
  m.def(
      "topk_block_counts",
      [](uintptr_t bits, int elem_bytes, int64_t R, int64_t n, uintptr_t threshold, uintptr_t gt, uintptr_t eq,
         int64_t P, int64_t tiles, int64_t mag_mask, int64_t nan_key, int threads, uintptr_t stream) {
        py::gil_scoped_release release;
        hfkern::topk_block_counts(ptr<const void>(bits), elem_bytes, R, n, ptr<const int64_t>(threshold),
                                  ptr<int32_t>(gt), ptr<int32_t>(eq), P, tiles, mag_mask, nan_key, threads,
                                  ptr<void>(stream));
      },
      py::arg("bits"), py::arg("elem_bytes"), py::arg("R"), py::arg("n"), py::arg("threshold"), py::arg("gt"),
      py::arg("eq"), py::arg("P"), py::arg("tiles"), py::arg("mag_mask"), py::arg("nan_key"), py::arg("threads"),
      py::arg("stream"));
  m.def(
      "topk_write",
      [](uintptr_t bits, int elem_bytes, int64_t R, int64_t n, uintptr_t threshold, uintptr_t quota,
         uintptr_t tie_offset, uintptr_t out_offset, uintptr_t values, uintptr_t indices, int64_t cap, int64_t P,
         int64_t tiles, int64_t mag_mask, int64_t nan_key, int threads, uintptr_t stream) {
        py::gil_scoped_release release;
        hfkern::topk_write(ptr<const void>(bits), elem_bytes, R, n, ptr<const int64_t>(threshold),
                           ptr<const int64_t>(quota), ptr<const int64_t>(tie_offset), ptr<const int64_t>(out_offset),
                           ptr<void>(values), ptr<int32_t>(indices), cap, P, tiles, mag_mask, nan_key, threads,
                           ptr<void>(stream));
      },
      py::arg("bits"), py::arg("elem_bytes"), py::arg("R"), py::arg("n"), py::arg("threshold"), py::arg("quota"),
      py::arg("tie_offset"), py::arg("out_offset"), py::arg("values"), py::arg("indices"), py::arg("cap"),
      py::arg("P"), py::arg("tiles"), py::arg("mag_mask"), py::arg("nan_key"), py::arg("threads"), py::arg("stream"));

  // The array batch norm (csrc/norm/batch_norm.cu; hfkern/cuda/batch_norm.py). Tensors are
  // (address, dtype code, s_b, s_r0, s_c, s_r1), per-channel tensors (address, dtype code,
  // s_b, s_c) with address 0 when absent; shape (B, R0, C, R1); tile (tr0, tc, tr1, c_inner);
  // chunks (chunk0, chunk1, P, P1).
  m.attr("BN_MAX_THREADS") = py::int_(hfkern::kBnMaxThreads);
  py::dict activations;
  activations["none"] = int(hfkern::BnActivation::None);
  activations["relu"] = int(hfkern::BnActivation::Relu);
  activations["gelu"] = int(hfkern::BnActivation::Gelu);
  m.attr("BN_ACTIVATIONS") = activations;
  using Tensor6 = std::array<int64_t, 6>;
  using Quad = std::array<int64_t, 4>;
  m.def(
      "batch_norm_stats",
      [](const Tensor6& x, const Quad& shape, const Quad& tile, const Quad& chunks, uintptr_t pmean, uintptr_t pm2,
         uintptr_t stream) {
        const auto xt = bn_tensor(x);
        const auto s = bn_shape(shape);
        const auto t = bn_tile(tile);
        const auto ch = bn_chunks(chunks);
        py::gil_scoped_release release;
        hfkern::batch_norm_stats(xt, s, t, ch, ptr<float>(pmean), ptr<float>(pm2), ptr<void>(stream));
      },
      py::arg("x"), py::arg("shape"), py::arg("tile"), py::arg("chunks"), py::arg("pmean"), py::arg("pm2"),
      py::arg("stream"));
  m.def(
      "batch_norm_finalize",
      [](uintptr_t pmean, uintptr_t pm2, int64_t s_part_b, const Quad& running_mean, const Quad& running_var,
         uintptr_t num_batches_tracked, int64_t s_nbt, bool training, bool update, bool cumulative, double momentum,
         double unbias, double eps, const Quad& shape, const Quad& chunks, uintptr_t mean, uintptr_t rstd, int threads,
         uintptr_t stream) {
        hfkern::BnFinalize a;
        a.pmean = ptr<const float>(pmean);
        a.pm2 = ptr<const float>(pm2);
        a.s_part_b = s_part_b;
        a.running_mean = bn_channels(running_mean);
        a.running_var = bn_channels(running_var);
        a.num_batches_tracked = ptr<const int64_t>(num_batches_tracked);
        a.s_nbt = s_nbt;
        a.training = training;
        a.update = update;
        a.cumulative = cumulative;
        a.momentum = momentum;
        a.unbias = unbias;
        a.eps = eps;
        const auto s = bn_shape(shape);
        const auto ch = bn_chunks(chunks);
        py::gil_scoped_release release;
        hfkern::batch_norm_finalize(a, s, ch, ptr<float>(mean), ptr<float>(rstd), threads, ptr<void>(stream));
      },
      py::arg("pmean"), py::arg("pm2"), py::arg("s_part_b"), py::arg("running_mean"), py::arg("running_var"),
      py::arg("num_batches_tracked"), py::arg("s_nbt"), py::arg("training"), py::arg("update"),
      py::arg("cumulative"), py::arg("momentum"), py::arg("unbias"), py::arg("eps"), py::arg("shape"),
      py::arg("chunks"), py::arg("mean"), py::arg("rstd"), py::arg("threads"), py::arg("stream"));
  m.def(
      "batch_norm_apply",
      [](const Tensor6& x, const Tensor6& y, const Quad& shape, const Quad& tile, uintptr_t mean, uintptr_t rstd,
         const Quad& weight, const Quad& bias, int activation, uintptr_t stream) {
        const auto xt = bn_tensor(x), yt = bn_tensor(y);
        const auto s = bn_shape(shape);
        const auto t = bn_tile(tile);
        const auto w = bn_channels(weight), b = bn_channels(bias);
        const auto act = bn_activation(activation);
        py::gil_scoped_release release;
        hfkern::batch_norm_apply(xt, yt, s, t, ptr<const float>(mean), ptr<const float>(rstd), w, b, act,
                                 ptr<void>(stream));
      },
      py::arg("x"), py::arg("y"), py::arg("shape"), py::arg("tile"), py::arg("mean"), py::arg("rstd"),
      py::arg("weight"), py::arg("bias"), py::arg("activation"), py::arg("stream"));
  m.def(
      "batch_norm_backward_partials",
      [](const Tensor6& grad_y, const Tensor6& x, const Quad& shape, const Quad& tile, const Quad& chunks,
         uintptr_t mean, uintptr_t rstd, const Quad& weight, const Quad& bias, int activation, uintptr_t pg,
         uintptr_t pgx, uintptr_t stream) {
        const auto gt = bn_tensor(grad_y), xt = bn_tensor(x);
        const auto s = bn_shape(shape);
        const auto t = bn_tile(tile);
        const auto ch = bn_chunks(chunks);
        const auto w = bn_channels(weight), b = bn_channels(bias);
        const auto act = bn_activation(activation);
        py::gil_scoped_release release;
        hfkern::batch_norm_backward_partials(gt, xt, s, t, ch, ptr<const float>(mean), ptr<const float>(rstd), w, b,
                                             act, ptr<float>(pg), ptr<float>(pgx), ptr<void>(stream));
      },
      py::arg("grad_y"), py::arg("x"), py::arg("shape"), py::arg("tile"), py::arg("chunks"), py::arg("mean"),
      py::arg("rstd"), py::arg("weight"), py::arg("bias"), py::arg("activation"), py::arg("pg"), py::arg("pgx"),
      py::arg("stream"));
  m.def(
      "batch_norm_backward_reduce",
      [](uintptr_t pg, uintptr_t pgx, int64_t B, int64_t C, int64_t P, uintptr_t sums, const Quad& grad_weight,
         const Quad& grad_bias, int threads, uintptr_t stream) {
        const auto gw = bn_channels(grad_weight), gb = bn_channels(grad_bias);
        py::gil_scoped_release release;
        hfkern::batch_norm_backward_reduce(ptr<const float>(pg), ptr<const float>(pgx), B, C, P, ptr<float>(sums), gw,
                                           gb, threads, ptr<void>(stream));
      },
      py::arg("pg"), py::arg("pgx"), py::arg("B"), py::arg("C"), py::arg("P"), py::arg("sums"),
      py::arg("grad_weight"), py::arg("grad_bias"), py::arg("threads"), py::arg("stream"));
  m.def(
      "batch_norm_backward_dx",
      [](const Tensor6& grad_y, const Tensor6& x, const Tensor6& grad_x, const Quad& shape, const Quad& tile,
         uintptr_t mean, uintptr_t rstd, const Quad& weight, const Quad& bias, uintptr_t sums, double inv_n,
         bool training, int activation, uintptr_t stream) {
        const auto gt = bn_tensor(grad_y), xt = bn_tensor(x), ot = bn_tensor(grad_x);
        const auto s = bn_shape(shape);
        const auto t = bn_tile(tile);
        const auto w = bn_channels(weight), b = bn_channels(bias);
        const auto act = bn_activation(activation);
        py::gil_scoped_release release;
        hfkern::batch_norm_backward_dx(gt, xt, ot, s, t, ptr<const float>(mean), ptr<const float>(rstd), w, b,
                                       ptr<const float>(sums), inv_n, training, act, ptr<void>(stream));
      },
      py::arg("grad_y"), py::arg("x"), py::arg("grad_x"), py::arg("shape"), py::arg("tile"), py::arg("mean"),
      py::arg("rstd"), py::arg("weight"), py::arg("bias"), py::arg("sums"), py::arg("inv_n"), py::arg("training"),
      py::arg("activation"), py::arg("stream"));
}
