"""Regenerate the Python code for proto/pdserve/v1/*.proto into pdserve/v1/.

Usage: python scripts/gen_proto.py [--check]
  --check  regenerate into a temp dir and exit 1 if the committed code differs
           (tests/proto/test_generated.py runs this).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = Path("pdserve") / "v1"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto under proto/pdserve/v1; return the generated files."""
    protos = sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_dir / PACKAGE).glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    target = ROOT / PACKAGE
    if not args.check:
        generate(ROOT)
        print(f"generated into {target}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [
            f.name
            for f in fresh
            if not (target / f.name).exists() or not filecmp.cmp(f, target / f.name, shallow=False)
        ]
    if stale:
        print("generated protobuf code is stale: run `make proto`: " + ", ".join(stale))
        return 1
    print("generated protobuf code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
