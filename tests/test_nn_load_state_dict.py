"""Array modules' load_state_dict is all or nothing: a failed load changes nothing."""

import copy

import pytest
import torch

import hfkern.nn as hnn
from hfkern.nn import StateDictError

B = 3

# (name, factory, one array input): every hfkern.nn module with parameters or buffers.
MODULES = [
    ("Linear", lambda: hnn.Linear(5, 3, B=B), lambda: torch.randn(B, 4, 5)),
    ("Conv1d", lambda: hnn.Conv1d(2, 3, 3, B=B), lambda: torch.randn(B, 4, 2, 9)),
    ("Conv2d", lambda: hnn.Conv2d(2, 3, 3, padding=1, B=B), lambda: torch.randn(B, 2, 2, 7, 6)),
    ("ConvTranspose1d", lambda: hnn.ConvTranspose1d(2, 3, 3, stride=2, B=B), lambda: torch.randn(B, 2, 2, 5)),
    ("ConvTranspose2d", lambda: hnn.ConvTranspose2d(2, 3, 3, stride=2, B=B), lambda: torch.randn(B, 2, 2, 4, 5)),
    ("LayerNorm", lambda: hnn.LayerNorm(6, B=B), lambda: torch.randn(B, 4, 6)),
    ("RMSNorm", lambda: hnn.RMSNorm(6, B=B), lambda: torch.randn(B, 4, 6)),
    ("GroupNorm", lambda: hnn.GroupNorm(2, 4, B=B), lambda: torch.randn(B, 3, 4, 5)),
    ("BatchNorm1d", lambda: hnn.BatchNorm1d(4, B=B), lambda: torch.randn(B, 6, 4)),
    ("BatchNorm2d", lambda: hnn.BatchNorm2d(4, B=B), lambda: torch.randn(B, 3, 4, 5, 5)),
    ("Embedding", lambda: hnn.Embedding(7, 3, B=B), lambda: torch.randint(0, 7, (B, 5))),
    ("PReLU", lambda: hnn.PReLU(3, B=B), lambda: torch.randn(B, 4, 3)),
    ("MultiheadAttention", lambda: hnn.MultiheadAttention(6, 2, add_bias_kv=True, B=B),
     lambda: torch.randn(B, 5, 2, 6)),
    ("TransformerEncoderLayer", lambda: hnn.TransformerEncoderLayer(6, 2, 10, dropout=0.0, B=B),
     lambda: torch.randn(B, 5, 2, 6)),
]
IDS = [m[0] for m in MODULES]


def _forward(module, x):
    if isinstance(module, hnn.MultiheadAttention):
        return module(x, x, x)[0]
    return module(x)


def _new_values(module):
    """A loadable state dict whose every entry differs from the module's."""
    return {k: (torch.randn_like(v) if v.is_floating_point() else v + 1)
            for k, v in module.state_dict().items()}


def _last_param_key(module):
    return [k for k, p in module.named_parameters() if p.requires_grad][-1]


def _break(kind, module, sd):
    """(bad state dict, assign, key the error names) for one kind of failure.

    Every entry but the broken one is valid and new, so a load that copies
    entry by entry and stops (or raises) at the broken one shows.
    """
    key = list(sd)[-1]
    v = sd[key]
    if kind == "shape":
        sd[key] = v.new_zeros(*v.shape[:-1], v.shape[-1] + 1)
    elif kind == "B":
        sd[key] = torch.cat([v, v[:1]])
    elif kind == "missing":
        key = list(sd)[0]  # not the last: BatchNorm may lack its last, num_batches_tracked
        del sd[key]
    elif kind == "unexpected":
        key = "not_a_module.weight"
        sd[key] = torch.zeros(1)
    elif kind == "not_tensor":
        sd[key] = v.tolist()
    elif kind == "meta":
        sd[key] = v.to("meta")
    elif kind == "sparse":
        sd[key] = v.to_sparse()
    elif kind == "assign_int":
        key = _last_param_key(module)
        sd[key] = sd[key].round().long()
        return sd, True, key
    else:
        raise ValueError(kind)
    return sd, False, key


