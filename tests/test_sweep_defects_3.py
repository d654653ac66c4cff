"""The sweep runner's fixes of the third round of defects:

1. a resumed sweep refills a slot with the default of every per-model optimizer and scheduler
   argument an earlier trial of the array gave (the checkpoint keeps which: ``_Args.given``),
   as the uninterrupted sweep does; older checkpoints too;
2. with ``B=None`` and a custom ``loss``, the array is sized with a step of that loss;
3. ``hp[seed_param]`` holds each trial's seed exactly (int64), also above 2**24;
4. ``seed``, ``device``, ``checkpoint``, ``progress`` and ``name`` are checked by the constructor;
5. ``best_trials_table``'s docstring says what its columns are.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hfkern
from _util import import_sweep_extra

optuna = import_sweep_extra()  # before everything that imports it
import _sweep_cases as cases  # noqa: E402
import hfkern.sweep as hs  # noqa: E402
from hfkern.optim import lr_scheduler as H  # noqa: E402
from hfkern.sweep._storage import SEED_ATTR  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
torch.set_num_threads(1)


def new_study(pruner=None) -> optuna.Study:
    return optuna.create_study(direction="minimize", sampler=optuna.samplers.RandomSampler(0),
                               pruner=pruner or optuna.pruners.NopPruner())


def valid_loss(model, hp) -> torch.Tensor:
    """The built-in "loss" metric, as a metric callable."""
    _, (xv, yv) = cases.data()
    return hfkern.nn.functional.cross_entropy(model(hfkern.broadcast(xv, model.B)), yv).double()


# ---- 1. a resumed sweep resets the arguments of a refilled slot ------------------------------------

class PruneTrial0AtReport2(optuna.pruners.BasePruner):
    def prune(self, study, trial) -> bool:
        return trial.number == 0 and max(trial.intermediate_values, default=0) >= 2


class Killed(BaseException):
    """Stands for the process's death."""


def kill_after_round_2_reports(runner) -> None:
    """Run ``runner`` until it dies after round 2's reports (trial 0 told pruned, its slot free),
    before that round's refill and checkpoint; the dead process tells the study nothing more."""
    runner._fail = lambda *a, **k: None
    rounds = []
    refill = runner._refill

    def refill_or_die(a):
        rounds.append(1)
        if len(rounds) == 2:
            raise Killed
        refill(a)

    runner._refill = refill_or_die
    with pytest.raises(Killed):
        runner.run(n_trials=3)


def conditional_study(extra: str, value: float) -> optuna.Study:
    """Trial 0 gives ``extra`` (and is pruned at report 2), trials 1 and 2 do not: trial 2 takes
    trial 0's slot."""
    study = new_study(PruneTrial0AtReport2())
    study.enqueue_trial({"lr": 0.1, "momentum": 0.8, extra: value})
    study.enqueue_trial({"lr": 0.1, "momentum": 0.2})
    study.enqueue_trial({"lr": 0.1, "momentum": 0.3})
    return study


def conditional_space(extra: str):
    def space(trial):
        p = {"lr": trial.suggest_float("lr", 0.02, 0.2), "momentum": trial.suggest_float("momentum", 0.0, 0.9)}
        if p["momentum"] > 0.45:
            p[extra] = trial.suggest_float(extra, 0.2, 0.9)
        return p
    return space


def weight_decay_case():
    kw = dict(space=conditional_space("weight_decay"), fusible=["lr", "momentum", "weight_decay"], B=2,
              metric=valid_loss, name="r")

    def alone(t):
        def sgd(p, params):
            return torch.optim.SGD(params, lr=p["lr"], momentum=p["momentum"], weight_decay=p.get("weight_decay", 0))
        return cases.train_alone(t.params, t.user_attrs[SEED_ATTR], optimizer=sgd)

    return "weight_decay", 0.5, kw, alone


