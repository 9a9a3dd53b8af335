"""Whole models against their peers, and where mha's time goes.

    python benchmarks/models.py [--rounds 3] [--threads 2] [--calls 3] [--cases minilm,llama]
                                [--tokens 128,512] [--workdir DIR] [--json FILE]
    python benchmarks/models.py --profile [--cases ...]        # mha alone, by operation
    python benchmarks/models.py --simd avx2 ...                 # every library on AVX2

Cases (float32, one text, every library on ``--threads`` threads: mha.set_num_threads,
torch.set_num_threads, onnxruntime's intra_op_num_threads; NumPy's BLAS keeps its default):

  minilm attentions, N tokens: all-MiniLM-L6-v2 on N ids with every attention map: mha
      ``model(ids)`` (what ``model.attentions(text)`` runs, without the tokenizer) against
      transformers' eager attention with output_attentions=True, output_hidden_states=True.
  minilm hidden states, N tokens: no attention maps (what sentence embedding needs): mha
      ``model(ids, need_weights=False)`` against transformers' SDPA (output_hidden_states=True)
      and onnxruntime on the same model exported with torch.onnx (dynamo) at N tokens, last
      hidden state only, ORT_ENABLE_ALL.
  llama prefill / decode: a random LLaMA of SmolLM-135M's shape (30 layers, hidden 576, 9 heads,
      3 KV heads, MLP 1536, vocab 49152, tied), saved once in --workdir. Greedy generation of 64
      new tokens after a 256-token prompt; prefill = the time to the first new token (prompt
      forward, LM head, argmax), decode = the intervals between consecutive new tokens (one
      step on the KV cache, LM head, argmax). A turn opens with an untimed generation of 4.
      mha ``generate(need_weights=False)`` and with its attentions, against transformers'
      ``generate`` with SDPA, and with eager attention returning its attentions.
  families (``--cases families``, or ``family:gemma2`` ... one at a time; ``--families``
      picks some): issue 36's seven decoder families, each a random model of a 125M-class
      shape (FAMILY_SHAPES: 12 layers, width 768, 12 heads of 64, GQA where the family has
      it, Gemma 2's caps as its real configs have them), saved once in --workdir with
      transformers' save_pretrained. One forward on 128 random ids with every attention map
      and every hidden state: mha ``model(ids, need_weights=True)`` against the same
      folder's base model (AutoModel: no LM head, as mha's ``model(ids)`` has none) in
      transformers' eager attention with output_attentions=True, output_hidden_states=True.
      Preparing a folder checks that both give the same attentions and hidden states.

SIMD path: ``--simd avx2`` (or avx512, baseline) runs the workers with mha, torch (ATen, MKL,
oneDNN) and NumPy on that path (``mha.apps.simd``): on an AVX-512 machine, what an AVX2 laptop
runs. onnxruntime has no switch: it picks its kernels by the CPU's features. The header says
which path each library ran.

Import order: each round runs two worker processes, one that imports torch and transformers
before mha ("torch first", what most notebooks do) and one that imports mha first; a worker
times its peers in turns, rotating which goes first. A turn is one untimed call, then
``--calls`` timed calls. Reported per case, order and peer: the median of all timed calls over
the rounds, and the spread: the lowest and highest median of one turn; and for each peer, the
paired ratio: its turn median over mha's turn median of the same worker and turn (run back to
back), as the median, quartiles and range over the turns.

The profile (``--profile``) runs mha's side of each case under cProfile and sums the time by
operation (attention kernel, products with their fused activation and residual, norms, RoPE,
...; NumPy and C calls are charged to the mha.models.ops function that made them).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
SMOLLM_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
PROMPT, NEW = 256, 64

# issue 36's families at a 125M-class shape: {model_type: (transformers config class, CausalLM
# class, config)}; 12 layers of width 768 with 12 heads of 64 throughout
_COMMON = dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
               max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILY_SHAPES = {
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",      # Pythia-160M's shape
                 dict(_COMMON, intermediate_size=3072, vocab_size=50304, rotary_pct=0.25,
                      rotary_emb_base=10000, use_parallel_residual=True)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(_COMMON, intermediate_size=2048, vocab_size=32000, head_dim=64,
                   num_key_value_heads=4)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(_COMMON, intermediate_size=2048, vocab_size=32000, head_dim=64,
                    num_key_value_heads=4, query_pre_attn_scalar=64,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                    sliding_window=4096)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(_COMMON, intermediate_size=2048, vocab_size=32000, head_dim=64,
                         num_key_value_heads=4, query_pre_attn_scalar=64,
                         sliding_window=512)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(_COMMON, intermediate_size=2048, vocab_size=32000, head_dim=64,
                   num_key_value_heads=4, tie_word_embeddings=True)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM",
              dict(_COMMON, intermediate_size=2048, vocab_size=32000)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(_COMMON, intermediate_size=2048, vocab_size=32064, sliding_window=2047)),
}
FAMILY_TOKENS = 128


# --- preparation (in the parent process) ---------------------------------------------------------

def prepare(workdir, tokens, cases):
    """Write what the workers read: MiniLM exported to ONNX per length, the random LLaMA."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    import mha.models

    workdir.mkdir(parents=True, exist_ok=True)
    if "minilm" in cases:
        folder = str(mha.models.minilm_path())
        model = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()

        class LastHidden(torch.nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, ids):
                return self.model(input_ids=ids).last_hidden_state

        for n in tokens:
            path = workdir / f"minilm-{n}.onnx"
            if not path.is_file():
                print(f"exporting MiniLM at {n} tokens to {path}", file=sys.stderr)
                ids = torch.from_numpy(minilm_ids(n))
                torch.onnx.export(LastHidden(model), (ids,), str(path), dynamo=True,
                                  input_names=["ids"], output_names=["last_hidden_state"])
                import onnxruntime
                session = onnxruntime.InferenceSession(str(path))
                with torch.no_grad():
                    expected = model(ids).last_hidden_state.numpy()
                error = np.abs(session.run(None, {"ids": ids.numpy()})[0] - expected).max()
                print(f"onnxruntime against transformers: {error:.1e}", file=sys.stderr)
                if not error < 1e-3:
                    path.unlink()
                    raise SystemExit(f"the ONNX export of MiniLM is wrong ({error:.2e})")
    if "llama" in cases:
        folder = workdir / "smollm-shape"
        if not (folder / "model.safetensors").is_file():
            print(f"writing a random LLaMA of SmolLM-135M's shape to {folder}", file=sys.stderr)
            torch.manual_seed(0)
            config = transformers.LlamaConfig(**SMOLLM_SHAPE)
            transformers.LlamaForCausalLM(config).save_pretrained(folder,
                                                                  safe_serialization=True)
    for case in cases:
        if case.startswith("family:"):
            prepare_family(workdir, case.split(":", 1)[1], torch, transformers)


