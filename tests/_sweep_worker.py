"""A sweep runner process for the multi-process tests: one Runner on a shared study.

    python tests/_sweep_worker.py STORAGE_URL STUDY N_TRIALS [--checkpoint PATH] [--name NAME]
                                  [--heartbeat S] [--grace S] [--rounds-delay S]

``--rounds-delay`` sleeps after every report, so that a test can kill the
process mid-array.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import optuna  # noqa: E402

import hfkern.sweep as hs  # noqa: E402
import _sweep_cases as cases  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("study")
    p.add_argument("n_trials", type=int)
    p.add_argument("--checkpoint")
    p.add_argument("--name")
    p.add_argument("--heartbeat", type=int, default=30)
    p.add_argument("--grace", type=int, default=None)
    p.add_argument("--rounds-delay", type=float, default=0.0)
    p.add_argument("--B", type=int, default=3)
    args = p.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = hs.storage(args.url, heartbeat_interval=args.heartbeat, grace_period=args.grace)
    study = optuna.load_study(study_name=args.study, storage=storage, sampler=optuna.samplers.RandomSampler(),
                              pruner=optuna.pruners.NopPruner())
    metric = None
    if args.rounds_delay:
        def metric(model, hp, _inner=[None]):  # the built-in loss, then a pause
            time.sleep(args.rounds_delay)
            return _loss_metric(model)
    runner = cases.runner(study, B=args.B, checkpoint=args.checkpoint, name=args.name,
                          **({"metric": metric} if metric else {}))
    print(runner.run(n_trials=args.n_trials), flush=True)


def _loss_metric(model):
    import hfkern
    from hfkern.nn.functional import cross_entropy

    _, (xv, yv) = cases.data()
    return cross_entropy(model(hfkern.broadcast(xv, model.B)), yv).double()


if __name__ == "__main__":
    main()
