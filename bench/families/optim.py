"""Array optimizer steps (``hfkern::sgd_step_``, ``adam_step_``, ``adagrad_step_``,
``adadelta_step_``, ``rmsprop_step_``, ``lars_step_``, ``lamb_step_``) and ``nonfinite_models``.

No kernel-benchmark suite: bench/bench_optim.py benchmarks the optimizers on
whole models' parameter lists.
"""

from __future__ import annotations

import torch

from hfkern._optim_specs import OPTIMIZER_SPECS

from . import Family

# Each step op's declaration: its flag arguments (in signature order, after
# ``hypers``), its hyperparameter rows and when each state list is present.
_SPECS = {spec.op: spec for spec in OPTIMIZER_SPECS}
_FLAGS = {op: spec.flags for op, spec in _SPECS.items()}
_HYPER_ROWS = {op: spec.rows for op, spec in _SPECS.items()}


def _step_args(op: str, params, grads, flags: dict, momentum: bool, hypers, state_dtype):
    """The step op's arguments up to ``hypers``, state zeroed in the parameters' layouts."""
    spec = _SPECS[op]
    present = {**flags, "momentum": momentum, "": True}  # a list's condition: a flag, a row, or always
    states = [[torch.zeros_like(p, dtype=state_dtype) for p in params] if present[when] else []
              for _, _, when in spec.states]
    steps = [torch.zeros(p.size(0), device=p.device) for p in params] if present[spec.steps_when] else []
    return (params, grads, *states, steps, hypers)


def compile_calls():
    from hfkern.triton import optim

    B = 3
    flag_sets = {
        "sgd_step_": [dict(nesterov=n, maximize=m, has_weight_decay=wd, momentum=mo)
                      for n, m, wd, mo in [(False, False, False, False), (False, False, True, True),
                                           (True, True, True, True)]],
        "adam_step_": [dict(amsgrad=a, maximize=m, decoupled_weight_decay=d, has_weight_decay=wd)
                       for a, m, d, wd in [(False, False, False, False), (True, True, False, True),
                                           (False, False, True, True)]],
        "adagrad_step_": [dict(maximize=m, has_weight_decay=wd) for m, wd in [(False, False), (True, True)]],
        "adadelta_step_": [dict(maximize=m, has_weight_decay=wd) for m, wd in [(False, False), (True, True)]],
        "rmsprop_step_": [dict(centered=c, maximize=m, has_weight_decay=wd, momentum=mo)
                          for c, m, wd, mo in [(False, False, False, False), (True, True, True, True)]],
        # exclude_1d: the [B] parameter is launched apart, without the norm pass
        "lars_step_": [dict(exclude_1d=e, maximize=m, has_weight_decay=wd, momentum=mo)
                       for e, m, wd, mo in [(False, False, False, False), (True, True, True, True)]],
        "lamb_step_": [dict(bias_correction=bc, exclude_1d=e, maximize=m, has_weight_decay=wd)
                       for bc, e, m, wd in [(False, False, False, False), (True, True, True, True)]],
    }
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        state = torch.float64 if dtype == torch.float64 else torch.float32
        for op, flag_list in flag_sets.items():
            for flags in flag_list:
                for skip in (None, torch.zeros(B, dtype=torch.bool)):
                    params = [torch.randn(B, 37, 11, dtype=dtype), torch.randn(B, dtype=dtype)]
                    grads = [torch.randn_like(p) for p in params]
                    f = dict(flags)
                    momentum = f.pop("momentum", False)
                    hypers = torch.rand(len(_HYPER_ROWS[op]), B, dtype=state)
                    args = _step_args(op, params, grads, f, momentum, hypers, state)
                    step = getattr(optim, op)

                    def calls(step=step, args=args, f=f, skip=skip):
                        step(*args, *f.values(), skip)

                    label = ",".join(k for k, v in flags.items() if v) or "plain"
                    skipping = " skip" if skip is not None else ""
                    yield f"{op.removesuffix('_step_')} [{label}]{skipping} {dtype}", calls
        yield f"nonfinite_models {dtype}", lambda dtype=dtype: optim.nonfinite_models(
            [torch.randn(B, 37, 11, dtype=dtype), torch.randn(B, dtype=dtype)])


def samples(device):
    def params_grads(B):
        # odd sizes, a [B] parameter, and a parameter whose per-model slice is
        # dense but not row-major, with a gradient in yet another layout
        params = [torch.randn(B, 7, 5, device=device), torch.randn(B, device=device),
                  torch.randn(B, 3, 9, device=device).transpose(1, 2)]
        grads = [torch.randn(7, B, 5, device=device).transpose(0, 1), torch.randn(B, device=device),
                 torch.randn(B, 9, 3, device=device)]
        return params, grads

    for op, flags in _FLAGS.items():
        for B, on, momentum, skip in ((3, False, False, None), (1, True, True, None),
                                      (3, True, True, [False, True, False])):
            params, grads = params_grads(B)
            f = dict.fromkeys(flags, on)
            # hyperparameters in the ranges they take (betas, rho, alpha and momentum below 1, eps
            # above 0); zero where a flag promises it, as the optimizers pass them
            rows = _HYPER_ROWS[op]
            hypers = 0.05 + 0.5 * torch.rand(len(rows), B, device=device)
            for row, kept in (("weight_decay", on), ("momentum", momentum)):
                if row in rows and not kept:
                    hypers[rows.index(row)] = 0
            args = _step_args(op, params, grads, f, momentum, hypers, torch.float32)
            mask = None if skip is None else torch.tensor(skip, device=device)
            yield op, (*args, *f.values(), mask)
    params, grads = params_grads(3)
    grads[1][1] = float("inf")
    grads[2][2, 1, 1] = float("nan")
    yield "nonfinite_models", (grads,)
    yield "nonfinite_models", (params_grads(1)[1],)


FAMILY = Family(
    name="optim",
    summary="array optimizer steps (SGD, Adam/AdamW, Adagrad, Adadelta, RMSprop, LARS, LAMB) and the non-finite check",
    compile_calls=compile_calls,
    samples=samples,
)
