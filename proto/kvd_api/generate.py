"""Regenerate (or check) the committed Python code for kvd.v1.

    python -m kvd_api.generate          # rewrite proto/kvd_api/v1/kvd_pb2*.py{,i}
    python -m kvd_api.generate --check  # exit 1 if the committed code is stale
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILE = "kvd_api/v1/kvd.proto"
OUTPUTS = ("kvd_pb2.py", "kvd_pb2.pyi", "kvd_pb2_grpc.py")


def generate(out_root: Path) -> None:
    """Run protoc (from grpcio-tools) on kvd.proto, writing under out_root."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(PROTO_ROOT / PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILE}")


def stale_files() -> list[str]:
    """Names of generated files that differ from what protoc produces now."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / "kvd_api" / "v1"
        committed = PROTO_ROOT / "kvd_api" / "v1"
        return [
            name
            for name in OUTPUTS
            if not (committed / name).exists()
            or not filecmp.cmp(fresh / name, committed / name, shallow=False)
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated code: {', '.join(stale)}; run `make proto`", file=sys.stderr)
            return 1
        print("generated code is up to date")
        return 0
    generate(PROTO_ROOT)
    print(f"regenerated {', '.join(OUTPUTS)} in {PROTO_ROOT / 'kvd_api' / 'v1'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
