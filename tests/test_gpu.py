"""The modules on a CUDA device against the same array on the CPU (skipped without CUDA)."""

import pytest
import torch

import hfkern
import hfkern.nn as hnn
import hfkern.nn.functional as HF

pytestmark = pytest.mark.gpu

B = 3


def _cases():
    return [
        (lambda: hnn.Conv2d(3, 8, 3, padding=1, groups=1, B=B), (4, 3, 9, 9)),
        (lambda: hnn.Conv2d(4, 8, 3, stride=2, groups=2, padding_mode="reflect", padding=1, B=B), (4, 4, 9, 9)),
        (lambda: hnn.ConvTranspose2d(4, 6, 3, stride=2, output_padding=1, B=B), (4, 4, 5, 5)),
        (lambda: hnn.Conv1d(4, 6, 3, padding="same", B=B), (4, 4, 11)),
        (lambda: hnn.Linear(7, 5, B=B), (4, 6, 7)),
        (lambda: hnn.LayerNorm(7, B=B), (4, 6, 7)),
        (lambda: hnn.RMSNorm(7, B=B), (4, 6, 7)),
        (lambda: hnn.GroupNorm(2, 4, B=B), (4, 4, 5, 5)),
        (lambda: hnn.BatchNorm2d(4, B=B), (4, 4, 5, 5)),
        (lambda: hnn.BatchNorm1d(4, B=B), (6, 4)),
        (lambda: hnn.MultiheadAttention(8, 2, batch_first=True, B=B), (4, 5, 8)),
        (lambda: hnn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, B=B), (4, 5, 8)),
    ]


def _run(module, x):
    out = module(x, x, x)[0] if isinstance(module, hnn.MultiheadAttention) else module(x)
    grads = torch.autograd.grad(out, [x] + list(module.parameters()), torch.ones_like(out))
    return out, grads


@pytest.mark.parametrize("case", range(len(_cases())))
@pytest.mark.parametrize("shared", [False, True])
def test_module_cuda_matches_cpu(case, shared):
    make, shape = _cases()[case]
    cpu = make().double()
    gpu = make().double().cuda()
    gpu.load_state_dict(cpu.state_dict())
    data = torch.randn(*shape, dtype=torch.float64) if shared else torch.randn(B, *shape, dtype=torch.float64)

    def array_input(device):
        t = data.to(device)
        return (hfkern.broadcast(t, B) if shared else t).requires_grad_()

    x_cpu, x_gpu = array_input("cpu"), array_input("cuda")
    out_c, grads_c = _run(cpu, x_cpu)
    out_g, grads_g = _run(gpu, x_gpu)
    torch.testing.assert_close(out_g.cpu(), out_c)
    for g, c in zip(grads_g, grads_c):
        torch.testing.assert_close(g.cpu(), c)


def test_embedding_and_losses_cuda():
    emb = hnn.Embedding(11, 4, padding_idx=0, B=B).cuda()
    idx = torch.randint(0, 11, (B, 5), device="cuda")
    out = emb(idx)
    loss = HF.cross_entropy(out, torch.randint(0, 4, (B, 5), device="cuda"))
    loss.sum().backward()
    ref = torch.stack([m.cuda()(idx[b]) for b, m in enumerate(emb.to_modules())])
    torch.testing.assert_close(out, ref)
    assert emb.weight.grad is not None and emb.weight.grad[:, 0].abs().sum() == 0