def gamma_case():
    kw = dict(space=conditional_space("gamma"), fusible=["lr", "momentum", "gamma"], B=2, metric=valid_loss,
              name="r", scheduler=H.StepLR,
              scheduler_kwargs=lambda p: {"step_size": 1, **({"gamma": p["gamma"]} if "gamma" in p else {})})

    def alone(t):
        gamma = t.params.get("gamma", 0.1)
        return cases.train_alone(t.params, t.user_attrs[SEED_ATTR],
                                 scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma))

    return "gamma", 0.9, kw, alone


def check_resumed_against_uninterrupted(tmp_path, case, older_format: bool = False) -> None:
    extra, value, kw, alone = case()
    reference = conditional_study(extra, value)
    cases.runner(reference, **kw).run(n_trials=3)

    ckpt = tmp_path / "runner.pt"
    study = conditional_study(extra, value)
    kill_after_round_2_reports(cases.runner(study, checkpoint=ckpt, **kw))
    assert [t.state for t in study.trials] == [TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING]
    saved = torch.load(ckpt, weights_only=False)
    given = "optimizer_given" if extra == "weight_decay" else "scheduler_given"
    assert extra in saved["arrays"][0][given]  # trial 0 gave it: its row stays in the checkpoint
    if older_format:  # as a checkpoint of format 3 (no given arguments) holds it
        saved["version"] = 3
        for a in saved["arrays"]:
            del a["optimizer_given"], a["scheduler_given"]
        torch.save(saved, ckpt)
    summary = cases.runner(study, checkpoint=ckpt, **kw).run(n_trials=3)
    assert summary.completed == 2
    for want, got in zip(reference.trials, study.trials):
        assert got.params == want.params and got.state == want.state
        cases.assert_close_curves(cases.curve(got), cases.curve(want), f"trial {got.number} resumed vs uninterrupted",
                                  rel=1e-5)
        full = alone(got)
        cases.assert_close_curves(cases.curve(got), full[:len(got.intermediate_values)],
                                  f"trial {got.number} resumed vs alone")
    # Trial 2 gives no extra: it trains with the default, not with trial 0's value it replaced.
    assert extra not in study.trials[2].params


@pytest.mark.parametrize("case", [weight_decay_case, gamma_case], ids=["optimizer", "scheduler"])
def test_a_resumed_sweep_refills_a_slot_with_the_defaults_of_the_previous_trials_arguments(tmp_path, case):
    check_resumed_against_uninterrupted(tmp_path, case)


@pytest.mark.parametrize("case", [weight_decay_case, gamma_case], ids=["optimizer", "scheduler"])
def test_a_checkpoint_of_format_3_resumes_with_every_argument_of_its_state_given(tmp_path, case):
    check_resumed_against_uninterrupted(tmp_path, case, older_format=True)


# ---- 2. B=None sizes the array with the runner's own loss --------------------------------------------

def bce_problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 6, generator=g)
    y = (x[:, 0] > 0).float()  # float targets [N] for outputs [N, 1]: the default sizing step's MSE rejects them

    def model(p):
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))

    def loss(out, t, hp):
        return torch.nn.functional.binary_cross_entropy_with_logits(
            out.squeeze(-1), t.expand(out.shape[0], -1), reduction="none").mean(1)

    return x, y, model, loss


class LogitsAndAux(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, z):
        o = self.lin(z)
        return o, o.square().mean(-1)


def tuple_problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 6, generator=g)
    y = (x[:, 0] > 0).long()

    def loss(out, t, hp):  # a model returning (logits, aux): the default sizing step takes one tensor
        logits, aux = out
        return hfkern.nn.functional.cross_entropy(logits, t) + 0.01 * aux.mean(-1)

    return x, y, lambda p: LogitsAndAux(), loss