def prepare_family(workdir, family, torch, transformers):
    """Save a random model of the family's FAMILY_SHAPES once; check mha against it."""
    import mha.models
    folder = workdir / f"family-{family}"
    if (folder / "model.safetensors").is_file():
        return
    config_class, model_class, shape = FAMILY_SHAPES[family]
    print(f"writing a random {family} of a 125M-class shape to {folder}", file=sys.stderr)
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**shape)
    hf = getattr(transformers, model_class)(config).eval()
    hf.save_pretrained(folder, safe_serialization=True)
    base = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    ids = family_ids(family)
    with torch.no_grad():
        out = base(torch.from_numpy(ids), output_attentions=True, output_hidden_states=True)
    enc = mha.models.load(folder)(ids)
    attn = np.stack([a.numpy() for a in out.attentions], axis=1)
    error_a = np.abs(enc.attentions - attn).max()
    last = out.hidden_states[-1].numpy()
    error_h = np.abs(enc.hidden_states[:, -1] - last).max() / np.abs(last).max()
    print(f"{family}: mha against transformers eager: attentions {error_a:.1e}, last hidden "
          f"state {error_h:.1e} of its scale", file=sys.stderr)
    if not (error_a < 1e-4 and error_h < 1e-4):
        import shutil
        shutil.rmtree(folder)
        raise SystemExit(f"mha's {family} differs from transformers' ({error_a:.1e}, "
                         f"{error_h:.1e})")


