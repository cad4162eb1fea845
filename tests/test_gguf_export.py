"""The draft's GGUF export (``make draft-gguf``): the target's tokenizer as stored, the weights back through our own
GGUF reader within Q8_0's rounding, and the reduced output vocabulary as zero rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spec_core.gguf_checkpoint import unpermute_rope
from spec_core.gguf_export import gguf_name, permute_rope
from spec_core.model_paths import ModelLoadError


def test_permute_is_the_inverse_of_our_unpermute():
    w = np.random.default_rng(0).standard_normal((4 * 2 * 8, 5)).astype(np.float32)
    assert np.array_equal(unpermute_rope(permute_rope(w, 4), 4), w)
    assert not np.array_equal(permute_rope(w, 4), w)


def test_gguf_names():
    assert gguf_name("model.layers.3.self_attn.q_proj.weight") == "blk.3.attn_q.weight"
    assert gguf_name("model.layers.0.mlp.down_proj.weight") == "blk.0.ffn_down.weight"
    assert gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    with pytest.raises(ModelLoadError, match="no GGUF name"):
        gguf_name("model.layers.0.mystery.weight")


@pytest.fixture(scope="module")
def exported(real_pair, tmp_path_factory) -> Path:
    from spec_core.gguf_export import export_llama_gguf
    from spec_core.model_paths import installed_target_gguf

    return export_llama_gguf(real_pair["draft"], installed_target_gguf(), tmp_path_factory.mktemp("export") / "d.gguf")


def test_export_carries_the_targets_tokenizer(exported):
    from spec_core.gguf_checkpoint import open_gguf
    from spec_core.model_paths import installed_target_gguf

    draft, target = open_gguf(exported), open_gguf(installed_target_gguf())
    names = [n for n in target.fields if n.startswith("tokenizer.")]
    assert "tokenizer.ggml.tokens" in names and "tokenizer.ggml.merges" in names
    for name in names:
        assert draft.fields[name].contents() == target.fields[name].contents(), name
    assert draft.fields["general.architecture"].contents() == "llama"


def test_export_round_trips_through_our_reader(exported, real_pair):
    from spec_core.gguf_checkpoint import dequantized_state_dict, open_gguf
    from spec_core.model_paths import load_safetensors_dir

    back = dequantized_state_dict(open_gguf(exported))
    weights = {k: v.float().numpy() for k, v in load_safetensors_dir(Path(real_pair["draft"])).items()}
    for name, w in weights.items():
        if w.ndim == 1:
            assert np.array_equal(back[name], w), name
        else:  # Q8_0: each block of 32 rounded to its max / 127
            assert np.abs(back[name] - w).max() <= np.abs(w).max() / 127, name
    keep = np.zeros(len(back["lm_head.weight"]), dtype=bool)
    keep[json.loads((Path(real_pair["draft"]) / "token_map.json").read_text())] = True
    assert not back["lm_head.weight"][~keep].any()
    assert np.array_equal(back["lm_head.weight"][keep], back["model.embed_tokens.weight"][keep])
