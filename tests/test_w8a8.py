"""``--dtype w8a8``: int8 weights and activations (through fbgemm, or the compiled kernel with a scale per row), with
SmoothQuant scales calibrated at load (:mod:`spec_core.backends.cpu.w8a8`). Its greedy agreement with fp32 on the real pair is reported in ``test_real_pair.py``."""

from __future__ import annotations

import pytest
import torch

from spec_core.backends.cpu import cpu_kernels
from spec_core.backends.cpu.quant import (
    Observed,
    RowW8A8Weight,
    W8A8Weight,
    can_w8a8,
    matmul,
    nbytes,
    quantize_w8a8,
    w8a8_reduce_range,
)

pytestmark = pytest.mark.skipif(not can_w8a8(), reason="this torch build has no fbgemm (x86 CPUs only)")


def test_w8a8_matmul_is_near_fp32_and_reads_a_quarter_of_the_bytes():
    gen = torch.Generator().manual_seed(3)
    w_t = torch.randn(96, 40, generator=gen)  # [in, out]
    q = quantize_w8a8(w_t)
    assert isinstance(q, W8A8Weight) and q.shape == (96, 40) and nbytes(q) == 96 * 40 + 40 * 4
    for x in (torch.randn(1, 96, generator=gen), torch.randn(2, 5, 96, generator=gen)):
        got, ref = matmul(x, q), x @ w_t
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert (got - ref).abs().max() < 0.03 * ref.abs().max()
    # one scale per call: a row with a huge value coarsens its batch-mate's quantization (not batch-invariant)
    x = torch.randn(2, 96, generator=gen)
    loud = torch.cat([x[:1], x[1:] * 1000])
    assert not torch.equal(matmul(x, q)[0], matmul(loud, q)[0])


def test_observed_weight_records_each_input_channels_largest_value():
    w = Observed(torch.randn(4, 3))
    x = torch.tensor([[1.0, -5.0, 2.0, 0.0], [-3.0, 1.0, 0.5, 0.25]])
    assert torch.allclose(matmul(x, w), x @ w.w)
    matmul(x[:1] * 2, w)
    assert torch.equal(w.amax, torch.tensor([3.0, 10.0, 4.0, 0.25]))


def _qwen2(path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(7)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                      max_position_embeddings=512)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_smoothing_folds_into_the_model_exactly(family, tiny_models, tmp_path):
    """Folding the SmoothQuant scales (into the norms, into V for the output projection, shared across the query
    heads of a K/V head, and into up's columns for the down projection) leaves the fp32 model's function unchanged: Llama (GQA), Qwen3 (q/k norms) and
    Qwen2 (q/k/v biases)."""
    from spec_core.backends.cpu.w8a8 import input_ranges, smooth_layer
    from spec_core.runner import ModelRunner

    path = _qwen2(tmp_path / "qwen2") if family == "qwen2" else tiny_models[family]
    runner = ModelRunner(path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (12, 20)]
    ids = torch.tensor([prompts[0]])

    def logits():
        return runner.forward(runner.new_cache(1, 12), ids, torch.arange(12)[None])

    before = logits()
    ranges = input_ranges(runner, prompts)
    assert all(isinstance(m, torch.Tensor) for m in runner.weight_matrices())  # calibration left no wrappers
    assert ranges[0]["qkv"].shape == (64,) and (ranges[0]["down"] > 0).all()
    for layer, amax in zip(runner.layers, ranges):
        smooth_layer(layer, amax, runner.spec)
    assert not torch.equal(runner.layers[0].ln_attn.weight, ModelRunner(path).layers[0].ln_attn.weight)
    after = logits()
    assert (after - before).abs().max() < 1e-4 * before.abs().max()


def test_w8a8_runner_is_quantized_and_near_fp32(toy_pair):
    from spec_core.backends.cpu.quant import LinearWeight, PackedLinear, onednn_bf16
    from spec_core.runner import ModelRunner

    ref = ModelRunner(toy_pair["target"])
    runner = ModelRunner(toy_pair["target"], weights="w8a8")
    # the compiled kernel with a scale per row where fbgemm would keep 7 bits (x86 without VNNI), else fbgemm
    rows = cpu_kernels.quant_gemm() is not None and w8a8_reduce_range()
    assert runner.batch_invariant == rows
    layer = runner.layers[0]
    kind = RowW8A8Weight if rows else W8A8Weight
    assert all(isinstance(m, kind) for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    if rows:  # the head too, so that the whole forward is batch-invariant
        assert isinstance(runner.lm_head, RowW8A8Weight)
    elif onednn_bf16():  # a bf16 head where oneDNN multiplies bf16, else the fp32 one
        assert isinstance(runner.lm_head, (PackedLinear, LinearWeight)) and nbytes(runner.lm_head) == nbytes(
            ref.lm_head) // 2
    else:
        assert torch.equal(runner.lm_head, ref.lm_head)
    assert not runner.exact and 2 * runner.weight_bytes_per_token() < ref.weight_bytes_per_token()
    ids = torch.tensor([list(range(40, 72))])
    a = ref.forward(ref.new_cache(1, 32), ids, torch.arange(32)[None])
    b = runner.forward(runner.new_cache(1, 32), ids, torch.arange(32)[None])
    assert torch.nn.functional.cosine_similarity(a.flatten(0, 1), b.flatten(0, 1), dim=-1).min() > 0.98
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8
    with pytest.raises(ValueError, match="dense fp32"):
        from spec_core.backends.cpu.w8a8 import convert

        convert(runner, [[1, 2, 3]])


def test_w8a8_without_the_kernels_is_fbgemms(toy_pair):
    from spec_core.runner import ModelRunner

    runner = ModelRunner(toy_pair["target"], weights="w8a8", kernels=False)
    assert isinstance(runner.layers[0].qkv, W8A8Weight) and not runner.batch_invariant


def test_w8a8_without_a_tokenizer_to_calibrate_on_says_so(toy_pair, tmp_path):
    """A model folder with no tokenizer (a bare draft) cannot be calibrated: one clear error, not a traceback from
    transformers."""
    import shutil

    from spec_core.runner import ModelRunner

    bare = tmp_path / "bare"
    shutil.copytree(toy_pair["target"], bare, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(ValueError, match="no tokenizer"):
        ModelRunner(bare, weights="w8a8")


def test_the_drafter_process_and_server_load_the_draft_in_its_weight_format(toy_pair):
    """SSD's drafter process and the gRPC drafter server load the draft as SD's engine does: ``w8a8`` (the draft's
    format under an int4 target) is a weight format, not fp32 weights computing in fp32 (an fp32 draft costs
    3.1 ms a step against 0.8)."""
    from drafter_service.process import DrafterProcessConfig, load_draft
    from spec_core.config import ModelConfig, SSDConfig
    from spec_core.models import load_runner

    for dtype, weights in (("w8a8", "w8a8"), ("int8", "int8"), ("float32", None)):
        config = DrafterProcessConfig(toy_pair["draft"], SSDConfig(), core=None, dtype=dtype)
        runner = load_draft(config)
        assert runner.weights == weights and not runner.exact
        assert runner.weights == load_runner(ModelConfig(toy_pair["draft"], dtype), reference=False).weights
