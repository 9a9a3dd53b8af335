"""Build of mha's C extension `mha._C` (the metadata lives in pyproject.toml).

The core is C11 (csrc/common.h says which compiler extensions it uses and where). Its kernels
are compiled once per instruction set (csrc/dispatch.h), each kernel unit with the flags of its
instruction set, and the extension picks one at run time: every x86-64 machine gets the AVX2
kernels when its CPU has them, whatever the compiler. A unit whose flags the compiler refuses
(another architecture) is built empty and the baseline kernels serve alone.

The C files are listed once, in csrc/sources.mk, which csrc/Makefile includes and this file
reads; the binding, csrc/module.c, is the extension's own.

Threads: on POSIX systems (Linux, macOS) the kernels run on mha's own thread pool over POSIX
threads (csrc/threads.c), so no OpenMP runtime is linked there. On Windows OpenMP is used where the
compiler has it (probed by compiling and linking a tiny program): MinGW's GCC or clang with
-fopenmp (or a separate libomp that MHA_LIBOMP_PREFIX=/path/to/libomp names), MSVC with
/openmp; otherwise the core builds serial and says so. Environment: MHA_NO_OPENMP=1 builds
serial everywhere; MHA_PORTABLE=1 builds the kernels in plain C11 without GNU vector
extensions (what MSVC gets).
"""
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.modified import newer_group
except ImportError:  # setuptools < 69
    from distutils.dep_util import newer_group

SOURCE_LIST = "csrc/sources.mk"


def read_source_list(path=SOURCE_LIST):
    """{name: [csrc/file, ...]} from the `NAME = files` lines of csrc/sources.mk."""
    lists, name = {}, None
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].rstrip()
            if name is None and "=" in line:
                name, _, line = line.partition("=")
                name = name.strip()
                lists[name] = []
            if name is None:
                continue
            more = line.endswith("\\")
            lists[name] += ["csrc/" + word for word in line.rstrip("\\").split()]
            if not more:
                name = None
    return lists


FILES = read_source_list()
CORE = ["csrc/module.c"] + FILES["CORE_SOURCES"]
HEADERS = FILES["HEADERS"] + [SOURCE_LIST]
# Each kernel unit's flags, per compiler type ("unix": GCC and clang), and the macro its
# instruction set defines (the unit is built where the flags define it: x86 targets).
KERNEL_UNIT_FLAGS = {
    "csrc/kernels_avx2.c": {"unix": ["-mavx2", "-mfma"], "msvc": ["/arch:AVX2"],
                            "defines": "__AVX2__"},
    "csrc/kernels_avx512.c": {"unix": ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512bw",
                                       "-mavx512vl"], "msvc": ["/arch:AVX512"],
                              "defines": "__AVX512F__"},
}
KERNEL_UNITS = {unit: KERNEL_UNIT_FLAGS[unit] for unit in FILES["ISA_UNITS"]}
# The kernel units take nearly all of the compile time (GCC 12, -O3: 6-9 s each; module.c 1 s,
# the rest 0.6 s together): they start first so that the small sources fill in beside them.
SLOW = ("csrc/kernels_avx512.c", "csrc/kernels_avx2.c", "csrc/kernels_baseline.c")
# Compiles only where the flags target the unit's instruction set (x86 with AVX2, AVX-512).
UNIT_PROBE = "#ifndef {0}\n#error no {0}\n#endif\nint main(void) {{ return 0; }}\n"
OPENMP_PROBE = "#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n"


def say(message):
    print(f"mha: {message}", file=sys.stderr)