@pytest.mark.parametrize("problem", [bce_problem, tuple_problem], ids=["bce", "tuple-output"])
def test_b_none_with_a_custom_loss_is_sized_with_that_loss_and_trains_as_b_2(problem):
    x, y, model, loss = problem()

    def metric(m, hp):
        out = m(hfkern.broadcast(x, m.B))
        out = out[0] if isinstance(out, tuple) else out
        return out.float().square().mean(dim=tuple(range(1, out.dim()))).double()

    curves = {}
    for B in (2, None):
        study = new_study()
        runner = hs.Runner(study, lambda t: {"lr": t.suggest_float("lr", 0.01, 0.1)}, model, fusible=["lr"],
                           train=(x, y), batch_size=16, epochs=1, optimizer=hfkern.optim.SGD, loss=loss,
                           metric=metric, B=B, progress=False, report_every=4)
        summary = runner.run(n_trials=2)
        assert summary.completed == 2 and summary.failed == 0, (B, summary)
        assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
        curves[B] = [cases.curve(t) for t in study.trials]
    assert runner.B == 2  # sized: at most n_trials
    for got, want in zip(curves[None], curves[2]):
        cases.assert_close_curves(got, want, "B=None vs B=2", rel=1e-6)


def test_sizing_runs_the_runners_loss_with_hp():
    x, y, model, loss = bce_problem()
    seen = []

    def watched(out, t, hp):
        seen.append((out.shape[0], sorted(hp), hp["seed"].dtype, [hp["lr"].shape[0]]))
        return loss(out, t, hp)

    runner = hs.Runner(new_study(), lambda t: {"lr": t.suggest_float("lr", 0.01, 0.1)}, model, fusible=["lr"],
                       train=(x, y), batch_size=16, epochs=1, optimizer=hfkern.optim.SGD, loss=watched,
                       metric=lambda m, hp: torch.zeros(m.B, dtype=torch.float64), B=None, progress=False)
    runner.run(n_trials=2)
    sized = {B for B, *_ in seen}
    assert {2, 4, 8} <= sized  # max_array_size's sizes ran the user's loss
    assert all(keys == ["lr", "seed"] and dtype == torch.int64 and n == [B] for B, keys, dtype, n in seen)


# ---- 3. hp holds each trial's seed exactly --------------------------------------------------------

def seen_seeds(runner) -> list[list[int]]:
    seen = []
    loss = runner._loss

    def watched(out, target, hp):
        seen.append((hp["seed"].dtype, hp["seed"].tolist()))
        return loss(out, target, hp)

    runner._loss = watched
    return seen


def seed_space(seeds):
    """A space that adds trial n's seed parameter ``seeds[n]`` as a fixed value (Optuna's suggest_int
    holds its values as float64, which rounds above 2**53)."""
    def space(trial):
        return {**cases.space(trial), "seed": seeds[trial.number]}
    return space


def test_large_seed_parameters_reach_hp_exactly():
    seeds = [2**40 + 1, 2**40 + 2, 2**62 + 3]  # float32 would round them (the first two to the same value)
    study = new_study()
    runner = cases.runner(study, space=seed_space(seeds), B=3)
    seen = seen_seeds(runner)
    assert runner.run(n_trials=3).completed == 3
    assert seen and all(dtype == torch.int64 and values == seeds for dtype, values in seen)
    for t, s in zip(study.trials, seeds):
        assert t.user_attrs[SEED_ATTR] == s
        cases.assert_close_curves(cases.curve(t), cases.train_alone(t.params, s), f"trial {t.number}")


def test_the_largest_runner_seed_reaches_hp_exactly():
    seed = 2**63 - 2**32  # the largest seed the runner takes
    study = new_study()
    runner = cases.runner(study, seed=seed, B=2)
    seen = seen_seeds(runner)
    assert runner.run(n_trials=2).completed == 2
    assert all(values == [seed, seed + 1] for _, values in seen)
    for t in study.trials:
        assert t.user_attrs[SEED_ATTR] == seed + t.number
        cases.assert_close_curves(cases.curve(t), cases.train_alone(t.params, seed + t.number), f"trial {t.number}")


def test_hp_seeds_stay_exact_in_a_refilled_slot():
    study = new_study(cases.PruneNumbers([0]))
    seeds = [2**50 + 1, 2**50 + 3, 2**50 + 5]
    runner = cases.runner(study, space=seed_space(seeds), B=2)
    seen = seen_seeds(runner)
    runner.run(n_trials=3)
    assert [2**50 + 5, 2**50 + 3] in [values for _, values in seen]  # trial 2 in trial 0's slot
    t2 = study.trials[2]
    cases.assert_close_curves(cases.curve(t2), cases.train_alone(t2.params, seeds[2]), "trial 2")


