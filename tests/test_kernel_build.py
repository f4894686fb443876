"""CPU/CI checks of the kernel build: nvcc (shared library for sm_90, export check) and
NVRTC (cubin and PTX for sm_90, the per-user cache), plus the ABI constants that
`binding.py` mirrors from `kernels/expert_cache.cu`. No GPU is needed for any of them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from expertcache_cli.device import binding, kernel_build
from expertcache_cli.rules.policy import Policy

KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def _needs_nvrtc():
    pytest.importorskip("cuda.bindings", reason="cuda-bindings not installed (pip install "
                        "cuda-bindings nvidia-cuda-nvrtc)")
    try:
        kernel_build.nvrtc_version()
    except kernel_build.KernelBuildError as exc:
        pytest.skip(f"NVRTC unavailable: {exc}")


def _needs_nvcc() -> str:
    nvcc = kernel_build.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: the ahead-of-time build cannot be checked here")
    return nvcc


def test_nvrtc_cubin_sm90_has_both_kernels():
    _needs_nvrtc()
    image = kernel_build.nvrtc_compile(90, "cubin")
    assert kernel_build.missing_entry_points(image, kernel_build.KERNEL_ENTRY_POINTS) == []
    assert kernel_build.missing_entry_points(image, ("no_such_kernel",)) == ["no_such_kernel"]


def test_nvrtc_ptx_sm90_has_both_kernels():
    _needs_nvrtc()
    ptx = kernel_build.nvrtc_compile(90, "ptx").decode(errors="replace")
    for name in kernel_build.KERNEL_ENTRY_POINTS:
        assert re.search(rf"\.entry\s+{name}\s*\(", ptx), f"{name} missing from the PTX"


def _entry_bodies(ptx: str) -> dict[str, str]:
    parts = re.split(r"\.entry\s+(\w+)\s*\(", ptx)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_pdl_waits_are_in_both_kernels_on_sm90_and_absent_before():
    """Each kernel waits for the one before it (griddepcontrol.wait) where PDL exists, and
    the manager releases the gather; sm_80 has no PDL, so nothing of it is emitted."""
    _needs_nvrtc()
    bodies = _entry_bodies(kernel_build.nvrtc_compile(90, "ptx").decode(errors="replace"))
    for name in kernel_build.KERNEL_ENTRY_POINTS:
        assert "griddepcontrol.wait" in bodies[name], f"{name} does not wait under PDL"
    manage = bodies["expert_cache_manage_kernel"]
    assert "griddepcontrol.launch_dependents" in manage
    # the state prefetches come first, the wait before the first load of the ids
    assert manage.index("prefetch.global.L2") < manage.index("griddepcontrol.wait")
    assert manage.index("griddepcontrol.wait") < manage.index("ld.global")
    sm80 = kernel_build.nvrtc_compile(80, "ptx").decode(errors="replace")
    assert "griddepcontrol" not in sm80


def test_nvrtc_compile_leaves_shared_bytes_objects_alone():
    # NVRTC fills caller-provided buffers; handing it CPython's shared one-byte object
    # (what `b" " * 1` is) once turned every b" " in the process into b"\x00".
    _needs_nvrtc()
    kernel_build.nvrtc_compile(90, "cubin")
    kernel_build.nvrtc_compile(90, "ptx")
    assert (b" " * 1)[0] == 32 and bytes([32])[0] == 32


def test_nvrtc_cache_is_keyed_and_reused(tmp_path, monkeypatch):
    _needs_nvrtc()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = kernel_build.cached_image(90)
    assert not first.cached and first.kind == "cubin" and first.arch == 90
    assert first.path.parent == tmp_path / "expertcache" / "kernels"
    again = kernel_build.cached_image(90)
    assert again.cached and again.path == first.path
    # an edited source must not reuse the old binary
    src = kernel_build.kernel_sources()
    edited = dict(src, **{"expert_cache.cu": src["expert_cache.cu"] + "\n// edit\n"})
    monkeypatch.setattr(kernel_build, "kernel_sources", lambda: edited)
    assert kernel_build.cached_image(90).path != first.path


def test_pick_target_falls_back_to_ptx():
    _needs_nvrtc()
    archs = kernel_build.nvrtc_supported_archs()
    assert kernel_build.pick_target(90) == (90, "cubin")
    newest = archs[-1]
    assert kernel_build.pick_target(newest + 50) == (newest, "ptx")


def test_nvcc_library_sm90_exports_both_entry_points(tmp_path):
    _needs_nvcc()
    lib = kernel_build.build_shared_library(tmp_path / "libexpertcache.so", (90,))
    have = kernel_build.elf_symbols(lib.read_bytes())
    for name in kernel_build.LIBRARY_ENTRY_POINTS:
        assert name in have
    assert "expert_cache_abi_version" in have


def test_build_script_export_check(tmp_path):
    _needs_nvcc()
    out = tmp_path / "lib.so"
    proc = subprocess.run(["bash", str(KERNELS / "build.sh"), str(out), "90"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "exports expert_cache_manage, expert_cache_gather" in proc.stdout
    assert kernel_build.missing_entry_points(out.read_bytes(),
                                             kernel_build.LIBRARY_ENTRY_POINTS) == []


def test_nvcc_command_covers_every_aot_arch(tmp_path):
    cmd = " ".join(kernel_build.nvcc_command(tmp_path / "x.so"))
    for a in (80, 86, 89, 90, 100, 120):
        assert f"code=sm_{a}" in cmd
    assert "code=compute_120" in cmd


def test_elf_reader_rejects_non_elf():
    with pytest.raises(ValueError):
        kernel_build.elf_symbols(b"not an elf file at all")


def test_binding_constants_match_the_kernel_source():
    src = (KERNELS / "expert_cache.cu").read_text()
    defines = dict(re.findall(r"#define (EC_\w+) (-?\d+)", src))
    assert int(defines["EC_ABI_VERSION"]) == binding.ABI_VERSION
    assert int(defines["EC_THREADS"]) == binding.THREADS
    assert int(defines["EC_MAX_EXPERTS"]) == binding.MAX_EXPERTS
    assert int(defines["EC_MAX_SLOTS"]) == binding.MAX_SLOTS
    assert int(defines["EC_GATHER_MAX_TENSORS"]) == binding.GATHER_MAX_TENSORS
    assert int(defines["EC_SPREAD_MAX"]) == binding.SPREAD_MAX
    assert int(defines["EC_POLICY_LRU"]) == int(Policy.LRU)
    assert int(defines["EC_POLICY_LFU"]) == int(Policy.LFU)
    for code in binding.ERROR_CODES:
        assert str(code) in defines.values()
    # manager arguments: same names, same order as the kernel signature
    sig = re.search(r"expert_cache_manage_kernel\((.*?)\)\s*\{", src, re.S).group(1)
    sig = re.sub(r"//[^\n]*", "", sig)
    names = re.findall(r"(\w+)\s*(?:,|$)", sig.replace("\n", " ").strip())
    assert names == [n for n, _ in binding.MANAGE_ARGS]
    # and the C wrapper's, with the stream last
    sig = re.search(r"int expert_cache_manage\((.*?)\)\s*\{", src, re.S).group(1)
    names = re.findall(r"(\w+)\s*(?:,|$)", sig.replace("\n", " ").strip())
    assert names == [n for n, _ in binding.MANAGE_ARGS] + ["stream"]
    # the gather's C wrapper: the arguments the library backend passes, in its order
    sig = re.search(r"int expert_cache_gather\((.*?)\)\s*\{", src, re.S).group(1)
    names = re.findall(r"(\w+)\s*(?:,|$)", sig.replace("\n", " ").strip())
    assert names == [n for n, _ in binding.GATHER_ARGS] + ["stream"]


def test_manager_shared_memory_is_the_kernels_formula():
    """binding.manage_smem_bytes must give the launch exactly the bytes the kernel's layout
    takes: too few and the step's marks overrun shared memory."""
    compat = (KERNELS / "ec_compat.h").read_text()
    assert re.search(r"#else\s*\n#\s*define EC_WARP (\d+)", compat).group(1) == str(binding.WARP)
    src = (KERNELS / "expert_cache.cu").read_text()
    body = re.search(r"#define EC_MANAGE_SMEM\(E, S\)\s*\\\n(.*)", src).group(1)
    # C integer arithmetic on positive ints: the casts go, "/" is floor division
    expr = body.replace("(long long)", "").replace("/", "//")
    names = {"EC_THREADS": binding.THREADS, "EC_WARP": binding.WARP}
    for e, s in ((128, 32), (256, 64), (binding.MAX_EXPERTS, binding.MAX_SLOTS), (7, 1)):
        expect = eval(expr, {"__builtins__": {}}, {**names, "E": e, "S": s})
        assert binding.manage_smem_bytes(e, s) == expect


