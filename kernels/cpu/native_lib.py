"""Native kernel libraries: C sources built with the host's compiler on first use, loaded once a process.

Every native library of `kernels` (`kernels.cpu.native` with `kernels.cpu.fused`, `kernels.cpu.packed_linear`
with `kernels.cpu.layers`) is a :class:`NativeLibrary`: an environment switch that turns it off,
an optional check of the host (CPU flags), the build (:func:`build_library`: `cc -O3 -fopenmp` and
the host's vector flags, cached under `$PAGEDKV_HOME/kernels/<stem>-<hash>.so`, each source's object
once under `kernels/objects/`), the `ctypes` load, an optional start-up call, and the argument
types of its functions. The first use tries once; the outcome (the loaded library, or why there is
none) holds for the life of the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from pagedkv.config import env
from pagedkv.runtime.cpu_flags import cpu_flags
from pagedkv.runtime.paths import pagedkv_home

#: The C sources and headers of every library.
CSRC = Path(__file__).resolve().parent / "csrc"
_BUILD_TIMEOUT_S = 120


def _arch_flags() -> list[str]:
    flags = cpu_flags()
    out = ["-mavx2", "-mfma"] if "avx2" in flags and "fma" in flags else []
    if out and "f16c" in flags:
        out.append("-mf16c")  # fp16 -> fp32 conversions: the fp8 cache reads of 8-wide builds
    avx512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
    if out and all(f in flags for f in avx512):
        out += [f"-m{f}" for f in avx512]
    return out


def _compiler() -> str | None:
    for name in (env("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build_library(sources: tuple[Path, ...], headers: tuple[Path, ...] = (), extra_flags: tuple[str, ...] = (),
                  stem: str = "paged_cpu") -> Path:
    """Compile C `sources` into one shared library (or find it built); return its path.

    The flags are `-O3 -fopenmp` (without OpenMP if the compiler lacks it), the host's vector
    flags (`_arch_flags`) and `extra_flags`; the library is cached under
    `$PAGEDKV_HOME/kernels/<stem>-<hash>.so`, the hash over sources, headers, flags and compiler.

    Raises:
        RuntimeError: no C compiler, or the build failed (its stderr is in the message).
    """
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    source = b"".join(path.read_bytes() for path in (*sources, *headers))
    errors = []
    for openmp in (["-fopenmp"], []):  # a compiler without OpenMP still gives a 1-thread kernel
        flags = ["-O3", "-std=gnu11", "-fPIC", "-shared", *openmp, *_arch_flags(), *extra_flags]
        key = hashlib.sha256(source + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
        out_dir = pagedkv_home() / "kernels"
        target = out_dir / f"{stem}-{key}.so"
        if target.is_file():
            return target
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
        os.close(fd)
        try:
            error = _compile(cc, flags, sources, tmp, version)
            if error is None:
                os.replace(tmp, target)  # atomic: concurrent builders each write their own tmp
                return target
            errors.append(f"{' '.join(flags)}: {error[-500:]}")
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    raise RuntimeError(f"building the native CPU kernels ({stem}) failed: " + " | ".join(errors))


def _compile(cc: str, flags: list[str], sources: tuple[Path, ...], out: str, version: str) -> str | None:
    """Compile ``sources`` into the shared library ``out``; returns None, or the failing step's stderr.

    Each source becomes an object file, cached beside the libraries (``objects/``, keyed by the
    source, every header of its folder, the flags and the compiler), so libraries that share a
    source (``packed_linear`` holds all of ``paged_cpu``'s) compile it once; the missing ones are
    compiled all at once (one compiler per source), then linked.
    """
    obj_dir = pagedkv_home() / "kernels" / "objects"
    obj_dir.mkdir(parents=True, exist_ok=True)
    compile_flags = [f for f in flags if f != "-shared"]
    objects, procs = [], []
    for src in sources:
        headers = b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.h")))
        key = hashlib.sha256(src.read_bytes() + headers + " ".join(compile_flags).encode() + version.encode())
        obj = obj_dir / f"{src.stem}-{key.hexdigest()[:16]}.o"
        objects.append(str(obj))
        if not obj.is_file():
            fd, tmp = tempfile.mkstemp(dir=obj_dir, suffix=".o.tmp")
            os.close(fd)
            procs.append((subprocess.Popen([cc, *compile_flags, "-c", "-o", tmp, str(src)], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.PIPE, text=True), tmp, obj))
    failed = None
    for proc, tmp, obj in procs:
        try:
            _, err = proc.communicate(timeout=_BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err = f"timed out after {_BUILD_TIMEOUT_S} s\n{err}"
        if proc.returncode == 0:
            os.replace(tmp, obj)  # atomic, as the library's
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            failed = failed or err.strip() or f"{cc} exited with {proc.returncode}"
    if failed is not None:
        return failed
    link = subprocess.run([cc, *flags, "-o", out, *objects, "-lm"], capture_output=True, text=True,
                          timeout=_BUILD_TIMEOUT_S)
    return None if link.returncode == 0 else link.stderr.strip() or f"{cc} exited with {link.returncode}"


class NativeLibrary:
    """One native library, built and loaded on first use, once a process (thread-safe).

    Args:
        missing: what the error of a use says when it is unavailable ("the AMX kernel is not available").
        stem: the cached file's name stem (`build_library`).
        sources: its C files; headers: the headers they include (part of the cache key).
        switch: the environment variable that turns it off when "0".
        check: the host's fitness, called before the build: why it cannot run here, or None.
        start: called with the loaded library before use; raises RuntimeError when it refuses.
    """

    def __init__(self, missing: str, stem: str, sources: tuple[Path, ...], headers: tuple[Path, ...] = (), *,
                 switch: str, check: Callable[[], str | None] | None = None,
                 start: Callable[[ctypes.CDLL], None] | None = None):
        self.missing, self.stem, self.sources, self.headers = missing, stem, tuple(sources), tuple(headers)
        self.switch, self._check, self._start = switch, check, start
        #: The loaded library (its functions typed), or None before the first use or when unavailable.
        self.handle: ctypes.CDLL | None = None
        #: Why it is not in use (None while it is, or before the first try).
        self.unavailable_reason: str | None = None
        self._tried = False
        self._lock = threading.Lock()
        self._signatures: dict[str, tuple[list, object]] = {}

    def declare(self, name: str, argtypes: list, restype: object = ctypes.c_int) -> None:
        """Give C function `name` its ctypes argument and result types (applied at load, or now if loaded)."""
        self._signatures[name] = (argtypes, restype)
        if self.handle is not None:
            self._type(self.handle, name)

    def _type(self, lib: ctypes.CDLL, name: str) -> None:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = self._signatures[name]

    def _open(self) -> ctypes.CDLL:
        if not env(self.switch):
            raise RuntimeError(f"disabled by {self.switch}=0")
        reason = self._check() if self._check else None
        if reason:
            raise RuntimeError(reason)
        try:
            lib = ctypes.CDLL(str(build_library(self.sources, self.headers, stem=self.stem)))
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(str(e)) from e
        if self._start:
            self._start(lib)
        return lib

    def load(self) -> ctypes.CDLL | None:
        """The library, built and loaded on the first call; None when it is unavailable here
        (`unavailable_reason` says why). Later calls return the first call's outcome."""
        with self._lock:
            if self._tried:
                return self.handle
            self._tried = True
            try:
                lib = self._open()
            except RuntimeError as e:
                self.unavailable_reason = str(e)
                return None
            for name in self._signatures:
                self._type(lib, name)
            self.handle = lib
            return lib

    def available(self) -> bool:
        """True when the library is built and loaded (builds it on the first call)."""
        return (self.handle or self.load()) is not None

    def require(self) -> ctypes.CDLL:
        """The loaded library.

        Raises:
            RuntimeError: it is unavailable here (the message says why).
        """
        lib = self.handle or self.load()
        if lib is None:
            raise RuntimeError(f"{self.missing}: {self.unavailable_reason}")
        return lib


__all__ = ["CSRC", "NativeLibrary", "build_library", "cpu_flags"]
