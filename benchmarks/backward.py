"""The whole-model backward of a GPT-2-small-shaped random model against torch eager.

    python benchmarks/backward.py [--threads 2] [--rounds 3] [--batch 4] [--tokens 128]
                                  [--layers 12] [--json FILE]

One step = the forward that keeps what the backward needs, the next-token cross-entropy and
every parameter's gradient: mha ``model.loss_and_grads(ids)`` (the C core's chunked
cross-entropy over the tied LM head) against transformers' GPT2LMHeadModel in torch eager
(``model(ids, labels=ids).loss.backward()``, gradients set to None before each step), both
float32 on the same random weights (12 layers, 768 wide, 12 heads, vocab 50,257, 1,024
positions by default), on ``--threads`` threads (mha.set_num_threads, torch.set_num_threads).
torch is imported first. Each round times one untimed step, then one step of each peer in
turn (the first peer alternates); reported: the median step over the rounds and the spread
(lowest and highest), and the two losses (they agree to float32 rounding).
"""
import argparse
import json
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    import torch
    import mha
    torch.set_num_threads(args.threads)
    mha.set_num_threads(args.threads)
    ref, ours = build(args.layers)
    ids = np.random.default_rng(1).integers(0, 50257, size=(args.batch, args.tokens))
    ids_t = torch.from_numpy(ids)

    def torch_step():
        ref.zero_grad(set_to_none=True)
        loss = ref(input_ids=ids_t, labels=ids_t).loss
        loss.backward()
        return float(loss.detach())

    def mha_step():
        return ours.loss_and_grads(ids)[0]

    peers = {"mha": mha_step, "torch": torch_step}
    times = {name: [] for name in peers}
    losses = {name: fn() for name, fn in peers.items()}          # untimed: warm up
    for r in range(args.rounds):
        order = list(peers) if r % 2 == 0 else list(peers)[::-1]
        for name in order:
            start = time.perf_counter()
            peers[name]()
            times[name].append(time.perf_counter() - start)
    result = {name: dict(median=float(np.median(t)), low=float(min(t)), high=float(max(t)),
                         loss=losses[name]) for name, t in times.items()}
    print(f"GPT-2 shape: {args.layers} layers x 768, vocab 50257; {args.batch} x {args.tokens} "
          f"tokens; {args.threads} threads; {args.rounds} rounds")
    for name, r in result.items():
        print(f"  {name:6s} step {r['median']:.3f} s  (spread {r['low']:.3f} - "
              f"{r['high']:.3f})  loss {r['loss']:.6f}")
    print(f"  torch / mha: {result['torch']['median'] / result['mha']['median']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(vars(args), result=result), f, indent=1)


if __name__ == "__main__":
    main()
