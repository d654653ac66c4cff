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
#include "hfkern/depthwise_conv.h"
#include "hfkern/embedding.h"
#include "hfkern/layer_norm.h"
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

  // The array depthwise conv2d (csrc/conv/depthwise_conv.cu; hfkern/cuda/conv.py). Activations
  // are (address, dtype code, s_b, s_n, s_c, s_h, s_w), weights and biases (address, dtype
  // code, s_b, s_c, s_h, s_w) with address 0 for no bias; geometry (B, N, C, H, W, OH, OW,
  // kh, kw, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w); tile (tc, th, tw, rows, c_inner).
  m.attr("DW_MAX_THREADS") = py::int_(hfkern::kDwMaxThreads);
  m.attr("DW_MAX_ROWS") = py::int_(hfkern::kDwMaxRows);
  {
    using DwT = std::array<int64_t, 7>;
    using DwW = std::array<int64_t, 6>;
    using DwG = std::array<int64_t, 15>;
    using DwTi = std::array<int64_t, 5>;
    auto dw_tensor = [](const DwT& a) {
      hfkern::DwTensor v;
      v.data = ptr<void>(static_cast<uintptr_t>(a[0]));
      v.dtype = dtype_from_code(static_cast<int>(a[1]));
      v.s_b = a[2];
      v.s_n = a[3];
      v.s_c = a[4];
      v.s_h = a[5];
      v.s_w = a[6];
      return v;
    };
    auto dw_weight = [](const DwW& a) {
      hfkern::DwWeight v;
      v.data = ptr<void>(static_cast<uintptr_t>(a[0]));
      v.dtype = dtype_from_code(static_cast<int>(a[1]));
      v.s_b = a[2];
      v.s_c = a[3];
      v.s_h = a[4];
      v.s_w = a[5];
      return v;
    };
    auto dw_geometry = [](const DwG& a) {
      for (int i = 7; i < 15; ++i)
        if (a[i] < 0 || a[i] > 0x7fffffff)
          throw std::invalid_argument("hfkern: expected kernel, stride, padding and dilation in [0, 2**31), got " +
                                      std::to_string(a[i]));
      hfkern::DwGeometry g;
      g.B = a[0];
      g.N = a[1];
      g.C = a[2];
      g.H = a[3];
      g.W = a[4];
      g.OH = a[5];
      g.OW = a[6];
      g.kh = static_cast<int>(a[7]);
      g.kw = static_cast<int>(a[8]);
      g.stride_h = static_cast<int>(a[9]);
      g.stride_w = static_cast<int>(a[10]);
      g.pad_h = static_cast<int>(a[11]);
      g.pad_w = static_cast<int>(a[12]);
      g.dil_h = static_cast<int>(a[13]);
      g.dil_w = static_cast<int>(a[14]);
      return g;
    };
    auto dw_tile = [](const DwTi& a) {
      for (int i = 0; i < 4; ++i)
        if (a[i] < 1 || a[i] > hfkern::kDwMaxThreads)
          throw std::invalid_argument("hfkern: expected tile sizes in [1, " + std::to_string(hfkern::kDwMaxThreads) +
                                      "], got " + std::to_string(a[i]));
      hfkern::DwTile t;
      t.tc = static_cast<int>(a[0]);
      t.th = static_cast<int>(a[1]);
      t.tw = static_cast<int>(a[2]);
      t.rows = static_cast<int>(a[3]);
      t.c_inner = a[4] != 0;
      return t;
    };
    m.def(
        "depthwise_conv_fwd",
        [=](const DwT& x, const DwW& weight, const DwW& bias, const DwT& y, const DwG& geometry, const DwTi& tile,
            uintptr_t stream) {
          const auto xt = dw_tensor(x), yt = dw_tensor(y);
          const auto w = dw_weight(weight), b = dw_weight(bias);
          const auto g = dw_geometry(geometry);
          const auto t = dw_tile(tile);
          py::gil_scoped_release release;
          hfkern::depthwise_conv_fwd(xt, w, b, yt, g, t, ptr<void>(stream));
        },
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("y"), py::arg("geometry"), py::arg("tile"),
        py::arg("stream"));
    m.def(
        "depthwise_conv_dgrad",
        [=](const DwT& grad_y, const DwW& weight, const DwT& grad_x, bool sum_models, const DwG& geometry,
            const DwTi& tile, uintptr_t stream) {
          const auto gy = dw_tensor(grad_y), gx = dw_tensor(grad_x);
          const auto w = dw_weight(weight);
          const auto g = dw_geometry(geometry);
          const auto t = dw_tile(tile);
          py::gil_scoped_release release;
          hfkern::depthwise_conv_dgrad(gy, w, gx, sum_models, g, t, ptr<void>(stream));
        },
        py::arg("grad_y"), py::arg("weight"), py::arg("grad_x"), py::arg("sum_models"), py::arg("geometry"),
        py::arg("tile"), py::arg("stream"));
    m.def(
        "depthwise_conv_wgrad_partials",
        [=](const DwT& grad_y, const DwT& x, const DwG& geometry, const DwTi& tile, int64_t chunk_rows, int64_t P,
            uintptr_t partials, uintptr_t stream) {
          const auto gy = dw_tensor(grad_y), xt = dw_tensor(x);
          const auto g = dw_geometry(geometry);
          const auto t = dw_tile(tile);
          py::gil_scoped_release release;
          hfkern::depthwise_conv_wgrad_partials(gy, xt, g, t, chunk_rows, P, ptr<float>(partials), ptr<void>(stream));
        },
        py::arg("grad_y"), py::arg("x"), py::arg("geometry"), py::arg("tile"), py::arg("chunk_rows"), py::arg("P"),
        py::arg("partials"), py::arg("stream"));
    m.def(
        "depthwise_conv_wgrad_reduce",
        [=](uintptr_t partials, const DwG& geometry, int64_t P, const DwW& grad_w, int threads, uintptr_t stream) {
          const auto g = dw_geometry(geometry);
          const auto gw = dw_weight(grad_w);
          py::gil_scoped_release release;
          hfkern::depthwise_conv_wgrad_reduce(ptr<const float>(partials), g, P, gw, threads, ptr<void>(stream));
        },
        py::arg("partials"), py::arg("geometry"), py::arg("P"), py::arg("grad_w"), py::arg("threads"),
        py::arg("stream"));
  }

  // The array embedding (csrc/embedding/embedding.cu; hfkern/cuda/embedding.py). An index
  // tensor is (address, index bytes, L, s_b, s_m, s_l); the backward's grad_out strides
  // (s_gb, s_gm, s_gl, s_gd) and shape (B, V, D, items).
  {
    m.attr("EMB_MAX_THREADS") = py::int_(hfkern::kEmbMaxThreads);
    using Index6 = std::array<int64_t, 6>;
    using Quad4 = std::array<int64_t, 4>;
    auto emb_index = [](const Index6& t) {
      hfkern::EmbIndex v;
      v.data = ptr<const void>(static_cast<uintptr_t>(t[0]));
      v.index_bytes = static_cast<int>(t[1]);
      v.L = t[2];
      v.s_b = t[3];
      v.s_m = t[4];
      v.s_l = t[5];
      return v;
    };
    m.def(
        "embedding_forward",
        [emb_index](uintptr_t weight, uintptr_t out, int word_bytes, int64_t B, int64_t n, int64_t Dw, int64_t s_wb,
                    int64_t s_wv, int64_t s_wd, const Index6& index, int tx, int ty, uintptr_t stream) {
          hfkern::EmbForward a;
          a.weight = ptr<const void>(weight);
          a.out = ptr<void>(out);
          a.word_bytes = word_bytes;
          a.B = B;
          a.n = n;
          a.Dw = Dw;
          a.s_wb = s_wb;
          a.s_wv = s_wv;
          a.s_wd = s_wd;
          a.idx = emb_index(index);
          py::gil_scoped_release release;
          hfkern::embedding_forward(a, tx, ty, ptr<void>(stream));
        },
        py::arg("weight"), py::arg("out"), py::arg("word_bytes"), py::arg("B"), py::arg("n"), py::arg("Dw"),
        py::arg("s_wb"), py::arg("s_wv"), py::arg("s_wd"), py::arg("index"), py::arg("tx"), py::arg("ty"),
        py::arg("stream"));
    m.def(
        "embedding_sort_keys",
        [emb_index](const Index6& index, int64_t models, int64_t n, int64_t V, int key_bytes, uintptr_t keys,
                    uintptr_t positions, int threads, uintptr_t stream) {
          const auto idx = emb_index(index);
          py::gil_scoped_release release;
          hfkern::embedding_sort_keys(idx, models, n, V, key_bytes, ptr<void>(keys), ptr<int32_t>(positions),
                                      threads, ptr<void>(stream));
        },
        py::arg("index"), py::arg("models"), py::arg("n"), py::arg("V"), py::arg("key_bytes"), py::arg("keys"),
        py::arg("positions"), py::arg("threads"), py::arg("stream"));
    m.def("embedding_sort_temp_bytes", &hfkern::embedding_sort_temp_bytes, py::arg("items"), py::arg("key_bytes"),
          py::arg("end_bit"));
    m.def(
        "embedding_sort",
        [](uintptr_t temp, size_t temp_bytes, uintptr_t keys_in, uintptr_t keys_out, uintptr_t values_in,
           uintptr_t values_out, int64_t items, int key_bytes, int end_bit, uintptr_t stream) {
          py::gil_scoped_release release;
          hfkern::embedding_sort(ptr<void>(temp), temp_bytes, ptr<const void>(keys_in), ptr<void>(keys_out),
                                 ptr<const int32_t>(values_in), ptr<int32_t>(values_out), items, key_bytes, end_bit,
                                 ptr<void>(stream));
        },
        py::arg("temp"), py::arg("temp_bytes"), py::arg("keys_in"), py::arg("keys_out"), py::arg("values_in"),
        py::arg("values_out"), py::arg("items"), py::arg("key_bytes"), py::arg("end_bit"), py::arg("stream"));
    m.def(
        "embedding_segments",
        [](uintptr_t sorted_keys, int key_bytes, int64_t items, int64_t rows, uintptr_t bounds, int threads,
           uintptr_t stream) {
          py::gil_scoped_release release;
          hfkern::embedding_segments(ptr<const void>(sorted_keys), key_bytes, items, rows, ptr<int32_t>(bounds),
                                     threads, ptr<void>(stream));
        },
        py::arg("sorted_keys"), py::arg("key_bytes"), py::arg("items"), py::arg("rows"), py::arg("bounds"),
        py::arg("threads"), py::arg("stream"));
    auto emb_backward = [](uintptr_t grad, int dtype, int64_t L, const Quad4& strides, uintptr_t perm,
                           uintptr_t bounds, uintptr_t part, uintptr_t grad_w, const Quad4& shape,
                           int64_t padding_idx, int64_t chunk, int vec, bool shared, bool scale) {
      hfkern::EmbBackward a;
      a.grad = ptr<const void>(grad);
      a.dtype = dtype_from_code(dtype);
      a.L = L;
      a.s_gb = strides[0];
      a.s_gm = strides[1];
      a.s_gl = strides[2];
      a.s_gd = strides[3];
      a.perm = ptr<const int32_t>(perm);
      a.bounds = ptr<const int32_t>(bounds);
      a.part = ptr<float>(part);
      a.grad_w = ptr<void>(grad_w);
      a.B = shape[0];
      a.V = shape[1];
      a.D = shape[2];
      a.items = shape[3];
      a.padding_idx = padding_idx;
      a.chunk = chunk;
      a.vec = vec;
      a.shared = shared;
      a.scale = scale;
      return a;
    };
    m.def(
        "embedding_backward_chunks",
        [emb_backward](uintptr_t grad, int dtype, int64_t L, const Quad4& strides, uintptr_t perm, uintptr_t bounds,
                       uintptr_t part, uintptr_t grad_w, const Quad4& shape, int64_t padding_idx, int64_t chunk,
                       int vec, bool shared, bool scale, int tx, uintptr_t stream) {
          const auto a = emb_backward(grad, dtype, L, strides, perm, bounds, part, grad_w, shape, padding_idx, chunk,
                                      vec, shared, scale);
          py::gil_scoped_release release;
          hfkern::embedding_backward_chunks(a, tx, ptr<void>(stream));
        },
        py::arg("grad"), py::arg("dtype"), py::arg("L"), py::arg("strides"), py::arg("perm"), py::arg("bounds"),
        py::arg("part"), py::arg("grad_w"), py::arg("shape"), py::arg("padding_idx"), py::arg("chunk"),
        py::arg("vec"), py::arg("shared"), py::arg("scale"), py::arg("tx"), py::arg("stream"));
    m.def(
        "embedding_backward_rows",
        [emb_backward](uintptr_t grad, int dtype, int64_t L, const Quad4& strides, uintptr_t perm, uintptr_t bounds,
                       uintptr_t part, uintptr_t grad_w, const Quad4& shape, int64_t padding_idx, int64_t chunk,
                       int vec, bool shared, bool scale, int tx, int ty, uintptr_t stream) {
          const auto a = emb_backward(grad, dtype, L, strides, perm, bounds, part, grad_w, shape, padding_idx, chunk,
                                      vec, shared, scale);
          py::gil_scoped_release release;
          hfkern::embedding_backward_rows(a, tx, ty, ptr<void>(stream));
        },
        py::arg("grad"), py::arg("dtype"), py::arg("L"), py::arg("strides"), py::arg("perm"), py::arg("bounds"),
        py::arg("part"), py::arg("grad_w"), py::arg("shape"), py::arg("padding_idx"), py::arg("chunk"),
        py::arg("vec"), py::arg("shared"), py::arg("scale"), py::arg("tx"), py::arg("ty"), py::arg("stream"));
  }
  // The array layer norm and RMS norm (csrc/norm/layer_norm.cu; hfkern/cuda/layer_norm.py).
  // Tensors are (address, dtype code, s_b, s_m0, s_m1, s_d0, s_d1), parameters (address,
  // dtype code, s_b, s_d) with address 0 when absent; shape (B, M, M1, D, D1); config
  // (row_threads, lanes, rows, regs, vec, param_vec).
  {
    m.attr("LN_MAX_THREADS") = py::int_(hfkern::kLnMaxThreads);
    m.attr("LN_MAX_BWD_THREADS") = py::int_(hfkern::kLnMaxBwdThreads);
    m.attr("LN_FWD_VALUES") = py::int_(hfkern::kLnFwdValues);
    m.attr("LN_BWD_VALUES") = py::int_(hfkern::kLnBwdValues);
    py::dict ln_activations;
    ln_activations["none"] = int(hfkern::LnActivation::None);
    ln_activations["relu"] = int(hfkern::LnActivation::Relu);
    ln_activations["gelu"] = int(hfkern::LnActivation::Gelu);
    m.attr("LN_ACTIVATIONS") = ln_activations;
    using LnData = std::array<int64_t, 7>;
    using LnQuad = std::array<int64_t, 4>;
    auto ln_tensor = [](const LnData& t) {
      hfkern::LnTensor v;
      v.data = ptr<void>(static_cast<uintptr_t>(t[0]));
      v.dtype = dtype_from_code(static_cast<int>(t[1]));
      v.s_b = t[2];
      v.s_m0 = t[3];
      v.s_m1 = t[4];
      v.s_d0 = t[5];
      v.s_d1 = t[6];
      return v;
    };
    auto ln_param = [](const LnQuad& t) {
      hfkern::LnParam v;
      v.data = ptr<void>(static_cast<uintptr_t>(t[0]));
      v.dtype = dtype_from_code(static_cast<int>(t[1]));
      v.s_b = t[2];
      v.s_d = t[3];
      return v;
    };
    auto ln_shape = [](const std::array<int64_t, 5>& s) { return hfkern::LnShape{s[0], s[1], s[2], s[3], s[4]}; };
    auto ln_config = [](const std::array<int64_t, 6>& c) {
      for (int i = 0; i < 3; ++i)
        if (c[i] < 1 || c[i] > hfkern::kLnMaxThreads)
          throw std::invalid_argument("hfkern: expected row_threads, lanes and rows in [1, " +
                                      std::to_string(hfkern::kLnMaxThreads) + "], got " + std::to_string(c[i]));
      hfkern::LnConfig v;
      v.row_threads = static_cast<int>(c[0]);
      v.lanes = static_cast<int>(c[1]);
      v.rows = static_cast<int>(c[2]);
      v.regs = c[3] != 0;
      v.vec = c[4] != 0;
      v.param_vec = c[5] != 0;
      return v;
    };
    auto ln_activation = [](int code) {
      if (code < 0 || code > 2) throw std::invalid_argument("hfkern: unknown activation code " + std::to_string(code));
      return static_cast<hfkern::LnActivation>(code);
    };
    m.def(
        "layer_norm_forward",
        [=](const LnData& x, const LnData& y, const LnQuad& weight, const LnQuad& bias,
            const std::array<int64_t, 5>& shape, const std::array<int64_t, 6>& config, double eps, bool rms,
            int activation, uintptr_t mean, uintptr_t rstd, uintptr_t stream) {
          const auto xt = ln_tensor(x), yt = ln_tensor(y);
          const auto w = ln_param(weight), b = ln_param(bias);
          const auto s = ln_shape(shape);
          const auto c = ln_config(config);
          const auto act = ln_activation(activation);
          py::gil_scoped_release release;
          hfkern::layer_norm_forward(xt, yt, w, b, s, c, eps, rms, act, ptr<float>(mean), ptr<float>(rstd),
                                     ptr<void>(stream));
        },
        py::arg("x"), py::arg("y"), py::arg("weight"), py::arg("bias"), py::arg("shape"), py::arg("config"),
        py::arg("eps"), py::arg("rms"), py::arg("activation"), py::arg("mean"), py::arg("rstd"), py::arg("stream"));
    m.def(
        "layer_norm_backward",
        [=](const LnData& grad_y, const LnData& x, const LnData& grad_x, const LnQuad& weight, const LnQuad& bias,
            const std::array<int64_t, 5>& shape, const std::array<int64_t, 6>& config, int64_t chunk, int64_t P,
            uintptr_t mean, uintptr_t rstd, bool rms, int activation, uintptr_t pw, uintptr_t pb,
            uintptr_t stream) {
          const auto gt = ln_tensor(grad_y), xt = ln_tensor(x), ot = ln_tensor(grad_x);
          const auto w = ln_param(weight), b = ln_param(bias);
          const auto s = ln_shape(shape);
          const auto c = ln_config(config);
          const auto act = ln_activation(activation);
          py::gil_scoped_release release;
          hfkern::layer_norm_backward(gt, xt, ot, w, b, s, c, chunk, P, ptr<const float>(mean),
                                      ptr<const float>(rstd), rms, act, ptr<float>(pw), ptr<float>(pb),
                                      ptr<void>(stream));
        },
        py::arg("grad_y"), py::arg("x"), py::arg("grad_x"), py::arg("weight"), py::arg("bias"), py::arg("shape"),
        py::arg("config"), py::arg("chunk"), py::arg("P"), py::arg("mean"), py::arg("rstd"), py::arg("rms"),
        py::arg("activation"), py::arg("pw"), py::arg("pb"), py::arg("stream"));
    m.def(
        "layer_norm_sum_partials",
        [=](uintptr_t pw, uintptr_t pb, int64_t B, int64_t P, int64_t D, const LnQuad& grad_weight,
            const LnQuad& grad_bias, int threads, uintptr_t stream) {
          const auto gw = ln_param(grad_weight), gb = ln_param(grad_bias);
          py::gil_scoped_release release;
          hfkern::layer_norm_sum_partials(ptr<const float>(pw), ptr<const float>(pb), B, P, D, gw, gb, threads,
                                          ptr<void>(stream));
        },
        py::arg("pw"), py::arg("pb"), py::arg("B"), py::arg("P"), py::arg("D"), py::arg("grad_weight"),
        py::arg("grad_bias"), py::arg("threads"), py::arg("stream"));
  }
}
