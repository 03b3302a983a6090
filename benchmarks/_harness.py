"""Shared plumbing: records, percentiles, machine info, fresh-subprocess cases, merged JSON output."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import DEFAULT_WORK_DIR, PACKAGE_DIR

# Fields every record carries (None where a field does not apply to the method).
REQUIRED_FIELDS = ("rows", "dim", "method", "p50_ms", "p95_ms", "p99_ms", "qps", "recall_at_10", "peak_rss_mb")
_VERSIONED_PACKAGES = ("drift-lance", "lancedb", "pylance", "pyarrow", "polars", "numpy", "openai", "graphrag")
_RESULT_MARKER = "BENCH-RESULT "


@dataclass
class Record:
    """One measured case. Latencies in ms; `qps` is throughput with one query in flight,
    `qps_concurrent` with `concurrency` queries in flight."""

    benchmark: str
    rows: int | None
    dim: int | None
    method: str
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    qps: float | None = None
    qps_concurrent: float | None = None
    concurrency: int | None = None
    recall_at_10: float | None = None
    peak_rss_mb: float | None = None
    queries: int | None = None
    index_type: str | None = None
    index_build_s: float | None = None
    params: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    measured_at: str = ""

    def to_json(self) -> dict[str, Any]:
        if not self.machine:
            self.machine = machine_info()
        if not self.versions:
            self.versions = library_versions()
        if not self.measured_at:
            self.measured_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return _round_floats(asdict(self))


def _round_floats(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 4)
    if isinstance(value, dict):
        return {k: _round_floats(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_round_floats(v) for v in value]
    return value


def latency_summary(latencies_s: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99 in milliseconds of per-query latencies given in seconds."""
    ms = np.asarray(latencies_s, dtype=np.float64) * 1000.0
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {"p50_ms": float(p50), "p95_ms": float(p95), "p99_ms": float(p99)}


def recall_at_k(found: Sequence[Sequence[int]], truth: np.ndarray, k: int = 10) -> float:
    """Mean fraction of the exact top-k ids present in each returned top-k."""
    hits = [len(set(map(int, got[:k])) & set(map(int, exact[:k]))) for got, exact in zip(found, truth, strict=True)]
    return float(np.mean(hits)) / k


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def machine_info() -> dict[str, Any]:
    import psutil

    return {
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "cpu": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def library_versions() -> dict[str, str]:
    versions = {}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def work_dir() -> Path:
    path = Path(os.environ.get("DRIFT_LANCE_BENCH_WORK", DEFAULT_WORK_DIR))
    path.mkdir(parents=True, exist_ok=True)
    return path


class CaseFailed(RuntimeError):
    """A benchmark case subprocess exited non-zero or printed no result."""


def run_case(target: str, timeout_s: float | None = None, *, python: str | None = None,
             env: dict[str, str] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Run `module:function(**kwargs)` in a fresh interpreter (`python`, default this one) and return
    its result dict, with `peak_rss_mb` (the child's own peak) and `wall_s` added. A fresh process per
    case keeps one case's memory and caches out of the next one's numbers."""
    spec = json.dumps({"target": target, "kwargs": kwargs})
    env = child_env(env)
    # An earlier case's writes (a 10^6 x 1536 ingest leaves GBs to flush) go to disk now, not
    # while this case times queries that read the same disk.
    os.sync()
    proc = subprocess.run(
        [python or sys.executable, "-m", "benchmarks._worker", spec],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_RESULT_MARKER) and proc.returncode == 0:
            return json.loads(line[len(_RESULT_MARKER) :])
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
    raise CaseFailed(f"benchmark case {target} {kwargs} failed (exit {proc.returncode}):\n{tail}")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a Python child that imports `benchmarks` (and `extra`)."""
    return {**os.environ, **(extra or {}), "PYTHONPATH": _pythonpath()}


def _pythonpath() -> str:
    root = str(PACKAGE_DIR.parent)
    existing = os.environ.get("PYTHONPATH")
    return f"{root}{os.pathsep}{existing}" if existing else root


def emit_result(result: dict[str, Any]) -> None:
    """Called by the worker: print the case's result on one marked line."""
    print(_RESULT_MARKER + json.dumps(result), flush=True)


def record_key(record: dict[str, Any]) -> str:
    """Identity of a case: a rerun with the same key replaces the older record. Sweep and curve points
    are one case per index type and parameter set, DRIFT runs one per simulated LLM latency; every
    other benchmark keeps one record per (rows, dim, method), the latest."""
    parts = [record.get("benchmark"), record.get("rows"), record.get("dim"), record.get("method")]
    if record.get("benchmark") in ("sweep", "curve"):
        parts += [record.get("index_type"), json.dumps(record.get("params", {}), sort_keys=True)]
    elif record.get("benchmark") == "drift":
        parts.append(record.get("params", {}).get("latency_ms"))
    return json.dumps(parts)


def write_records(out_dir: Path, name: str, records: Iterable[Record | dict[str, Any]]) -> Path:
    """Merge `records` into `out_dir/<name>.json` (a JSON list), replacing records with the same key,
    so runs at several sizes accumulate in one file. Locked: parallel runs may share a file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    new = [r.to_json() if isinstance(r, Record) else r for r in records]
    with open(_lock_path(path), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        existing = json.loads(path.read_text()) if path.exists() else []
        merged = {record_key(r): r for r in existing}
        merged.update({record_key(r): r for r in new})
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(list(merged.values()), indent=1) + "\n")
        tmp.replace(path)
    return path


def _lock_path(path: Path) -> Path:
    """A lock file outside the results directory (which is committed), one per results file."""
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"drift-lance-bench-{digest}.lock"


def load_records(out_dir: Path, name: str) -> list[dict[str, Any]]:
    path = out_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else []


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
