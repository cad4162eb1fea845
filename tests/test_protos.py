"""The committed gRPC stubs match the .proto, and the codec round-trips every message exactly."""

from __future__ import annotations

import filecmp
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from protos import codec
from protos.gen import ROOT, generate
from protos.ssd.v1 import ssd_pb2 as pb
from spec_core.config import SamplingParams
from spec_core.speculation import BranchBundle, FreeEvent, OutcomeEvent, PrefillEvent, Speculation, SpeculationMsg


def test_regenerating_stubs_gives_no_diff(tmp_path: Path) -> None:
    generate(tmp_path)
    for name in ("ssd_pb2.py", "ssd_pb2.pyi", "ssd_pb2_grpc.py"):
        fresh, committed = tmp_path / "protos/ssd/v1" / name, ROOT / "protos/ssd/v1" / name
        assert filecmp.cmp(fresh, committed, shallow=False), f"{name} is stale: run `make proto`"


def test_events_round_trip() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=11)
    for ev in (PrefillEvent("r1", [1, 2, 3], params, 4), PrefillEvent("r1", [1, 2, 3], replace(params, coupled=True), 4),
               OutcomeEvent("r1", 3, [5, 6, 7], 2, 9, 4, verify_s=0.01),
               OutcomeEvent("r1", 4, [5], 1, 9, 4, step_s=[0.25, 0.25, 0.5], step_others=7),  # float32-exact
               FreeEvent("r1")):
        back = codec.event_from_pb(pb.DrafterEvent.FromString(codec.event_to_pb(ev).SerializeToString()))
        if isinstance(ev, PrefillEvent):
            assert (back.request_id, back.token_ids, back.k) == ("r1", [1, 2, 3], 4)
            p = back.params
            assert (p.top_k, p.seed, p.coupled) == (5, 11, bool(ev.params.coupled))
            assert p.temperature == pytest.approx(0.7) and p.top_p == pytest.approx(0.9)
        else:
            assert back == ev


def test_a_bad_step_table_is_refused() -> None:
    for table in ([0.1, float("nan")], [0.0], [0.01] * 25):
        msg = codec.event_to_pb(OutcomeEvent("r1", 4, [5], 1, 9, 4, step_s=table))
        with pytest.raises(ValueError, match="step_s"):
            codec.event_from_pb(pb.DrafterEvent.FromString(msg.SerializeToString()))


