"""The launch wrapper every Triton launcher shares (hfkern/triton/_common.py)."""

import pytest

triton = pytest.importorskip("triton")
from hfkern.triton import _common  # noqa: E402
from hfkern.triton import conv, embedding, layer_norm, optim  # noqa: E402


def _tuned_objects():
    for module in (conv, embedding, layer_norm, optim):
        for value in vars(module).values():
            for item in value.values() if isinstance(value, dict) else [value]:
                if isinstance(item, _common.Tuned):
                    yield item


def _launched(monkeypatch, tuned, env):
    """The autotuner a CUDA launch of ``tuned`` runs under ``env``."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if env is None:
        monkeypatch.delenv("HFKERN_TRITON_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("HFKERN_TRITON_AUTOTUNE", env)
    seen = []
    monkeypatch.setattr(type(tuned.tuned), "run", lambda self, *a, **k: seen.append(self))
    tuned[(1,)]()
    return seen[0]


def test_autotuned_by_default_and_first_config_when_off(monkeypatch):
    tuned = embedding._fwd
    assert _launched(monkeypatch, tuned, None) is tuned.tuned
    assert _launched(monkeypatch, tuned, "1") is tuned.tuned
    fixed = _launched(monkeypatch, tuned, "0")
    assert fixed is tuned.fixed
    assert fixed.configs == tuned.configs[:1] and len(tuned.tuned.configs) > 1


def test_bad_autotune_setting_raises(monkeypatch):
    monkeypatch.setenv("HFKERN_TRITON_AUTOTUNE", "yes")
    with pytest.raises(ValueError, match=r"HFKERN_TRITON_AUTOTUNE must be 0 or 1, got 'yes'"):
        _common.autotuning()


def test_every_launcher_kernel_has_a_fixed_first_config():
    tuned = list(_tuned_objects())
    assert len(tuned) >= 10
    for t in tuned:
        assert t.fixed.configs == t.configs[:1]
        assert t.fixed.fn is t.kernel and t.tuned.fn is t.kernel


@pytest.mark.gpu
def test_gpu_autotuned_launches_match_torch(monkeypatch):
    # The GPU run may take its tests with HFKERN_TRITON_AUTOTUNE=0; here the
    # autotuner times every config, and whichever wins must agree with torch.
    import torch

    import hfkern
    import hfkern.nn as hnn
    import hfkern.optim as hoptim

    monkeypatch.setenv("HFKERN_TRITON_AUTOTUNE", "1")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    B, dev = 3, "cuda"
    model = torch.nn.Sequential(
        hnn.Conv2d(5, 12, 3, padding=1, B=B), hnn.Flatten(),
        hnn.LayerNorm(12 * 9 * 7, B=B), hnn.Linear(12 * 9 * 7, 4, B=B),
    ).to(dev)
    emb = hnn.Embedding(300, 12 * 9 * 7, B=B).to(dev)
    x = torch.randn(B, 6, 5, 9, 7, device=dev)
    idx = torch.randint(0, 300, (B, 6), device=dev)
    results = {}
    for backend in ("triton", "torch"):
        m = [p.detach().clone() for p in list(model.parameters()) + list(emb.parameters())]
        with hfkern.use_backend(backend):
            y = model[3](model[2](model[1](model[0](x)) + emb(idx)))
            y.square().sum().backward()
            params = list(model.parameters()) + list(emb.parameters())
            opt = hoptim.Adam(params, lr=[1e-3, 2e-3, 3e-3])
            opt.step()
        results[backend] = (y.detach(), [p.detach().clone() for p in params])
        with torch.no_grad():  # back to the start for the other backend
            for p, p0 in zip(params, m):
                p.copy_(p0)
                p.grad = None
    torch.testing.assert_close(results["triton"][0], results["torch"][0], atol=1e-4, rtol=1e-4)
    for a, b in zip(results["triton"][1], results["torch"][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
