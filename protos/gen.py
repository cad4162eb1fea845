"""Regenerate the committed Python stubs from ``protos/ssd/v1/ssd.proto`` (``make proto``).

The stubs are committed; ``tests/test_protos.py`` checks that regenerating them gives no diff. Import paths follow
the file layout (``protos.ssd.v1.ssd_pb2``), so no post-processing is needed.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "protos/ssd/v1/ssd.proto"


def generate(out_dir: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = ["protoc", f"-I{ROOT}", f"-I{well_known}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(ROOT / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
