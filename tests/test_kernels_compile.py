"""The device allreduce kernels (``ringcomm/engines/kernels/allreduce.cu``) compile, every
instantiation for every architecture we target, on a machine without a GPU.

NVRTC needs no GPU or driver, only CuPy's binding and NVRTC's library (cupy-cuda12x and
nvidia-cuda-nvrtc-cu12); where either is missing, as on CI's CPU machine, the compiling
tests skip and say why. The tests of the source itself run everywhere.
"""

from __future__ import annotations

import re

import pytest

from ringcomm.core.device import kernel_geometry as geometry
from ringcomm.core.dtypes import DTYPE_NAMES, REDUCE_OPS
from ringcomm.engines import kernels

NVRTC_PROBLEM = kernels.nvrtc_problem()
needs_nvrtc = pytest.mark.skipif(bool(NVRTC_PROBLEM), reason=NVRTC_PROBLEM)


def test_the_source_and_the_geometry_agree() -> None:
    """The mirror and the launcher take the kernels' limits from kernel_geometry."""
    constants = dict(re.findall(r"constexpr int (k\w+) = (\d+);", kernels.source()))
    assert {name: int(value) for name, value in constants.items()} == {
        "kMaxRanks": geometry.MAX_RANKS, "kMaxBlocks": geometry.MAX_BLOCKS,
        "kMaxThreads": geometry.MAX_THREADS, "kVectorBytes": geometry.VECTOR_BYTES,
        "kPhaseStart": geometry.PHASES.index("start"), "kPhaseEnd": geometry.PHASES.index("end"),
        "kPhases": len(geometry.PHASES)}
    # the abort word after the flags, and the pad's length: expressions of the above
    assert "constexpr int kAbortWord = kPhases * kMaxBlocks * kMaxRanks;" in kernels.source()
    flags = len(geometry.PHASES) * geometry.MAX_BLOCKS * geometry.MAX_RANKS
    assert flags == geometry.ABORT_WORD
    assert "constexpr int kPadWords = kAbortWord + kVectorBytes / 4;" in kernels.source()
    assert geometry.PAD_WORDS == geometry.ABORT_WORD + geometry.VECTOR_BYTES // 4


def test_every_dtype_and_op_of_the_host_path_has_a_kernel() -> None:
    assert set(kernels.CUDA_TYPES) == set(DTYPE_NAMES.values())
    assert set(kernels.CUDA_OPS) == set(REDUCE_OPS)
    pairs = sum(len(op.dtypes) for op in REDUCE_OPS.values())
    assert len(kernels.instantiations()) == len(kernels.REDUCING) * pairs + 1 == 205


@needs_nvrtc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("architecture", kernels.ARCHITECTURES)
def test_every_kernel_compiles(architecture: str) -> None:
    """Each instantiation is an entry of the PTX, meets its peers twice with system-scope
    release stores and acquire loads (and a look at the abort word while it waits), and
    loads 16 bytes at a time on its vector path."""
    names = [kernels.kernel_name(*i) for i in kernels.instantiations()]
    compiled = kernels.compile_ptx(architecture, names)
    assert f".target sm_{architecture.removeprefix('compute_')}" in compiled.ptx
    entries = {match[0]: match[1] for match in
               re.findall(r"\.entry (\w+)\((.*?)\n}\n", compiled.ptx, re.S)}
    for name in names:
        body = entries[compiled.lowered[name]]
        assert body.count("st.release.sys.global.u32") == 2, name
        assert body.count("ld.acquire.sys.global.u32") == 2, name
        assert body.count("ld.relaxed.sys.global.u32") == 2, name  # the abort word
        assert re.search(r"\bld(\.global)?\.v(4\.\w32|2\.\w64)\b", body), name
    assert len(entries) == len(names)


@needs_nvrtc
def test_a_compile_error_is_an_error_with_nvrtcs_log() -> None:
    broken = kernels.source().replace("constexpr int kMaxRanks = 8;", "constexpr int kMaxRanks = 8")
    with pytest.raises(kernels.KernelCompileError) as caught:
        kernels.compile_ptx("compute_90", [], broken)
    message = str(caught.value)
    assert f"NVRTC {kernels.nvrtc_version()} could not compile allreduce.cu" in message
    assert re.search(r"allreduce\.cu\(\d+\): error: expected a \";\"", message), message


@needs_nvrtc
@pytest.mark.parametrize("algorithm,dtype,op,lacking", [
    ("one_shot", "complex64", "max", "max"),
    ("two_shot", "int32", "avg", "divide"),
    ("one_shot", "float32", "bxor", "bit_xor")])
def test_a_pair_the_host_path_refuses_does_not_compile(algorithm: str, dtype: str, op: str,
                                                       lacking: str) -> None:
    """The kernels' arithmetic lacks what numpy lacks, so a kernel the launcher must never
    ask for cannot even be built."""
    assert dtype not in REDUCE_OPS[op].dtypes
    with pytest.raises(kernels.KernelCompileError, match=f'has no member "{lacking}"'):
        kernels.compile_ptx("compute_80", [kernels.kernel_name(algorithm, dtype, op)])
