"""mha.apps.bench (`python -m mha bench`): the table's arithmetic and the command line (the timings themselves are not tested:
this machine is too noisy for timed tests)."""
import math

import pytest

from mha.apps import bench


def test_table_ratios_rates_and_missing_peers():
    ceiling = 100.0
    rows = [bench._row("a: demo", "forward", "mha", 0.010, 1e9, ceiling),
            bench._row("a: demo", "forward", "torch", 0.020, 1e9, ceiling),
            bench._row("a: demo", "forward", "numpy", 0.005, 1e9, ceiling),
            bench._row("e: model", "forward", "mha", 0.040, None, ceiling)]
    assert rows[0]["gflops"] == pytest.approx(100.0) and rows[0]["ceiling_frac"] == pytest.approx(1.0)
    assert math.isnan(rows[3]["gflops"])
    meta = dict(date="2026-01-01", cpu="cpu", threads=2, matmul_gflops=ceiling, torch="x")
    text = bench.table(dict(meta=meta, rows=rows))
    demo = next(line for line in text.splitlines() if line.startswith("| a: demo"))
    assert "| 10.00 | 20.00 | 5.00 | 2.00x | 0.50x | 100.0 | 100% |" in demo
    model = next(line for line in text.splitlines() if line.startswith("| e: model"))
    assert model.endswith("| 40.00 | - | - | - | - | - | - |")


def test_table_gives_the_range_of_the_rounds_ratios():
    rows = [bench._row("a: demo", "forward", "mha", 0.010, 1e9, 100.0, [0.010, 0.008, 0.012]),
            bench._row("a: demo", "forward", "torch", 0.015, 1e9, 100.0, [0.020, 0.010, 0.015])]
    meta = dict(date="2026-01-01", cpu="cpu", threads=2, matmul_gflops=100.0, torch="x")
    demo = next(line for line in bench.table(dict(meta=meta, rows=rows)).splitlines()
                if line.startswith("| a: demo"))
    # rounds: 20/10 = 2.00, 10/8 = 1.25, 15/12 = 1.25; pooled medians 15/10 = 1.50
    assert "| 1.50x (1.25-2.00) |" in demo


def test_measure_keeps_each_rounds_median(monkeypatch):
    fns, _ = fake_functions(monkeypatch, {"a": [1.0, 2.0, 3.0, 4.0], "b": [5.0, 6.0, 7.0, 8.0]})
    rows = bench._measure("x", "forward", fns, 2, None, 1.0)
    by = {r["impl"]: r for r in rows}
    # settle 0.25 s: one untimed call, then the turn's first call is timed and measure (0.1 s)
    # has passed: a times 2 then 4, b times 6 then 8
    assert by["a"]["round_ms"] == [2000.0, 4000.0] and by["a"]["ms"] == 3000.0
    assert by["b"]["round_ms"] == [6000.0, 8000.0]


def test_flop_counts():
    # case a's shape at 8 heads: 4 projections of 2048 x 256 x 256 plus q k^T and P v
    assert bench.layer_flops(16, 128, 128, 256, 8, 32) == 8 * 2048 * 256 * 256 + 4 * 16 * 8 * 128 * 128 * 32
    assert bench.attention_flops(1, 1, 4, 4, 2, causal=True) == bench.attention_flops(1, 1, 4, 4, 2) // 2