@pytest.mark.parametrize("value, match", [
    (2**63, r"seed parameter 'seed' must be in \[-2\*\*63, 2\*\*63\).*got 9223372036854775808 "
            r"\(-9223372036854775808 is torch's same seed\)"),
    (-(2**63) - 1, r"seed parameter 'seed' must be in \[-2\*\*63, 2\*\*63\)"),
    (3.5, r"seed parameter 'seed' must be an integer seed, got 3.5"),
    (math.inf, r"seed parameter 'seed' must be an integer seed, got inf"),
])
def test_a_seed_parameter_hp_cannot_hold_fails_its_trial_with_a_value_error(value, match):
    study = new_study()
    with pytest.raises(ValueError, match=match):
        cases.runner(study, space=seed_space([value]), B=2).run(n_trials=1)
    assert [t.state for t in study.trials] == [TrialState.FAIL]


# ---- 4. the constructor's argument checks -----------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(seed=2**64), ValueError, r"seed must be in \[-2\*\*63, 2\*\*63 - 2\*\*32\], got 18446744073709551616"),
    (dict(seed=2**64 - 1), ValueError, r"seed must be in \[-2\*\*63, 2\*\*63 - 2\*\*32\]"),
    (dict(seed=-(2**63) - 1), ValueError, r"seed must be in \[-2\*\*63, 2\*\*63 - 2\*\*32\]"),
    (dict(seed=2**63 - 2**32 + 1), ValueError, r"seed \+ n.*trial numbers up to 2\*\*32"),
    (dict(device="meta"), ValueError, r"device must be a 'cpu' or 'cuda' device .*got meta"),
    (dict(checkpoint=5), TypeError, r"checkpoint must be a file path \(a str or os.PathLike of a str\) or None, "
                                    r"got int 5"),
    (dict(checkpoint=b"runner.pt"), TypeError, r"checkpoint must be a file path .*got bytes"),
    (dict(checkpoint=""), ValueError, r"checkpoint must be a file path or None, got an empty path"),
    (dict(progress="no"), TypeError, r"progress must be a bool, got str 'no'"),
    (dict(progress=1), TypeError, r"progress must be a bool, got int 1"),
    (dict(capture=1), TypeError, r"capture must be a bool, got int 1"),
    (dict(name=5), TypeError, r"name must be a str or None, got int 5"),
])
def test_bad_constructor_arguments_raise_before_any_trial(kwargs, error, match):
    study = new_study()
    with pytest.raises(error, match=match):
        cases.runner(study, **kwargs)
    assert study.trials == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_index_past_the_devices_is_a_value_error():
    with pytest.raises(ValueError, match="expected an index in"):
        cases.runner(new_study(), device=f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize("seed", [-(2**63), 2**63 - 2**32, 0])
def test_seeds_at_the_limits_are_taken(seed, tmp_path):
    import pathlib

    runner = cases.runner(new_study(), seed=seed, checkpoint=pathlib.Path(tmp_path / "r.pt"), progress=False)
    assert runner.seed == seed and runner.checkpoint == str(tmp_path / "r.pt")


def test_the_smallest_seed_trains():
    study = new_study()
    assert cases.runner(study, seed=-(2**63), B=1).run(n_trials=1).completed == 1
    t = study.trials[0]
    cases.assert_close_curves(cases.curve(t), cases.train_alone(t.params, -(2**63)), "trial 0")


# ---- 5. best_trials_table's docstring --------------------------------------------------------------

def test_best_trials_table_has_the_columns_its_docstring_names():
    pytest.importorskip("rich")
    study = new_study()
    cases.runner(study, B=2).run(n_trials=2)
    table = hs.best_trials_table(study)
    assert [c.header for c in table.columns] == ["trial", "value", "lr", "momentum"]
    doc = hs.best_trials_table.__doc__
    assert "steps" not in doc and "number, value, parameters" in doc
    assert math.isfinite(study.best_value)
