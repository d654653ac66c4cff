"""Embedding: out-of-range indices raise IndexError, in eager mode and under torch.compile alike."""

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
