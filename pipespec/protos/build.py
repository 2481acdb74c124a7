"""Regenerates pipespec/protos/pipespec_pb2.py and pipespec/protos/pipespec_pb2_grpc.py from pipespec/protos/pipespec.proto.

    python -m pipespec.protos.build [--out DIR]

The generated files are committed; tests/test_protos.py regenerates them into a temporary directory
and checks the committed ones are identical, so they never drift from the .proto.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent


def build(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    code = protoc.main(
        ["grpc_tools.protoc", f"-I{HERE}", f"--python_out={out}", f"--grpc_python_out={out}", str(HERE / "pipespec.proto")]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    grpc_module = out / "pipespec_pb2_grpc.py"
    # protoc writes a top-level import; make it absolute within the `pipespec.protos` package
    text = re.sub(r"^import pipespec_pb2 as", "from pipespec.protos import pipespec_pb2 as", grpc_module.read_text(), flags=re.M)
    grpc_module.write_text(text)
    return [out / "pipespec_pb2.py", grpc_module]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE)
    for path in build(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    sys.exit(main())
