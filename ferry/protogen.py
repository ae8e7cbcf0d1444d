"""Generate Python code from protos/ into libs/pb (committed), or check that
the committed code is current (``--check``, run by ``make test`` and CI)."""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_PKG = pathlib.Path("libs") / "pb"


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    from grpc_tools import protoc  # dev dependency: only needed to (re)generate

    protos = sorted(PROTO_ROOT.glob("libs/pb/*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p.relative_to(out_root) for p in (out_root / OUT_PKG).glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if libs/pb is stale")
    args = parser.parse_args(argv)
    if not args.check:
        files = generate(ROOT)
        print(f"generated {len(files)} files in {OUT_PKG}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(pathlib.Path(tmp))
        committed = sorted(p.relative_to(ROOT) for p in (ROOT / OUT_PKG).glob("*_pb2*.py*"))
        stale = [str(f) for f in files if not (ROOT / f).exists()
                 or not filecmp.cmp(pathlib.Path(tmp) / f, ROOT / f, shallow=False)]
        extra = [str(f) for f in committed if f not in files]
    if stale or extra:
        print("generated protobuf code is stale; run `make protos` and commit:", *stale, *extra, sep="\n  ")
        return 1
    print(f"protos up to date ({len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
