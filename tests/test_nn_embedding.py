"""Embedding: out-of-range indices fail as torch.nn.functional.embedding does on each device (IndexError
on the CPU, a device-side assertion on CUDA), in eager mode and under torch.compile alike."""

import pytest
import torch
from torch import nn

import hfkern
from hfkern.nn.embedding import Embedding
from hfkern.ops.embedding import embedding_checked_indices

V, D = 7, 3


def _bad_inputs(B):
    """(indices, index the error names, where) per kind of bad input."""
    per_model = torch.randint(0, V, (B, 4, 5))
    too_big = per_model.clone()
    too_big[B - 1, 2, 3] = V
    negative = per_model.clone()
    negative[0, 1, 1] = -2
    shared = torch.randint(0, V, (4, 5))
    shared[3, 4] = V + 4
    return [(too_big, V, f"model {B - 1}'s input"), (negative, -2, "model 0's input"),
            (hfkern.broadcast(shared, B), V + 4, "the shared input"),
            (too_big.to(torch.int32), V, f"model {B - 1}'s input")]


def _check_raises(fn, B):
    for idx, bad, where in _bad_inputs(B):
        with pytest.raises(IndexError, match=rf"Embedding: index {bad} in {where} is out of range: "
                                             rf"expected indices in \[0, {V}\)"):
            fn(idx)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_out_of_range_is_index_error_eager_and_compiled(backend, max_norm):
    # IndexError is what torch's own eager lookup raises on CPU; the array
    # raises it (with the index and the model) in eager mode and compiled.
    with pytest.raises(IndexError):
        nn.Embedding(V, D)(torch.tensor([V]))
    B = 3
    torch._dynamo.reset()
    emb = Embedding(V, D, max_norm=max_norm, B=B)
    compiled = torch.compile(emb, fullgraph=True, backend=backend)
    before = emb.weight.detach().clone()
    _check_raises(emb, B)
    _check_raises(compiled, B)
    assert torch.equal(emb.weight, before)  # nothing looked up, nothing renormalized
    # valid indices still look up what B torch embeddings look up, forward and backward
    mods = emb.to_modules()
    for idx in (torch.randint(0, V, (B, 4, 5)), hfkern.broadcast(torch.randint(0, V, (4, 5)), B)):
        y = compiled(idx)
        expected = torch.stack([m(idx[b]) for b, m in enumerate(mods)])
        torch.testing.assert_close(y, expected)
        g = torch.randn_like(y)
        (grad,) = torch.autograd.grad(y, emb.weight, g)
        for b, m in enumerate(mods):
            (ref,) = torch.autograd.grad(m(idx[b]), m.weight, g[b])
            torch.testing.assert_close(grad[b], ref)


def test_checked_indices_op():
    values = torch.randint(0, V, (3, 4))
    torch.library.opcheck(embedding_checked_indices, (values, V, False, "Embedding"))
    out = embedding_checked_indices(values, V, False, "Embedding")
    assert torch.equal(out, values) and out.data_ptr() != values.data_ptr()
    with pytest.raises(IndexError, match=r"index 9 in the shared input"):
        embedding_checked_indices(torch.tensor([1, 9]), V, True, "Embedding")


# ---- the check as it runs on CUDA: a device-side assertion, no host read ---------------------

@pytest.fixture
def asserted_on_cpu(monkeypatch):
    """The CUDA form of the check (torch._assert_async), run on the CPU where its condition can
    be tested; the assertion raises RuntimeError there at once."""
    from hfkern.ops import embedding

    monkeypatch.setattr(embedding, "_ASSERTED_ON", embedding._ASSERTED_ON | {"cpu"})


@pytest.mark.parametrize("compiled", [False, True])
def test_device_side_form_of_the_check(asserted_on_cpu, compiled):
    B = 3
    torch._dynamo.reset()
    emb = Embedding(V, D, B=B)
    run = torch.compile(emb, fullgraph=True, backend="aot_eager") if compiled else emb
    before = emb.weight.detach().clone()
    for idx, _, _ in _bad_inputs(B):
        with pytest.raises(RuntimeError, match=rf"Embedding: an index is out of range \[0, {V}\)"):
            run(idx)
    assert torch.equal(emb.weight, before)
    edges = torch.tensor([[0, V - 1], [V - 1, 0], [3, 3]])  # the range's ends pass
    mods = emb.to_modules()
    torch.testing.assert_close(run(edges), torch.stack([m(edges[b]) for b, m in enumerate(mods)]))


@pytest.mark.gpu
def test_gpu_index_check_does_not_synchronize():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    B = 3
    emb = Embedding(V, D, B=B).cuda()
    inputs = [torch.randint(0, V, (B, 4, 5), device="cuda"),
              hfkern.broadcast(torch.randint(0, V, (4, 5), device="cuda"), B)]
    for idx in inputs:
        emb(idx)  # first calls: allocations, kernel loads
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [emb(idx) for idx in inputs]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mods = emb.to_modules()
    for idx, out in zip(inputs, outs):
        torch.testing.assert_close(out, torch.stack([m(idx[b]) for b, m in enumerate(mods)]))


@pytest.mark.gpu
def test_gpu_out_of_range_fails_a_device_side_assertion():
    """As torch.nn.functional.embedding does on CUDA; run in a process of its own, whose CUDA
    context the assertion leaves unusable."""
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    code = (
        "import torch, hfkern\n"
        f"emb = hfkern.nn.Embedding({V}, {D}, B=2).cuda()\n"
        f"idx = torch.tensor([[0, 1], [2, {V}]], device='cuda')\n"
        "emb(idx)\n"
        "torch.cuda.synchronize()\n"
        "print('no error')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "no error" not in done.stdout
    assert "device-side assert" in done.stderr or "Assertion" in done.stderr, done.stderr[-2000:]
