"""Turning `kernels/expert_cache.cu` into something the GPU can run, with no toolkit needed.

Why two paths: a vLLM user usually has a pip-installed CUDA build of torch and no CUDA
toolkit, but that torch already depends on NVRTC and `cuda-bindings`. So the default path
compiles the kernel source at first use with NVRTC for the current device's architecture,
caches the binary per user (keyed by source hash, options, NVRTC version and arch) under
``$XDG_CACHE_HOME/expertcache`` (``~/.cache/expertcache``), loads it through the driver
API and launches on torch's current stream (`binding.py` does the launching). The second
path builds a shared library ahead of time with nvcc (SASS for sm_80/86/89/90/100/120 plus
PTX, with an export check); ``EXPERT_CACHE_LIB=/path/libexpertcache.so`` selects one.

Everything here imports lazily: `expertcache build-kernels --help` and the CPU tests must
not need cuda-bindings or torch.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

#: C entry points of the shared library (host wrappers that validate, then launch).
LIBRARY_ENTRY_POINTS = ("expert_cache_manage", "expert_cache_gather", "expert_cache_set_pdl")
#: ``__global__`` kernels looked up by name in the NVRTC image.
KERNEL_ENTRY_POINTS = ("expert_cache_manage_kernel", "expert_cache_gather_kernel")
#: nvcc ahead-of-time targets: SASS for each, plus PTX of the last for newer GPUs.
AOT_ARCHS = (80, 86, 89, 90, 100, 120)
SOURCE_FILES = ("expert_cache.cu", "ec_compat.h")
NVRTC_OPTIONS = ("-std=c++17", "-DEC_KERNELS_ONLY=1")


class KernelBuildError(UserError):
    """The kernels could not be built or loaded; the message says exactly what is missing."""


def kernel_dir() -> Path:
    """The directory holding the kernel source (shipped as package data via a symlink)."""
    from importlib import resources

    path = Path(str(resources.files("expertcache_cli") / "kernels"))
    if not (path / SOURCE_FILES[0]).is_file():
        raise KernelBuildError(
            f"kernel source {SOURCE_FILES[0]} not found in {path}: the package was installed "
            "without its package data (reinstall expertcache)"
        )
    return path


def kernel_sources() -> dict[str, str]:
    """File name -> text of every kernel source file (the .cu and its compat header)."""
    d = kernel_dir()
    return {name: (d / name).read_text() for name in SOURCE_FILES}


def source_hash() -> str:
    """Hash of the kernel sources: part of every cache key, so an edit forces a rebuild."""
    h = hashlib.sha256()
    for name, text in sorted(kernel_sources().items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Per-user cache of compiled kernels: ``$XDG_CACHE_HOME/expertcache/kernels``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "expertcache" / "kernels"


# ----------------------------------------------------------------------------- ELF symbols


def elf_symbols(data: bytes) -> set[str]:
    """Names of the defined symbols in an ELF64 image (a .so's dynsym, a cubin's symtab).

    A few lines of ELF parsing instead of shelling out to ``nm``: the export check must
    work on a machine with no binutils and on NVRTC cubins held in memory.
    """
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not an ELF64 image")
    endian = "<" if data[5] == 1 else ">"
    shoff = struct.unpack_from(endian + "Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from(endian + "HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        off = shoff + i * shentsize
        sh_type = struct.unpack_from(endian + "I", data, off + 4)[0]
        sh_offset, sh_size = struct.unpack_from(endian + "QQ", data, off + 0x18)
        sh_link = struct.unpack_from(endian + "I", data, off + 0x28)[0]
        sh_entsize = struct.unpack_from(endian + "Q", data, off + 0x38)[0]
        sections.append((sh_type, sh_offset, sh_size, sh_link, sh_entsize))
    names: set[str] = set()
    for sh_type, sh_offset, sh_size, sh_link, sh_entsize in sections:
        if sh_type not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            continue
        str_off = sections[sh_link][1]
        for j in range(sh_size // (sh_entsize or 24)):
            so = sh_offset + j * (sh_entsize or 24)
            st_name = struct.unpack_from(endian + "I", data, so)[0]
            st_shndx = struct.unpack_from(endian + "H", data, so + 6)[0]
            if st_name == 0 or st_shndx == 0:  # unnamed or undefined (imported)
                continue
            end = data.index(b"\0", str_off + st_name)
            names.add(data[str_off + st_name : end].decode(errors="replace"))
    return names


def missing_entry_points(image: bytes, names: tuple[str, ...]) -> list[str]:
    """The entry points of ``names`` that ``image`` does not define (empty = all there)."""
    have = elf_symbols(image)
    return [n for n in names if n not in have]


# ----------------------------------------------------------------------------- NVRTC


def _import_nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise KernelBuildError(
            "cannot compile the kernels: the Python package cuda-bindings is missing "
            f"({exc}); install it with `pip install cuda-bindings nvidia-cuda-nvrtc` (a CUDA "
            "build of torch normally brings both), or point EXPERT_CACHE_LIB at a library "
            "built by kernels/build.sh"
        ) from None
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # the bindings load libnvrtc lazily; missing lib fails here
        raise KernelBuildError(
            f"cannot compile the kernels: the NVRTC library could not be loaded ({exc}); "
            "install it with `pip install nvidia-cuda-nvrtc`"
        ) from None
    return nvrtc, (major, minor)


def _nvrtc_check(nvrtc, result, what: str, log: str = "") -> None:
    if int(result) != 0:
        _, msg = nvrtc.nvrtcGetErrorString(result)
        detail = f"\n{log}" if log else ""
        raise KernelBuildError(f"NVRTC {what} failed: {msg.decode()}{detail}")


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC that would compile the kernels."""
    return _import_nvrtc()[1]


