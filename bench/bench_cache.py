"""What hfkern.data.CachedDataset saves: time per sample over epochs 1..3 for a dataset that decodes PNGs.

The dataset holds N PNG-encoded RGB images (smooth patterns plus noise, so they
compress as photographs do rather than as noise) and decodes sample i as a
torchvision-style ``ToTensor`` would: Pillow decode, ``[3, H, W]`` float32 in
[0, 1], plus an int label. A DataLoader (batch 32, default collate, so every
sample's bytes are read) runs ``--epochs`` epochs over it in each of:

* ``uncached``:    the dataset itself;
* ``memory``:      ``CachedDataset(memory_bytes=...)``, large enough for every sample;
* ``disk``:        ``CachedDataset(disk_dir=..., disk_bytes=...)`` on a fresh directory
  (epoch 1 decodes and writes, later epochs read the memory-mapped entries);
* ``disk_reopen``: a fresh process on the directory the ``disk`` run of the same
  round left (every epoch reads from disk; the page cache is warm, since the
  entries were just written: this is a second trial of a sweep on one machine);
* ``both``:        memory and disk tiers (epoch 1 writes both, later epochs hit memory).

Each configuration runs in a fresh Python process (no state carries over but the
disk directory) after a warm-up on other images, configurations interleaved round by
round; the table gives the median over rounds of each epoch's time per sample.
With workers, epoch 1 includes starting them (for every configuration alike). ``--workers 2`` repeats it
with two DataLoader workers (persistent, so their memory tiers live across epochs).

    python bench/bench_cache.py --save bench/results/cache_<device>_<date>.json
    python bench/bench_cache.py --n 32 --size 64 --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import pickle
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

CONFIGS = ("uncached", "memory", "disk", "disk_reopen", "both")
KEY = "bench-png"


def make_pngs(n: int, size: int, seed: int = 0) -> list[bytes]:
    """``n`` PNG-encoded ``size`` x ``size`` RGB images: a few random low-frequency waves plus mild noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    out = []
    for _ in range(n):
        img = np.zeros((size, size, 3), np.float32)
        for c in range(3):
            for _ in range(3):
                fx, fy, ph = rng.uniform(0.5, 4), rng.uniform(0.5, 4), rng.uniform(0, 2 * np.pi)
                img[..., c] += np.sin(2 * np.pi * (fx * xx + fy * yy) + ph)
        img = (img - img.min()) / (np.ptp(img) + 1e-6) * 230 + rng.normal(0, 6, img.shape)
        buf = io.BytesIO()
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


class PNGDataset:
    """Sample i: (the decoded image as ``[3, H, W]`` float32 in [0, 1], i % 10)."""

    def __init__(self, pngs: list[bytes]) -> None:
        self.pngs = pngs

    def __len__(self) -> int:
        return len(self.pngs)

    def __getitem__(self, i: int):
        import torch
        from PIL import Image

        with Image.open(io.BytesIO(self.pngs[i])) as im:
            a = np.array(im.convert("RGB"))  # writable, as torch.from_numpy wants
        return torch.from_numpy(a).permute(2, 0, 1).float().div_(255), i % 10


def build(config: str, pngs: list[bytes], disk_dir: str | None, cache_bytes: int):
    """The dataset a configuration reads."""
    base = PNGDataset(pngs)
    if config == "uncached":
        return base
    from hfkern.data import CachedDataset

    kw: dict = {}
    if config in ("memory", "both"):
        kw["memory_bytes"] = cache_bytes
    if config in ("disk", "disk_reopen", "both"):
        kw.update(disk_dir=disk_dir, disk_bytes=cache_bytes, key=KEY)
    return CachedDataset(base, **kw)


def run_config(config: str, pngs: list[bytes], disk_dir: str | None, *, epochs: int, workers: int,
               batch_size: int = 32, cache_bytes: int = 1 << 34) -> dict:
    """Time ``epochs`` epochs of one configuration in this process: seconds per sample per epoch,
    and the cache's counters."""
    import torch
    from torch.utils.data import DataLoader

    # Warm-up on other images (and another cache directory): imports, Pillow's plugins and the
    # cache's code paths are paid before the clock starts, the measured cache stays cold.
    warm_dir = None if disk_dir is None else disk_dir.rstrip("/") + "-warmup"
    warm = build(config, make_pngs(8, 32, seed=1), warm_dir, cache_bytes)
    for _ in range(2):
        for _ in DataLoader(warm, batch_size=4):
            pass
    if warm_dir is not None:
        shutil.rmtree(warm_dir, ignore_errors=True)

    ds = build(config, pngs, disk_dir, cache_bytes)
    loader = DataLoader(ds, batch_size=batch_size, num_workers=workers, persistent_workers=workers > 0)
    per_sample, checksum = [], 0.0
    for _ in range(epochs):
        t0 = time.perf_counter()
        for x, y in loader:
            checksum += float(x[:, :, 0, 0].sum()) + int(y.sum())  # touches a little; collate read all
        per_sample.append((time.perf_counter() - t0) / len(ds))
    del loader
    out = {"config": config, "workers": workers, "s_per_sample": per_sample, "checksum": checksum,
           "torch_threads": torch.get_num_threads()}
    if config != "uncached":
        out["stats"] = ds.stats()
        if disk_dir is not None:
            usage = ds.disk_usage()
            out["entry_bytes"] = usage["bytes"] / max(usage["entries"], 1)
    return out