def family_ids(family):
    """(1, FAMILY_TOKENS) random ids of the family's vocabulary (past the special ids)."""
    vocab = FAMILY_SHAPES[family][2]["vocab_size"]
    return np.random.default_rng(0).integers(3, vocab, FAMILY_TOKENS)[None]


def minilm_ids(n):
    """(1, n) ids of real text: MiniLM's tokenizer on a repeated sentence, [CLS] ... [SEP]."""
    import mha.models
    from mha.apps.encode_speed import _ids
    return _ids(mha.models.load("minilm"), n)[None]


# --- a worker: one process, one import order -------------------------------------------------------

def worker(args):
    spec = json.loads(args.worker)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if spec["order"] == "torch first":
        import torch
        import transformers
        import mha
    else:
        import mha
        import torch
        import transformers
    threads = spec["threads"]
    mha.set_num_threads(threads)
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    results = []
    if spec["case"] == "minilm":
        results += minilm_case(spec, mha, torch, transformers)
    elif spec["case"].startswith("family:"):
        results += family_case(spec, mha, torch, transformers)
    else:
        results += llama_case(spec, mha, torch, transformers)
    from mha.apps.simd import describe_paths
    ran_ort = spec["case"] == "minilm" and "onnxruntime" in sys.modules
    info = {"order": spec["order"], "build_info": mha.build_info(),
            "simd": describe_paths(torch, onnxruntime=ran_ort),
            "torch_threads": torch.get_num_threads(), "results": results}
    print("RESULT " + json.dumps(info))


def take_turns(peers, turns, calls):
    """{name: fn() -> list of seconds}: ``turns`` turns each, rotating the first; one untimed
    call opens a turn. Returns {name: [per-turn lists of seconds]}."""
    names = list(peers)
    samples = {name: [] for name in names}
    for t in range(turns):
        for name in names[t % len(names):] + names[:t % len(names)]:
            peers[name]()                                           # untimed
            samples[name].append([s for _ in range(calls) for s in peers[name]()])
    return samples


def timed(fn):
    def run():
        t0 = time.perf_counter()
        fn()
        return [time.perf_counter() - t0]
    return run


def minilm_case(spec, mha, torch, transformers):
    import mha.models
    model = mha.models.load("minilm")
    hf = transformers.AutoModel.from_pretrained(str(model.folder),
                                                attn_implementation="eager").eval()
    hf_sdpa = transformers.AutoModel.from_pretrained(str(model.folder),
                                                     attn_implementation="sdpa").eval()
    ort = None
    try:
        import onnxruntime as ort
    except ImportError:
        print("onnxruntime is not installed: its row is skipped", file=sys.stderr)
    rows = []
    for n in spec["tokens"]:
        ids = minilm_ids(n)
        t_ids = torch.from_numpy(ids)
        attn = {
            "mha": timed(lambda: model(ids)),
            "transformers eager": timed(lambda: hf(t_ids, output_attentions=True,
                                                   output_hidden_states=True)),
        }
        hidden = {
            "mha": timed(lambda: model(ids, need_weights=False)),
            "transformers sdpa": timed(lambda: hf_sdpa(t_ids, output_hidden_states=True)),
        }
        if ort is not None:
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            options.intra_op_num_threads = spec["threads"]
            options.inter_op_num_threads = 1
            session = ort.InferenceSession(str(Path(spec["workdir"]) / f"minilm-{n}.onnx"),
                                           options, providers=["CPUExecutionProvider"])
            hidden["onnxruntime"] = timed(lambda: session.run(None, {"ids": ids}))
        for label, peers in ((f"minilm attentions, {n} tokens", attn),
                             (f"minilm hidden states, {n} tokens", hidden)):
            for name, samples in take_turns(peers, spec["turns"], spec["calls"]).items():
                rows.append({"case": label, "peer": name, "samples": samples})
    return rows


def family_case(spec, mha, torch, transformers):
    import mha.models
    family = spec["case"].split(":", 1)[1]
    folder = Path(spec["workdir"]) / f"family-{family}"
    model = mha.models.load(folder)
    hf = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    ids = family_ids(family)
    t_ids = torch.from_numpy(ids)
    peers = {
        "mha": timed(lambda: model(ids, need_weights=True)),
        "transformers eager": timed(lambda: hf(t_ids, output_attentions=True,
                                               output_hidden_states=True)),
    }
    label = f"{family} attentions, {FAMILY_TOKENS} tokens"
    return [{"case": label, "peer": name, "samples": samples}
            for name, samples in take_turns(peers, spec["turns"], spec["calls"]).items()]


