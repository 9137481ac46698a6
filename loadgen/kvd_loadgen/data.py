"""Where the shared traces are: $KVD_DATA_DIR, else `shared/data` beside the project (the
source), else the copy that ships inside this package, `kvd_loadgen/traces` (so a clone
anywhere, or an installed wheel, can run the tests and the bench; a test checks the copy
still equals the source when both are there)."""

from __future__ import annotations

import os
from pathlib import Path

COMMITTED_COPY = Path(__file__).resolve().parent / "traces"
INTENT_PROFILES = ("balanced", "deadline_pressure", "rag_mixed_priority", "speculative_decode",
                   "long_context_extreme")


def data_dir() -> Path:
    env = os.environ.get("KVD_DATA_DIR")
    if env:
        return Path(env)
    for start in (Path.cwd(), Path(__file__).resolve()):
        for parent in (start, *start.parents):
            candidate = parent / "shared" / "data"
            if candidate.is_dir():
                return candidate
    if COMMITTED_COPY.is_dir():
        return COMMITTED_COPY
    raise FileNotFoundError("cannot find shared/data; set KVD_DATA_DIR")


def resolve_intent_trace(name: str) -> Path:
    """A trace file path, or a profile name from shared/data/intent-traces."""
    path = Path(name)
    if path.exists():
        return path
    candidate = data_dir() / "intent-traces" / f"{name}.intent.jsonl.gz"
    if candidate.exists():
        return candidate
    raise FileNotFoundError(f"no trace file or profile named {name!r}")
