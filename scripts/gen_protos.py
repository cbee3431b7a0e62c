"""Regenerate the protobuf and gRPC code beside the .proto sources.

One command (``make protos`` or ``python scripts/gen_protos.py``) writes
``*_pb2.py``, ``*_pb2_grpc.py`` and ``*_pb2.pyi`` next to each ``.proto`` under
``protos/``; ``--check`` regenerates into a temporary folder and exits 1 when the
committed files differ (tests/pagedkv/test_protos.py runs it).

The generator is pinned: grpcio-tools ``GRPCIO_TOOLS_VERSION`` (requirements/protos.in), with
googleapis-common-protos for the ``google/rpc/status.proto`` the compute service imports. Its
output carries no protobuf version guard (gencode 5.26.1) and needs grpcio 1.65.5 or newer,
so the committed code imports on the floors in pyproject.toml and on the newest releases
(protobuf 4.25 to 7.x were tried). An interpreter without
that release runs this script again in ``.venv-protos``, made on first use from the hashed
requirements/protos.lock.
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
GRPCIO_TOOLS_VERSION = "1.65.5"
TOOL_LOCK = ROOT / "requirements" / "protos.lock"
TOOL_ENV = ROOT / ".venv-protos"


def has_pinned_generator() -> bool:
    """True when this interpreter has grpcio-tools ``GRPCIO_TOOLS_VERSION``."""
    try:
        return importlib.metadata.version("grpcio-tools") == GRPCIO_TOOLS_VERSION
    except importlib.metadata.PackageNotFoundError:
        return False


def tool_python() -> Path:
    """The interpreter of ``.venv-protos``, made (or remade when the lock changed) from the lock.

    Raises:
        subprocess.CalledProcessError: pip could not install the lock.
    """
    python = TOOL_ENV / "bin" / "python"
    stamp = TOOL_ENV / ".lock-sha256"
    digest = hashlib.sha256(TOOL_LOCK.read_bytes()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return python
    print(f"making {TOOL_ENV.name} (grpcio-tools {GRPCIO_TOOLS_VERSION}) from {TOOL_LOCK.relative_to(ROOT)}")
    venv.EnvBuilder(clear=True, with_pip=True).create(TOOL_ENV)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", "--require-hashes", "-r", str(TOOL_LOCK)], check=True)
    stamp.write_text(digest + "\n")
    return python


def proto_files() -> list[Path]:
    """Every .proto under protos/, relative to it, sorted."""
    return sorted(p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run grpcio-tools' protoc into ``out_dir``; return the generated paths (relative).

    Raises:
        RuntimeError: protoc failed.
    """
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    rpc = importlib.metadata.distribution("googleapis-common-protos")  # ships google/rpc/status.proto
    rpc_include = Path(rpc.locate_file("google/rpc/status.proto")).parents[2]
    protos = [str(p) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"-I{rpc_include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p.relative_to(out_dir) for p in out_dir.rglob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed code is stale")
    parser.add_argument("--setup", action="store_true", help="only make the generator's environment (.venv-protos)")
    args = parser.parse_args(argv)
    if args.setup:
        print(f"grpcio-tools {GRPCIO_TOOLS_VERSION}: {sys.executable if has_pinned_generator() else tool_python()}")
        return 0
    if not has_pinned_generator():
        return subprocess.run([str(tool_python()), __file__, *(argv if argv is not None else sys.argv[1:])]).returncode
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generated = generate(out)
        stale = [
            str(rel)
            for rel in generated
            if not (PROTO_ROOT / rel).exists() or not filecmp.cmp(out / rel, PROTO_ROOT / rel, shallow=False)
        ]
        if args.check:
            if stale:
                print("stale generated files (run `make protos`):", *stale, sep="\n  ")
                return 1
            print(f"{len(generated)} generated files up to date")
            return 0
        for rel in generated:
            shutil.copyfile(out / rel, PROTO_ROOT / rel)
        print(f"wrote {len(generated)} files:", *map(str, generated), sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
