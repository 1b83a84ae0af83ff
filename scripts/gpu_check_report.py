#!/usr/bin/env python
"""The report of scripts/gpu_check.sh: benchmarks/results/gpu_<device>.json and .md.

gpu_check.sh runs it after every stage, with the stages still to come in --pending, so that a
check cut short (a machine's time limit) still leaves the report of what it finished. Reads the
work dir's junit files, benchmark JSON (copied to benchmarks/results/ under the device's name)
and the training run's metrics. Exits 1 unless every stage ran, none failed and the training
loss went down.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bev.utils.io import atomic_write as write  # noqa: E402


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def sm(capability: list[int] | None) -> str:
    """The compute capability as nvcc names it (sm_90), or that there is none."""
    return "no compute capability" if capability is None else "sm_" + "".join(map(str, capability))


def junit_counts(xml: Path) -> dict | str:
    """tests / failures / errors / skipped of a junit file, or why there is none."""
    if not xml.exists():  # pytest died before writing it (a crash: see the log), or did not run
        return "no report: the pytest process crashed or did not run"
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def pool_section(bench: dict, kept: Path) -> tuple[dict, list[str]]:
    """The op benchmark's targets and headline rows (fused native, materialised + native)."""
    keys = ("method", "forward_ms", "fwd_bwd_ms", "fwd_bwd_peak_mb")
    section = {"file": os.path.relpath(kept), "targets": bench["targets"], "headline": []}
    for r in bench["results"]:
        for row in r["rows"]:
            if row["method"].startswith(("native bev_pool", "materialise+native")):
                section["headline"].append(dict(size=r["size"], dtype=r.get("dtype"), **{k: row.get(k) for k in keys}))
    lines = ["", "| size | dtype | method | fwd ms | fwd+bwd ms | fwd+bwd peak MB |", "|---|---|---|---:|---:|---:|"]
    for h in section["headline"]:
        lines.append(
            f"| {h['size']} | {h['dtype']} | {h['method']} | {fmt(h['forward_ms'], '.3f')} | "
            f"{fmt(h['fwd_bwd_ms'], '.3f')} | {fmt(h['fwd_bwd_peak_mb'], '.1f')} |"
        )
    lines += [f"[{'MET' if c['met'] else 'MISSED'}] {c['target']}: {c['ratio']:.2f}x" for c in bench["targets"]]
    return section, lines


