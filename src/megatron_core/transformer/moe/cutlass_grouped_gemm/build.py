"""Building the CUTLASS grouped GEMM (``grouped_gemm_sm90.cu``) into a shared library, once per machine.

The library is compiled with ``nvcc`` against the CUTLASS headers the first time it is needed and cached under
``$MEGATRON_CORE_CACHE_DIR`` (default ``~/.cache/megatron_core``) in a folder named by a hash of the sources,
the compiler's version and the header location, so a change to any of them rebuilds. Concurrent ranks wait on
a file lock and the library appears atomically. ``MEGATRON_CORE_CUTLASS_GEMM_LIB`` names a prebuilt library
instead (machines without ``nvcc``).

Where the pieces come from:

* ``nvcc``: ``$CUDA_HOME/bin/nvcc`` (also ``$CUDA_PATH``), else the one on ``PATH``;
* CUTLASS headers: ``$CUTLASS_PATH/include`` and ``$CUTLASS_PATH/tools/util/include`` (a CUTLASS checkout),
  else the copy inside the ``nvidia-cutlass`` package (``pip install nvidia-cutlass``, the ``cutlass`` extra).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

SOURCES = ("grouped_gemm_sm90.cu", "grouped_gemm_sm90_impl.cuh")
LIBRARY_NAME = "libmcore_grouped_gemm_sm90.so"
PREBUILT_ENV = "MEGATRON_CORE_CUTLASS_GEMM_LIB"
CACHE_ENV = "MEGATRON_CORE_CACHE_DIR"
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
              "-DNDEBUG", "-Xcompiler", "-fPIC", "-shared")


class CutlassBuildError(RuntimeError):
    """The grouped GEMM library cannot be built or found (what is missing is in the message)."""


def find_nvcc() -> str:
    """Path of ``nvcc`` (``$CUDA_HOME``, ``$CUDA_PATH``, then ``PATH``)."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found is None:
        raise CutlassBuildError("nvcc was not found (set CUDA_HOME, or put nvcc on PATH); or set "
                                f"{PREBUILT_ENV} to a prebuilt {LIBRARY_NAME}")
    return found


def find_cutlass_includes() -> tuple[Path, Path]:
    """``(include, tools/util/include)`` of CUTLASS: ``$CUTLASS_PATH``, else the ``nvidia-cutlass`` package."""
    root = os.environ.get("CUTLASS_PATH")
    if root:
        include, util = Path(root) / "include", Path(root) / "tools" / "util" / "include"
        if not (include / "cutlass" / "cutlass.h").is_file():
            raise CutlassBuildError(f"CUTLASS_PATH={root} holds no include/cutlass/cutlass.h")
        return include, util
    try:
        import cutlass_library
    except ImportError as error:
        raise CutlassBuildError("the CUTLASS headers were not found: pip install nvidia-cutlass (the 'cutlass' "
                                "extra) or set CUTLASS_PATH to a CUTLASS checkout") from error
    source = Path(cutlass_library.__file__).resolve().parent / "source"
    include, util = source / "include", source / "tools" / "util" / "include"
    if not (include / "cutlass" / "cutlass.h").is_file():
        raise CutlassBuildError(f"the nvidia-cutlass package at {source.parent} holds no headers under {include}")
    return include, util


def _source_dir() -> Path:
    return Path(__file__).resolve().parent


def _cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "megatron_core")


def _build_key(nvcc: str, includes: tuple[Path, Path]) -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((_source_dir() / name).read_bytes())
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    digest.update(version.encode())
    digest.update(" ".join(map(str, (*includes, *NVCC_FLAGS))).encode())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def library_path() -> Path:
    """The grouped GEMM library: the prebuilt one named by the environment, or the cached build (built now if
    missing; about a minute)."""
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt:
        if not os.path.isfile(prebuilt):
            raise CutlassBuildError(f"{PREBUILT_ENV}={prebuilt} does not exist")
        return Path(prebuilt)
    nvcc = find_nvcc()
    includes = find_cutlass_includes()
    folder = _cache_root() / "cutlass_grouped_gemm" / _build_key(nvcc, includes)
    target = folder / LIBRARY_NAME
    if target.is_file():
        return target
    with _locked(folder / ".lock"):
        if target.is_file():  # another rank built it while this one waited
            return target
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            partial = Path(scratch) / LIBRARY_NAME
            command = [nvcc, *NVCC_FLAGS, "-I", str(includes[0]), "-I", str(includes[1]),
                       str(_source_dir() / SOURCES[0]), "-o", str(partial)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise CutlassBuildError(f"building {LIBRARY_NAME} failed ({' '.join(command)}):\n"
                                        f"{done.stderr[-4000:]}")
            os.replace(partial, target)
    return target
