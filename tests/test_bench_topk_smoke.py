"""bench/bench_topk.py runs end to end on tiny sizes and writes its JSON."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
try:
    import bench_topk
finally:
    sys.path.remove(str(BENCH))


def test_bench_topk_smoke(tmp_path):
    assert bench_topk.main(["--sizes", "3001", "--densities", "0.1,0.01", "--reps", "1", "--device", "cpu",
                            "--out", str(tmp_path), "--name", "smoke"]) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert {"device", "torch", "date", "settings"} <= set(result["meta"])
    rows = result["rows"]
    impls = {r["impl"] for r in rows}
    assert impls == {"torch.topk", "torch/approx", "torch/exact"}
    assert len(rows) == 2 * 3
    for r in rows:
        assert r["ms"] > 0 and r["k"] == max(1, round(r["density"] * r["n"]))
        assert r["k"] <= r["count"] <= (5 * r["k"] + 3) // 4
        if r["impl"] == "torch/approx":
            assert r["passes"] >= 1