KINDS = ["shape", "B", "missing", "unexpected", "not_tensor", "meta", "sparse", "assign_int"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("name,factory,make_input", MODULES, ids=IDS)
def test_failed_load_changes_nothing(name, factory, make_input, strict, kind):
    if kind in ("missing", "unexpected") and not strict:
        pytest.skip("not an error without strict")
    module = factory()
    reference = copy.deepcopy(module)  # what the module must still be after the failed load
    before = {k: v.clone() for k, v in module.state_dict().items()}
    tensors = {k: v for k, v in module.state_dict(keep_vars=True).items()}
    good = _new_values(module)
    bad, assign, key = _break(kind, module, dict(good))

    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict") as info:
        module.load_state_dict(bad, strict=strict, assign=assign)
    assert isinstance(info.value, ValueError)  # hfkern's bad-input type, too
    assert key in str(info.value)
    if kind == "B":
        assert f"holds {B + 1} models" in str(info.value) and f"B={B}" in str(info.value)

    after = module.state_dict(keep_vars=True)
    assert list(after) == list(before)
    for k, v in after.items():
        assert v is tensors[k], f"{k} was replaced"
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), f"{k} changed"
    x = make_input()
    torch.testing.assert_close(_forward(module, x), _forward(reference, x), rtol=0, atol=0)
    torch.testing.assert_close(module.state_dict(), reference.state_dict(), rtol=0, atol=0)

    # the valid dict still loads, all of it
    result = module.load_state_dict(good, strict=strict, assign=assign and kind != "assign_int")
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    for k, v in module.state_dict().items():
        assert torch.equal(v, good[k].to(v.dtype)), k


@pytest.mark.parametrize("name,factory,make_input", MODULES, ids=IDS)
def test_failed_load_reports_every_problem_at_once(name, factory, make_input):
    module = factory()
    sd = _new_values(module)
    keys = list(sd)
    first, gone = keys[0], keys[1] if len(keys) > 1 else None
    sd[first] = sd[first][:-1]  # B - 1 models
    sd["stray"] = torch.zeros(2)
    if gone is not None:
        del sd[gone]
    before = copy.deepcopy(module.state_dict())
    with pytest.raises(StateDictError) as info:
        module.load_state_dict(sd)
    msg = str(info.value)
    assert f"size mismatch for {first}" in msg and f"holds {B - 1} models" in msg
    assert 'Unexpected key(s) in state_dict: "stray"' in msg
    if gone is not None:
        assert f'Missing key(s) in state_dict: "{gone}"' in msg
    torch.testing.assert_close(module.state_dict(), before, rtol=0, atol=0)


def test_keys_checked_as_torch_walks_them():
    # A submodule's entries are checked under its prefix, as torch walks them;
    # an entry for a child that does not exist is unexpected.
    layer = hnn.TransformerEncoderLayer(6, 2, 10, dropout=0.0, B=2)
    sd = layer.state_dict()
    bad = dict(sd)
    bad["self_attn.out_proj.weight"] = bad["self_attn.out_proj.weight"][:, :, :-1]
    bad["linear1.weight"] = torch.randn_like(bad["linear1.weight"])
    with pytest.raises(StateDictError, match=r"size mismatch for self_attn\.out_proj\.weight: expected "
                                             r"shape \[2, 6, 6\] \(B=2 models of \[6, 6\]\), got \[2, 6, 5\]"):
        layer.load_state_dict(bad)
    torch.testing.assert_close(layer.state_dict(), sd, rtol=0, atol=0)
    with pytest.raises(StateDictError, match='Unexpected key.*"linear3.weight"'):
        layer.load_state_dict(dict(sd, **{"linear3.weight": torch.zeros(1)}))
    assert layer.load_state_dict(dict(sd, **{"linear3.weight": torch.zeros(1)}), strict=False) \
        .unexpected_keys == ["linear3.weight"]
    # modules without state, and a state dict that is no mapping, as torch
    with pytest.raises(StateDictError, match='Unexpected key.*"weight"'):
        hnn.Dropout(0.5, B=2).load_state_dict({"weight": torch.zeros(2)})
    with pytest.raises(TypeError, match="dict-like"):
        hnn.Linear(2, 2, B=2).load_state_dict([("weight", torch.zeros(2, 2, 2))])
