"""hfkern arrays under torch.autocast compute in the dtypes B torch models do.

Each case fuses B torch models and runs both under autocast: the outputs have
torch's dtype and agree, and every parameter's gradient (float32, as torch's)
agrees to low-precision tolerance. hfkern's own ops carry torch's autocast rule
of the op they fuse (hfkern/ops/_autocast.py); without it an array conv ran in
float32 inside a bfloat16 region, or failed on a low-precision input.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hfkern
from hfkern.ops import _autocast

B = 3

CASES = {
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(3, 5, 3, padding=1), nn.ReLU()), (4, 3, 11)),
    "conv2d_bn": (lambda: nn.Sequential(nn.Conv2d(3, 6, 3, stride=2), nn.BatchNorm2d(6), nn.ReLU()), (4, 3, 9, 9)),
    "conv2d_groups": (lambda: nn.Sequential(nn.Conv2d(4, 6, 3, groups=2, bias=False)), (2, 4, 7, 5)),
    "conv_transpose1d": (lambda: nn.Sequential(nn.ConvTranspose1d(2, 3, 4, stride=3)), (2, 2, 5)),
    "conv_transpose2d_bn": (lambda: nn.Sequential(nn.ConvTranspose2d(3, 4, 3, 2, output_padding=1),
                                                  nn.BatchNorm2d(4)), (3, 3, 5, 5)),
    "linear_layer_norm": (lambda: nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7)), (3, 5)),
    "linear_rms_norm": (lambda: nn.Sequential(nn.Linear(5, 7), nn.RMSNorm(7)), (3, 5)),
    "conv_after_linear": (lambda: _LinearThenConv(), (2, 6)),
    # torch.prelu casts under autocast; the array's per-model kernel has no rule of its own
    # (a bf16 conv output met a float32 weight and raised; a float32 input stayed float32)
    "conv_prelu": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.PReLU(4)), (2, 3, 6, 6)),
    "linear_prelu": (lambda: nn.Sequential(nn.PReLU(), nn.Linear(5, 3), nn.PReLU()), (4, 5)),
}


class _LinearThenConv(nn.Module):
    """A low-precision activation (the linear's) reaching a conv with float32 weights."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 2 * 3 * 8)
        self.conv = nn.Conv1d(3, 4, 3)

    def forward(self, x):
        return self.conv(self.fc(x).view(-1, 3, 8))


def _check(make, shape, device, dtype):
    torch.manual_seed(0)
    models = [make().to(device) for _ in range(B)]
    fused = hfkern.fuse(models)
    x = torch.randn(*shape, device=device)
    exact_models = copy.deepcopy(models)
    exact = torch.stack([m(x) for m in exact_models])     # float32, no autocast
    with torch.autocast(device.type, dtype=dtype):
        ref = torch.stack([m(x) for m in models])
        out = fused(hfkern.broadcast(x, B))
    assert out.dtype == ref.dtype
    # Rounding differs where torch computes a layer in several low-precision steps
    # (RMS norm on the CPU) and hfkern in one: the array's error against float32
    # is at most twice torch's own, or within one low-precision rounding.
    err, ref_err = (out.float() - exact).abs().max(), (ref.float() - exact).abs().max()
    assert err <= 2 * ref_err + 1e-2 * exact.abs().max(), (err, ref_err)
    gy = torch.randn(ref.shape, device=device)
    (exact * gy).sum().backward()
    (ref.float() * gy).sum().backward()
    (out.float() * gy).sum().backward()
    for name, p in fused.named_parameters():
        want = torch.stack([m.get_parameter(name).grad for m in models])
        truth = torch.stack([m.get_parameter(name).grad for m in exact_models])
        assert p.grad.dtype == want.dtype == torch.float32, name
        # The same rule against float32: the array's error at most twice torch's own, plus a
        # fraction of the gradient's size. A conv bias before batch norm has a true gradient of
        # zero, so both are pure low-precision noise there and only the first term applies.
        err, ref_err = (p.grad - truth).abs().max(), (want - truth).abs().max()
        assert err <= 2 * ref_err + 3e-2 * truth.abs().max(), (name, err, ref_err)


@pytest.mark.parametrize("name", list(CASES))
def test_array_under_cpu_autocast_matches_torch(name):
    make, shape = CASES[name]
    _check(make, shape, torch.device("cpu"), torch.bfloat16)


def test_array_conv_op_casts_to_the_regions_dtype():
    x = torch.randn(2, 3, 4, 6, 6)
    w = torch.randn(2, 5, 4, 3, 3)
    args = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    assert torch.ops.hfkern.array_conv(x, w, None, *args).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.ops.hfkern.array_conv(x, w, None, *args)
        assert y.dtype == torch.bfloat16
        # float64 is not autocast's to change, as torch leaves it
        assert torch.ops.hfkern.array_conv(x.double(), w.double(), None, *args).dtype == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert torch.ops.hfkern.array_conv(x, w, None, *args).dtype == torch.float32


def test_fused_transformer_lm_under_cpu_autocast():
    from bench.models import TransformerLM

    torch.manual_seed(0)
    models = [TransformerLM(vocab=13, d_model=8, nhead=2, num_layers=1, dim_ff=12, dropout=0.0) for _ in range(B)]
    fused = hfkern.fuse(models)
    idx = torch.randint(0, 13, (2, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.stack([m(idx) for m in models])
        out = fused(hfkern.broadcast(idx, B))
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)


def test_register_rejects_an_unknown_policy():
    with pytest.raises(ValueError, match="expected one of .*'lower'.*got 'fp16'"):
        _autocast.register("hfkern::array_conv", "fp16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_array_under_cuda_autocast_matches_torch(name, dtype):
    """On CUDA torch runs layer norm in float32 and convolutions in the region's dtype."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    make, shape = CASES[name]
    _check(make, shape, torch.device("cuda"), dtype)


def test_norm_cuda_autocast_rules_follow_torchs_registrations():
    """torch's CUDA autocast rule for RMS norm changed between versions (2.11 kept the input's
    dtype, later versions run it in float32): the array op has a CUDA autocast kernel exactly
    where torch's own op has one."""
    for ours, theirs in (("hfkern::array_rms_norm", "aten::rms_norm"),
                         ("hfkern::array_layer_norm", "aten::layer_norm")):
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        assert has(ours, "AutocastCUDA") == has(theirs, "AutocastCUDA"), ours


def test_rms_norm_default_eps_is_that_of_the_compute_dtype():
    """torch's RMSNorm with ``eps=None`` adds float32's epsilon for bfloat16 input
    (the dtype it computes in); bfloat16's own (0.0078) would change small inputs."""
    torch.manual_seed(0)
    models = [nn.RMSNorm(7).bfloat16() for _ in range(B)]
    for m in models:
        nn.init.uniform_(m.weight, 0.5, 1.5)
    fused = hfkern.fuse([nn.Sequential(m) for m in models])
    x = (torch.randn(4, 7) * 0.05).bfloat16()
    ref = torch.stack([m(x) for m in models])
    out = fused(hfkern.broadcast(x, B))
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