def llama_case(spec, mha, torch, transformers):
    import mha.models
    folder = Path(spec["workdir"]) / "smollm-shape"
    model = mha.models.load(folder)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    prompt = np.random.default_rng(0).integers(3, SMOLLM_SHAPE["vocab_size"], PROMPT)
    t_prompt = torch.from_numpy(prompt[None])

    class Clock:              # transformers' streamer interface: put() per token, end()
        def __init__(self):
            self.stamps = [time.perf_counter()]

        def put(self, value):
            if value.ndim == 1:          # a new token (the prompt comes first, 2-D)
                self.stamps.append(time.perf_counter())

        def end(self):
            pass

        def __call__(self, token_id):    # mha's callback
            self.stamps.append(time.perf_counter())

    def run_mha(new, need_weights):
        clock = Clock()
        model.generate(prompt, max_new_tokens=new, stop_at_eos=False, callback=clock,
                       need_weights=need_weights, progress=False)
        return clock.stamps

    def run_hf(new, implementation):
        hf.set_attn_implementation(implementation)
        clock = Clock()
        extra = {}
        if implementation == "eager":
            extra = dict(output_attentions=True, return_dict_in_generate=True)
        hf.generate(t_prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                    pad_token_id=0, streamer=clock, **extra)
        return clock.stamps

    runs = {"mha": lambda new: run_mha(new, False),
            "mha +attentions": lambda new: run_mha(new, True),
            "transformers sdpa": lambda new: run_hf(new, "sdpa"),
            "transformers eager +attentions": lambda new: run_hf(new, "eager")}
    stamps = {name: [] for name in runs}
    names = list(runs)
    for t in range(spec["turns"]):
        for name in names[t % len(names):] + names[:t % len(names)]:
            runs[name](4)                                   # untimed: prefill + 4 tokens
            stamps[name].append([runs[name](NEW) for _ in range(spec["llama_calls"])])
    rows = []
    for name, turns in stamps.items():
        prefill = [[s[1] - s[0] for s in turn] for turn in turns]
        decode = [[b - a for s in turn for a, b in zip(s[1:], s[2:])] for turn in turns]
        rows.append({"case": f"llama prefill, {PROMPT} tokens", "peer": name,
                     "samples": prefill})
        rows.append({"case": f"llama decode, per token over {NEW}", "peer": name,
                     "samples": decode})
    return rows


# --- the parent: rounds of workers, the table -------------------------------------------------------

def run_workers(args, tokens, cases):
    rows = {}
    meta = []
    orders = ["torch first", "mha first"]
    for r in range(args.rounds):
        for case in cases:
            for order in (orders if r % 2 == 0 else orders[::-1]):
                spec = dict(order=order, case=case, threads=args.threads, turns=args.turns,
                            calls=args.calls, llama_calls=args.llama_calls, tokens=tokens,
                            workdir=str(args.workdir))
                print(f"round {r + 1}/{args.rounds}: {case}, {order}", file=sys.stderr,
                      flush=True)
                out = subprocess.run([sys.executable, str(HERE), "--worker", json.dumps(spec)],
                                     capture_output=True, text=True, cwd="/")
                line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                if out.returncode or not line:
                    sys.stderr.write(out.stderr[-3000:])
                    raise SystemExit(f"worker failed: {case}, {order}")
                info = json.loads(line[-1][len("RESULT "):])
                meta.append({k: v for k, v in info.items() if k != "results"})
                for row in info["results"]:
                    key = (row["case"], order, row["peer"])
                    rows.setdefault(key, []).extend(row["samples"])
    return rows, meta


def summarize(rows):
    """One line per (case, order, peer): median ms of all calls, spread of turn medians, and
    the turn medians themselves (``turn_ms``, in the order they ran)."""
    table = []
    for (case, order, peer), turns in rows.items():
        every = [s for turn in turns for s in turn]
        medians = [np.median(turn) for turn in turns]
        table.append(dict(case=case, order=order, peer=peer, ms=1e3 * float(np.median(every)),
                          low=1e3 * float(min(medians)), high=1e3 * float(max(medians)),
                          calls=len(every), turns=len(turns),
                          turn_ms=[1e3 * float(m) for m in medians]))
    return table