def _child(args) -> None:
    import torch

    # One intra-op thread, as in a DataLoader worker: on a small shared machine, torch's
    # parallel small ops (the decode's float conversion, collate's stack) otherwise wait
    # for descheduled threads, and that noise would swamp what the cache changes.
    torch.set_num_threads(1)
    with open(args.pngs, "rb") as f:
        pngs = pickle.load(f)
    res = run_config(args.child, pngs, args.disk_dir, epochs=args.epochs, workers=args.workers)
    print("RESULT " + json.dumps(res))


def _spawn(config: str, pngs_path: str, disk_dir: str, epochs: int, workers: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--pngs", pngs_path,
           "--disk-dir", disk_dir, "--epochs", str(epochs), "--workers", str(workers)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} (workers={workers}) failed:\n{proc.stderr[-4000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _versions() -> dict:
    import PIL
    import torch

    import hfkern

    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
            "pillow": PIL.__version__, "hfkern": hfkern.__version__}


def _device() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu ({model}, {os.cpu_count()} threads)"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=256, help="images")
    p.add_argument("--size", type=int, default=224, help="image side in pixels")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader workers, one pass each")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--dir", default=None, help="where the disk tiers go (default: a temp dir, removed after)")
    p.add_argument("--save", default=None, help="write the JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--pngs", default=None, help=argparse.SUPPRESS)
    p.add_argument("--disk-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.workers = args.workers[0]
        _child(args)
        return {}
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        p.error(f"unknown configs {unknown}; expected some of {list(CONFIGS)}")

    root = tempfile.mkdtemp(prefix="hfkern-bench-cache-", dir=args.dir)
    try:
        pngs = make_pngs(args.n, args.size)
        pngs_path = os.path.join(root, "pngs.pkl")
        with open(pngs_path, "wb") as f:
            pickle.dump(pngs, f)
        runs = []
        for workers in args.workers:
            for r in range(args.rounds):
                for config in configs:
                    name = "disk" if config == "disk_reopen" else config
                    disk_dir = os.path.join(root, f"w{workers}-r{r}-{name}")
                    if config == "disk_reopen" and not os.path.isdir(disk_dir):
                        raise SystemExit("disk_reopen needs the disk config before it in --configs")
                    res = _spawn(config, pngs_path, disk_dir, args.epochs, workers)
                    res["round"] = r
                    runs.append(res)
                    print(f"workers={workers} round={r} {config:12s} " +
                          " ".join(f"{s * 1e3:8.3f}" for s in res["s_per_sample"]) + "  ms/sample", flush=True)
                for config in configs:  # a round's directories go before the next round
                    shutil.rmtree(os.path.join(root, f"w{workers}-r{r}-{config}"), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows = []
    for workers in args.workers:
        for config in configs:
            mine = [x for x in runs if x["config"] == config and x["workers"] == workers]
            med = [statistics.median(x["s_per_sample"][e] for x in mine) for e in range(args.epochs)]
            row = {"config": config, "workers": workers, "median_ms_per_sample": [m * 1e3 for m in med],
                   "rounds_ms_per_sample": [[s * 1e3 for s in x["s_per_sample"]] for x in mine]}
            if "stats" in mine[0]:
                row["stats_last_round"] = mine[-1]["stats"]
            if "entry_bytes" in mine[0]:
                row["entry_bytes"] = mine[-1]["entry_bytes"]
            rows.append(row)
    base = {r["workers"]: r["median_ms_per_sample"] for r in rows if r["config"] == "uncached"}
    for r in rows:
        if r["workers"] in base:
            r["speedup_vs_uncached"] = [b / m for b, m in zip(base[r["workers"]], r["median_ms_per_sample"])]

    result = {
        "benchmark": "bench/bench_cache.py",
        "date": datetime.date.today().isoformat(),
        "device": _device(),
        **_versions(),
        "images": args.n, "image_size": args.size,
        "png_bytes_mean": float(np.mean([len(b) for b in pngs])),
        "sample_bytes": 3 * args.size * args.size * 4,
        "epochs": args.epochs, "rounds": args.rounds, "batch_size": 32,
        "load_average_at_end": os.getloadavg(),
        "rows": rows,
    }
    print(f"\n{'config':12s} {'workers':>7s}  " + "  ".join(f"epoch {e + 1} ms/sample" for e in range(args.epochs)))
    for r in rows:
        sp = r.get("speedup_vs_uncached", [])
        print(f"{r['config']:12s} {r['workers']:7d}  " + "  ".join(
            f"{m:10.3f} ({s:5.1f}x)" for m, s in zip(r["median_ms_per_sample"], sp)))
    if args.save:
        os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
        with open(args.save, "w") as f:
            json.dump(result, f, indent=1)
        print(f"saved {args.save}")
    return result


if __name__ == "__main__":
    main()
