#!/usr/bin/env python3
"""Generates the gRPC stubs of atmost_client from proto/atmost/v1/*.proto.

    python generate_stubs.py [OUT_DIR]

OUT_DIR defaults to src/atmost_client/_pb, where the stubs are committed.
Run it with the grpcio-tools pinned in requirements-test.txt: the generated
code names the protobuf and grpcio versions it needs, so another version
makes different files, and tests/test_stubs.py (which regenerates them into
a temporary folder and compares) fails until the pin and the stubs agree.

protoc writes `from atmost.v1 import types_pb2` (the .proto import path);
the stubs live inside the package instead, so those imports are rewritten to
`from atmost_client._pb import types_pb2`, and the files are laid flat.
"""

import pathlib
import re
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent.parent / "proto"
DEFAULT_OUT = HERE / "src" / "atmost_client" / "_pb"
IMPORT = re.compile(r"^from atmost\.v1 import ", re.MULTILINE)

INIT = '''"""Generated from proto/atmost/v1/*.proto by clients/python/generate_stubs.py.

Do not edit: run the generator (tests/test_stubs.py fails when these files
differ from what it makes).
"""
'''


def generate(out_dir: pathlib.Path) -> None:
    protos = sorted((PROTO_ROOT / "atmost" / "v1").glob("*.proto"))
    if not protos:
        sys.exit(f"generate_stubs.py: no .proto files under {PROTO_ROOT}")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                *[str(p) for p in protos],
            ],
            check=True,
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.iterdir():
            if old.is_file():
                old.unlink()
        (out_dir / "__init__.py").write_text(INIT, encoding="utf-8")
        for made in sorted((pathlib.Path(tmp) / "atmost" / "v1").iterdir()):
            text = IMPORT.sub("from atmost_client._pb import ", made.read_text(encoding="utf-8"))
            (out_dir / made.name).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT)
