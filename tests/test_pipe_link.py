"""The local drafter pipe: codec messages both ways, in order; sends never block, so two loops that both write
before reading cannot deadlock."""

from __future__ import annotations

import multiprocessing as mp
import threading

import torch

from drafter_service.process import PipeLink
from spec_core.config import SamplingParams
from spec_core.speculation import BranchBundle, OutcomeEvent, PrefillEvent, Speculation

VOCAB = 5000


def test_both_ends_write_far_past_the_pipe_buffer_before_reading() -> None:
    a, b = mp.Pipe()
    verifier, drafter = PipeLink(a, vocab_size=VOCAB), PipeLink(b, role="drafter")
    g = torch.Generator().manual_seed(0)
    events = [PrefillEvent(f"r{i}", list(range(i, i + 20_000)), SamplingParams(temperature=0.5, seed=i), 3)
              for i in range(20)]  # ~80 kB each, unread
    probs = torch.rand(3, VOCAB, generator=g)
    bundles = [BranchBundle(f"r{i}", i, [1, 2, 3], {(k, 7): Speculation([4, 5, 6], probs, "tree") for k in range(40)})
               for i in range(20)]  # dense rows: ~2.4 MB each, unread
    done = threading.Event()
    got: dict[str, list] = {}

    def both_write_then_read() -> None:
        for ev, bundle in zip(events, bundles):
            verifier.send(ev)
            drafter.send(bundle)
        got["events"] = [drafter.recv() for _ in events]
        got["bundles"] = [verifier.recv() for _ in bundles]
        done.set()

    t = threading.Thread(target=both_write_then_read, daemon=True)
    t.start()
    t.join(60)
    assert done.is_set(), "a blocking send deadlocked the two ends"
    assert [(e.request_id, e.token_ids, e.params.seed, e.k) for e in got["events"]] == \
        [(e.request_id, e.token_ids, e.params.seed, e.k) for e in events]  # in order, intact
    for sent, recv in zip(bundles, got["bundles"]):
        assert (recv.request_id, recv.round, recv.base_tokens) == (sent.request_id, sent.round, sent.base_tokens)
        assert set(recv.entries) == set(sent.entries)
        assert torch.allclose(recv.entries[(0, 7)].draft_probs, probs)
    verifier.close()
    drafter.close()


def test_a_closed_end_reads_as_eof_and_the_link_as_dead() -> None:
    a, b = mp.Pipe()
    verifier, drafter = PipeLink(a, vocab_size=VOCAB), PipeLink(b, role="drafter")
    verifier.send(OutcomeEvent("r", 1, [1, 2], 1, 9, 3))
    verifier.close()
    assert drafter.recv().key == (1, 9)  # what was written before the close still arrives
    assert not drafter.poll(0.5) and not drafter.alive
    try:
        drafter.recv()
    except EOFError:
        pass
    else:
        raise AssertionError("recv on a closed pipe must raise EOFError")
    drafter.close()
