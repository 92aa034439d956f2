"""An earlier revision's engine, installed beside this one, so that a benchmark measures before and after in the
same run (kvseal.bench.ops --baseline REV).

How: `git archive REV` of this checkout is unpacked into a temporary directory; `python -m venv --without-pip`
makes a venv there; a .pth file in its site-packages names this environment's site-packages, so the venv finds the
same dependencies (numpy, grpcio, ...) but not this checkout's kvseal (a .pth line adds a directory to sys.path;
the editable install's own hook in this environment is not run); then this environment's pip installs REV into
the venv (`--no-deps --no-build-isolation --prefix`), which builds REV's copy kernel with this environment's
setuptools. The engine of REV is then `VENV/bin/python -m kvseal serve`.
"""

from __future__ import annotations

import io
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def install(rev: str, where: Path) -> str:
    """Installs the engine of `rev` into a venv under `where`; returns its python. Raises RuntimeError with git's or
    pip's message when it cannot."""
    src, venv = where / "src", where / "venv"
    archive = _run(["git", "-C", str(REPO), "archive", "--format=tar", rev], f"git archive {rev}")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(src, filter="data")
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], "python -m venv")
    python = venv / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], "the venv")
    site = Path(purelib.decode().strip())
    site.mkdir(parents=True, exist_ok=True)
    (site / "_kvseal_bench_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--prefix", str(venv)]
    _run([*pip, str(src)], f"pip install of {rev}")
    return str(python)


def _run(argv: list[str], what: str) -> bytes:
    r = subprocess.run(argv, capture_output=True, stdin=subprocess.DEVNULL, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed: {r.stderr.decode(errors='replace')[-2000:]}")
    return r.stdout
