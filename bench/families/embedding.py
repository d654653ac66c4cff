"""Array embedding (``hfkern::array_embedding``, its dense and sparse backward ops and the renorm op).

Benchmark suite: BERT-base's word and position tables and a small language
model's token table, with the token counts of a training batch; one case draws
text-like (Zipf) indices. ``cuda``: the ops under the cuda backend (our gather
and CUB-sorted deterministic backward kernels), where that backend is available.
Baseline: ``loop``, B separate ``F.embedding`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import Family, Impl, Loop, cuda_baseline, leaf


@dataclass(frozen=True)
class EmbeddingShape:
    """One model's lookup of ``[batch, seq]`` indices in a ``[V, D]`` table.

    ``zipf``: 0 draws the indices uniformly over the table; s > 0 draws index r
    with probability proportional to ``1 / (r + 1) ** s``, as token frequencies
    of natural text roughly follow (s about 1), so a few rows are hit very often.
    """

    model: str
    layer: str
    V: int
    D: int
    batch: int
    seq: int
    quick: bool = False
    zipf: float = 0.0

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def describe(self) -> str:
        dist = f", Zipf s={self.zipf:g}" if self.zipf else ""
        return f"table {self.V}x{self.D}, idx [{self.batch}, {self.seq}] ({self.tokens} tokens{dist})"


SHAPES: list[EmbeddingShape] = [
    EmbeddingShape("bert-base", "word", 30522, 768, 32, 128, quick=True),
    EmbeddingShape("bert-base", "position", 512, 768, 32, 128),
    EmbeddingShape("lm-small", "token", 8192, 512, 16, 256, quick=True),
    # Text-like token frequencies: the most frequent row takes about 10% of the hits.
    EmbeddingShape("lm-small", "token-zipf", 8192, 512, 16, 256, quick=True, zipf=1.0),
]
SMOKE_SHAPES = [EmbeddingShape("smoke", "emb", 17, 6, 2, 5)]


def make_data(s: EmbeddingShape, B: int, dtype: torch.dtype, device, grad: bool) -> dict:
    """w: [B, V, D]; idx: [B, batch, seq] int64, uniform over the table or Zipf
    distributed (``s.zipf``); gy: [B, batch, seq, D]."""
    w = torch.randn(B, s.V, s.D, device=device, dtype=dtype)
    if s.zipf:
        p = torch.arange(1, s.V + 1, dtype=torch.float64, device=device) ** -s.zipf
        idx = torch.multinomial(p.float(), B * s.tokens, replacement=True).view(B, s.batch, s.seq)
    else:
        idx = torch.randint(0, s.V, (B, s.batch, s.seq), device=device)
    gy = torch.randn(B, s.batch, s.seq, s.D, device=device, dtype=dtype) if grad else None
    return {"B": B, "w": w, "idx": idx, "gy": gy}


def cost(s: EmbeddingShape, B: int, elem: int) -> tuple:
    t = B * s.tokens
    fwd = (8 * t + 2 * elem * t * s.D, None)  # indices, one row read per lookup, out
    bwd = (8 * t + elem * t * s.D + elem * B * s.V * s.D, None)  # indices, gy in; dense grad out
    return fwd, bwd


class HfkernEmbedding(Impl):
    kind = "backend"

    def __init__(self, s, backend: str):
        self.s = s
        self.name = self.backend = backend

    def inputs(self, d, grad):
        w = leaf(d["w"]) if grad else d["w"]
        return (w, d["idx"]), [w]

    def forward(self, args):
        w, idx = args
        return [torch.ops.hfkern.array_embedding(w, idx, -1, False, False)]


class LoopEmbedding(Loop):
    def inputs(self, d, grad):
        (ws,) = self.per_model(d, ("w",), grad)
        (idx,) = self.per_model(d, ("idx",), False)
        return (ws, idx), ws

    def forward(self, args):
        return [F.embedding(i, w) for w, i in zip(*args)]


# ---- the launchers' code paths and the op samples --------------------------------

def compile_calls():
    from hfkern.triton import embedding as emb

    B, V = 3, 50
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for D in (24, 1000):
            w = torch.randn(B, V, D, dtype=dtype)
            for idx_dtype in (torch.int64, torch.int32):
                for shared in (False, True):
                    # more hits per model than a chunk: rows of V=50 repeat past it
                    shape = (5, 30)
                    idx = torch.randint(0, V, (1 if shared else B, *shape), dtype=idx_dtype)
                    idx[..., :20] = 7
                    idx = idx.expand(B, *shape)

                    def calls(w=w, idx=idx, D=D, shape=shape):
                        emb.array_embedding(w, idx)
                        gy = torch.randn(B, *shape, D, dtype=w.dtype)
                        for scale in (False, True):
                            emb.array_embedding_backward(gy, idx, V, 3, scale)

                    yield f"embedding D={D} {idx_dtype}{' shared' if shared else ''} {dtype}", calls


def samples(device):
    def rand(*shape):
        return torch.randn(*shape, device=device)

    def idx(*shape, V, dtype=torch.int64):
        i = torch.randint(0, V, shape, device=device, dtype=dtype)
        i.view(-1)[::3] = 2  # repeated rows: hit counts above 1, and the padding row
        return i

    cases = [
        # a transposed table, indices as an array conv's output leaves them ([N, B, ...] memory)
        (rand(3, 5, 11).transpose(1, 2), idx(4, 3, 6, V=11).transpose(0, 1)),
        # B = 1, int32 indices
        (rand(1, 7, 9), idx(1, 10, V=7, dtype=torch.int32)),
        # one index tensor shared by the models (stride 0 on the array dim)
        (rand(3, 13, 4), idx(1, 2, 5, V=13).expand(3, 2, 5)),
    ]
    for w, i in cases:
        B, V, D = w.shape
        yield "array_embedding", (w, i, -1, False, False)
        gy = rand(*i.shape, 2 * D)[..., ::2]
        for padding_idx, scale in ((-1, False), (2, True)):
            yield "array_embedding_backward", (gy, i, V, padding_idx, scale)
        yield "array_embedding_sparse_backward", (gy, i, V, 2)
        yield "array_embedding_renorm_", (rand(B, V, D), i, 1.0, 2.0)


FAMILY = Family(
    name="embedding",
    summary="array embedding lookup, its dense and sparse weight gradients, and max-norm renorm",
    shapes=SHAPES,
    smoke_shapes=SMOKE_SHAPES,
    quick_directions=("fwd", "bwd"),
    make_data=make_data,
    cost=cost,
    backend_impl=HfkernEmbedding,
    baselines={"cuda": cuda_baseline(HfkernEmbedding), "loop": LoopEmbedding},
    compile_calls=compile_calls,
    samples=samples,
)
