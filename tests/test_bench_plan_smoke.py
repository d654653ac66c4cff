"""bench/bench_plan.py end to end at the smoke size, so that it never rots: the accuracy checks,
the measured front, the plain-against-recomputation comparison and the fit's profiles, from
which hfkern.plan.fit_profiles gives back the very predictions the bench reported."""

import json
import os
import subprocess
import sys

import pytest

import hfkern.plan as hp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _profile(record: dict) -> hp.Profile:
    fields = dict(record["strategy_fields"], recompute=tuple(record["strategy_fields"]["recompute"]))
    rest = {k: v for k, v in record.items() if k not in ("strategy", "strategy_fields")}
    return hp.Profile(strategy=hp.Strategy(**fields), **rest)


@pytest.mark.long
def test_smoke_run_and_its_profiles_refit_to_its_predictions(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, os.path.join("bench", "bench_plan.py"), "--size", "smoke", "--workloads", "resnet18",
         "--profile-steps", "1", "--measure", "3", "--max-B", "6", "--check-B", "5", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "plan.json").read_text())
    assert record["args"]["profile_B"] == list(hp.default_profile_B("cpu"))
    (w,) = record["workloads"]
    assert w["workload"] == "resnet18" and (tmp_path / "resnet18.png").stat().st_size > 0
    assert [a["strategy"] for a in w["accuracy"]][:1] == ["B=5 fp32"]
    # (at most 3 plans measured; at this size, timed over one step on a busy machine, one plan can
    # be both the fastest and the smallest, and the front that one plan)
    assert len(w["measured_front"]) == min(3, len(w["front"])) >= 1
    assert all(m["measured_step_s"] > 0 for m in w["measured_front"])
    more = w["more_models"]
    if more:  # plain fusion is the plan without its recomputation: the same precision and arrays
        assert more["plain"] == more["plan"].split(" rc=")[0].replace(f"B={more['plan_B']}", f"B={more['plain_B']}")
    # the profiles of the fit, as saved, give the same model
    model = hp.fit_profiles([_profile(p) for p in w["profiles"]])
    assert {p["strategy_fields"]["B"] for p in w["profiles"]} == set(hp.default_profile_B("cpu"))
    compared = 0
    for a in w["accuracy"]:
        label = a["strategy"]
        if label == "B=5 fp32":
            s = hp.Strategy(B=5)
        elif label.startswith("B=5 fp32 rc="):
            s = hp.Strategy(B=5, recompute=tuple(label.split(" rc=")[1].split(",")))
        else:
            continue
        assert s.label == label and model.predict(s) == (a["predicted_step_s"], a["predicted_peak"])
        compared += 1
    assert compared == 2
