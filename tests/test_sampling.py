"""logits → probabilities: temperature, top-k, top-p and greedy rows, one function for both sides."""

from __future__ import annotations

import pytest
import torch

from spec_core.config import SamplingParams
from spec_core.sampling import logits_to_probs, saguaro_downweight


def test_temperature_zero_is_one_hot_argmax():
    logits = torch.tensor([[[0.1, 3.0, 2.0, -1.0]]])
    probs = logits_to_probs(logits, torch.tensor([0.0]))
    assert probs.tolist() == [[[0.0, 1.0, 0.0, 0.0]]]


def test_temperature_scales_logits():
    logits = torch.randn(2, 3, 11)
    probs = logits_to_probs(logits, torch.tensor([0.5, 2.0]))
    assert torch.allclose(probs[0], torch.softmax(logits[0] / 0.5, -1), atol=1e-6)
    assert torch.allclose(probs[1], torch.softmax(logits[1] / 2.0, -1), atol=1e-6)


def test_top_k_keeps_k_tokens_per_row():
    logits = torch.tensor([[[1.0, 4.0, 3.0, 2.0]], [[1.0, 4.0, 3.0, 2.0]]])
    probs = logits_to_probs(logits, torch.tensor([1.0, 1.0]), top_k=torch.tensor([2, 0]))
    assert (probs[0, 0] > 0).tolist() == [False, True, True, False]
    assert (probs[1, 0] > 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(2, 1))


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    probs = logits_to_probs(logits, torch.tensor([1.0]), top_p=torch.tensor([0.8]))
    assert (probs[0, 0] > 0).tolist() == [True, True, False, False]
    assert torch.allclose(probs[0, 0, :2], torch.tensor([0.625, 0.375]))
    tiny = logits_to_probs(logits, torch.tensor([1.0]), top_p=torch.tensor([0.01]))
    assert tiny[0, 0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_saguaro_downweights_top_f():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    out = saguaro_downweight(probs, top_f=2, c=0.5)
    expected = torch.tensor([[0.2, 0.15, 0.2, 0.1]]) / 0.65
    assert torch.allclose(out, expected)
    assert torch.equal(saguaro_downweight(probs, 2, 1.0), probs)
    with pytest.raises(ValueError):
        saguaro_downweight(probs, 2, 0.0)


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(max_new_tokens=0), dict(top_k=-1)])
def test_sampling_params_validation(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_truncate_top_n_keeps_the_most_likely_and_renormalises() -> None:
    from spec_core.sampling import truncate_top_n

    probs = torch.softmax(torch.randn(3, 100), -1)
    out = truncate_top_n(probs, 5)
    assert torch.allclose(out.sum(-1), torch.ones(3))
    assert ((out > 0).sum(-1) == 5).all()
    assert torch.equal(out.argmax(-1), probs.argmax(-1))
    top = torch.topk(probs, 5, dim=-1).indices
    assert torch.allclose(out.gather(-1, top), probs.gather(-1, top) / probs.gather(-1, top).sum(-1, keepdim=True))
    assert torch.equal(truncate_top_n(probs, 0), probs)
