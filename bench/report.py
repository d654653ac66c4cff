"""Kernel benchmark results: files, tables and the summary the targets need.

    python bench/report.py show results.json [--table]
    python bench/report.py merge a.json b.json ... --out DIR --name STEM [--table]

A result set is a JSON file ``{"meta": {...}, "rows": [...]}`` next to a CSV
with the same rows (one column per key of ``COLUMNS``). A run that was cut
short leaves its JSON with ``"complete": false`` and the rows so far in the
CSV; loading prefers the JSON's rows when it is complete, else the CSV's.

The summary:

* conv: forward+backward speedup of the triton backend over cuDNN grouped
  convolution (the faster of the NCHW and channels-last layouts per case),
  geometric mean over the suite's cases per dtype; the same for the torch
  backend over B separate calls.
* layer norm: forward and backward bandwidth as a percentage of the measured
  copy bandwidth, per dtype and backend (median, min, max over the cases).
* embedding: forward bandwidth as a percentage of the copy bandwidth.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import statistics
from typing import Iterable

COLUMNS = [
    "op", "model", "layer", "shape", "B", "dtype", "direction", "impl", "kind",
    "status", "ms", "gbps", "tflops", "frac_copy_bw", "frac_matmul", "bytes", "flops",
    "rel_err", "rotate", "note", "error",
    "device", "torch", "triton", "cudnn", "cuda", "hfkern", "timer", "date",
]
_INT_COLUMNS = {"B", "bytes", "flops", "rotate"}
_FLOAT_COLUMNS = {"ms", "gbps", "tflops", "frac_copy_bw", "frac_matmul", "rel_err"}


def _families():
    """bench/families, imported on first use: reading and merging result files needs
    neither torch nor the families."""
    import families

    return families


# ---- files -----------------------------------------------------------------

class ContextLost(RuntimeError):
    """The CUDA context is unusable (e.g. after an illegal memory access): stop the run."""


def run_cases(cases, run_case, writer: "RowWriter", meta: dict, time_budget: float | None,
              t_start: float, device, ms_format: str = "{:.4f}") -> None:
    """Run ``run_case(case) -> rows`` for each case in order, appending rows to ``writer``.

    Stops at the time budget, or when a case raises ContextLost; Ctrl-C stops
    too. ``meta`` records why it stopped (``stopped``/``aborted``), how many cases
    were not run and the elapsed time; the JSON is written whatever happens.
    """
    import time

    import torch

    done = 0
    try:
        for i, case in enumerate(cases):
            if time_budget is not None and time.monotonic() - t_start > time_budget:
                meta["skipped_cases"] = len(cases) - i
                meta["stopped"] = f"time budget of {time_budget:.0f} s reached"
                print(f"time budget of {time_budget:.0f} s reached: {len(cases) - i} cases not run")
                break
            try:
                rows = run_case(case)
            except ContextLost as e:
                meta["aborted"] = str(e)[:500]
                meta["skipped_cases"] = len(cases) - i
                print(f"aborted: {e}")
                break
            for r in rows:
                writer.add(r)
            done += 1
            print(f"[{i + 1}/{len(cases)}] {case.label()}: " + ", ".join(
                f"{r['impl']} {ms_format.format(r['ms'])}" if r["status"] == "ok" else f"{r['impl']} err"
                for r in rows
            ), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        meta["finished"] = "aborted" not in meta
    except KeyboardInterrupt:
        meta["aborted"] = "interrupted"
        meta["skipped_cases"] = len(cases) - done
        print("interrupted: writing the results so far")
    finally:
        meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
        writer.write_json(complete=True)
        writer.close()


class RowWriter:
    """Appends rows to ``<dir>/<stem>.csv`` as they come and writes ``<stem>.json``.

    The CSV is flushed after every row so a run that is killed keeps what it
    measured; :meth:`write_json` rewrites the JSON (call it at the start, and
    at the end with ``complete=True``). ``columns``: the keys of a row that are
    kept (another benchmark's own); ``with_csv=False``: the JSON only,
    rewritten after every row instead.
    """

    def __init__(self, out_dir: str, stem: str, meta: dict, columns: list[str] = COLUMNS,
                 with_csv: bool = True):
        os.makedirs(out_dir, exist_ok=True)
        self.csv_path = os.path.join(out_dir, stem + ".csv") if with_csv else None
        self.json_path = os.path.join(out_dir, stem + ".json")
        self.meta = meta
        self.columns = columns
        self.rows: list[dict] = []
        self._f = self._csv = None
        if with_csv:
            self._f = open(self.csv_path, "w", newline="")
            self._csv = csv.DictWriter(self._f, fieldnames=columns, extrasaction="ignore")
            self._csv.writeheader()
            self._f.flush()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if self._csv is None:
            self.write_json(complete=False)
            return
        self._csv.writerow({k: _csv_value(row.get(k)) for k in self.columns})
        self._f.flush()

    def write_json(self, complete: bool) -> None:
        self.meta["complete"] = complete
        write_json(self.json_path, self.meta, self.rows, self.columns)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def _csv_value(v):
    if v is None:
        return ""
    if isinstance(v, float) and not math.isfinite(v):
        return ""
    return v


def write_json(path: str, meta: dict, rows: list[dict], columns: list[str] = COLUMNS) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "rows": [{k: r.get(k) for k in columns} for r in rows]}, f, indent=1)
    os.replace(tmp, path)


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(r.get(k)) for k in COLUMNS})


def read_csv(path: str) -> list[dict]:
    rows = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            row: dict = {}
            for k in COLUMNS:
                v = raw.get(k, "")
                if v in ("", None):
                    row[k] = None
                elif k in _INT_COLUMNS:
                    row[k] = int(float(v))
                elif k in _FLOAT_COLUMNS:
                    row[k] = float(v)
                else:
                    row[k] = v
            rows.append(row)
    return rows


def load(path: str) -> tuple[dict, list[dict]]:
    """(meta, rows) of a result set given its .json or .csv path."""
    stem = path[:-5] if path.endswith(".json") else path[:-4] if path.endswith(".csv") else path
    meta: dict = {}
    rows = None
    if os.path.exists(stem + ".json"):
        with open(stem + ".json") as f:
            data = json.load(f)
        meta = data.get("meta", {})
        if meta.get("complete"):
            rows = data.get("rows", [])
    if rows is None:
        rows = read_csv(stem + ".csv") if os.path.exists(stem + ".csv") else []
    return meta, rows


def merge(paths: Iterable[str]) -> tuple[dict, list[dict]]:
    """One result set from several: rows concatenated, metas kept per part."""
    parts, rows = [], []
    for p in paths:
        meta, r = load(p)
        parts.append({"file": os.path.basename(p), **meta})
        rows.extend(r)
    first = parts[0] if parts else {}
    meta = {k: first.get(k) for k in ("device", "versions", "ceilings", "date", "settings") if k in first}
    meta["complete"] = all(p.get("complete") for p in parts)
    meta["finished"] = all(p.get("finished") for p in parts)
    meta["skipped_cases"] = sum(p.get("skipped_cases") or 0 for p in parts)
    stopped = [f"{p['file']}: {p['stopped']}" for p in parts if p.get("stopped")]
    if stopped:
        meta["stopped"] = "; ".join(stopped)
    aborted = [f"{p['file']}: {p['aborted']}" for p in parts if p.get("aborted")]
    if aborted:
        meta["aborted"] = "; ".join(aborted)
    meta["parts"] = parts
    return meta, rows


def recorded_path(path: str | None) -> str | None:
    """``path`` as a result file records it: relative to the repository where it lies inside
    it, else ``"<out>"`` (a scratch folder of the machine that ran it says nothing)."""
    if path is None:
        return None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rel = os.path.relpath(os.path.abspath(path), root)
    return "<out>" if rel == ".." or rel.startswith(".." + os.sep) else rel


def recorded_argv(argv: Iterable[str]) -> list[str]:
    """A command line as a result file records it: the value of ``--out`` by :func:`recorded_path`."""
    out, after_out = [], False
    for a in argv:
        if after_out:
            out.append(recorded_path(a))
        elif a.startswith("--out="):
            out.append("--out=" + recorded_path(a[len("--out="):]))
        else:
            out.append(a)
        after_out = a == "--out"
    return out


def slug(text: str) -> str:
    """A file-name-safe form of a device name: lower case, [a-z0-9-] only."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40]


# ---- summary ---------------------------------------------------------------

def _ok(rows: Iterable[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok" and r.get("ms")]


def _case_key(r: dict) -> tuple:
    return (r["op"], r["model"], r["layer"], r["B"], r["dtype"], r["direction"])


def _dtypes(rows: list[dict]) -> list[str]:
    order = {"fp32": 0, "bf16": 1, "fp16": 2}
    return sorted({r["dtype"] for r in rows}, key=lambda d: (order.get(d, 9), d))


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def speedups(rows: list[dict], op: str, direction: str, fast: str, slow: str) -> dict[str, dict]:
    """Per dtype: time(slow) / time(fast) over the cases where both ran.

    Returns ``{dtype: {"geomean", "min", "max", "n"}}``; a dtype with no
    paired case is left out.
    """
    times: dict[tuple, dict[str, float]] = {}
    for r in _ok(rows):
        if r["op"] == op and r["direction"] == direction and r["impl"] in (fast, slow):
            times.setdefault(_case_key(r), {})[r["impl"]] = r["ms"]
    out = {}
    for dtype in _dtypes(rows):
        ratios = [t[slow] / t[fast] for k, t in times.items() if k[4] == dtype and fast in t and slow in t]
        if ratios:
            out[dtype] = {"geomean": geomean(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}
    return out


def bandwidth_fractions(rows: list[dict], op: str, direction: str, impl: str) -> dict[str, dict]:
    """Per dtype: the fraction of copy bandwidth ``impl`` reached, over the cases.

    Returns ``{dtype: {"median", "min", "max", "n"}}``.
    """
    out = {}
    for dtype in _dtypes(rows):
        f = [r["frac_copy_bw"] for r in _ok(rows)
             if r["op"] == op and r["direction"] == direction and r["impl"] == impl
             and r["dtype"] == dtype and r.get("frac_copy_bw") is not None]
        if f:
            out[dtype] = {"median": statistics.median(f), "min": min(f), "max": max(f), "n": len(f)}
    return out


def max_rel_err(rows: list[dict]) -> dict[str, dict[str, float]]:
    """``{"op:impl": {dtype: worst rel_err}}`` over the checked rows."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("rel_err") is None or r["impl"] == "grouped_best":
            continue
        d = out.setdefault(f"{r['op']}:{r['impl']}", {})
        d[r["dtype"]] = max(d.get(r["dtype"], 0.0), r["rel_err"])
    return out


def summarize(rows: list[dict]) -> dict:
    """The numbers the targets are judged by, as a dict (see the module docstring)."""
    errors = [r for r in rows if r.get("status") == "error"]
    return {
        "conv_fwdbwd_triton_vs_cudnn_grouped": speedups(rows, "conv", "fwd+bwd", "triton", "grouped_best"),
        "conv_fwd_triton_vs_cudnn_grouped": speedups(rows, "conv", "fwd", "triton", "grouped_best"),
        "conv_fwdbwd_triton_vs_torch": speedups(rows, "conv", "fwd+bwd", "triton", "torch"),
        "conv_fwdbwd_torch_vs_loop": speedups(rows, "conv", "fwd+bwd", "torch", "loop"),
        "layer_norm_fwd_frac_copy_bw": {
            impl: bandwidth_fractions(rows, "layer_norm", "fwd", impl) for impl in ("triton", "torch", "loop")
        },
        "layer_norm_bwd_frac_copy_bw": {
            impl: bandwidth_fractions(rows, "layer_norm", "bwd", impl) for impl in ("triton", "torch", "loop")
        },
        "embedding_fwd_frac_copy_bw": {
            impl: bandwidth_fractions(rows, "embedding", "fwd", impl) for impl in ("triton", "torch", "loop")
        },
        # What auto's choice for CUDA tensors rests on: triton against the torch
        # backend, in the directions each family's targets are stated in.
        "triton_vs_torch": {
            f"{op} {direction}": speedups(rows, op, direction, "triton", "torch")
            for op, family in _families().discover().items() for direction in family.directions
            if direction in family.quick_directions
        },
        "max_rel_err": max_rel_err(rows),
        "rows": len(rows),
        "ok": len(_ok(rows)),
        "errors": len(errors),
        "error_impls": sorted({f"{r['op']}:{r['impl']}" for r in errors}),
    }


def summary_lines(summary: dict, meta: dict | None = None) -> list[str]:
    meta = meta or {}
    lines = []
    dev = meta.get("device")
    if dev:
        ceil = meta.get("ceilings") or {}
        bw = ceil.get("copy_gbps")
        lines.append(f"device: {dev}; copy bandwidth ceiling: "
                     + (f"{bw:.0f} GB/s" if bw else "not measured"))

    def speed_block(title, stats):
        lines.append(title)
        if not stats:
            lines.append("  n/a (no case where both ran)")
        for dtype, s in stats.items():
            lines.append(f"  {dtype}: {s['geomean']:.2f}x geomean over {s['n']} cases "
                         f"(min {s['min']:.2f}x, max {s['max']:.2f}x)")

    def frac_block(title, per_impl):
        lines.append(title)
        any_ = False
        for impl, stats in per_impl.items():
            for dtype, s in stats.items():
                any_ = True
                lines.append(f"  {impl:6s} {dtype}: {100 * s['median']:.0f}% median over {s['n']} cases "
                             f"(min {100 * s['min']:.0f}%, max {100 * s['max']:.0f}%)")
        if not any_:
            lines.append("  n/a (no measured case)")

    speed_block("conv fwd+bwd: triton speedup over cuDNN grouped conv (best of NCHW / channels_last)",
                summary["conv_fwdbwd_triton_vs_cudnn_grouped"])
    speed_block("conv fwd: triton speedup over cuDNN grouped conv (best layout)",
                summary["conv_fwd_triton_vs_cudnn_grouped"])
    speed_block("conv fwd+bwd: triton speedup over the torch backend",
                summary["conv_fwdbwd_triton_vs_torch"])
    speed_block("conv fwd+bwd: torch backend (fused) speedup over B separate calls",
                summary["conv_fwdbwd_torch_vs_loop"])
    frac_block("layer norm fwd: bandwidth as % of copy bandwidth", summary["layer_norm_fwd_frac_copy_bw"])
    frac_block("layer norm bwd: bandwidth as % of copy bandwidth", summary["layer_norm_bwd_frac_copy_bw"])
    frac_block("embedding fwd: bandwidth as % of copy bandwidth", summary["embedding_fwd_frac_copy_bw"])
    lines.append("triton speedup over the torch backend (what auto's choice for CUDA tensors rests on):")
    for key, stats in (summary.get("triton_vs_torch") or {}).items():
        for dtype, st in stats.items():
            lines.append(f"  {key} {dtype}: {st['geomean']:.2f}x geomean over {st['n']} cases "
                         f"(min {st['min']:.2f}x, max {st['max']:.2f}x)")
    errs = summary.get("max_rel_err") or {}
    if errs:
        lines.append("largest relative error against the torch backend (||out - ref|| / ||ref||):")
        for key, per_dtype in sorted(errs.items()):
            lines.append(f"  {key}: " + ", ".join(f"{d} {e:.1e}" for d, e in per_dtype.items()))
    lines.append(f"rows: {summary['rows']} ({summary['ok']} ok, {summary['errors']} errors"
                 + (f": {', '.join(summary['error_impls'])}" if summary["error_impls"] else "") + ")")
    skipped = meta.get("skipped_cases")
    if skipped:
        why = meta.get("stopped") or meta.get("aborted") or "time budget or abort"
        lines.append(f"not run: {skipped} of the planned cases ({why})")
    if meta.get("aborted"):
        lines.append(f"aborted: {meta['aborted']}")
    return lines


# ---- tables ----------------------------------------------------------------

def _impls(rows: list[dict]) -> list[str]:
    """The implementations of ``rows`` in the families' report order; unknown names last."""
    seen = {r["impl"] for r in rows}
    order = _families().impl_order()
    return [i for i in order if i in seen] + sorted(seen - set(order))


def pivot(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """One line per case: ms of every implementation ("err" for an error row),
    then the triton (else torch) throughput and its fraction of the ceiling."""
    impls = _impls(rows)
    cases: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        cases.setdefault(_case_key(r), {})[r["impl"]] = r
    header = ["op", "layer", "B", "dtype", "dir"] + [f"{i} ms" for i in impls] + ["rate", "of ceil"]
    lines = []
    for key, by_impl in cases.items():
        op, model, layer, B, dtype, direction = key
        cells = [op, f"{model}.{layer}", str(B), dtype, direction]
        for i in impls:
            r = by_impl.get(i)
            if r is None:
                cells.append("")
            elif r.get("status") != "ok":
                cells.append("err")
            else:
                cells.append(f"{r['ms']:.4f}")
        best = next((by_impl[i] for i in ("triton", "torch") if by_impl.get(i, {}).get("status") == "ok"), None)
        if best is None:
            cells += ["", ""]
        elif op == "conv" and best.get("tflops") is not None:
            frac = best.get("frac_matmul")
            cells += [f"{best['tflops']:.1f} TF/s {best['impl']}", "" if frac is None else f"{100 * frac:.0f}%"]
        elif best.get("gbps") is not None:
            frac = best.get("frac_copy_bw")
            cells += [f"{best['gbps']:.0f} GB/s {best['impl']}", "" if frac is None else f"{100 * frac:.0f}%"]
        else:
            cells += ["", ""]
        lines.append(cells)
    return header, lines


def print_table(rows: list[dict], title: str = "hfkern kernel benchmark (median ms)") -> None:
    header, lines = pivot(rows)
    print_cells(title, header, lines, left={0, 1, 4})


def print_cells(title: str, header: list[str], lines: list[list[str]], left: set[int] = frozenset({0}),
                min_width: int = 200) -> None:
    """A table of text cells (``left``: the columns aligned left), every cell printed whole."""
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(header)]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
        for l in lines:
            print("  ".join(c.rjust(w) for c, w in zip(l, widths)))
        return
    table = Table(title=title)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i in left else "right", no_wrap=True)
    for l in lines:
        table.add_row(*l)
    # Logs are read wider than a terminal: a console as wide as the widest cells (a cell, its
    # padding and a border: 3 more), so that rich neither folds nor cuts one, layer names included.
    Console(width=max(min_width, sum(w + 3 for w in widths) + 1)).print(table)


def print_summary(rows: list[dict], meta: dict | None = None) -> dict:
    s = summarize(rows)
    print("\n".join(["", "=== summary ==="] + summary_lines(s, meta)))
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Show or merge kernel benchmark results.")
    sub = p.add_subparsers(dest="cmd", required=True)
    show = sub.add_parser("show", help="print the summary (and table) of result files")
    show.add_argument("files", nargs="+")
    show.add_argument("--table", action="store_true")
    mg = sub.add_parser("merge", help="merge result files into one CSV + JSON and print the summary")
    mg.add_argument("files", nargs="+")
    mg.add_argument("--out", required=True, help="directory for the merged files")
    mg.add_argument("--name", default=None,
                    help="file stem of the merged files (default kernels_<device>_<date>)")
    mg.add_argument("--table", action="store_true")
    args = p.parse_args(argv)
    meta, rows = merge(args.files)
    if args.table:
        print_table(rows)
    meta["summary"] = print_summary(rows, meta)
    if args.cmd == "merge":
        os.makedirs(args.out, exist_ok=True)
        if args.name is None:
            device = str(meta.get("device") or "unknown").split(" (")[0]
            args.name = f"kernels_{slug(device)}_{meta.get('date') or 'undated'}"
        write_csv(os.path.join(args.out, args.name + ".csv"), rows)
        write_json(os.path.join(args.out, args.name + ".json"), meta, rows)
        print(f"wrote {os.path.join(args.out, args.name)}.csv and .json ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