def compiler_accepts(compiler, compile_flags, link_flags=(), source="int main(void) { return 0; }\n"):
    """True when `compiler` compiles and links a tiny C program with these flags."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.c")
        with open(path, "w") as f:
            f.write(source)
        try:
            objects = compiler.compile([path], output_dir=tmp, extra_postargs=list(compile_flags))
            compiler.link_executable(objects, "probe", output_dir=tmp, extra_postargs=list(link_flags))
        except Exception:
            return False
    return True


def libomp_prefixes():
    """Where an LLVM libomp may be installed for a clang without its own OpenMP (Windows)."""
    prefixes = []
    if os.environ.get("MHA_LIBOMP_PREFIX"):
        prefixes.append(os.environ["MHA_LIBOMP_PREFIX"])
    return [p for i, p in enumerate(prefixes) if os.path.isdir(p) and p not in prefixes[:i]]


def openmp_flags(compiler, unix):
    """(compile flags, link flags, description) of the first OpenMP that links, or None."""
    if not unix:
        candidates = [(["/openmp"], [], "/openmp")]
    else:  # the compiler's own -fopenmp, then a separate libomp (first if MHA_LIBOMP_PREFIX names one)
        candidates = [(["-fopenmp"], ["-fopenmp"], "-fopenmp")]
        for prefix in libomp_prefixes():
            lib = os.path.join(prefix, "lib")
            candidate = (["-Xpreprocessor", "-fopenmp", "-I" + os.path.join(prefix, "include")],
                         ["-L" + lib, "-lomp", "-Wl,-rpath," + lib], f"libomp in {prefix}")
            candidates.insert(len(candidates) if prefix != os.environ.get("MHA_LIBOMP_PREFIX") else 0, candidate)
    for cflags, lflags, what in candidates:
        if compiler_accepts(compiler, cflags, lflags, OPENMP_PROBE):
            return cflags, lflags, what
    return None


class BuildExt(build_ext):
    def build_extensions(self):
        import numpy  # the C API's headers: only a build needs them, not pip's metadata steps

        unix = self.compiler.compiler_type == "unix"
        kind = "unix" if unix else "msvc"
        if unix:
            flags = ["-std=c11", "-O3", "-Wall", "-Wextra", "-ffp-contract=fast"]
            # Debug information: line tables only (-g1), not Python's -g, whose variable
            # locations cost a fifth of the kernel units' compile time (GCC 12: kernels_avx2.c
            # 7.3 s against 9.4 s) for the same machine code. A -g level in CFLAGS wins.
            if not any(f.startswith("-g") for f in os.environ.get("CFLAGS", "").split()):
                flags.append("-g1")
        else:  # MSVC: C11 where it knows /std:c11 (VS 2019 16.8 and later)
            flags = ["/O2"] + (["/std:c11"] if compiler_accepts(self.compiler, ["/std:c11"]) else [])
        # POSIX: the kernels' threads are mha's own pool (csrc/threads.c) on pthreads
        posix = unix and sys.platform != "win32"
        link = ["-pthread"] if posix else []
        if posix:
            flags.append("-pthread")
        if os.environ.get("MHA_PORTABLE"):
            flags.append("-DMHA_PORTABLE" if unix else "/DMHA_PORTABLE")
            say("MHA_PORTABLE: the kernels in plain C11, without vector extensions")
        omp = None if os.environ.get("MHA_NO_OPENMP") or posix else openmp_flags(self.compiler, unix)
        if posix and not os.environ.get("MHA_NO_OPENMP"):
            say("threads: mha's own pool (POSIX threads)")
        elif omp:
            flags += omp[0]
            link += omp[1]
            say(f"OpenMP: {omp[2]}")
        elif os.environ.get("MHA_NO_OPENMP"):
            flags.append("-DMHA_SERIAL" if unix else "/DMHA_SERIAL")
            say("OpenMP disabled by MHA_NO_OPENMP; building the serial core")
        else:
            say("the compiler has no OpenMP; building the serial core")
        # each kernel unit with its instruction set's flags, where the compiler targets it
        self.unit_flags = {}
        for unit, isa_flags in KERNEL_UNITS.items():
            extra = isa_flags[kind]
            probe = UNIT_PROBE.format(isa_flags["defines"])
            if not compiler_accepts(self.compiler, flags + extra, link, probe):
                say(f"{unit}: the compiler does not target it here ({' '.join(extra)}); "
                    f"its path is left out")
                extra = []
            elif not unix and compiler_accepts(self.compiler, flags + extra + ["/fp:contract"], link):
                extra = extra + ["/fp:contract"]  # fused multiply-adds (VS 2022 and later)
            self.unit_flags[unit] = extra
        for ext in self.extensions:
            ext.include_dirs = ext.include_dirs + [numpy.get_include()]
            ext.extra_compile_args = flags + ext.extra_compile_args
            ext.extra_link_args = link + ext.extra_link_args
        # setuptools skips an extension newer than its sources: not when the compiler or the
        # flags changed since the build in build_temp (CC=clang pip install . after a GCC build)
        stamp = os.path.join(self.build_temp, "mha-build.txt")
        signature = repr((getattr(self.compiler, "compiler_so", kind), flags, link, self.unit_flags))
        if not os.path.exists(stamp) or open(stamp).read() != signature:
            self.force = True
        super().build_extensions()
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(signature)

    def build_extension(self, ext):
        """Compile every source and kernel unit at once, one per core (the two kernel units
        take most of the time), then let setuptools link them."""
        path = self.get_ext_fullpath(ext.name)
        if not (self.force or newer_group(ext.sources + ext.depends, path, "newer")):
            return super().build_extension(ext)  # up to date: setuptools says so and skips
        jobs = [(source, []) for source in ext.sources] + list(self.unit_flags.items())
        jobs.sort(key=lambda job: job[0] not in SLOW)  # the slow units first, the rest after
        for source, _ in jobs:  # the object folders, before the threads race to make them
            os.makedirs(os.path.join(self.build_temp, os.path.dirname(source)), exist_ok=True)

        def compile_one(job):
            source, extra = job
            return self.compiler.compile([source], output_dir=self.build_temp, macros=ext.define_macros,
                                         include_dirs=ext.include_dirs, depends=ext.depends,
                                         extra_postargs=ext.extra_compile_args + extra)
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objects = [o for objs in pool.map(compile_one, jobs) for o in objs]
        sources, extra_objects = ext.sources, ext.extra_objects
        ext.sources, ext.extra_objects = [], objects + list(extra_objects)
        self.force, force = True, self.force  # link even though no source is left to compile
        try:
            super().build_extension(ext)
        finally:
            ext.sources, ext.extra_objects, self.force = sources, extra_objects, force


setup(
    ext_modules=[
        Extension(
            "mha._C",
            sources=CORE,
            include_dirs=["csrc"],
            depends=HEADERS + list(KERNEL_UNITS),
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
