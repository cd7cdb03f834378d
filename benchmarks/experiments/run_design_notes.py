"""Runs every ``--full`` experiment in sequence and writes one table: experiment | design notes | ours
(0.6B) | ours (7B shapes).

Each experiment runs in its own process (a fresh device, so JAX's peak-memory statistic belongs to
it) under a time limit (``--limit``, 180 s by default: each experiment should finish in under 3 minutes,
compilation included); a job that times out or fails gets that written in its cells, and the rest go on.
Every job writes its JSON report and log under ``--out/<job>/``; the table is rebuilt from every job
folder present under ``--out``, so jobs run in separate calls (``--only``) merge into one table
(``--table-only`` rebuilds it without running anything).

    python benchmarks/experiments/run_design_notes.py --out DIR                       # all jobs (GPU; ~6 x 3 min at most)
    python benchmarks/experiments/run_design_notes.py --out DIR --only memory-0.6b,memory-7b
    python benchmarks/experiments/run_design_notes.py --out DIR --table-only
    python benchmarks/experiments/run_design_notes.py --out DIR --tiny                # the same jobs at tiny sizes (CPU)

Writes ``design_notes.md`` (the table) and ``design_notes.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# job -> (script, report file, column, extra arguments)
JOBS = {
    "memory-0.6b": ("exp_memory.py", "memory.json", "0.6b", ["--model", "qwen3-0.6b"]),
    "memory-7b": ("exp_memory.py", "memory.json", "7b", ["--model", "qwen2.5-7b"]),
    "prefix-0.6b": ("exp_prefix_cache.py", "prefix_cache.json", "0.6b", ["--model", "qwen3-0.6b"]),
    "prefix-7b": ("exp_prefix_cache.py", "prefix_cache.json", "7b", ["--model", "qwen2.5-7b"]),
    "block-size-0.6b": ("exp_block_size.py", "block_size.json", "0.6b", ["--model", "qwen3-0.6b"]),
    "affinity-0.6b": ("exp_prefix_affinity.py", "prefix_affinity.json", "0.6b", ["--model", "qwen3-0.6b"]),
}
# Table order; an experiment no job reports stays in the table with empty cells.
EXPERIMENTS = ["memory_64x8", "memory_7b_32", "prefix_ttft", "prefix_concurrency", "block_size", "timestamp_miss",
               "prefix_affinity"]


def run_job(name: str, out: Path, limit: float, tiny: bool) -> dict:
    """Runs one job in a subprocess; returns its status (the report stays in ``out/name``)."""
    script, _, _, extra = JOBS[name]
    job_dir = out / name
    job_dir.mkdir(parents=True, exist_ok=True)
    if tiny:  # the --full code path at tiny sizes, tiny model (CPU)
        extra = ["--model", "tiny", "--tiny-override"]
    cmd = [sys.executable, str(HERE / script), "--full", *extra, "--out", str(job_dir)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(job_dir / "log.txt", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit, env=env).returncode
            status = "ok" if rc == 0 else f"FAILED (exit {rc}, see {name}/log.txt)"
        except subprocess.TimeoutExpired:
            status = f"TIMEOUT after {limit:.0f} s (see {name}/log.txt)"
    status = dict(job=name, status=status, seconds=time.perf_counter() - t0, command=" ".join(cmd))
    (job_dir / "status.json").write_text(json.dumps(status))
    print(f"[{name}] {status['status']} in {status['seconds']:.0f} s", flush=True)
    return status


def build_table(out: Path) -> tuple[str, dict]:
    """Markdown table (and its data) from every job folder under ``out``."""
    cells: dict[str, dict[str, str]] = {e: {} for e in EXPERIMENTS}
    notes: dict[str, str] = {}
    jobs = {}
    for name, (_, report_file, column, _) in JOBS.items():
        job_dir = out / name
        if not (job_dir / "status.json").is_file():
            continue
        status = json.loads((job_dir / "status.json").read_text())
        jobs[name] = status
        report_path = job_dir / report_file
        if status["status"] == "ok" and report_path.is_file():
            for row in json.loads(report_path.read_text()).get("design_notes_rows", []):
                if row["experiment"] not in experiments_of(name):
                    continue  # e.g. the 0.6B-only memory workload in a --tiny run of the 7B job
                cells.setdefault(row["experiment"], {})[column] = row["ours"]
                notes[row["experiment"]] = row["design_notes"]
        else:  # say so in every cell this job would have filled
            for experiment in experiments_of(name):
                cells[experiment].setdefault(column, status["status"])
    lines = ["| experiment | design notes | ours (0.6B) | ours (7B shapes) |", "| --- | --- | --- | --- |"]
    for experiment, by_column in cells.items():
        lines.append(f"| {experiment} | {notes.get(experiment, '')} | {by_column.get('0.6b', '-')} | "
                     f"{by_column.get('7b', '-')} |")
    return "\n".join(lines) + "\n", dict(cells=cells, design_notes=notes, jobs=jobs)


def experiments_of(job: str) -> list[str]:
    """The table rows a job fills (for marking a failed job's cells)."""
    return {"memory-0.6b": ["memory_64x8", "memory_7b_32"], "memory-7b": ["memory_7b_32"],
            "prefix-0.6b": ["prefix_ttft", "prefix_concurrency", "timestamp_miss"],
            "prefix-7b": ["prefix_ttft", "prefix_concurrency", "timestamp_miss"],
            "block-size-0.6b": ["block_size"], "affinity-0.6b": ["prefix_affinity"]}[job]


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=",".join(JOBS), help=f"comma-separated jobs out of {','.join(JOBS)}")
    ap.add_argument("--limit", type=float, default=180.0, help="seconds per job")
    ap.add_argument("--table-only", action="store_true", help="rebuild the table from --out, run nothing")
    ap.add_argument("--tiny", action="store_true", help="tiny model and sizes (CPU check of the whole driver)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(names) - set(JOBS))
        if unknown:
            ap.error(f"unknown jobs {unknown}; known: {list(JOBS)}")
        for name in names:
            run_job(name, out, args.limit, args.tiny)
    table, data = build_table(out)
    (out / "design_notes.md").write_text(table)
    (out / "design_notes.json").write_text(json.dumps(data, indent=1))
    print(table)
    return table


if __name__ == "__main__":
    main()
