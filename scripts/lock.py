"""Remake the hashed lock files in requirements/ (``make lock``).

    python scripts/lock.py [--upgrade]

- ``requirements/cpu.lock``: pagedkv with its ``dev`` extra and its build requirements, what
  ``make install`` (and so CI) and the CPU image install;
- ``requirements/cuda.lock``: pagedkv with its ``cuda12`` and ``triton`` extras and its build
  requirements, what the CUDA image installs, with torch held to ``CUDA_TORCH_VERSION`` and Triton
  pinned to ``CUDA_TRITON_VERSION`` (the GPU machines' image);
- ``requirements/protos.lock``: the generator of the gRPC code (requirements/protos.in).

Each is resolved by ``uv pip compile --universal --generate-hashes`` for every Python pagedkv
supports. torch is held to ``TORCH_VERSION`` (CUDA: ``CUDA_TORCH_VERSION``) but left out of the
CPU and CUDA locks, with the CUDA libraries of its PyPI build (``nvidia-*``, ``cuda-*``): each
install takes torch first from the index of its build (the CPU wheel here, ``TORCH_INDEX_URL`` in
the image), then the lock with ``--no-deps``. triton is in both locks, at the version that torch
pins (CUDA: ``requirements/cuda-constraints.txt``, which this script writes).

Without ``--upgrade`` the versions already locked are kept where they still resolve.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQ = ROOT / "requirements"
TORCH_VERSION = "2.13.0"
#: The CUDA image's torch and Triton: the versions of the GPU machines the device check runs on
#: (their image: torch 2.11.0, Triton 3.6.0), so that what the image installs is what was checked.
CUDA_TORCH_VERSION = "2.11.0"
CUDA_TRITON_VERSION = "3.6.0"
CUDA_CONSTRAINTS = REQ / "cuda-constraints.txt"
PYTHON_MIN = "3.10"


def uv() -> str:
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if found is None:
        raise SystemExit("uv not found: install the dev extra (make install)")
    return found


def compile_lock(inputs: list[str], out: Path, extra: list[str], upgrade: bool) -> None:
    cmd = [uv(), "pip", "compile", "-q", "--universal", "--python-version", PYTHON_MIN, "--generate-hashes",
           "--index-url", "https://pypi.org/simple", "--no-emit-index-url",
           "--custom-compile-command", "make lock", *extra, *inputs, "-o", str(out)]
    if upgrade:
        cmd.append("--upgrade")
    subprocess.run(cmd, check=True, cwd=ROOT)
    pins = re.findall(r"^[A-Za-z0-9_.-]+==", out.read_text(), flags=re.M)
    print(f"wrote {out.relative_to(ROOT)}: {len(pins)} pins")


def torch_build_packages(tmp: Path, version: str = TORCH_VERSION) -> list[str]:
    """torch and the packages that only its CUDA build brings (the nvidia-* and cuda-* wheels)."""
    (tmp / "torch.in").write_text(f"torch=={version}\n")
    out = tmp / "torch.txt"
    subprocess.run([uv(), "pip", "compile", "-q", "--universal", "--python-version", PYTHON_MIN, "--no-header",
                    "--index-url", "https://pypi.org/simple", str(tmp / "torch.in"), "-o", str(out)],
                   check=True, cwd=ROOT)
    names = re.findall(r"^([A-Za-z0-9_.-]+)==", out.read_text(), flags=re.M)
    return ["torch", *sorted(n for n in names if re.match(r"(nvidia|cuda)-", n))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upgrade", action="store_true", help="take the newest versions, not the locked ones")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        held = torch_build_packages(tmp)
        (tmp / "torch-constraint.txt").write_text(f"torch=={TORCH_VERSION}\n")
        common = ["-c", str(tmp / "torch-constraint.txt")]
        for package in held:
            common += ["--no-emit-package", package]
        compile_lock(["pyproject.toml", "requirements/build.in"], REQ / "cpu.lock", [*common, "--extra", "dev"],
                     args.upgrade)
        cuda_held = torch_build_packages(tmp, CUDA_TORCH_VERSION)
        CUDA_CONSTRAINTS.write_text(f"# The CUDA image's torch and Triton (scripts/lock.py writes this file).\n"
                                    f"torch=={CUDA_TORCH_VERSION}\ntriton=={CUDA_TRITON_VERSION}\n")
        cuda = ["-c", str(CUDA_CONSTRAINTS.relative_to(ROOT))]
        for package in cuda_held:
            cuda += ["--no-emit-package", package]
        compile_lock(["pyproject.toml", "requirements/build.in"], REQ / "cuda.lock",
                     [*cuda, "--extra", "cuda12", "--extra", "triton"], args.upgrade)
    compile_lock(["requirements/protos.in"], REQ / "protos.lock", [], args.upgrade)
    return 0


if __name__ == "__main__":
    sys.exit(main())
