"""One SIMD path for mha and its peers in a benchmark: the ``--simd`` option of
``python -m mha bench`` and ``benchmarks/models.py``.

On a machine with AVX-512, ``--simd avx2`` times what a laptop with AVX2 only would run: mha's
AVX2 kernels (``MHA_SIMD``), torch's ATen kernels (``ATEN_CPU_CAPABILITY``) and its MKL and
oneDNN products (``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``), and NumPy's OpenBLAS
(``OPENBLAS_CORETYPE``, the matmul ceiling). Each library reads its variable once, when it
loads, so the benchmark runs again in a child process with the variables set
(`run_on_path`). onnxruntime has no such switch: its kernels (MLAS) choose by the CPU's
features, so on an AVX-512 machine its rows are AVX-512 whatever ``--simd`` says
(`describe_paths` says so in the table's header).
"""
import os
import subprocess
import sys
from typing import Any, Dict, Optional, Sequence

__all__ = ["SIMD_PATHS", "simd_environment", "run_on_path", "describe_paths"]

SIMD_PATHS = ("avx512", "avx2", "baseline")

# Each library's name for a path. MKL's lowest choice is SSE4.2 and oneDNN's SSE4.1: the
# nearest to mha's baseline (SSE2 on x86-64); OpenBLAS is left to choose on avx512 (its
# AVX-512 kernel is named after the CPU, not the instruction set).
_ENVIRONMENT = {
    "avx512": {"MHA_SIMD": "avx512", "ATEN_CPU_CAPABILITY": "avx512",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx2": {"MHA_SIMD": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "OPENBLAS_CORETYPE": "Haswell"},
    "baseline": {"MHA_SIMD": "baseline", "ATEN_CPU_CAPABILITY": "default",
                 "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41",
                 "OPENBLAS_CORETYPE": "Nehalem"},
}


def simd_environment(path: str) -> Dict[str, str]:
    """The environment variables that put mha, torch and NumPy on one SIMD path.

    Parameters
    ----------
    path : {"avx512", "avx2", "baseline"}
        The path (the values of ``MHA_SIMD``).

    Returns
    -------
    dict of str to str
        Variable -> value, to add to the environment of a process before it imports the
        libraries.

    Raises
    ------
    ValueError
        For a path not in `SIMD_PATHS`.

    Examples
    --------
    >>> simd_environment("avx2")["ATEN_CPU_CAPABILITY"]
    'avx2'
    """
    if path not in _ENVIRONMENT:
        raise ValueError(f"simd path must be one of {', '.join(SIMD_PATHS)}, got {path!r}")
    return dict(_ENVIRONMENT[path])


def run_on_path(path: Optional[str], argv: Sequence[str]) -> Optional[int]:
    """Run ``python argv...`` again with the environment of `path`, unless this process has it.

    Parameters
    ----------
    path : str or None
        The ``--simd`` value; None (or a process that already has the environment) runs
        nothing.
    argv : sequence of str
        The arguments after the interpreter (``["-m", "mha", "bench", ...]`` or a script and
        its options), ``--simd`` among them.

    Returns
    -------
    int or None
        The child's exit status, or None when this process should run the benchmark itself.
    """
    if path is None:
        return None
    env = simd_environment(path)
    if all(os.environ.get(k) == v for k, v in env.items()):
        return None
    print(f"--simd {path}: running again with {' '.join(f'{k}={v}' for k, v in env.items())}",
          file=sys.stderr, flush=True)
    return subprocess.call([sys.executable, *argv], env={**os.environ, **env})


def describe_paths(torch: Any = None, onnxruntime: bool = False) -> str:
    """Which SIMD path each library ran in this process, for a table's header.

    Parameters
    ----------
    torch : module or None
        The imported torch, if it ran.
    onnxruntime : bool
        Whether onnxruntime ran.

    Returns
    -------
    str
        E.g. ``"mha avx2 (MHA_SIMD=avx2); torch ATen AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2"``.
    """
    import mha

    info = mha.build_info()
    parts = [f"mha {info['simd']} ({info['simd_choice']})"]
    if torch is not None:
        capability = "unknown"
        try:
            capability = torch.backends.cpu.get_cpu_capability()
        except AttributeError:  # torch < 2.1
            pass
        mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS")
        parts.append(f"torch ATen {capability}" + (f", MKL_ENABLE_INSTRUCTIONS={mkl}" if mkl else ""))
    if onnxruntime:
        parts.append("onnxruntime by the CPU's features (no switch)")
    return "; ".join(parts)
