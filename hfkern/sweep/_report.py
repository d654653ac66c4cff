"""What a sweep shows: a progress bar while it runs, the best trials when it ends."""

from __future__ import annotations

import math

import optuna
from optuna.trial import TrialState

from ._storage import counts

__all__ = ["Progress", "best_trials_table", "note", "print_best_trials"]


def note(message: str) -> None:
    """A line printed above the progress bar (tqdm keeps the bar intact)."""
    from tqdm import tqdm

    tqdm.write(message)


class Progress:
    """A tqdm bar over the study's trials: finished (of ``n_trials``), pruned, failed, running, best value.

    It counts every runner's trials (the study's), so each of several runners
    shows the sweep's progress; ``running`` is this runner's.
    """

    def __init__(self, study: optuna.Study, n_trials: int, enabled: bool = True):
        self.study = study
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=n_trials, desc=study.study_name, unit="trial", dynamic_ncols=True)

    def update(self, running: int) -> None:
        if self._bar is None:
            return
        trials = self.study.get_trials(deepcopy=False)
        finished = [t for t in trials if counts(t) and t.state.is_finished()]
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        best = None
        if complete:
            pick = max if self.study.direction == optuna.study.StudyDirection.MAXIMIZE else min
            best = pick(t.value for t in complete)
        self._bar.n = min(len(finished), self._bar.total)
        self._bar.set_postfix(
            pruned=sum(t.state == TrialState.PRUNED for t in trials),
            failed=sum(t.state == TrialState.FAIL for t in trials),
            running=running, best="-" if best is None else f"{best:.4g}", refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def best_trials_table(study: optuna.Study, top: int = 10):
    """A ``rich.table.Table`` of the study's ``top`` best complete trials: number, value, parameters (one
    column each, ``-`` where a trial has none); its title counts the complete, pruned and failed trials."""
    from rich.table import Table

    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.value is not None and math.isfinite(t.value)]
    reverse = study.direction == optuna.study.StudyDirection.MAXIMIZE
    best = sorted(complete, key=lambda t: t.value, reverse=reverse)[:top]
    names = sorted({k for t in best for k in t.params})
    states = [t.state for t in study.get_trials(deepcopy=False)]
    table = Table(title=f"{study.study_name}: best {len(best)} of {states.count(TrialState.COMPLETE)} complete "
                        f"trials ({states.count(TrialState.PRUNED)} pruned, {states.count(TrialState.FAIL)} failed)")
    table.add_column("trial", justify="right")
    table.add_column("value", justify="right")
    for n in names:
        table.add_column(n, justify="right")
    for t in best:
        table.add_row(str(t.number), f"{t.value:.5g}",
                      *[_fmt(t.params.get(n)) for n in names])
    return table


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def print_best_trials(study: optuna.Study, top: int = 10) -> None:
    """Print :func:`best_trials_table` with rich."""
    from rich.console import Console

    Console().print(best_trials_table(study, top))
