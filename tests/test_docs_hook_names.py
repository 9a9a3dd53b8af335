"""docs/models.md's tables of hook names say what each family declares (``_hook_layout``,
which the forward, the cache, ``wrt`` and the errors all read): every name a model has is in
its family's table, and every name of the table is one the model has. The decoders share one
table: every decoder family (issue 36's too, GPT-NeoX in both residual forms) has its names in
it, and every name in it is some decoder's."""
import re
from pathlib import Path

import pytest

import mha.models

DOCS = Path(__file__).resolve().parents[1] / "docs" / "models.md"

GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 50,
        "n_positions": 32}
LLAMA = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
         "vocab_size": 50}
NEW = [dict(LLAMA, model_type=t) for t in
       ("qwen3", "olmo2", "phi3", "gemma", "gemma2", "gemma3_text")] + [
    dict(LLAMA, model_type="gpt_neox", num_key_value_heads=4, use_parallel_residual=p)
    for p in (True, False)]
DECODERS = [GPT2, LLAMA, *NEW]
BERT = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 48, "vocab_size": 50}


def tables():
    """The two tables under '### The names, per family' -> [set of names] (decoder, encoder):
    a cell's first backticked name gives the prefix of the names after it (``a.b.hook_x``,
    ``hook_y`` -> a.b.hook_x, a.b.hook_y), with the block written as blocks.{l}."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("### The names, per family", 1)[1].split("\n### ", 1)[0]
    found, names = [], None
    for line in section.splitlines():
        if line.startswith("| name |"):
            names = set()
            found.append(names)
        elif line.startswith("| `") and names is not None:
            cell = line.split("|")[1]
            parts = re.findall(r"`([^`]+)`", cell)
            prefix = parts[0].rsplit(".", 1)[0] + "." if "." in parts[0] else ""
            for i, part in enumerate(parts):
                names.add(part if i == 0 or "." in part else prefix + part)
    return found


def declared(model):
    return {re.sub(r"^blocks\.\d+\.", "blocks.{l}.", n) for n in model.hook_names()}


@pytest.mark.parametrize("config, table", [*((c, 0) for c in DECODERS), (BERT, 1)],
                         ids=lambda x: x["model_type"] + ("" if x.get(
                             "use_parallel_residual", True) else "-sequential")
                         if isinstance(x, dict) else str(x))
def test_the_docs_name_what_each_family_declares(config, table):
    model = mha.models.from_config(config, seed=0)
    names = tables()[table]
    have = declared(model)
    assert have <= names, f"not in docs/models.md: {sorted(have - names)}"
    if table == 1:
        assert names <= have | {"embed.hook_token_type_embed"}, sorted(names - have)


def test_every_name_of_the_decoder_table_is_some_decoders():
    names = tables()[0]
    have = set()
    for config in DECODERS:
        have |= declared(mha.models.from_config(config, seed=0))
    assert names == have, (sorted(names - have), sorted(have - names))
