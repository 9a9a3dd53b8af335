"""Reference data from SAELens 6.x and TransformerLens 3.x, for tests/test_sae.py.

Runs in its own environment (sae-lens 6 needs TransformerLens < 4, mha's has 4): torch,
transformers, sae-lens, transformer-lens<4. ``python sae_lens_ref.py OUT`` writes into OUT:

- ``gpt2/`` and ``llama/``: tiny random models (transformers' save_pretrained; the LLaMA with
  grouped-query attention, 4 query heads on 2 key/value heads);
- ``saes/{name}/``: random SAEs and transcoders written by SAELens's own ``save_model``;
- ``ref.npz``: for each SAE, an input and SAELens's ``encode``, ``decode`` and ``forward`` of
  it; for each model, the ids, the plain logits, then with its SAEs spliced in by
  ``HookedSAETransformer`` (no weight processing), with and without the error term: the
  logits, every cached SAE name, and the gradients of one logit with respect to the SAEs'
  points and the model's ``hook_embed``.

Keys: ``sae/{name}/{x,acts,recons,out}``, ``{model}/ids``, ``{model}/plain``,
``{model}/{err}/logits``, ``{model}/{err}/cache/{hook name}``, ``{model}/{err}/grad/{hook
name}``, err being ``err0`` or ``err1``.
"""
import sys
from pathlib import Path

import numpy as np
import torch

torch.manual_seed(0)
OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)
VOCAB = 97
ref: dict[str, np.ndarray] = {}


