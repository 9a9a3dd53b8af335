"""Reference data from lxt 2.1 (AttnLRP, ``lxt.efficient``), for tests/test_attn_lrp.py.

Runs in its own environment (lxt 2.1 imports a transformers 4 BERT file that transformers 5
no longer has): torch, transformers < 5, lxt (installed without its dependencies: only
``lxt.efficient`` is used; its package imports torchvision for a ViT patch map of its own,
whose module a stand-in replaces here). ``python lxt_ref.py OUT FAMILY`` writes into OUT:

- ``FAMILY/``: a tiny random model (transformers' save_pretrained): "gpt2"; "llama" with
  grouped-query attention (4 query heads on 2 key/value heads), every bias; "bert"
  (BertModel);
- ``FAMILY.npz``: in float64, with lxt's AttnLRP patches (``monkey_patch``, eager
  attention): ``ids`` (n,), then for each target ``t`` in ``targets``: ``{t}/value`` (the
  target's value), ``{t}/tokens`` (n,) ``(e * de).sum(-1)`` at the token embeddings (the
  ``inputs_embeds`` lxt's examples explain), ``{t}/heads`` (L, H) ``z * dz`` at the output
  projection's input summed over positions and d_head, ``{t}/layers`` (L, n) ``x * dx`` at
  each layer's input summed over the width; ``output``: the unpatched forward's logits (n,
  vocab) or last hidden state (n, d).

Targets: a causal model's logit of token 7 at the last position ("int") and the difference
of the logits of 7 and 11 there ("pair"); BERT's unit 3 of the last hidden state at position
0 ("int").
"""
import sys
import types
from pathlib import Path

import numpy as np
import torch

VOCAB = 97


def _stand_in_vit():
    """lxt.efficient.models imports its ViT patch map, lxt.efficient.models.vit_torch, which
    imports torchvision; these models never use it: a stand-in module takes its place."""
    try:
        import torchvision  # noqa: F401
        return
    except ImportError:
        pass
    vit = types.ModuleType("lxt.efficient.models.vit_torch")
    vit.vision_transformer = types.ModuleType("vision_transformer (stand-in)")
    vit.cp_LRP = {}
    sys.modules[vit.__name__] = vit


def _pruneable_heads_fallback():
    """lxt 2.1's BERT file imports find_pruneable_heads_and_indices from
    transformers.pytorch_utils, which late transformers 4 releases dropped; lxt's later
    releases carry this same fallback."""
    import transformers.pytorch_utils as pu
    if hasattr(pu, "find_pruneable_heads_and_indices"):
        return

    def find_pruneable_heads_and_indices(heads, n_heads, head_size, already_pruned_heads):
        mask = torch.ones(n_heads, head_size)
        heads = set(heads) - already_pruned_heads
        for head in heads:
            head = head - sum(1 if h < head else 0 for h in already_pruned_heads)
            mask[head] = 0
        mask = mask.view(-1).contiguous().eq(1)
        return heads, torch.arange(len(mask))[mask].long()
    pu.find_pruneable_heads_and_indices = find_pruneable_heads_and_indices


def perturb(model, seed, scale=0.2):
    """transformers' init plus N(0, scale) noise: peaked heads, norm gains away from 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def build(family, folder):
    """Write the tiny model of ``family`` into folder; return (its transformers module, which
    lxt patches, and its class)."""
    import transformers
    torch.manual_seed(1)
    if family == "gpt2":
        from transformers.models.gpt2 import modeling_gpt2 as module
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32,
                                         n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
        cls = transformers.GPT2LMHeadModel
    elif family == "llama":
        from transformers.models.llama import modeling_llama as module
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            attention_bias=True, mlp_bias=True, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2)
        cls = transformers.LlamaForCausalLM
    else:
        from transformers.models.bert import modeling_bert as module
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=48,
                                         max_position_embeddings=64)
        cls = transformers.BertModel
    model = cls(config).eval()
    perturb(model, 2)
    model.save_pretrained(folder, safe_serialization=True)
    return module, cls


def parts(model, family):
    """(layers, the attention output projections) of the model."""
    if family == "gpt2":
        layers = model.transformer.h
        return layers, [layer.attn.c_proj for layer in layers]
    if family == "llama":
        layers = model.model.layers
        return layers, [layer.self_attn.o_proj for layer in layers]
    layers = model.encoder.layer
    return layers, [layer.attention.output.dense for layer in layers]


def relevance(model, family, ids, target):
    """AttnLRP's relevance (float64) of one target: (value, tokens, heads, layers)."""
    layers, projections = parts(model, family)
    seen = {"x": [None] * len(layers), "z": [None] * len(layers)}

    def keep(kind, i):
        def hook(module, args, kwargs):
            t = args[0] if args else kwargs["hidden_states"]
            t.retain_grad()
            seen[kind][i] = t
        return hook

    handles = [m.register_forward_pre_hook(keep("x", i), with_kwargs=True)
               for i, m in enumerate(layers)]
    handles += [m.register_forward_pre_hook(keep("z", i), with_kwargs=True)
                for i, m in enumerate(projections)]
    embeds = model.get_input_embeddings()(torch.tensor(ids)[None]).detach().requires_grad_()
    out = model(inputs_embeds=embeds)
    if family == "bert":
        value = out.last_hidden_state[0, 0, target]
    else:
        logits = out.logits[0, -1]
        value = (logits[target] if isinstance(target, int)
                 else logits[target[0]] - logits[target[1]])
    value.backward()
    for h in handles:
        h.remove()
    H = model.config.num_attention_heads
    tokens = (embeds * embeds.grad).sum(-1)[0]
    heads = torch.stack([(z * z.grad).reshape(z.shape[1], H, -1).sum(dim=(0, 2))
                         for z in seen["z"]])
    per_layer = torch.stack([(x * x.grad).sum(-1)[0] for x in seen["x"]])
    return [t.detach().numpy().astype(np.float64) for t in (value, tokens, heads, per_layer)]


def main(out_dir, family):
    out_dir = Path(out_dir)
    folder = out_dir / family
    folder.mkdir(parents=True, exist_ok=True)
    _stand_in_vit()
    _pruneable_heads_fallback()
    module, cls = build(family, folder)
    ids = np.random.default_rng(5).integers(3, VOCAB, size=11)
    ref = {"ids": ids}
    import lxt.efficient
    plain = cls.from_pretrained(folder, attn_implementation="eager").eval().double()
    with torch.no_grad():
        out = plain(torch.tensor(ids)[None])
    ref["output"] = (out.last_hidden_state if family == "bert" else out.logits)[0].numpy()
    lxt.efficient.monkey_patch(module, verbose=False)
    if family == "bert":            # lxt replaced modeling_bert's classes by its own
        cls = module.BertModel
    model = cls.from_pretrained(folder, attn_implementation="eager").eval().double()
    targets = {"int": 3} if family == "bert" else {"int": 7, "pair": (7, 11)}
    for name, target in targets.items():
        value, tokens, heads, layers = relevance(model, family, [int(i) for i in ids], target)
        ref.update({f"{name}/value": value, f"{name}/tokens": tokens, f"{name}/heads": heads,
                    f"{name}/layers": layers})
    np.savez(out_dir / f"{family}.npz", **ref)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
