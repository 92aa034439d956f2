"""The committed protobuf modules must be what kvseal.proto generates (run kvseal/proto/generate.sh)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_modules_are_current(tmp_path: Path) -> None:
    (tmp_path / "kvseal" / "proto").mkdir(parents=True)
    shutil.copy(ROOT / "kvseal" / "proto" / "kvseal.proto", tmp_path / "kvseal" / "proto")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            "--python_out=.",
            "--pyi_out=.",
            "--grpc_python_out=.",
            "kvseal/proto/kvseal.proto",
        ],
        cwd=tmp_path,
        check=True,
    )
    for name in ("kvseal_pb2.py", "kvseal_pb2.pyi", "kvseal_pb2_grpc.py"):
        fresh = (tmp_path / "kvseal" / "proto" / name).read_text()
        committed = (ROOT / "kvseal" / "proto" / name).read_text()
        assert fresh == committed, f"kvseal/proto/{name} is stale: run kvseal/proto/generate.sh"