def test_bad_cases_option_exits_with_a_message(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--cases", "xyz"])
    assert info.value.code == 2
    assert "--cases" in capsys.readouterr().err


def fake_functions(monkeypatch, costs):
    """A fake clock for bench.time.perf_counter and a function per name of `costs`: its k-th
    call advances the clock by costs[name][k], so the timed durations are exact and the tests do
    not depend on the machine's speed. Returns (functions by name, the names in call order)."""
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    calls = []

    def fn(name):
        def run():
            clock[0] += costs[name][calls.count(name)]
            calls.append(name)
        return run
    return {name: fn(name) for name in costs}, calls


def test_median_times_takes_turns_settles_and_times_the_last_call(monkeypatch):
    fns, calls = fake_functions(monkeypatch, {"a": [1.0, 5.0, 2.0, 9.0, 3.0, 4.0, 6.0],
                                              "b": [1.0, 1.0, 7.0, 2.0, 3.0, 2.0, 4.0]})
    medians = bench.median_times(fns, repeats=3, settle=1.5, measure=0.0)
    # rounds start from a different function (a b | b a | a b); a turn calls untimed until 1.5 s
    # have passed (a: 1 + 5 s, b: 1 + 1 s in the first round; one call of >= 2 s after), then
    # once timed
    assert "".join(calls) == "aaa" + "bbb" + "bb" + "aa" + "aa" + "bb"
    # timed: a 2, 3, 6 -> 3; b 7, 3, 4 -> 4
    assert medians == {"a": 3.0, "b": 4.0}


def test_median_times_pools_the_calls_of_each_measuring_window(monkeypatch):
    fns, calls = fake_functions(monkeypatch, {"a": [3.0, 1.0, 2.0, 4.0, 9.0, 3.0, 1.0, 5.0],
                                              "b": [3.0, 10.0, 3.0, 1.0, 1.0, 2.0, 6.0]})
    medians = bench.median_times(fns, repeats=2, settle=2.5, measure=3.5)
    # round 1 (a b): a settles on its 3 s call, then times 1, 2 (3 s < 3.5), 4; b settles on
    # 3, times 10. Round 2 (b a): b settles on 3, times 1, 1, 2 (4 s); a settles on 9, times 3, 1
    # (4 s). Pooled medians: a of 1 2 4 3 1 -> 2; b of 10 1 1 2 -> 1.5
    assert "".join(calls) == "aaaa" + "bb" + "bbbb" + "aaa"
    assert medians == {"a": 2.0, "b": 1.5}


def test_encode_case_times_both_measures_at_each_length():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import mha.models
    try:
        mha.models.minilm_path()
    except (ImportError, OSError) as e:
        pytest.skip(f"MiniLM is not installed: {e}")
    rows = bench._encode_case(2, 100.0, 1, lengths=(16, 24))
    got = {(r["case"], r["what"], r["impl"]) for r in rows}
    want = {(f"e: MiniLM, {n} tokens", what, impl) for n in (16, 24)
            for what in ("forward +weights", "forward (torch: SDPA)") for impl in ("mha", "torch")}
    assert got == want
    assert all(r["ms"] > 0 and len(r["round_ms"]) == 1 for r in rows)


# --- --simd: one SIMD path for mha and its peers (mha.apps.simd) ------------------------------

def test_simd_environment_names_each_librarys_switch():
    from mha.apps import simd
    env = simd.simd_environment("avx2")
    assert env == {"MHA_SIMD": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                   "ONEDNN_MAX_CPU_ISA": "AVX2", "OPENBLAS_CORETYPE": "Haswell"}
    assert simd.simd_environment("baseline")["ATEN_CPU_CAPABILITY"] == "default"
    assert "OPENBLAS_CORETYPE" not in simd.simd_environment("avx512")
    with pytest.raises(ValueError, match="avx512, avx2, baseline"):
        simd.simd_environment("sse9")


def test_run_on_path_runs_a_child_only_when_the_environment_differs(monkeypatch):
    from mha.apps import simd
    children = []
    monkeypatch.setattr(simd.subprocess, "call", lambda args, env: children.append((args, env)) or 7)
    assert simd.run_on_path(None, ["-m", "mha", "bench"]) is None and not children
    for k, v in simd.simd_environment("avx2").items():
        monkeypatch.setenv(k, v)
    assert simd.run_on_path("avx2", ["-m", "mha", "bench"]) is None and not children
    monkeypatch.setenv("MHA_SIMD", "avx512")
    assert simd.run_on_path("avx2", ["-m", "mha", "bench", "--simd", "avx2"]) == 7
    (args, env), = children
    assert args[1:] == ["-m", "mha", "bench", "--simd", "avx2"] and env["MHA_SIMD"] == "avx2"
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"


def test_describe_paths_says_what_ran():
    import mha
    from mha.apps import simd
    text = simd.describe_paths(None, onnxruntime=True)
    assert text.startswith(f"mha {mha.build_info()['simd']} (")
    assert text.endswith("onnxruntime by the CPU's features (no switch)")

    class FakeTorch:
        class backends:
            class cpu:
                @staticmethod
                def get_cpu_capability():
                    return "AVX2"
    assert "; torch ATen AVX2" in simd.describe_paths(FakeTorch)


def test_bench_simd_option_refuses_an_unknown_path(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--simd", "sse9"])
    assert info.value.code == 2
    assert "--simd" in capsys.readouterr().err


def test_bench_table_header_names_the_simd_paths():
    rows = [bench._row("a: demo", "forward", "mha", 0.010, 1e9, 100.0)]
    meta = dict(date="2026-01-01", cpu="cpu", threads=2, matmul_gflops=100.0, torch="x",
                simd="mha avx2 (MHA_SIMD=avx2); torch ATen AVX2")
    head = bench.table(dict(meta=meta, rows=rows)).splitlines()[0]
    assert "SIMD paths: mha avx2 (MHA_SIMD=avx2); torch ATen AVX2." in head