def test_manager_shared_memory_fits_the_default_limit():
    assert binding.manage_smem_bytes(binding.MAX_EXPERTS, binding.MAX_SLOTS) <= 48 * 1024


def test_binding_checks():
    with pytest.raises(ValueError, match="multiple of 16"):
        binding.check_slab("w13", 24)
    binding.check_slab("w13", 48)
    with pytest.raises(ValueError, match="cannot run on the device"):
        binding.policy_code("opt")
    assert binding.policy_code("LFU") == 1
    with pytest.raises(ValueError, match="num_slots"):
        binding.check_manage_config(128, binding.MAX_SLOTS + 1, 0, 8, 8)
    # the manager lists at most S misses in shared memory: a larger cap would overrun it
    with pytest.raises(ValueError, match="max_inserts=33 outside 0..num_slots=32"):
        binding.check_manage_config(128, 32, 0, 32, 33)
    binding.check_manage_config(128, 32, 0, 128, 32)  # max_distinct may exceed S
    with pytest.raises(ValueError, match="aligned"):
        binding.check_aligned("src", 0x1008)


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os
    import sys

    return subprocess.run([sys.executable, "-m", "expertcache_cli", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})})


def test_build_kernels_command_for_named_arch(tmp_path):
    _needs_nvrtc()
    proc = _cli("build-kernels", "--arch", "90", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "sm_90" in proc.stdout and "compiled in" in proc.stdout
    assert "expert_cache_manage_kernel, expert_cache_gather_kernel" in proc.stdout
    again = _cli("build-kernels", "--arch", "90", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert "already cached" in again.stdout


def test_build_kernels_command_errors_are_one_line():
    proc = _cli("build-kernels", "--arch", "nine")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--arch" in proc.stderr
    proc = _cli("build-kernels", env={"EXPERT_CACHE_LIB": "/no/such/libexpertcache.so"})
    assert proc.returncode == 2 and "no such file" in proc.stderr


def _host_library(tmp_path: Path, abi: int, exports: tuple[str, ...]) -> Path:
    """A shared library with the named C entry points (doing nothing) and an ABI number,
    built by the host C compiler: what an older or partial build of the kernels looks like
    to the loader, without nvcc."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler: the stand-in library cannot be built here")
    src = tmp_path / "lib.c"
    src.write_text(f"int expert_cache_abi_version(void) {{ return {abi}; }}\n"
                   + "".join(f"int {name}(void) {{ return 0; }}\n" for name in exports))
    out = tmp_path / "libold.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out


def test_a_library_of_an_older_abi_is_refused_with_its_abi_and_how_to_rebuild(tmp_path):
    """A library built before the manager took vLLM Marlin's block list exports the same
    names with other arguments; the user is told the library's ABI against the package's
    and how to rebuild, never left to launch it."""
    old = _host_library(tmp_path, binding.ABI_VERSION - 1,
                        ("expert_cache_manage", "expert_cache_gather", "expert_cache_set_pdl",
                         "expert_cache_block_remap"))
    with pytest.raises(kernel_build.KernelBuildError,
                       match=rf"kernel ABI {binding.ABI_VERSION - 1}, this package needs "
                             rf"{binding.ABI_VERSION}: rebuild it \(kernels/build.sh"):
        binding.LibraryKernels(old)


def test_a_library_of_this_abi_missing_an_entry_point_names_it(tmp_path):
    partial = _host_library(tmp_path, binding.ABI_VERSION,
                            ("expert_cache_manage", "expert_cache_set_pdl"))
    with pytest.raises(kernel_build.KernelBuildError,
                       match="does not export expert_cache_gather: rebuild it"):
        binding.LibraryKernels(partial)
