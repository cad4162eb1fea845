"""Drafter faults: SIGKILL-equivalent ``ray.kill`` of the drafter actor mid-generation.

Every in-flight request completes with output identical to AR; the verifier switches to its backup within one
round (counted); Ray restarts the drafter, the verifier reconnects, and the cache-hit rate recovers.
"""

from __future__ import annotations

import json
import time

import ray

from spec_core.config import SamplingParams
from verifier_service.client import SSDClient

PROMPTS = ["def parse_args(argv):\n    ", "class Cache:\n    def get(self, key):\n        "]


def _stats(client: SSDClient) -> dict:
    return json.loads(client.stats().json)


def test_drafter_killed_mid_generation_recovers(ray_session, default_pair, greedy_reference) -> None:
    from cluster.launch import PairConfig, launch

    dep = launch(PairConfig(default_pair["target"], default_pair["draft"], port=0, use_gpu=False, adaptive_k=False))
    try:
        old_pid = ray.get(dep.drafter.pid.remote())
        with SSDClient(dep.address) as client:
            stream = client.generate(PROMPTS[0], SamplingParams(max_new_tokens=300, ignore_eos=True))
            got = [next(stream) for _ in range(4)]
            ray.kill(dep.drafter, no_restart=False)  # the process dies; Ray restarts the actor
            got += list(stream)
            tokens = [t for r in got if r.WhichOneof("kind") == "delta" for t in r.delta.token_ids]
            final = got[-1].final
            assert list(final.token_ids) == tokens == greedy_reference(PROMPTS[0], 300)
            s = _stats(client)
            assert s["backup_rounds"] > 0
            assert s["backup_switch_rounds"] is not None and s["backup_switch_rounds"] <= 1, s

            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and not (_stats(client)["drafter_reconnects"] >= 1
                                                        and _stats(client)["drafter_connected"]):
                time.sleep(0.5)
            s = _stats(client)
            assert s["drafter_reconnects"] >= 1 and s["drafter_connected"], s
            assert ray.get(dep.drafter.pid.remote()) != old_pid

            before = _stats(client)
            res = client.complete(PROMPTS[1], SamplingParams(max_new_tokens=64, ignore_eos=True))
            after = _stats(client)
            assert list(res.token_ids) == greedy_reference(PROMPTS[1], 64)
            rounds = after["ssd_rounds"] - before["ssd_rounds"]
            hits = after["ssd_hits"] - before["ssd_hits"]
            assert rounds > 0 and hits / rounds >= 0.5, (hits, rounds)
    finally:
        dep.shutdown(grace_s=5)
