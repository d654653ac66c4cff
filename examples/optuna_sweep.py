"""An Optuna sweep of the digits CNN, trained B trials at a time as one fused array.

64 trials of the CNN of ``examples/digits_sweep.py`` on scikit-learn's bundled
digits search SGD's learning rate, momentum and weight decay for the best
validation accuracy, with Optuna's random sampler and median pruner.
``hfkern.sweep.Runner`` trains up to B = 16 trials at once as one fused array,
reports every trial's accuracy after each epoch, prunes with the study's
pruner and refills a pruned or finished trial's slot with a new trial. For
comparison the same 64 trials then run one by one as plain ``torch.nn`` models
with ``torch.optim.SGD`` under Optuna's own ``study.optimize`` (same sampler and
seed, same pruner; trial n has the same initial weights and the same batches
in both runs), and the wall times of the two searches are printed. They agree
trial by trial only in law: with B trials in flight the pruner decides with
fewer finished trials than one by one, so the two runs prune different trials
and train different numbers of epochs (``--pruner none``: the same work).

    python examples/optuna_sweep.py            # full run (minutes on a 2-core CPU)
    python examples/optuna_sweep.py --quick    # a short smoke run

Optuna's plots of the fused study (optimization history, parallel coordinates,
intermediate values) are written as PNG files to ``--out``. With ``--storage``
the fused study lives in a database, and the same command started in several
processes or on several machines (``--skip-plain``, each with its own
``--sampler-seed``) shares its trials.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import warnings

import optuna
import torch
import torch.nn.functional as F
from optuna.trial import TrialState
from rich.console import Console
from rich.table import Table

import hfkern
import hfkern.sweep as hs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits_sweep import cnn, device_name, load_data  # noqa: E402  (the demo's data and CNN)

FUSIBLE = ["lr", "momentum", "weight_decay"]  # SGD's per-model hyper-parameters: one array holds any mix
PLOTS = ("optimization_history", "parallel_coordinate", "intermediate_values")
QUICK = {"trials": 8, "B": 4, "epochs": 2, "train_samples": 192}  # 3 steps per epoch at batch size 64


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=None, help=f"trials of the study (default 64, {QUICK['trials']} "
                                                            f"with --quick)")
    p.add_argument("--B", type=int, default=None, help=f"trials per fused array (default 16, {QUICK['B']} with "
                                                       f"--quick)")
    p.add_argument("--epochs", type=int, default=None, help=f"training epochs of a complete trial (default 10, "
                                                            f"{QUICK['epochs']} with --quick)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step and model (default 64)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the batch order and the initial weights (trial n's: seed + n)")
    p.add_argument("--sampler-seed", type=int, default=None,
                   help="seed of the sampler (default: --seed); processes sharing a study need different ones, "
                        "or they draw the same parameters")
    p.add_argument("--sampler", choices=("random", "tpe"), default="random",
                   help="Optuna sampler (default random: trial n gets the same parameters in both runs)")
    p.add_argument("--pruner", choices=("median", "none"), default="median",
                   help="median: MedianPruner(n_startup_trials=5, n_warmup_steps=2) (default); none: every "
                        "trial trains all its epochs, so both runs do the same work")
    p.add_argument("--out", metavar="DIR", default="sweep_out", help="directory of the PNG plots (default sweep_out)")
    p.add_argument("--save", metavar="PATH", default=None,
                   help="also write the measurements (with device, versions and date) as JSON to PATH")
    p.add_argument("--skip-plain", action="store_true", help="run only the fused sweep, not the one-by-one one")
    p.add_argument("--storage", metavar="URL", default=None,
                   help="the fused study's database (sqlite:///sweep.db, postgresql+psycopg2://...); every process "
                        "started with the same URL and --study-name shares its trials (default: in memory)")
    p.add_argument("--study-name", default="digits-sgd", help="the study's name in --storage (default digits-sgd)")
    p.add_argument("--checkpoint", metavar="PATH", default=None,
                   help="the runner's checkpoint: a runner started again with it resumes the trials it held")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK['trials']} trials, B = {QUICK['B']}, {QUICK['epochs']} epochs on "
                        f"{QUICK['train_samples']} training images")
    args = p.parse_args(argv)
    for name, full in (("trials", 64), ("B", 16), ("epochs", 10)):
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick else full)
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.batch_size < 2:
        p.error(f"--batch-size must be >= 2 (batch norm needs two samples), got {args.batch_size}")
    return args


def space(trial: optuna.Trial) -> dict:
    """SGD's hyper-parameters; all fusible, so every trial fits every array."""
    return {
        "lr": trial.suggest_float("lr", 1e-3, 1.0, log=True),
        "momentum": trial.suggest_float("momentum", 0.0, 0.99),
        "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True),
    }


