"""Build of mha's C extension `mha._C` (the metadata lives in pyproject.toml).

OpenMP is used where the compiler has it (probed by compiling a tiny program); otherwise the
core builds serial. The core is plain C11, compiled with -O3 -Wall -Wextra.
"""
import os
import sys
import tempfile

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CORE = ["csrc/gemm.c", "csrc/attention.c", "csrc/multihead.c", "csrc/threads.c", "csrc/flow.c"]


def compiler_accepts(compiler, flags, source="int main(void) { return 0; }\n"):
    """True when `compiler` compiles and links a tiny C program with these flags."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.c")
        with open(path, "w") as f:
            f.write(source)
        try:
            objects = compiler.compile([path], output_dir=tmp, extra_postargs=flags)
            compiler.link_executable(objects, "probe", output_dir=tmp, extra_postargs=flags)
        except Exception:
            return False
    return True


class BuildExt(build_ext):
    def build_extensions(self):
        unix = self.compiler.compiler_type == "unix"
        flags = ["-std=c11", "-O3", "-Wall", "-Wextra", "-ffp-contract=fast"] if unix else ["/O2"]
        link = []
        openmp = "#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
        if os.environ.get("MHA_NO_OPENMP"):
            print("mha: OpenMP disabled by MHA_NO_OPENMP; building the serial core")
        elif unix and compiler_accepts(self.compiler, ["-fopenmp"], openmp):
            flags.append("-fopenmp")
            link.append("-fopenmp")
        elif not unix and compiler_accepts(self.compiler, ["/openmp"], openmp):
            flags.append("/openmp")
        else:
            print("mha: the compiler has no OpenMP; building the serial core", file=sys.stderr)
        for ext in self.extensions:
            ext.extra_compile_args = flags + ext.extra_compile_args
            ext.extra_link_args = link + ext.extra_link_args
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "mha._C",
            sources=["csrc/module.c"] + CORE,
            include_dirs=["csrc", numpy.get_include()],
            depends=["csrc/mha.h", "csrc/common.h", "csrc/vec.h", "csrc/gemm_impl.h", "csrc/attention_impl.h",
                     "csrc/multihead_impl.h"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