def nvrtc_supported_archs() -> list[int]:
    """SM architectures this NVRTC can emit SASS for (e.g. [75, 80, ..., 120])."""
    nvrtc, _ = _import_nvrtc()
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    _nvrtc_check(nvrtc, err, "nvrtcGetSupportedArchs")
    return sorted(int(a) for a in archs)


def pick_target(device_arch: int) -> tuple[int, str]:
    """What to compile for a device of ``device_arch`` (e.g. 90): (arch, "cubin" | "ptx").

    SASS when this NVRTC knows the arch; otherwise PTX of the newest arch it knows below
    it, which the driver JIT-compiles (a GPU newer than the installed NVRTC).
    """
    archs = nvrtc_supported_archs()
    if device_arch in archs:
        return device_arch, "cubin"
    lower = [a for a in archs if a <= device_arch]
    if not lower:
        raise KernelBuildError(
            f"this NVRTC (supports sm_{archs[0]}..sm_{archs[-1]}) cannot target sm_{device_arch}"
        )
    return lower[-1], "ptx"


def nvrtc_compile(arch: int, kind: str = "cubin") -> bytes:
    """Compile the kernels with NVRTC for ``sm_{arch}``: a cubin, or PTX for ``compute_{arch}``.

    No GPU is needed, which is what lets CI check this path.
    """
    nvrtc, _ = _import_nvrtc()
    sources = kernel_sources()
    main = SOURCE_FILES[0]
    headers = [n for n in SOURCE_FILES if n != main]
    err, prog = nvrtc.nvrtcCreateProgram(
        sources[main].encode(),
        main.encode(),
        len(headers),
        [sources[h].encode() for h in headers],
        [h.encode() for h in headers],
    )
    _nvrtc_check(nvrtc, err, "nvrtcCreateProgram")
    try:
        target = f"sm_{arch}" if kind == "cubin" else f"compute_{arch}"
        opts = [f"--gpu-architecture={target}".encode(), *(o.encode() for o in NVRTC_OPTIONS)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        # Output buffers must be fresh, mutable memory: `b" " * n` for n <= 1 is CPython's
        # shared one-byte object, and NVRTC writing into it corrupts every b" " in the process.
        _, log_size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(log_size)
        nvrtc.nvrtcGetProgramLog(prog, log)
        text = log.decode(errors="replace").strip("\x00 \n")
        _nvrtc_check(nvrtc, err, f"compile for {target}", text)
        if kind == "cubin":
            _, size = nvrtc.nvrtcGetCUBINSize(prog)
            out = bytearray(size)
            (err,) = nvrtc.nvrtcGetCUBIN(prog, out)
        else:
            _, size = nvrtc.nvrtcGetPTXSize(prog)
            out = bytearray(size)
            (err,) = nvrtc.nvrtcGetPTX(prog, out)
        _nvrtc_check(nvrtc, err, f"fetching the {kind}")
        return bytes(out)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@dataclass(frozen=True)
class CompiledImage:
    """A compiled kernel image and where it came from (for `build-kernels` to report)."""

    path: Path
    arch: int
    kind: str  # "cubin" or "ptx"
    cached: bool  # True when it was already in the cache


def cached_image(device_arch: int) -> CompiledImage:
    """The kernels for ``sm_{device_arch}``, compiled with NVRTC once and then cached.

    The key covers the source hash, NVRTC options and version, and the target; writes
    are atomic (temp file + rename), so concurrent first uses (several vLLM workers)
    cannot read a half-written file.
    """
    arch, kind = pick_target(device_arch)
    major, minor = nvrtc_version()
    key = hashlib.sha256(
        f"{source_hash()}|{' '.join(NVRTC_OPTIONS)}|nvrtc{major}.{minor}|{kind}|{arch}".encode()
    ).hexdigest()[:20]
    path = cache_dir() / f"expert_cache-{key}-sm_{arch}.{kind}"
    if path.is_file() and path.stat().st_size > 0:
        return CompiledImage(path, arch, kind, True)
    image = nvrtc_compile(arch, kind)
    if kind == "cubin":
        missing = missing_entry_points(image, KERNEL_ENTRY_POINTS)
        if missing:
            raise KernelBuildError(f"NVRTC image lacks entry points {', '.join(missing)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(image)
        os.replace(tmp, path)
    except OSError as exc:
        # An unwritable cache is not fatal: keep the image in a private temp file.
        fd, tmp = tempfile.mkstemp(prefix="expert_cache-", suffix=f".{kind}")
        with os.fdopen(fd, "wb") as f:
            f.write(image)
        path = Path(tmp)
        import warnings

        warnings.warn(f"kernel cache {cache_dir()} not writable ({exc}); using {path}",
                      stacklevel=2)
    return CompiledImage(path, arch, kind, False)


# ----------------------------------------------------------------------------- nvcc (AOT)


def find_nvcc() -> str | None:
    """nvcc from $NVCC, PATH or $CUDA_HOME/bin, or None."""
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc")):
        if cand and Path(cand).exists():
            return cand
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    cand = Path(home) / "bin" / "nvcc"
    return str(cand) if cand.exists() else None


def nvcc_command(out: Path, archs: tuple[int, ...] = AOT_ARCHS, nvcc: str = "nvcc") -> list[str]:
    """The nvcc command line of the shared library (the same as kernels/build.sh)."""
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    return [
        nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static",
        *gencode, "-o", str(out), str(kernel_dir() / SOURCE_FILES[0]),
    ]


def build_shared_library(out: Path, archs: tuple[int, ...] = AOT_ARCHS) -> Path:
    """Build ``libexpertcache.so`` with nvcc and check both entry points are exported."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise KernelBuildError(
            "nvcc not found (set NVCC or CUDA_HOME, or put it on PATH); it is only needed "
            "for the ahead-of-time library: the default NVRTC path needs no toolkit"
        )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(nvcc_command(out, archs, nvcc), capture_output=True, text=True)
    if proc.returncode != 0:
        raise KernelBuildError(f"nvcc failed (exit {proc.returncode}):\n{proc.stderr.strip()}")
    missing = missing_entry_points(out.read_bytes(), LIBRARY_ENTRY_POINTS)
    if missing:
        raise KernelBuildError(f"export check failed: {out} lacks {', '.join(missing)}")
    return out
