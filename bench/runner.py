"""`python -m bench`: run the benchmarks, print medians and ratios, write JSON and Markdown.

    python -m bench [--quick] [--only NAME[,NAME...]] [--select TEXT[,TEXT...]] [--threads 1]
                    [--out bench/results]

`--select` runs some columns of the chosen benchmarks (with their cases' floors) and writes
``<stem>-selected.*``, so that a full run's files are not replaced by a part of one.

Each job (one column of one block) runs in a fresh ``python -m bench.worker`` process whose
environment pins BLAS, OpenMP and XLA to ``--threads`` threads before anything is imported. A
missing peer is skipped with a note; a job that fails or times out is reported with its error;
neither stops the run. Exit status: 0 after a run (whatever was skipped), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import pareto, report, suite, targets
from .measure import machine, thread_env
from .peers import missing
from .table import Row, add_model_ratios, add_ratios, format_seconds

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and 3 repeats (the whole run in under 2 minutes)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help=f"run only these benchmarks (repeat or comma-separate): "
                             f"{', '.join(suite.BENCHMARKS)}; and, only when named, "
                             f"{', '.join(suite.OPT_IN)}")
    parser.add_argument("--threads", type=int, default=1,
                        help="BLAS / intra-op threads for every column (default 1)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"),
                        help="folder for the JSON and Markdown results (default bench/results)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds before one job is stopped (default 900, quick 120)")
    parser.add_argument("--select", action="append", default=[], metavar="TEXT",
                        help="run only the columns whose case or name contains one of these "
                             "texts (repeat or comma-separate; case-insensitive), with the "
                             "floor of each case they are in, e.g. --select 'T=1024,keep-all'")
    return parser.parse_args(argv)


def select_jobs(jobs: list[suite.Job], texts: list[str]) -> list[suite.Job]:
    """The jobs whose case or name contains one of `texts` (every text a case, or every text
    a name, must match: ``T=1024,keep-all`` is the keep-all columns of the T = 1,024 case),
    and the floor jobs of their cases; all jobs without `texts`."""
    wanted = [t.strip().lower() for part in texts for t in part.split(",") if t.strip()]
    if not wanted:
        return jobs
    cases = {j.case for j in jobs}
    case_texts = [t for t in wanted if any(t in c.lower() for c in cases)]
    name_texts = [t for t in wanted if t not in case_texts]

    def picked(job: suite.Job) -> bool:
        in_case = not case_texts or any(t in job.case.lower() for t in case_texts)
        named = not name_texts or any(t in job.name.lower() for t in name_texts)
        return in_case and named

    chosen = {(j.case, j.name) for j in jobs if picked(j)}
    keep_cases = {case for case, _ in chosen}
    return [j for j in jobs if (j.case, j.name) in chosen
            or (j.role == "floor" and j.case in keep_cases)]


def _selection(only: list[str]) -> set[str] | None:
    names = {n.strip() for part in only for n in part.split(",") if n.strip()}
    unknown = sorted(names - set(suite.BENCHMARKS) - set(suite.OPT_IN))
    if unknown:
        raise SystemExit(f"python -m bench: unknown benchmark(s) {', '.join(unknown)}; "
                         f"choose from {', '.join((*suite.BENCHMARKS, *suite.OPT_IN))}")
    return names or None


def _worker_env(threads: int) -> dict[str, str]:
    env = thread_env(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def run_job(job: suite.Job, threads: int, timeout: float) -> tuple[list[Row], dict[str, Any]]:
    """The rows one job produced (a single row with a note if it was skipped or failed)."""
    def noted(note: str, **extras: Any) -> list[Row]:
        return [Row(job.bench, job.case, job.name, job.role, note=note, extras=extras)]

    reason = missing(job.peer)
    if reason is not None:
        return noted(reason), {}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "bench.worker", job.task, "--params",
                   json.dumps(job.params), "--out", str(out), "--threads", str(threads)]
        try:
            proc = subprocess.run(command, cwd=REPO, env=_worker_env(threads),
                                  capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return noted(f"failed: timed out after {timeout:.0f} s"), {}
        if not out.exists():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return noted(f"failed: worker exited with {proc.returncode}: {last}",
                         stderr=proc.stderr[-4000:]), {}
        payload = json.loads(out.read_text())
    if not payload["ok"]:
        return noted(payload["note"], traceback=payload.get("traceback", "")), payload
    result = payload["result"]
    if "rows" in result:
        rows = [Row.from_result(job.bench, job.case, r["name"], "", r) for r in result["rows"]]
    else:
        rows = [Row.from_result(job.bench, job.case, job.name, job.role, result)]
    return rows, payload


def _summary(rows: list[Row]) -> str:
    if len(rows) == 1 and rows[0].seconds is None:
        return rows[0].note
    return ", ".join(f"{r.name if len(rows) > 1 else ''} {format_seconds(r.seconds)}".strip()
                     for r in rows)


def _pools(payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: dict[tuple, dict[str, Any]] = {}
    for payload in payloads:
        for pool in payload.get("blas", []):
            key = (pool.get("library"), pool.get("internal_api"), pool.get("num_threads"))
            seen.setdefault(key, pool)
    return list(seen.values())


def _stem(quick: bool, only: set[str] | None) -> str:
    parts = ["bench"] + (["quick"] if quick else []) + sorted(only or ())
    return "-".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        only = _selection(args.only)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.threads < 1:
        print("python -m bench: --threads must be at least 1", file=sys.stderr)
        return 2
    timeout = args.timeout or (120.0 if args.quick else 900.0)
    jobs = select_jobs(suite.jobs(args.quick, only), args.select)
    if not jobs:
        print("python -m bench: --select matched no column", file=sys.stderr)
        return 2
    meta = machine(args.threads)
    meta["mode"] = "quick" if args.quick else "default"
    meta["command"] = " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])])
    meta["sizes"] = {name: suite.SIZES[meta["mode"]][name] for name in (only or suite.BENCHMARKS)}
    print(f"{len(jobs)} jobs, {args.threads} thread(s) each, OPENBLAS_CORETYPE="
          f"{meta['OPENBLAS_CORETYPE'] or 'not set'}", flush=True)
    started = time.perf_counter()
    rows: list[Row] = []
    payloads = []
    for i, job in enumerate(jobs, 1):
        begun = time.perf_counter()
        job_rows, payload = run_job(job, args.threads, timeout)
        rows += job_rows
        payloads.append(payload)
        print(f"[{i:>2}/{len(jobs)}] {job.bench} {job.case} · {job.name}: {_summary(job_rows)} "
              f"({time.perf_counter() - begun:.1f} s)", flush=True)
    meta["wall_seconds"] = time.perf_counter() - started
    meta["blas"] = _pools(payloads)
    rows = pareto.merge_rounds(rows)  # its rounds, one row per point
    add_ratios(rows, suite.RATIOS)
    add_model_ratios(rows)
    checked = targets.check(rows)
    print()
    print(report.render_text(meta, rows, checked))
    stem = _stem(args.quick, only) + ("-selected" if args.select else "")  # not a full run's
    paths = report.write(Path(args.out), stem, meta, rows, checked)
    figure = pareto.plot(rows, Path(args.out) / f"{stem}.png")
    paths += [figure] if figure is not None else []
    print("written: " + ", ".join(str(p) for p in paths))
    return 0