def perturb(model, seed, scale=0.2):
    """transformers' init plus N(0, scale) noise: peaked heads, norm gains away from 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def build_gpt2(folder):
    import transformers
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
                                     n_head=4, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    perturb(model, 2)
    model.save_pretrained(folder, safe_serialization=True)
    from transformer_lens import HookedTransformerConfig
    cfg = HookedTransformerConfig(
        d_model=32, d_head=8, n_heads=4, d_mlp=128, n_layers=2, n_ctx=64, d_vocab=VOCAB,
        act_fn="gelu_new", normalization_type="LN", eps=config.layer_norm_epsilon,
        positional_embedding_type="standard", original_architecture="GPT2LMHeadModel",
        default_prepend_bos=False)
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights
    return model, cfg, convert_gpt2_weights(model, cfg)


def build_llama(folder):
    import transformers
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = transformers.LlamaForCausalLM(config).eval()
    perturb(model, 4)
    model.save_pretrained(folder, safe_serialization=True)
    from transformer_lens import HookedTransformerConfig
    cfg = HookedTransformerConfig(
        d_model=32, d_head=8, n_heads=4, d_mlp=48, n_layers=2, n_ctx=64, d_vocab=VOCAB,
        act_fn="silu", normalization_type="RMS", eps=1e-6, n_key_value_heads=2,
        positional_embedding_type="rotary", rotary_dim=8, rotary_base=10000,
        rotary_adjacent_pairs=False, final_rms=True, gated_mlp=True,
        original_architecture="LlamaForCausalLM", default_prepend_bos=False)
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights
    return model, cfg, convert_llama_weights(model, cfg)


def make_sae(name, arch, hook, d_in, d_sae, seed, **extra):
    """A SAELens SAE of random weights (SAELens's init plus noise on every parameter, so
    that biases and thresholds are not zero), saved with its save_model, loaded back."""
    from sae_lens import SAE
    from sae_lens.saes.sae import SAEMetadata
    from sae_lens.registry import get_sae_class
    sae_class, cfg_class = get_sae_class(arch)
    metadata = {"hook_name": hook}
    if "hook_name_out" in extra:
        metadata["hook_name_out"] = extra.pop("hook_name_out")
    cfg = cfg_class(d_in=d_in, d_sae=d_sae, dtype="float32", device="cpu",
                    metadata=SAEMetadata(**metadata), **extra)
    torch.manual_seed(seed)
    sae = sae_class(cfg)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for pname, p in sae.named_parameters():
            if pname == "threshold":
                p.copy_(0.05 + 0.1 * torch.rand(p.shape, generator=g))
            else:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    folder = OUT / "saes" / name
    sae.save_model(folder)
    return SAE.load_from_disk(folder)


def standalone(name, sae, shape):
    """encode, decode, forward of a random input, as SAELens computes them."""
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(shape, generator=g)
    with torch.no_grad():
        acts = sae.encode(x)
        recons = sae.decode(acts)
        if hasattr(sae, "hook_z_reshaping_mode") and sae.hook_z_reshaping_mode:
            recons_flat = recons.reshape(*recons.shape[:-2], -1)
        else:
            recons_flat = recons
        out = sae(x)
    ref[f"sae/{name}/x"] = x.numpy()
    ref[f"sae/{name}/acts"] = acts.numpy()
    ref[f"sae/{name}/recons"] = recons_flat.numpy()
    ref[f"sae/{name}/out"] = out.numpy()


def spliced(tag, model, saes, ids, target):
    """Logits, the SAE names' cache and the gradients of logits[0, -1, target] with every
    SAE spliced in, with and without the error term."""
    from sae_lens import HookedSAETransformer  # noqa: F401
    tokens = torch.from_numpy(ids)
    with torch.no_grad():
        ref[f"{tag}/plain"] = model(tokens).numpy()
    for err in (False, True):
        key = f"{tag}/err{int(err)}"
        with torch.no_grad():
            logits, cache = model.run_with_cache_with_saes(tokens, saes=saes,
                                                           use_error_term=err)
        ref[f"{key}/logits"] = logits.numpy()
        for name in cache.keys():
            if ".hook_sae_" in name:
                ref[f"{key}/cache/{name}"] = cache[name].numpy()
        # gradients: the SAEs attached, a hook keeps each point's tensor for its .grad
        model.reset_saes()
        for sae in saes:
            model.add_sae(sae, use_error_term=err)
        kept = {}

        def keep(t, hook):
            t.retain_grad()
            kept[hook.name] = t
            return t
        points = [n for n in model.hook_dict if ".hook_sae_" in n and "error" not in n]
        points.append("hook_embed")
        logits = model.run_with_hooks(tokens, fwd_hooks=[(p, keep) for p in points])
        logits[0, -1, target].backward()
        for name, t in kept.items():
            ref[f"{key}/grad/{name}"] = t.grad.numpy()
        model.reset_saes()
        model.zero_grad(set_to_none=True)


def main():
    from sae_lens import HookedSAETransformer
    import sae_lens
    import transformer_lens
    print("sae-lens", sae_lens.__version__, "transformer-lens", transformer_lens.__version__
          if hasattr(transformer_lens, "__version__") else "?")
    rng = np.random.default_rng(0)

    # --- standalone SAEs: every architecture and option ---
    z = (2, 5, 4, 8)                # (B, n, H, d_head) of the tiny models' hook_z
    r = (2, 5, 32)
    sae_specs = {
        "standard_z": ("standard", "blocks.0.attn.hook_z", 32, 64, dict(
            reshape_activations="hook_z")),
        "topk_rescale": ("topk", "blocks.1.hook_resid_pre", 32, 64, dict(
            k=6, rescale_acts_by_decoder_norm=True)),
        "topk": ("topk", "blocks.0.hook_resid_pre", 32, 48, dict(k=5)),
        "jumprelu": ("jumprelu", "blocks.1.hook_mlp_out", 32, 64, dict()),
        "jumprelu_nobdec": ("jumprelu", "blocks.1.hook_mlp_out", 32, 64, dict(
            apply_b_dec_to_input=False)),
        "jumprelu_z": ("jumprelu", "blocks.1.attn.hook_z", 32, 64, dict(
            reshape_activations="hook_z")),
        "gated": ("gated", "blocks.1.hook_attn_out", 32, 64, dict()),
        "transcoder": ("transcoder", "blocks.0.hook_resid_mid", 32, 64, dict(
            d_out=32, hook_name_out="blocks.0.hook_mlp_out", apply_b_dec_to_input=False)),
        "jumprelu_transcoder": ("jumprelu_transcoder", "blocks.1.hook_resid_mid", 32, 48, dict(
            d_out=32, hook_name_out="blocks.1.hook_mlp_out", apply_b_dec_to_input=False)),
        "rescale_norm": ("standard", "blocks.0.hook_resid_post", 32, 40, dict(
            normalize_activations="constant_norm_rescale")),
        "layer_norm": ("standard", "blocks.0.hook_resid_post", 32, 40, dict(
            normalize_activations="layer_norm")),
    }
    saes = {}
    for i, (name, (arch, hook, d_in, d_sae, extra)) in enumerate(sae_specs.items()):
        sae = make_sae(name, arch, hook, d_in, d_sae, 10 + i, **extra)
        saes[name] = sae
        standalone(name, sae, z if extra.get("reshape_activations") == "hook_z" else r)

    # --- spliced into GPT-2 and LLaMA (GQA) ---
    ids = rng.integers(1, VOCAB, size=(2, 7))
    for tag, build, chosen in (
            ("gpt2", build_gpt2, ["standard_z", "topk_rescale", "transcoder", "gated",
                                  "jumprelu"]),
            ("llama", build_llama, ["jumprelu_z", "topk", "jumprelu_transcoder"])):
        hf, cfg, state = build(OUT / tag)
        model = HookedSAETransformer(cfg)
        model.load_and_process_state_dict(state, fold_ln=False, center_writing_weights=False,
                                          center_unembed=False, fold_value_biases=False,
                                          refactor_factored_attn_matrices=False)
        model.eval()
        with torch.no_grad():
            gap = (model(torch.from_numpy(ids)) - hf(torch.from_numpy(ids)).logits).abs().max()
        assert gap < 1e-4, f"{tag}: TransformerLens and transformers differ by {gap}"
        ref[f"{tag}/ids"] = ids
        ref[f"{tag}/saes"] = np.array(chosen)
        spliced(tag, model, [saes[n] for n in chosen], ids, target=5)
    np.savez(OUT / "ref.npz", **ref)
    print(f"wrote {len(ref)} arrays to {OUT / 'ref.npz'}")


if __name__ == "__main__":
    main()