def test_bundle_probabilities_are_bit_exact() -> None:
    """The verifier must use exactly the q the drafter sampled from (losslessness depends on it)."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 50, generator=g), -1)
    bundle = BranchBundle("r", 7, [1, 2], {(0, 4): Speculation([4, 5, 6], probs, "cache"),
                                           (2, 9): Speculation([9, 9, 1], None, "cache")})
    wire = codec.message_to_pb(bundle).SerializeToString()
    back = codec.message_from_pb(pb.DrafterMessage.FromString(wire), 50)
    assert back.base_tokens == [1, 2] and back.round == 7
    assert torch.equal(back.entries[(0, 4)].draft_probs, probs)
    assert back.entries[(2, 9)].draft_probs is None
    jit = codec.message_to_pb(SpeculationMsg("r", 8, Speculation([3], probs[:1], "jit")))
    assert torch.equal(codec.message_from_pb(jit, 50).speculation.draft_probs, probs[:1])


def test_sparse_rows_are_bit_exact_and_small() -> None:
    from spec_core.sampling import truncate_top_n

    g = torch.Generator().manual_seed(1)
    probs = truncate_top_n(torch.softmax(torch.randn(2, 8192, generator=g), -1), 64)
    probs[1, 0] = 0.0  # a row with fewer non-zeros (padding) and a real entry competing with pad id 0
    probs[0, 0] = 0.125
    msg = codec.speculation_to_pb(Speculation([3, 4], probs, "cache"))
    assert msg.prob_width == 65 and not msg.draft_probs and msg.ByteSize() < 2 * 65 * 8 + 64
    back = codec.speculation_from_pb(pb.Speculation.FromString(msg.SerializeToString()), 8192)
    assert torch.equal(back.draft_probs, probs)


def test_the_block_scan_finds_every_non_zero_and_a_bundle_packs_in_one_scan() -> None:
    """Non-zeros in the last, partial block of 64 columns, beside one another, alone in a row; a bundle's branches
    packed together at one width decode to their own rows bit for bit."""
    from protos.prob_blobs import pack_sparse_many

    g = torch.Generator().manual_seed(2)
    vocab = 1000  # 15 full blocks and 40 columns
    rows = torch.zeros(4, vocab)
    rows[0, [0, 1, 2, 998, 999]] = torch.rand(5, generator=g)
    rows[1, 960] = 1.0
    rows[2, torch.randperm(vocab, generator=g)[:30]] = torch.rand(30, generator=g)
    rows[3, 63:65] = 0.5
    for probs in (rows, rows[1:2], rows[2:]):
        msg = pb.Speculation.FromString(codec.speculation_to_pb(Speculation([1] * len(probs), probs)).SerializeToString())
        assert msg.prob_width and torch.equal(codec.speculation_from_pb(msg, vocab).draft_probs, probs)
    assert codec.speculation_to_pb(Speculation([1], torch.full((1, vocab), 1e-3))).draft_probs  # dense: as is
    packed = pack_sparse_many([rows[:2], None, rows[2:]])
    assert packed[1] is None and packed[0][2] == packed[2][2] == 30
    bundle = BranchBundle("r", 1, [], {(0, 5): Speculation([5, 6], rows[:2]), (0, 7): Speculation([7], None),
                                       (1, 2): Speculation([2, 3], rows[2:])})
    back = codec.message_from_pb(pb.DrafterMessage.FromString(codec.message_to_pb(bundle).SerializeToString()), vocab)
    assert torch.equal(back.entries[(0, 5)].draft_probs, rows[:2])
    assert torch.equal(back.entries[(1, 2)].draft_probs, rows[2:])


def test_a_received_bundle_is_checked_whole_and_builds_only_the_branch_used() -> None:
    probs = torch.zeros(1, 50)
    probs[0, 3] = 1.0
    bundle = BranchBundle("r", 1, [], {(0, b): Speculation([b], probs) for b in range(4)})
    wire = codec.message_to_pb(bundle)
    back = codec.message_from_pb(wire, 50)
    assert len(back.entries) == 4 and (0, 2) in back.entries and (1, 2) not in back.entries
    assert sorted(back.entries) == [(0, b) for b in range(4)]
    assert torch.equal(back.entries[(0, 2)].draft_probs, probs)
    assert list(back.entries._built) == [(0, 2)]
    wire.bundle.branches[3].speculation.prob_ids = wire.bundle.branches[3].speculation.prob_ids[:-1]
    with pytest.raises(ValueError, match="sparse"):  # a malformed branch refuses the bundle on arrival
        codec.message_from_pb(wire, 50)
    wire = codec.message_to_pb(bundle)
    wire.bundle.branches[1].speculation.prob_ids = np.array([50], dtype="<i4").tobytes()
    with pytest.raises(ValueError, match="out of vocabulary"):
        codec.message_from_pb(wire, 50)


def test_malformed_blobs_are_rejected() -> None:
    with pytest.raises(ValueError, match="int32"):
        codec.unpack_ids(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="float32"):
        codec.unpack_probs(b"\x00" * 12, 2, 50)


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -1.0, "temperature"), ("temperature", float("nan"), "temperature"),
    ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"), ("max_new_tokens", 0, "max_new_tokens"),
])
def test_bad_request_fields(field: str, value: float, match: str) -> None:
    req = pb.GenerateRequest(prompt="x")
    setattr(req, field, value)
    with pytest.raises(ValueError, match=match):
        codec.request_to_params(req)


def test_handshake_mismatch_names_every_field() -> None:
    a = codec.make_hello("h1", 100, 2, 12, codec.sampling_mode(1.0, "geometric"))
    b = codec.make_hello("h2", 100, 3, 12, codec.sampling_mode(1.0, "geometric"))
    problems = codec.hello_mismatch(a, b)
    assert len(problems) == 2 and problems[0].startswith("vocab_hash") and problems[1].startswith("k:")
    assert codec.hello_mismatch(a, a) == []