def train_bench_section(tb: dict, kept: Path) -> tuple[dict, list[str]]:
    """Each config's training-step variants: median step, speed-up over fp32, arithmetic rate and, where
    profiled, the GPU kernel time and launches per step."""
    section = {"file": os.path.relpath(kept), "configs": {}}
    lines = [
        "",
        "| training step | variant | step ms | vs fp32 | TFLOP/s | GPU kernels ms | launches |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for key, c in tb["configs"].items():
        rows = {
            name: {k: v.get(k) for k in ("step_s", "speedup_vs_fp32", "gflop_per_s", "error")}
            for name, v in c["variants"].items()
        }
        for name, v in c["variants"].items():
            if "profile" in v:
                rows[name].update(
                    gpu_kernel_ms=v["profile"].get("gpu_kernel_ms"),
                    kernels_per_step=v["profile"].get("kernels_per_step"),
                )
        section["configs"][key] = rows
        for name, v in rows.items():
            tflops = fmt(v["gflop_per_s"] / 1e3 if v.get("gflop_per_s") else None, ".1f")
            cell = (
                f"{1e3 * v['step_s']:.1f} | {v['speedup_vs_fp32']}x | {tflops}"
                if v["step_s"]
                else f"failed: {v['error']} | |"
            )
            prof = f"{fmt(v.get('gpu_kernel_ms'), '.1f')} | {fmt(v.get('kernels_per_step'), 'd')}"
            lines.append(f"| {key} (batch {c['batch_size']}) | {name} | {cell} | {prof} |")
    return section, lines


def temporal_bench_section(tb: dict, kept: Path) -> tuple[dict, list[str]]:
    """The temporal step vs its single-frame baseline (scripts/bench_temporal.py)."""
    section = {"file": os.path.relpath(kept), "variants": tb["variants"]}
    lines = [
        "",
        "| temporal step | batch | precision | step ms (median) | vs single-frame |",
        "|---|---:|---|---:|---:|",
    ]
    for name, v in tb["variants"].items():
        lines.append(
            f"| {name} | {v['batch_size']} | {v['precision']} | {1e3 * v['median_s']:.1f} | {fmt(v.get('vs_static'), '.2f')} |"
        )
    return section, lines


def train_section(train_run: Path, what: str = "training") -> tuple[dict | None, list[str]]:
    """Steps, mean loss of the first and last fifth of the logged steps, best val IoU, s/step (as the time
    budget measured it: validations and the first epoch left out; else the training's wall time per step);
    None without a log."""
    metrics = sorted(train_run.glob("csv/version_*/metrics.csv"))
    if not metrics:
        return None, []
    with open(metrics[-1]) as f:
        losses = [(int(r["step"]), float(r["train/loss_step"])) for r in csv.DictReader(f) if r.get("train/loss_step")]
    if not losses:
        return None, []
    k = max(1, len(losses) // 5)
    first, last = statistics.mean(l for _, l in losses[:k]), statistics.mean(l for _, l in losses[-k:])
    section = dict(
        run=os.path.relpath(train_run),
        steps=losses[-1][0] + 1,
        logged=len(losses),
        loss_first_fifth=first,
        loss_last_fifth=last,
        loss_went_down=last < first,
    )
    run_metrics = train_run / "metrics.json"
    speed = ""
    if run_metrics.exists():
        rec = json.loads(run_metrics.read_text())
        section["val_iou_best"] = rec["metrics"].get("val/iou_best")
        measured = (rec.get("time_budget") or {}).get("s_per_step")
        if measured:
            section["s_per_step"] = measured
            speed = f", {measured * 1e3:.1f} ms/step (validations and the first epoch left out)"
        elif rec.get("fit_wall_s") and rec.get("global_step"):
            section["s_per_step"] = rec["fit_wall_s"] / rec["global_step"]
            speed = f", {section['s_per_step'] * 1e3:.1f} ms/step with validations"
    return section, [
        "",
        f"{what}: {section['steps']} steps{speed}, mean train/loss {first:.4f} (first fifth of the logged "
        f"steps) -> {last:.4f} (last fifth): {'went down' if last < first else 'DID NOT go down'}",
    ]


# work-dir file -> (report key, section builder); bench_train_cuda_b16 is the paper config at batch 16.
BENCHMARKS = {
    "bench_pool_cuda": ("bench", pool_section),
    "bench_train_cuda": ("bench_train", train_bench_section),
    "bench_train_cuda_b16": ("bench_train_b16", train_bench_section),
    "bench_temporal_cuda": ("bench_temporal", temporal_bench_section),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", required=True, help="the device's name as a file-name slug")
    p.add_argument("--work", type=Path, required=True, help="gpu_check's work dir (logs/, benchmark JSON, train/)")
    p.add_argument("--results", type=Path, required=True)
    p.add_argument("--times", default="{}", help="JSON: seconds per finished stage")
    p.add_argument("--failed", default="", help="failed stages, space-separated")
    p.add_argument("--pending", default="", help="stages not run yet, space-separated")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Write the report of the work dir's stages; 0 if the check is complete and passed."""
    a = parse_args(argv)
    import torch

    failed, pending = a.failed.split(), a.pending.split()
    gpu = torch.cuda.is_available()  # none: a report of a work dir read elsewhere (its tests, a copied dir)
    report = dict(
        device=torch.cuda.get_device_name() if gpu else "no CUDA device here",
        capability=list(torch.cuda.get_device_capability()) if gpu else None,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        stage_seconds=json.loads(a.times),
        failed_stages=failed,
        pending_stages=pending,
    )
    lines = [f"# GPU check on {report['device']} ({sm(report['capability'])}), torch {report['torch']}", ""]
    for key in ("tests", "tests_emulated"):
        if (a.work / "logs" / f"{key}.log").exists():
            report[key] = junit_counts(a.work / "logs" / f"{key}.xml")
            lines.append(f"{key}: {report[key]}")
    if (a.work / "logs" / "memcheck.log").exists():  # compute-sanitizer exits non-zero on any error it finds
        report["memcheck"] = "failed: see logs/memcheck.log" if "memcheck" in failed else "no errors, tests passed"
        lines.append(f"memcheck: {report['memcheck']}")
    for name, (key, build) in BENCHMARKS.items():  # the benchmarks that exist, kept under the device's name
        src = a.work / f"{name}.json"
        if src.exists():
            text, kept = src.read_text(), a.results / f"{name}_{a.device}.json"
            write(kept, text)
            report[key], more = build(json.loads(text), kept)
            lines += more
    report["train"], more = train_section(a.work / "train")
    lines += more
    went_down = report["train"] is None or report["train"]["loss_went_down"]  # None: skipped (or failed, in `failed`)
    ok = report["ok"] = not failed and not pending and went_down
    lines += [
        "",
        f"stage seconds: {report['stage_seconds']}",
        f"overall: {'OK' if ok else 'NOT DONE' if pending and not failed else 'FAILED'}"
        + (f" (failed stages: {' '.join(failed)}; logs in the work dir)" if failed else "")
        + (f" (still to run: {' '.join(pending)})" if pending else ""),
    ]
    out = a.results / f"gpu_{a.device}.json"
    write(out, json.dumps(report, indent=2) + "\n")
    write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
