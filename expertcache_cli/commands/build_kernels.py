"""`expertcache build-kernels`: compile the cache kernels now and say what was built.

Without options it compiles with NVRTC for the GPU it finds (warming the per-user cache
that the plugin would otherwise fill on first use) and runs a one-step self-test on it.
``--arch 90`` compiles for named architectures with no GPU present; ``--library PATH``
builds the ahead-of-time shared library with nvcc instead (select it at run time with
``EXPERT_CACHE_LIB=PATH``; while that is set, this command checks that library and
self-tests it instead of NVRTC). Every failure names what is missing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer

from .. import config
from ..device import kernel_build
from ..device.kernel_check import device_arch
from ..device.kernel_check import self_test as run_self_test
from ..errors import DeviceUnavailable
from . import parse_int_list, select_kernels


def build_kernels(
    arch: str = typer.Option(
        None, "--arch", help="compile for these SM archs (e.g. 90 or 80,90); no GPU needed"
    ),
    library: Path = typer.Option(
        None, "--library", help="build the nvcc shared library at this path instead of NVRTC"
    ),
    archs: str = typer.Option(
        ",".join(str(a) for a in kernel_build.AOT_ARCHS), "--archs",
        help="with --library: SASS targets (PTX of the last is added)",
    ),
    device: int = typer.Option(0, "--device", help="CUDA device to detect the arch from"),
    self_test: bool = typer.Option(
        True, "--self-test/--no-self-test", help="run one checked cache step on the GPU"
    ),
) -> None:
    """Compile the cache kernels (NVRTC, cached per user) or build the nvcc library."""
    t0 = time.perf_counter()
    if library is not None:
        targets = tuple(parse_int_list(archs, "--archs"))
        out = kernel_build.build_shared_library(library, targets)
        print(
            f"built {out} ({out.stat().st_size / 1e6:.1f} MB) with nvcc for "
            f"{', '.join(f'sm_{a}' for a in targets)} + compute_{targets[-1]} PTX in "
            f"{time.perf_counter() - t0:.1f} s; exports "
            f"{', '.join(kernel_build.LIBRARY_ENTRY_POINTS)}"
        )
        print(f"use it with: export {config.LIB}={out.resolve()}")
        return
    lib_env = os.environ.get(config.LIB)
    if lib_env and not arch:
        # The runtime will use this library, not NVRTC: check that one instead.
        from ..device.binding import ABI_VERSION, LibraryKernels

        try:  # the file, its exports and its ABI version
            LibraryKernels(lib_env, pdl=config.pdl_from_env())
        except kernel_build.KernelBuildError as exc:  # its message starts with the path
            raise kernel_build.KernelBuildError(f"{config.LIB}={exc}") from None
        print(f"{config.LIB}={lib_env}: exports "
              f"{', '.join(kernel_build.LIBRARY_ENTRY_POINTS)}, kernel ABI {ABI_VERSION} "
              "(NVRTC is not used while it is set)")
        if self_test:
            try:
                device_arch(device)
            except DeviceUnavailable as exc:
                print(f"self-test skipped: {exc}")
                return
            select_kernels()
            print(run_self_test(device))
        return
    if arch:
        wanted = [(a, None) for a in parse_int_list(arch, "--arch")]
    else:
        wanted = [device_arch(device)]
    major, minor = kernel_build.nvrtc_version()
    print(f"NVRTC {major}.{minor}, kernel source {kernel_build.source_hash()}, "
          f"cache {kernel_build.cache_dir()}")
    for a, name in wanted:
        t1 = time.perf_counter()
        img = kernel_build.cached_image(a)
        how = "already cached" if img.cached else f"compiled in {time.perf_counter() - t1:.1f} s"
        target = f"sm_{img.arch}" if img.kind == "cubin" else f"compute_{img.arch} PTX (JIT)"
        on = f" for {name} (sm_{a})" if name else ""
        print(f"{target}{on}: {img.path} ({img.path.stat().st_size:,} B, {how}); entry points "
              f"{', '.join(kernel_build.KERNEL_ENTRY_POINTS)}")
    if not arch and self_test:
        select_kernels()
        print(run_self_test(device))


def register(app: typer.Typer) -> None:
    app.command("build-kernels")(build_kernels)