def new_study(args, storage=None, name=None) -> optuna.Study:
    """A study maximizing accuracy; both runs get a sampler and a pruner built alike."""
    seed = args.seed if args.sampler_seed is None else args.sampler_seed
    sampler = (optuna.samplers.RandomSampler(seed=seed) if args.sampler == "random"
               else optuna.samplers.TPESampler(seed=seed))
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=2) if args.pruner == "median"
              else optuna.pruners.NopPruner())
    return optuna.create_study(direction="maximize", sampler=sampler, pruner=pruner, storage=storage,
                               study_name=name, load_if_exists=storage is not None)


def run_fused(args, train, valid, device) -> tuple[optuna.Study, hs.SweepSummary, float]:
    storage = hs.storage(args.storage) if args.storage else None
    study = new_study(args, storage, args.study_name)
    # Optuna warns once that heartbeats are meant for study.optimize; the runner records them itself.
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used", category=UserWarning)
    t0 = time.perf_counter()  # the runner's set-up (fusing, array building) counts
    runner = hs.Runner(study, space, lambda params: cnn(), fusible=FUSIBLE, train=train, valid=valid,
                       batch_size=args.batch_size, epochs=args.epochs, optimizer=hfkern.optim.SGD,
                       metric="accuracy", B=args.B, device=device, seed=args.seed, data_seed=args.seed,
                       checkpoint=args.checkpoint, progress=True)
    summary = runner.run(n_trials=args.trials)
    return study, summary, time.perf_counter() - t0


@torch.no_grad()
def accuracy(model, x, y) -> float:
    """The fraction of correct predictions, counted as the runner counts them (no float32 mean)."""
    model.eval()
    return (model(x).argmax(-1) == y).sum().item() / len(y)


def run_plain(args, train, valid, device) -> tuple[optuna.Study, float]:
    """The same search one trial at a time: plain torch under Optuna's own study.optimize."""
    (x, y), (xv, yv) = train, valid
    n = len(y)
    steps_per_epoch = n // args.batch_size

    def objective(trial: optuna.Trial) -> float:
        params = space(trial)
        torch.manual_seed(args.seed + trial.number)  # the runner's init seed of trial n
        model = cnn().to(device)
        opt = torch.optim.SGD(model.parameters(), **params)
        acc = float("nan")
        for epoch in range(1, args.epochs + 1):
            model.train()
            for i in range(steps_per_epoch):
                # the batches the runner gives a trial at this step of its own
                idx = hs.batch_indices(n, args.batch_size, (epoch - 1) * steps_per_epoch + i, args.seed).to(device)
                loss = F.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            acc = accuracy(model, xv, yv)
            trial.report(acc, epoch)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return acc

    study = new_study(args, name=f"{args.study_name}-one-by-one")
    t0 = time.perf_counter()
    study.optimize(objective, n_trials=args.trials, show_progress_bar=True)
    return study, time.perf_counter() - t0


def outcome(study: optuna.Study, seconds: float, steps_per_epoch: int) -> dict:
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best = max(complete, key=lambda t: t.value) if complete else None
    epochs = sum(len(t.intermediate_values) for t in trials)  # every report is one trained epoch
    return {
        "seconds": seconds,
        "trials": len(trials),
        "complete": len(complete),
        "pruned": sum(t.state == TrialState.PRUNED for t in trials),
        "failed": sum(t.state == TrialState.FAIL for t in trials),
        "epochs_trained": epochs,
        "steps_trained": epochs * steps_per_epoch,
        "best_value": None if best is None else best.value,
        "best_trial": None if best is None else best.number,
        "best_params": None if best is None else best.params,
    }


