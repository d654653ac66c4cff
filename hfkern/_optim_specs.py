"""The optimizer step ops, each declared once by name.

Each array optimizer's step op is declared here because three layers read the
same declaration and must never disagree on it: the op's checks and torch
implementation (hfkern/ops/optim.py), its Triton kernels (hfkern/triton/optim.py,
which may not import hfkern.ops) and the optimizer class that builds the
hyperparameter table (hfkern/optim/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["OptimizerSpec", "OPTIMIZER_SPECS", "SGD_SPEC", "ADAM_SPEC", "ADAGRAD_SPEC", "ADADELTA_SPEC",
            "RMSPROP_SPEC", "LARS_SPEC", "LAMB_SPEC", "TRUST_RATIO_SPECS", "excluded",
           "trust_subsets"]


@dataclass(frozen=True)
class OptimizerSpec:
    """The declaration of one ``hfkern::<name>_step_`` op.

    The op's arguments are ``(params, grads, *state lists, steps, hypers, *flags,
    skip)``; ``hypers`` is ``[len(rows), B]``, one row per name in ``rows``.

    ``states`` holds ``(argument, state key, when)`` per state list, in argument
    order: the op's argument name, the key the optimizer keeps the tensor under
    in ``optimizer.state[p]``, and when the list holds one tensor per parameter
    (else it is empty): ``""`` always; a flag's name: when that flag is True; a
    row's name: when any model's value of that row is non-zero (the op cannot
    read the values: it accepts either, and the lists of one row must agree).
    A row's state is model b's only while model b's own value is non-zero: a
    step in which it is 0 leaves model b's slice untouched, as torch keeps no
    such state for a model without the option (a momentum buffer switched off
    resumes as it was when switched on again; one never started is still the
    initial zeros). ``steps_when`` says the same of ``steps``; naming a row, it
    also makes each model's count count only its steps with a non-zero value
    (:attr:`counted_by`), so that a count of 0 marks state not started yet.
    ``pairs`` names the optimizer arguments that hold two rows (``betas``). A
    flag ``has_<row>`` promises that every model's ``<row>`` is 0 when False;
    the optimizer derives it from the values.
    """

    name: str
    rows: tuple[str, ...]
    states: tuple[tuple[str, str, str], ...]
    flags: tuple[str, ...]
    steps_when: str = ""
    pairs: tuple[tuple[str, tuple[str, str]], ...] = ()

    @property
    def op(self) -> str:
        return f"{self.name}_step_"

    @property
    def counted_by(self) -> str | None:
        """The row whose non-zero value a model's step count counts, or None: every update."""
        return self.steps_when if self.steps_when in self.rows else None

    @property
    def state_args(self) -> tuple[str, ...]:
        return tuple(arg for arg, _, _ in self.states)

    @property
    def args(self) -> tuple[str, ...]:
        """The op's argument names, in order."""
        return ("params", "grads", *self.state_args, "steps", "hypers", *self.flags, "skip")

    @property
    def mutated(self) -> tuple[str, ...]:
        return ("params", *self.state_args, "steps")

    def row(self, name: str) -> int:
        """The index of row ``name`` in ``hypers``."""
        if name not in self.rows:
            raise ValueError(
                f"hfkern::{self.op} has no hyperparameter row {name!r}; its rows are {list(self.rows)}"
            )
        return self.rows.index(name)

    def value_flag(self, flag: str) -> str | None:
        """The row a ``has_<row>`` flag summarizes, or None for a flag the caller sets."""
        row = flag.removeprefix("has_")
        return row if row != flag and row in self.rows else None

    @property
    def group_keys(self) -> tuple[str, ...]:
        """The optimizer's hyperparameter arguments in row order, each pair once."""
        keys: list[str] = []
        for row in self.rows:
            key = next((k for k, pair in self.pairs if row in pair), row)
            if key not in keys:
                keys.append(key)
        return tuple(keys)

    def pair(self, key: str) -> tuple[str, str] | None:
        """The two rows an optimizer argument holds, or None for a one-row argument."""
        return dict(self.pairs).get(key)


