"""Faults: ``ray.kill`` (the process dies; Ray restarts it) of the drafter or the verifier actor mid-generation,
and a slow drafter.

- Drafter killed: every in-flight request completes with output identical to AR; the verifier switches to its
  backup within one round (counted); Ray restarts the drafter, the verifier reconnects, the hit rate recovers.
- Verifier killed: the stream in flight ends with UNAVAILABLE (not a hang); Ray restarts the verifier on the same
  port; the Python client's retries carry the next call through, and the new verifier speculates again.
- Slow drafter (injected delay): the verifier never waits past its deadline; output still equals AR.
"""

from __future__ import annotations

import time

import grpc
import pytest
import ray
from fault_injection import late_drafter_loop
from local_ports import free_port

from drafter_service.server import DrafterServer, DrafterServerConfig
from protos import codec
from spec_core.config import ModelConfig, SamplingParams, SpeculationConfig, SSDConfig
from verifier_service.client import SSDClient
from verifier_service.server import VerifierServer, VerifierServerConfig

PROMPTS = ["def parse_args(argv):\n    ", "class Cache:\n    def get(self, key):\n        "]


def _stats(client: SSDClient) -> dict:
    return codec.stats_from_pb(client.stats())


def test_drafter_killed_mid_generation_recovers(ray_session, toy_pair, greedy_reference) -> None:
    from cluster.launch import launch
    from spec_core.settings import ServiceConfig

    # Chains at K = 2: this test measures that the restarted drafter's cache serves again (hits ≥ 0.5), not the
    # lower hit rate candidate trees, or a longer K with this toy draft, trade for tokens per round.
    dep = launch(ServiceConfig(target=toy_pair["target"], draft=toy_pair["draft"], port=0, gpu="no", fixed_k=True,
                               k=2, dtype="float32", tree="chain"))
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

            # The restarted drafter's cache serves again: one of up to three fresh requests (greedy, each checked
            # against AR) has hits on at least half its rounds. Hits are timing as well as prediction: on a loaded
            # CI machine a cold restarted process once served 13 of 27 rounds, where a quiet one serves 22 of 26.
            tried = []
            for prompt in (PROMPTS[1], PROMPTS[0], PROMPTS[1]):
                before = _stats(client)
                res = client.complete(prompt, SamplingParams(max_new_tokens=64, ignore_eos=True))
                after = _stats(client)
                assert list(res.token_ids) == greedy_reference(prompt, 64)
                tried.append((after["ssd_hits"] - before["ssd_hits"], after["ssd_rounds"] - before["ssd_rounds"],
                              {k: after["misses_by_cause"][k] - before["misses_by_cause"][k]
                               for k in after["misses_by_cause"]}))
                if tried[-1][1] > 0 and tried[-1][0] / tried[-1][1] >= 0.5:
                    break
            else:
                pytest.fail(f"the restarted drafter's cache served under half the rounds: (hits, rounds, misses by "
                            f"cause) {tried}")
    finally:
        dep.shutdown(grace_s=5)


def test_verifier_killed_is_restarted_and_clients_retry(ray_session, toy_pair, greedy_reference) -> None:
    from cluster.launch import launch
    from spec_core.settings import ServiceConfig

    port = free_port()  # a fixed public port: the restarted verifier binds it again
    # Chains at K = 2, as for the restarted drafter below: the hit-rate bar checks that the new verifier's drafter
    # serves from its cache again, not the lower hit rate that trees, or K = 3 with this toy draft, trade for tokens
    # per round (at the defaults a CI run measured 0.44 on 18 rounds).
    dep = launch(ServiceConfig(target=toy_pair["target"], draft=toy_pair["draft"], port=port, gpu="no",
                               fixed_k=True, k=2, dtype="float32", tree="chain"))
    try:
        old_pid = ray.get(dep.verifier.pid.remote())
        ref = greedy_reference(PROMPTS[0], 300)
        with SSDClient(dep.address, retries=0) as client:
            stream = client.generate(PROMPTS[0], SamplingParams(max_new_tokens=300, ignore_eos=True))
            got = [next(stream) for _ in range(4)]
            ray.kill(dep.verifier, no_restart=False)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                got += list(stream)
            cut_after = time.monotonic() - t0
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert cut_after < 30, cut_after  # an error, not a hang until the deadline
        tokens = [t for r in got if r.WhichOneof("kind") == "delta" for t in r.delta.token_ids]
        assert 0 < len(tokens) < 300 and tokens == ref[: len(tokens)]  # what arrived is correct, nothing doubled

        t0 = time.monotonic()
        with SSDClient(dep.address, retries=30, max_backoff_s=2.0) as client:  # rides out the restart
            res = client.complete(PROMPTS[1], SamplingParams(max_new_tokens=64, ignore_eos=True))
            assert list(res.token_ids) == greedy_reference(PROMPTS[1], 64)
            s = _stats(client)
        assert ray.get(dep.verifier.pid.remote()) != old_pid
        assert s["drafter_connected"] and s["ssd_rounds"] > 0 and s["ssd_hits"] / s["ssd_rounds"] >= 0.5, s
        print(f"verifier restart: stream cut after {cut_after:.2f} s, next call served after "
              f"{time.monotonic() - t0:.1f} s")
    finally:
        dep.shutdown(grace_s=5)


def test_slow_drafter_never_stalls_the_verifier(toy_pair, greedy_reference, monkeypatch) -> None:
    """Every drafter step is 0.3 s late (about 20 verifies). The verifier waits for a just-in-time draft on every
    miss (``neural`` policy, the worst case) but never past wait_fraction × a verify, then takes the backup."""
    late_drafter_loop(monkeypatch, 0.3)
    drafter = DrafterServer(DrafterServerConfig(ModelConfig(toy_pair["draft"]), SSDConfig(k=2)))
    drafter.start()
    server = VerifierServer(VerifierServerConfig(ModelConfig(toy_pair["target"]), spec=SpeculationConfig(
        k=2, backup_policy="neural", wait_fraction=0.5, adaptive_k=False)))
    try:
        address = server.start(drafter.address)
        with SSDClient(address) as client:
            out = client.generate_all(PROMPTS[0], SamplingParams(max_new_tokens=64, ignore_eos=True))
        assert list(out.final.token_ids) == out.streamed_token_ids == greedy_reference(PROMPTS[0], 64)
        s = server.stats()
        assert s["backup_rounds"] > 0 and s["verifier_max_wait_s"] < 0.1, s
        assert s["verifier_max_wait_s"] > 0.0, s  # it did wait (for JIT drafts that came too late)
    finally:
        server.stop()
        drafter.stop()