def save_plots(study: optuna.Study, out: str) -> list[str]:
    """Optuna's matplotlib plots of ``study`` as PNG files in ``out``."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    os.makedirs(out, exist_ok=True)
    paths = []
    for name in PLOTS:
        kwargs = {} if name == "intermediate_values" else {"target_name": "validation accuracy"}
        with warnings.catch_warnings():  # Optuna marks its matplotlib plots experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            ax = getattr(ovm, f"plot_{name}")(study, **kwargs)
        fig = ax.figure
        fig.set_size_inches(9, 5.5)
        if name == "intermediate_values":
            ax.set_xlabel("epoch (Optuna step)")
            ax.set_ylabel("validation accuracy")
            if ax.get_legend() is not None:
                ax.get_legend().remove()  # one entry per trial hides the curves
        path = os.path.join(out, f"{name}.png")
        fig.savefig(path, dpi=90, bbox_inches="tight", pil_kwargs={"optimize": True})
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> None:
    args = parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the progress bars and tables say it
    device = torch.device(args.device)
    console = Console()

    x_train, y_train, x_valid, y_valid = load_data(device)
    if args.quick:
        x_train, y_train = x_train[:QUICK["train_samples"]], y_train[:QUICK["train_samples"]]
    train, valid = (x_train, y_train), (x_valid, y_valid)
    steps_per_epoch = len(y_train) // args.batch_size
    if steps_per_epoch < 1:
        raise SystemExit(f"--batch-size {args.batch_size} exceeds the {len(y_train)} training images")
    console.print(f"device: {device_name(device)}; {args.trials} trials ({args.sampler} sampler, "
                  f"{'median' if args.pruner == 'median' else 'no'} pruner), "
                  f"B = {args.B}, {args.epochs} epochs of {steps_per_epoch} steps of {args.batch_size} samples "
                  f"({len(y_train)} train / {len(y_valid)} validation images)")

    console.rule(f"hfkern.sweep.Runner: up to {args.B} trials at a time as one fused array")
    fused, summary, fused_s = run_fused(args, train, valid, device)
    console.print(f"runner: {summary}")
    results = {"fused": outcome(fused, fused_s, steps_per_epoch), "plain": None}
    results["fused"]["arrays"] = summary.arrays
    results["fused"]["compactions"] = summary.compactions
    plots = save_plots(fused, args.out)
    console.print(f"plots written to {', '.join(plots)}")

    table = Table(title=f"{args.trials} trials of the digits CNN on {device_name(device)}",
                  caption="fused: hfkern.sweep.Runner" + ("" if args.skip_plain else "; one by one: torch.nn models "
                          "under Optuna's study.optimize") + "; epochs: trained by all trials together")
    for col, justify in (("trials", "left"), ("wall s", "right"), ("complete", "right"), ("pruned", "right"),
                         ("failed", "right"), ("epochs", "right"), ("best accuracy", "right")):
        table.add_column(col, justify=justify)
    rows = [(f"fused, B = {args.B}", results["fused"])]
    if not args.skip_plain:
        console.rule("torch models one by one: Optuna's study.optimize")
        plain, plain_s = run_plain(args, train, valid, device)
        hs.print_best_trials(plain)
        results["plain"] = outcome(plain, plain_s, steps_per_epoch)
        rows.append(("one by one", results["plain"]))
        # Trial n samples the same parameters in both runs only with the random sampler; the
        # pruner decides in both runs, but with B trials in flight it has seen fewer finished ones.
        pairs = list(zip(fused.trials, plain.trials))
        results["same_params"] = sum(a.params == b.params for a, b in pairs)
        results["same_state"] = sum(a.state == b.state for a, b in pairs)
        # A trial of the same parameters trains alike in both runs (same initial weights and
        # batches): where both ran an epoch, their accuracies agree up to float32 rounding, which
        # flips a validation image or two, and more at learning rates and momenta large enough
        # for training to amplify it (as plain torch on 1 and on 2 threads differ there).
        results["max_abs_diff_same_epoch"] = max(
            (abs(a.intermediate_values[e] - b.intermediate_values[e]) for a, b in pairs if a.params == b.params
             for e in set(a.intermediate_values) & set(b.intermediate_values)), default=None)
        results["per_trial"] = [
            {"number": a.number, "params": a.params,
             "fused": {"state": a.state.name, "value": a.value, "epochs": len(a.intermediate_values)},
             "plain": {"state": b.state.name, "value": b.value, "epochs": len(b.intermediate_values)}}
            for a, b in pairs]
    for label, r in rows:
        best = "-" if r["best_value"] is None else f"{r['best_value']:.4f} (trial {r['best_trial']})"
        table.add_row(label, f"{r['seconds']:.1f}", str(r["complete"]), str(r["pruned"]), str(r["failed"]),
                      str(r["epochs_trained"]), best)
    console.print(table)
    if results["plain"] is not None:
        results["speedup"] = results["plain"]["seconds"] / results["fused"]["seconds"]
        diff = results["max_abs_diff_same_epoch"]
        console.print(f"trial numbers with the same parameters in both runs: {results['same_params']} of "
                      f"{args.trials}; with the same outcome (complete or pruned): {results['same_state']}; "
                      f"largest accuracy difference at an epoch both trained: "
                      f"{'-' if diff is None else f'{diff:.2g}'}")
        console.print(f"speed-up of the fused sweep: {results['speedup']:.2f}x in wall time on "
                      f"{device_name(device)}")

    if args.save:
        record = {
            "benchmark": "examples/optuna_sweep.py",
            "date": datetime.date.today().isoformat(),
            "device": device_name(device),
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "optuna": optuna.__version__,
            "hfkern": hfkern.__version__,
            "backend": hfkern.get_backend(),
            "settings": {
                "trials": args.trials, "B": args.B, "epochs": args.epochs, "batch_size": args.batch_size,
                "steps_per_epoch": steps_per_epoch, "train_samples": len(y_train),
                "valid_samples": len(y_valid), "seed": args.seed, "sampler": args.sampler,
                "sampler_seed": args.seed if args.sampler_seed is None else args.sampler_seed,
                "pruner": ("MedianPruner(n_startup_trials=5, n_warmup_steps=2)" if args.pruner == "median"
                           else "NopPruner()"),
                "quick": args.quick,
                "space": {"lr": "log-uniform [1e-3, 1]", "momentum": "uniform [0, 0.99]",
                          "weight_decay": "log-uniform [1e-6, 1e-2]"},
                "metric": "validation accuracy after each epoch",
            },
            **results,
            "plots": [os.path.basename(p) for p in plots],
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
        with open(args.save, "w") as f:
            json.dump(record, f, indent=1)
        console.print(f"measurements written to {args.save}")


if __name__ == "__main__":
    main()
