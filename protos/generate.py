"""Regenerate the Python stubs for every .proto under protos/.

Run `python -m protos.generate` from the repository root after editing a
.proto file; tests/test_protos.py fails when the committed stubs are stale.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto into out_dir."""
    import grpc_tools
    from grpc_tools import protoc  # imported lazily: only this tool needs it

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))


def generated_files(out_dir: Path) -> dict[str, bytes]:
    """Generated stubs under out_dir/protos, keyed by their path relative to out_dir."""
    return {
        str(p.relative_to(out_dir)): p.read_bytes() for p in sorted((out_dir / "protos").rglob("*_pb2*.py*"))
    }


def stale_files() -> list[str]:
    """Names of generated files that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = generated_files(Path(tmp))
    committed = generated_files(ROOT)
    return sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))


def main() -> int:
    generate(ROOT)
    print("generated:", ", ".join(sorted(generated_files(ROOT))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