def paired_ratios(peer_row, mha_row):
    """peer / mha of each turn with the turn of mha that ran next to it (same worker, same
    turn index: the peers of a worker take turns back to back), so that load which comes and
    goes over seconds hits both sides of a ratio: on a shared machine the median of these
    is steadier than the ratio of two medians taken over minutes."""
    a, b = peer_row.get("turn_ms", []), mha_row.get("turn_ms", [])
    return [x / y for x, y in zip(a, b)] if len(a) == len(b) else []


def print_table(table):
    """Markdown; the last column is peer ms / mha ms (> 1: mha is faster), against mha's row
    of the same kind (with attentions against "mha +attentions" where there is one)."""
    print("| case | import order | peer | median ms | turn medians ms | peer / mha | "
          "paired: median (quartiles; range) |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for row in table:
        same = {r["peer"]: r for r in table
                if r["case"] == row["case"] and r["order"] == row["order"]}
        mha_row = same.get("mha +attentions" if "+attentions" in row["peer"] else "mha")
        ratio, paired = "", ""
        if not row["peer"].startswith("mha") and mha_row is not None:
            ratio = f"{row['ms'] / mha_row['ms']:.2f}x"
            r = paired_ratios(row, mha_row)
            if r:
                q1, q2, q3 = np.percentile(r, [25, 50, 75])
                paired = (f"{q2:.2f}x ({q1:.2f}-{q3:.2f}; {min(r):.2f}-{max(r):.2f}, "
                          f"{len(r)} turns)")
        print(f"| {row['case']} | {row['order']} | {row['peer']} | {row['ms']:.2f} | "
              f"{row['low']:.2f}-{row['high']:.2f} | {ratio} | {paired} |")


# --- the profile ----------------------------------------------------------------------------------

# mha function -> operation; NumPy and C functions are charged to their callers (so the C core's
# GEMM, _C.linear, counts as "products" when ops.linear calls it and "LM head" from ops.unembed)
KERNEL = "attention kernel (C)"
CATEGORIES = {
    "linear": "products + bias + activation + residual (mha GEMM, packed weights)",
    "unembed": "LM head (mha GEMM, packed table)",
    "layer_norm_": "norms (C)", "layer_norm": "norms (C)", "rms_norm": "norms (C)",
    "rope_": "RoPE (C)", "rope_table": "RoPE (C)", "_rope": "RoPE (C)",
    "embedding": "embedding gather (C)",
    "split_heads": "head split (views)",
    "append": "KV cache append",
    "generate": "generate's loop (argmax, bookkeeping)",
    "feed": "generate's loop (argmax, bookkeeping)",
    "_forward": "block glue (hidden-state copies, Python)",
    "_self_attention": "block glue (hidden-state copies, Python)",
    "_attention": "attention call (buffers, masks, Python)",
}


def profile(args, tokens, cases):
    import cProfile
    import pstats
    import mha
    import mha.models

    mha.set_num_threads(args.threads)
    runs = {}
    if "minilm" in cases:
        model = mha.models.load("minilm")
        for n in tokens:
            ids = minilm_ids(n)
            runs[f"minilm attentions, {n} tokens"] = lambda ids=ids: model(ids)
            runs[f"minilm hidden states, {n} tokens"] = \
                lambda ids=ids: model(ids, need_weights=False)
    if "llama" in cases:
        llama = mha.models.load(args.workdir / "smollm-shape")
        prompt = np.random.default_rng(0).integers(3, SMOLLM_SHAPE["vocab_size"], PROMPT)
        runs[f"llama prefill, {PROMPT} tokens"] = \
            lambda: llama(prompt[None], need_weights=False)
        runs[f"llama generate, {PROMPT} + {NEW} tokens"] = \
            lambda: llama.generate(prompt, max_new_tokens=NEW, stop_at_eos=False,
                                   need_weights=False, progress=False)
    for case in cases:
        if case.startswith("family:"):
            family = case.split(":", 1)[1]
            fmodel = mha.models.load(args.workdir / f"family-{family}")
            runs[f"{family} attentions, {FAMILY_TOKENS} tokens"] = \
                lambda m=fmodel, ids=family_ids(family): m(ids, need_weights=True)
    for label, fn in runs.items():
        fn()
        profiler = cProfile.Profile()
        repeats = 3
        t0 = time.perf_counter()
        profiler.enable()
        for _ in range(repeats):
            fn()
        profiler.disable()
        wall = (time.perf_counter() - t0) / repeats
        totals = by_category(pstats.Stats(profiler).stats)
        print(f"\n{label}: {1e3 * wall:.1f} ms a call under cProfile ({repeats} calls)")
        whole = sum(totals.values())
        for category, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"  {category:58s} {1e3 * seconds / repeats:8.2f} ms  "
                  f"{100 * seconds / whole:5.1f}%")