SGD_SPEC = OptimizerSpec(
    "sgd", rows=("lr", "momentum", "dampening", "weight_decay"),
    states=(("momentum_buffers", "momentum_buffer", "momentum"),),
    flags=("nesterov", "maximize", "has_weight_decay"), steps_when="momentum",
)
ADAM_SPEC = OptimizerSpec(
    "adam", rows=("lr", "beta1", "beta2", "eps", "weight_decay"),
    states=(("exp_avgs", "exp_avg", ""), ("exp_avg_sqs", "exp_avg_sq", ""),
            ("max_exp_avg_sqs", "max_exp_avg_sq", "amsgrad")),
    flags=("amsgrad", "maximize", "decoupled_weight_decay", "has_weight_decay"),
    pairs=(("betas", ("beta1", "beta2")),),
)
ADAGRAD_SPEC = OptimizerSpec(
    "adagrad", rows=("lr", "lr_decay", "weight_decay", "eps"),
    states=(("state_sums", "sum", ""),), flags=("maximize", "has_weight_decay"),
)
ADADELTA_SPEC = OptimizerSpec(
    "adadelta", rows=("lr", "rho", "eps", "weight_decay"),
    states=(("square_avgs", "square_avg", ""), ("acc_deltas", "acc_delta", "")),
    flags=("maximize", "has_weight_decay"),
)
RMSPROP_SPEC = OptimizerSpec(
    "rmsprop", rows=("lr", "alpha", "eps", "weight_decay", "momentum"),
    states=(("square_avgs", "square_avg", ""), ("grad_avgs", "grad_avg", "centered"),
            ("momentum_buffers", "momentum_buffer", "momentum")),
    flags=("centered", "maximize", "has_weight_decay"),
)
# Layer-wise adaptive optimizers: each (tensor, model) update is scaled by a trust
# ratio of two norms over that model's slice of the tensor, so a kernel makes a
# norm pass over every tile before the update (see hfkern/ops/optim.py).
LARS_SPEC = OptimizerSpec(
    "lars", rows=("lr", "momentum", "weight_decay", "trust_coefficient", "eps"),
    states=(("momentum_buffers", "momentum_buffer", "momentum"),),
    flags=("exclude_1d", "maximize", "has_weight_decay"),
)
LAMB_SPEC = OptimizerSpec(
    "lamb", rows=("lr", "beta1", "beta2", "eps", "weight_decay", "norm_min", "norm_max"),
    states=(("exp_avgs", "exp_avg", ""), ("exp_avg_sqs", "exp_avg_sq", "")),
    flags=("bias_correction", "exclude_1d", "maximize", "has_weight_decay"),
    pairs=(("betas", ("beta1", "beta2")), ("norm_bounds", ("norm_min", "norm_max"))),
)
TRUST_RATIO_SPECS = (LARS_SPEC, LAMB_SPEC)
OPTIMIZER_SPECS = (SGD_SPEC, ADAM_SPEC, ADAGRAD_SPEC, ADADELTA_SPEC, RMSPROP_SPEC, LARS_SPEC, LAMB_SPEC)


def excluded(p, exclude_1d: bool) -> bool:
    """Whether parameter ``p`` (``[B, ...]``) of a trust-ratio step is excluded from the
    ratio and weight decay: with ``exclude_1d``, when each model's slice has at most one
    dim (``[B]`` or ``[B, n]``: biases, normalization weights)."""
    return bool(exclude_1d) and p.dim() <= 2


def trust_subsets(spec: OptimizerSpec, args: Sequence[Any]) -> list[tuple[tuple, bool]]:
    """A trust-ratio op's arguments split into the parameters it adapts and those that
    ``exclude_1d`` excludes (each with its own lists), with whether the subset is adapted."""
    n = len(spec.states)
    flags = dict(zip(spec.flags, args[4 + n : -1]))
    params = args[0]
    out = []
    for trust in (True, False):
        index = [i for i, p in enumerate(params) if excluded(p, flags["exclude_1d"]) != trust]
        if not index:
            continue
        if len(index) == len(params):
            out.append((tuple(args), trust))
            continue
        lists = [[lst[i] for i in index] if lst else [] for lst in (args[0], args[1], *args[2 : 3 + n])]
        out.append(((*lists, *args[3 + n :]), trust))
    return out
