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


def test_scheduler_resume_from_a_checkpoint_loaded_onto_the_device():
    """torch.load(map_location="cuda") brings the schedulers' float64 record of the learning rates
    onto the device; the optimizer's load_state_dict keeps it a host record, so the resumed run
    goes on from the exact learning rates (not their float32 rounding) as the uninterrupted one."""
    import io

    import hfkern.optim as HO
    from hfkern.optim import lr_scheduler as HS

    def build():
        p = torch.zeros(2, 3, device="cuda", requires_grad=True)
        opt = HO.SGD([p], lr=[0.015, 0.1])
        return p, opt, HS.StepLR(opt, step_size=1, gamma=0.3)

    def steps(p, opt, sched, n):
        for _ in range(n):
            p.grad = torch.ones_like(p)
            opt.step()
            sched.step()

    p, opt, sched = build()
    steps(p, opt, sched, 3)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    steps(p, opt, sched, 3)
    buf.seek(0)
    saved = torch.load(buf, map_location="cuda")
    p2, opt2, sched2 = build()
    with torch.no_grad():
        p2.copy_(p)  # (the parameters do not matter here: the learning rates do)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    steps(p2, opt2, sched2, 3)
    assert opt2.param_groups[0]["scheduled_lr"].device.type == "cpu"
    assert torch.equal(opt2.param_groups[0]["scheduled_lr"], opt.param_groups[0]["scheduled_lr"])
    assert torch.equal(opt2.param_groups[0]["lr"], opt.param_groups[0]["lr"])
