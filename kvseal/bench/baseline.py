"""An earlier revision's engine, installed beside this one, so that a benchmark measures before and after in the
same run (kvseal.bench.ops --baseline REV).

How: `git archive REV` of this checkout is unpacked into a temporary directory; `python -m venv --without-pip`
makes a venv there; a .pth file in its site-packages names this environment's site-packages, so the venv finds the
same dependencies (numpy, grpcio, ...) but not this checkout's kvseal (a .pth line adds a directory to sys.path;
the editable install's own hook in this environment is not run); then this environment's pip installs REV into
the venv (`--no-deps --no-build-isolation --ignore-installed --prefix`: without --ignore-installed pip would first
uninstall this environment's own kvseal), which builds REV's copy kernel with this environment's
setuptools. The engine of REV is then `VENV/bin/python -m kvseal serve`, started in `where` (`python -m` puts its
working directory first on sys.path: started in this checkout, it would import this checkout's kvseal); install
checks that it imports its own.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def install(rev: str, where: Path) -> str:
    """Installs the engine of `rev` into a venv under `where`; returns its python, to be run in `where`. Raises
    RuntimeError with git's or pip's message when it cannot."""
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
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--ignore-installed"]
    pip += ["--prefix", str(venv)]  # --ignore-installed: else pip uninstalls this environment's kvseal first
    _run([*pip, str(src)], f"pip install of {rev}")
    found = _run([str(python), "-c", "import kvseal; print(kvseal.__file__)"], "the venv", cwd=where).decode().strip()
    if not found.startswith(str(venv)):
        raise RuntimeError(f"the venv of {rev} imports kvseal from {found}, not from its own install")
    return str(python)


ENV = {"PYTHONPATH": ""}  # set for the baseline's processes: they import its own kvseal, not one a PYTHONPATH names


def _run(argv: list[str], what: str, cwd: Path | None = None) -> bytes:
    env = dict(os.environ, **ENV)
    r = subprocess.run(argv, capture_output=True, stdin=subprocess.DEVNULL, timeout=600, cwd=cwd, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed: {r.stderr.decode(errors='replace')[-2000:]}")
    return r.stdout