def by_category(stats):
    """Seconds per operation: each function's own time, charged to its category, or (for
    NumPy, C and helper functions) split over its callers by the time it took under each."""
    def category(func, depth=0):
        path, _, name = func
        if "mha._C.attention_forward" in name:
            return {KERNEL: 1.0}
        if name in CATEGORIES and "mha" in path:
            return {CATEGORIES[name]: 1.0}
        callers = stats[func][4] if func in stats else {}
        total = sum(c[3] for c in callers.values())      # c: (calls, calls, own, cumulative)
        if depth > 12 or not callers or total <= 0:
            return {"Python and NumPy overhead (the rest)": 1.0}
        shares = {}
        for caller, c in callers.items():
            for cat, w in category(caller, depth + 1).items():
                shares[cat] = shares.get(cat, 0.0) + w * c[3] / total
        return shares

    totals = {}
    for func, (_, _, tottime, _, _) in stats.items():
        for cat, w in category(func).items():
            totals[cat] = totals.get(cat, 0.0) + w * tottime
    return totals


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=2, help="turns per peer in a worker")
    parser.add_argument("--calls", type=int, default=3, help="timed calls per turn")
    parser.add_argument("--llama-calls", type=int, default=1,
                        help="timed generations per turn (each gives 1 prefill and 63 decode "
                             "samples)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", default="128,512", help="MiniLM lengths")
    parser.add_argument("--cases", default="minilm,llama",
                        help="minilm, llama, families (each of --families), family:<type>")
    parser.add_argument("--families", default=",".join(FAMILY_SHAPES),
                        help="the model_types --cases families runs")
    parser.add_argument("--workdir", type=Path,
                        default=Path(tempfile.gettempdir()) / "mha-models-bench")
    parser.add_argument("--json", type=Path, help="also write the table here")
    parser.add_argument("--profile", action="store_true", help="profile mha by operation")
    parser.add_argument("--simd", choices=("avx512", "avx2", "baseline"),
                        help="run mha, torch and NumPy on this SIMD path (default: each one's best)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.simd:    # this script again with the path's environment, which the workers inherit
        import mha
        from mha.apps.simd import run_on_path
        if args.simd not in mha.build_info()["simd_paths"]:
            parser.error(f"--simd {args.simd}: this build and CPU run "
                         f"{' '.join(mha.build_info()['simd_paths'])}")
        status = run_on_path(args.simd, [str(HERE), *(sys.argv[1:] if argv is None else argv)])
        if status is not None:
            return status
    tokens = [int(t) for t in args.tokens.split(",")]
    cases = []
    for case in args.cases.split(","):
        cases += [f"family:{f}" for f in args.families.split(",")] if case == "families" \
            else [case]
    prepare(args.workdir, tokens, cases)
    if args.profile:
        return profile(args, tokens, cases)
    started = time.strftime("%Y-%m-%d %H:%M")
    rows, meta = run_workers(args, tokens, cases)
    table = summarize(rows)
    print(f"\n{started}, {args.threads} threads, {args.rounds} rounds x {args.turns} turns x "
          f"{args.calls} calls; load average at the end {os.getloadavg()[0]:.1f}")
    print(f"mha {meta[0]['build_info']}")
    print(f"SIMD paths: {'; '.join(sorted({m['simd'] for m in meta}))}")
    print_table(table)
    if args.json:
        args.json.write_text(json.dumps({"started": started, "table": table, "meta": meta},
                                        indent=1))


if __name__ == "__main__":
    sys.exit(main())
