"""What a run's numbers depend on beyond its inputs: the CPU and the math kernels torch runs on it.

A stage rerun with the same inputs on the same machine writes bit-identical outputs. On another machine the
floating-point results can differ in the last bits: the BLAS (MKL or OpenBLAS), oneDNN and ATen's vectorised
kernels pick code paths by the CPU's instruction set (AVX2, AVX-512, AMX), and a different path sums in a
different order. Training amplifies such rounding differences, so a rerun elsewhere lands near the recorded
numbers, not on them. `describe()` records what decides the kernels, so two records can be compared.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

# Environment variables that change which kernels run or how many threads split a reduction.
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE", "ONEDNN_MAX_CPU_ISA",
              "DNNL_MAX_CPU_ISA", "OPENBLAS_CORETYPE", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
# CPU flags that select kernel paths in MKL, oneDNN and ATen.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile",
             "amx_bf16")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (Linux), else {}."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            out[k.strip()] = v.strip()
    return out


def cpu() -> dict[str, Any]:
    """CPU model, vendor, logical CPUs and the instruction-set flags that select kernels."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    return {"model": info.get("model name") or platform.processor() or platform.machine(),
            "vendor": info.get("vendor_id"), "logical_cpus": os.cpu_count(), "arch": platform.machine(),
            "isa_flags": [f for f in ISA_FLAGS if f in flags] if flags else None}


def _torch_build(config: str) -> dict[str, Any]:
    """BLAS, LAPACK and oneDNN of torch's build, from `torch.__config__.show()`."""
    def find(pattern: str) -> str | None:
        m = re.search(pattern, config)
        return m.group(1).strip() if m else None

    return {"blas": find(r"BLAS_INFO=([^,\s]+)"), "lapack": find(r"LAPACK_INFO=([^,\s]+)"),
            "mkl": find(r"Math Kernel Library Version ([\d.]+)"),
            "onednn": find(r"MKL-DNN (v[\d.]+)") or find(r"oneDNN (v[\d.]+)"),
            "openmp": find(r"OpenMP (\d+)")}


def kernels() -> dict[str, Any]:
    """torch's version and math libraries, the ISA level its kernels dispatch to here, threads, and the
    environment variables that override any of it."""
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, **_torch_build(torch.__config__.show()),
                           "isa_level": torch.backends.cpu.get_cpu_capability(),
                           "mkl_available": torch.backends.mkl.is_available(),
                           "mkldnn_available": torch.backends.mkldnn.is_available(),
                           "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
                           "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                           "env": {k: os.environ[k] for k in KERNEL_ENV if k in os.environ}}
    if torch.cuda.is_available():
        from tandem.accounting import gpu_names

        out["cuda"] = {"version": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                       "devices": gpu_names()}
    return out


def describe() -> dict[str, Any]:
    """The machine a run's numbers came from: Python, OS, CPU and math kernels."""
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": cpu(),
            "kernels": kernels()}


def summary(desc: dict[str, Any]) -> str:
    """One line: 'AMD EPYC (2 CPUs; AVX2 kernels, mkl 2024.2, oneDNN v3.12.0; torch 2.13.0+cpu)'."""
    c, k = desc.get("cpu", {}), desc.get("kernels", {})
    libs = ", ".join(x for x in (k.get("blas") and f"{k['blas']} {k.get('mkl') or ''}".strip(),
                                 k.get("onednn") and f"oneDNN {k['onednn']}") if x)
    return (f"{c.get('model')} ({c.get('logical_cpus')} CPUs; {k.get('isa_level')} kernels"
            f"{', ' + libs if libs else ''}; torch {k.get('torch')})")
