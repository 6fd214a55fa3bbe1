"""The CUDA C kernels of the device allreduce (``allreduce.cu``, shipped inside the package)
and their compilation to PTX with NVRTC.

Why this module compiles on its own: NVRTC needs no GPU and no driver, so CI compiles every
kernel instantiation for each architecture we target on a CPU machine, and a compile error
fails a test there instead of on a GPU machine. It calls NVRTC through
``cupy_backends.cuda.libs.nvrtc`` (CuPy's binding, with the ``nvidia-cuda-nvrtc`` library);
``cupy.cuda.compiler`` would ask the driver first.

The engine (``ringcomm.engines.kernel``) launches them through ``cupy.RawModule`` with the
names ``kernel_name`` gives (``cupy_launch``), or, on the fake runtime, plays them in numpy.
Importing this module imports nothing beyond the standard library.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the kernels' CUDA C source, beside this module (package data)
ALLREDUCE_SOURCE = Path(__file__).with_name("allreduce.cu")

#: what CI compiles for: Ampere (A100) and Hopper (H100, H200), the GPUs this path targets
ARCHITECTURES = ("compute_80", "compute_90")

#: NVRTC's options besides the architecture: ``if constexpr`` needs C++17
OPTIONS = ("-std=c++17",)

#: the kernels, by algorithm: those that reduce are templates of an element type and an op
REDUCING = {"one_shot": "ringcomm::one_shot_allreduce",
            "two_shot": "ringcomm::two_shot_allreduce",
            "reduce_scatter": "ringcomm::reduce_scatter"}
#: the all-gather copies bytes: one kernel for every dtype
ALL_GATHER = "all_gather"
ALGORITHMS = {**REDUCING, ALL_GATHER: "ringcomm::all_gather"}

#: ringcomm's dtypes (``ringcomm.core.dtypes``) -> the C++ type that holds one in the kernels
CUDA_TYPES = {
    "float32": "float",
    "float64": "double",
    "float16": "ringcomm::Half",
    "bfloat16": "ringcomm::BFloat16",
    "int8": "signed char",
    "int16": "short",
    "int32": "int",
    "int64": "long long",
    "uint8": "unsigned char",
    "bool": "bool",
    "complex64": "ringcomm::Complex<float>",
    "complex128": "ringcomm::Complex<double>",
}

#: ringcomm's reductions (``REDUCE_OPS``) -> the kernels' op structs
CUDA_OPS = {"sum": "ringcomm::Sum", "prod": "ringcomm::Prod", "min": "ringcomm::Min",
            "max": "ringcomm::Max", "avg": "ringcomm::Avg", "band": "ringcomm::BitAnd",
            "bor": "ringcomm::BitOr", "bxor": "ringcomm::BitXor"}


class KernelCompileError(RuntimeError):
    """NVRTC refused the source; the message carries its log."""


def kernel_name(algorithm: str, dtype: str = "", op: str = "") -> str:
    """The C++ name of one kernel instantiation (what NVRTC's name expressions and
    ``cupy.RawModule(name_expressions=...)`` take): a reducing algorithm (``one_shot``,
    ``two_shot``, ``reduce_scatter``) with a dtype and an op by ringcomm's names, or
    ``all_gather`` (bytes: no dtype, no op)."""
    if algorithm == ALL_GATHER:
        return ALGORITHMS[ALL_GATHER]
    return f"{REDUCING[algorithm]}<{CUDA_TYPES[dtype]}, {CUDA_OPS[op]}>"


def instantiations() -> list[tuple[str, str, str]]:
    """Every (algorithm, dtype, op) the host path has: each op with each dtype
    ``REDUCE_OPS`` says it takes, by every reducing algorithm; and the all-gather's one
    (``("all_gather", "", "")``)."""
    from ...core.dtypes import REDUCE_OPS  # numpy and ml_dtypes: only when asked

    return [*((algorithm, dtype, op.name) for algorithm in REDUCING
              for op in REDUCE_OPS.values() for dtype in sorted(op.dtypes)),
            (ALL_GATHER, "", "")]


def source() -> str:
    """The kernels' CUDA C."""
    return ALLREDUCE_SOURCE.read_text()


def _nvrtc() -> Any:
    return importlib.import_module("cupy_backends.cuda.libs.nvrtc")


def nvrtc_problem() -> str:
    """Why NVRTC cannot compile here ("" when it can): CuPy's binding missing, or the NVRTC
    library it loads."""
    try:
        nvrtc = _nvrtc()
    except Exception as exc:  # ImportError, or a CUDA library under it that fails to load
        return (f"cupy_backends.cuda.libs.nvrtc does not import ({type(exc).__name__}: "
                f"{exc}); install cupy-cuda12x and nvidia-cuda-nvrtc-cu12")
    try:
        nvrtc.getVersion()
    except Exception as exc:
        return (f"the NVRTC library cannot be loaded ({type(exc).__name__}: {exc}); install "
                "nvidia-cuda-nvrtc-cu12 (or a CUDA toolkit)")
    return ""


def nvrtc_version() -> str:
    """NVRTC's version, "12.9"."""
    major, minor = _nvrtc().getVersion()
    return f"{major}.{minor}"


@dataclass(frozen=True)
class CompiledPTX:
    """PTX for one architecture, and the mangled name of each kernel asked for."""

    architecture: str
    ptx: str
    lowered: dict[str, str]  # kernel_name(...) -> its entry's name in the PTX
    log: str  # NVRTC's warnings, if any


def compile_ptx(architecture: str, names: list[str], code: str | None = None,
                filename: str = "allreduce.cu") -> CompiledPTX:
    """Compile ``code`` (the kernels' source by default) to PTX for ``architecture``
    ("compute_90"), instantiating the kernels ``names`` (``kernel_name``'s). A
    ``KernelCompileError`` with NVRTC's log where NVRTC refuses it."""
    nvrtc = _nvrtc()
    program = nvrtc.createProgram(source() if code is None else code, filename, [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(program, name)
        options = [f"-arch={architecture}", *OPTIONS]
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program)
            raise KernelCompileError(
                f"NVRTC {nvrtc_version()} could not compile {filename} for {architecture} "
                f"({exc}):\n{log}") from None
        ptx = nvrtc.getPTX(program)
        lowered = {name: nvrtc.getLoweredName(program, name) for name in names}
        log = nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)
    text = ptx.decode() if isinstance(ptx, bytes) else str(ptx)
    return CompiledPTX(architecture, text.rstrip("\0"), lowered, str(log or "").rstrip("\0"))
