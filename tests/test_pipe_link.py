"""The local drafter pipe: sends never block, so two loops that both write before reading cannot deadlock."""

from __future__ import annotations

import multiprocessing as mp
import threading

from drafter_service.process import PipeLink


def test_both_ends_write_far_past_the_pipe_buffer_before_reading() -> None:
    a, b = mp.Pipe()
    left, right = PipeLink(a), PipeLink(b)
    msgs = [{"i": i, "payload": bytes([i % 256]) * 200_000} for i in range(20)]  # 4 MB each way, unread
    done = threading.Event()

    def both_write_then_read() -> None:
        for m in msgs:
            left.send(m)
            right.send(m)
        assert [left.recv() for _ in msgs] == msgs  # in order, intact
        assert [right.recv() for _ in msgs] == msgs
        done.set()

    t = threading.Thread(target=both_write_then_read, daemon=True)
    t.start()
    t.join(30)
    assert done.is_set(), "a blocking send deadlocked the two ends"
    left.close()
    right.close()
