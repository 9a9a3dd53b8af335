"""The whole-model backward of a GPT-2-small-shaped random model against torch eager.

    python benchmarks/backward.py [--case gpt2] [--threads 2] [--rounds 3] [--batch 4]
                                  [--tokens 128] [--layers 12] [--json FILE]
    python benchmarks/backward.py --case minilm --batch 1 --tokens 128

One step = the forward that keeps what the backward needs, the next-token cross-entropy and
every parameter's gradient: mha ``model.loss_and_grads(ids)`` (the C core's chunked
cross-entropy over the tied LM head) against transformers' GPT2LMHeadModel in torch eager
(``model(ids, labels=ids).loss.backward()``, gradients set to None before each step), both
float32 on the same random weights (12 layers, 768 wide, 12 heads, vocab 50,257, 1,024
positions by default), on ``--threads`` threads (mha.set_num_threads, torch.set_num_threads).
torch is imported first. Each round times one untimed step, then one step of each peer in
turn (the first peer alternates); reported: the median step over the rounds and the spread
(lowest and highest), the median of the minor page faults the process took in a step (the
memory a step touches for the first time: what malloc handed back to the system, or never
had), and the two losses (they agree to float32 rounding).

``--case minilm``: a random BERT of all-MiniLM-L6-v2's shape (6 layers, 384 wide, 12 heads,
MLP 1536, vocab 30,522): mha ``model(ids, backward=True)`` then ``model.backward(d_hidden=g)``
against transformers' BertModel's forward and ``last_hidden_state.backward(g)``, g a fixed
random gradient; the "loss" column then shows sum(g * last hidden state).

``--processes separate``: each peer in a process of its own, torch's first (it builds the
weights and saves them for mha's), then mha's, which never imports torch: one untimed step,
then ``--rounds`` timed ones each: each peer alone (as ``training_step.py``'s ``mha`` case),
without the other's threads, memory and malloc state in its process.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np


def build(layers, seed=0):
    """(transformers model, mha model) with the same random GPT-2-small-shaped weights."""
    import torch
    import transformers

    import mha.models
    from mha.models.config import ModelConfig

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=50257,
                                     n_positions=1024)
    ref = transformers.GPT2LMHeadModel(config).eval()       # eval: no dropout, as mha
    checkpoint = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    ours = mha.models.GPT2Model(ModelConfig.from_dict(config.to_dict()), checkpoint,
                                name="gpt2-small-random")
    return ref, ours


def build_minilm(layers, seed=0):
    """(transformers BertModel, mha BertModel) with the same random MiniLM-shaped weights."""
    import torch
    import transformers

    import mha.models
    from mha.models.config import ModelConfig

    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=layers,
                                     num_attention_heads=12, intermediate_size=1536)
    ref = transformers.BertModel(config, add_pooling_layer=False).eval()
    checkpoint = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    raw = dict(config.to_dict(), model_type="bert")
    ours = mha.models.BertModel(ModelConfig.from_dict(raw), checkpoint, name="minilm-random")
    return ref, ours


def steps(args, ref, ours):
    """{peer: step function -> loss} for the torch model ref and the mha model ours (either
    None: that peer is not run)."""
    gpt2 = args.case == "gpt2"
    d_model = 768 if gpt2 else 384
    vocab = 50257 if gpt2 else 30522
    ids = np.random.default_rng(1).integers(0, vocab, size=(args.batch, args.tokens))
    g = np.random.default_rng(2).standard_normal((args.batch, args.tokens, d_model)
                                                  ).astype(np.float32)
    peers = {}
    if ours is not None:
        def mha_step():
            if gpt2:
                return ours.loss_and_grads(ids)[0]
            enc = ours(ids, need_weights=False, backward=True)
            ours.backward(d_hidden=g)
            return float((enc.last_hidden_state * g).sum())
        peers["mha"] = mha_step
    if ref is not None:
        import torch
        ids_t, g_t = torch.from_numpy(ids), torch.from_numpy(g)

        def torch_step():
            ref.zero_grad(set_to_none=True)
            if gpt2:
                loss = ref(input_ids=ids_t, labels=ids_t).loss
                loss.backward()
                return float(loss.detach())
            out = ref(input_ids=ids_t).last_hidden_state
            out.backward(g_t)
            return float((out.detach() * g_t).sum())
        peers["torch"] = torch_step
    return peers


def time_peers(peers, rounds):
    """{peer: [seconds of each timed step]}, {peer: loss of the untimed first step}, {peer:
    [minor page faults of each timed step]}: each round times one step of each peer in turn,
    the first peer alternating."""
    times = {name: [] for name in peers}
    faults = {name: [] for name in peers}
    losses = {name: fn() for name, fn in peers.items()}          # untimed: warm up
    for r in range(rounds):
        order = list(peers) if r % 2 == 0 else list(peers)[::-1]
        for name in order:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            peers[name]()
            times[name].append(time.perf_counter() - start)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return times, losses, faults


def worker(args):
    """One peer in this process (--processes separate): torch builds the weights and saves
    them to --weights, mha reads them; prints {"times": [...], "loss": ..., "faults": [...]}
    as JSON."""
    if args.worker == "torch":
        import torch
        torch.set_num_threads(args.threads)
        ref, ours = (build if args.case == "gpt2" else build_minilm)(args.layers)
        np.savez(args.weights, **{k: v.detach().numpy() for k, v in ref.state_dict().items()})
        with open(args.weights + ".json", "w") as f:
            json.dump(ref.config.to_dict(), f)
        peers = steps(args, ref, None)
    else:
        import mha
        import mha.models
        from mha.models.config import ModelConfig
        mha.set_num_threads(args.threads)
        with open(args.weights + ".json") as f:
            raw = json.load(f)
        checkpoint = dict(np.load(args.weights + ".npz"))
        if args.case == "gpt2":
            ours = mha.models.GPT2Model(ModelConfig.from_dict(raw), checkpoint, name="gpt2")
        else:
            ours = mha.models.BertModel(ModelConfig.from_dict(dict(raw, model_type="bert")),
                                        checkpoint, name="minilm")
        peers = steps(args, None, ours)
    times, losses, faults = time_peers(peers, args.rounds)
    name = args.worker
    print(json.dumps({"times": times[name], "loss": losses[name], "faults": faults[name]}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("gpt2", "minilm"), default="gpt2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, help="default 12 (gpt2), 6 (minilm)")
    parser.add_argument("--processes", choices=("shared", "separate"), default="shared",
                        help="both peers in this process (torch imported first), or each in "
                             "its own")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--worker", choices=("mha", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    gpt2 = args.case == "gpt2"
    args.layers = args.layers or (12 if gpt2 else 6)
    if args.worker:
        return worker(args)
    if args.processes == "separate":
        times, losses, faults = {}, {}, {}
        with tempfile.TemporaryDirectory() as tmp:
            for name in ("torch", "mha"):
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", name,
                       "--weights", os.path.join(tmp, "weights"), "--case", args.case,
                       "--threads", str(args.threads), "--rounds", str(args.rounds),
                       "--batch", str(args.batch), "--tokens", str(args.tokens),
                       "--layers", str(args.layers)]
                out = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                                text=True).stdout.splitlines()[-1])
                times[name], losses[name], faults[name] = out["times"], out["loss"], out["faults"]
        times = {"mha": times["mha"], "torch": times["torch"]}
        faults = {"mha": faults["mha"], "torch": faults["torch"]}
    else:
        import torch
        import mha
        torch.set_num_threads(args.threads)
        mha.set_num_threads(args.threads)
        ref, ours = (build if gpt2 else build_minilm)(args.layers)
        times, losses, faults = time_peers(steps(args, ref, ours), args.rounds)
    report(args, times, losses, faults)


def report(args, times, losses, faults):
    """Print (and with --json write) the median, spread, page faults and loss of each peer."""
    gpt2 = args.case == "gpt2"
    result = {name: dict(median=float(np.median(t)), low=float(min(t)), high=float(max(t)),
                         faults=int(np.median(faults[name])), loss=losses[name])
              for name, t in times.items()}
    shape = "GPT-2: {} layers x 768, vocab 50257" if gpt2 else "MiniLM: {} layers x 384"
    print(f"{shape.format(args.layers)}; {args.batch} x {args.tokens} tokens; "
          f"{args.threads} threads; {args.rounds} rounds; processes {args.processes}")
    for name, r in result.items():
        print(f"  {name:6s} step {r['median']:.3f} s  (spread {r['low']:.3f} - "
              f"{r['high']:.3f})  {r['faults']:6d} page faults  loss {r['loss']:.6f}")
    print(f"  torch / mha: {result['torch']['median'] / result['mha']['median']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(vars(args), result=result), f, indent=1)


if __name__ == "__main__":
    main()
