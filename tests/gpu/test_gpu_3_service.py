"""The service on one GPU: the drafter and verifier actors share it through fractional GPU bundles (Ray), and a
short greedy generation through the gRPC front equals the target's own greedy tokens (transformers, fp32).

``ServiceConfig(gpu="yes", gpu_fraction=0.5)`` places both actors on bundles of ``{"GPU": 0.5, "CPU": 1}``; each
actor then sees the same GPU (``CUDA_VISIBLE_DEVICES``) and loads its model there.
"""

from __future__ import annotations

import pytest
import torch

from spec_core.config import SamplingParams

pytestmark = pytest.mark.gpu

NEW = 24


@pytest.mark.timeout(480)
def test_pair_shares_one_gpu_and_equals_ar(gpu_ray, real_pair, prompts, hf_greedy, compare, device, log):
    from cluster.launch import LaunchOptions, PlacementError, launch
    from spec_core.settings import ServiceConfig
    from verifier_service.client import SSDClient

    kw = dict(port=0, gpu="yes", dtype="float32", k=2, gpu_fraction=0.5)
    log(f"launching the pair with {kw}; cluster resources {gpu_ray.cluster_resources()}")
    dep = error = None
    try:
        dep = launch(ServiceConfig(target=real_pair["target"], draft=real_pair["draft"], **kw),
                     options=LaunchOptions(pin_cores=False, placement_timeout_s=30, start_timeout_s=300))
    except PlacementError as exc:
        error = exc
    if error is not None:
        pytest.fail(f"the pair could not share one GPU (gpu-fraction 0.5): {error}")
    try:
        info = dep.info()
        d, v = info["drafter"], info["verifier"]
        for name, a in (("drafter", d), ("verifier", v)):
            log(f"{name}: device {a.get('device')}, gpu_ids {a.get('gpu_ids')}, resources "
                f"{a.get('assigned_resources')}, pid {a.get('pid')}")
        kind = torch.device(device).type
        assert d["device"].startswith(kind) and v["device"].startswith(kind), \
            f"both actors should load their model on {kind}: drafter {d['device']}, verifier {v['device']}"
        assert d["gpu_ids"] == v["gpu_ids"] and len(v["gpu_ids"]) == 1, \
            f"both actors should see the same one GPU: drafter {d['gpu_ids']}, verifier {v['gpu_ids']}"
        for name, a in (("drafter", d), ("verifier", v)):
            share = a["assigned_resources"].get("GPU", 0.0)
            assert 0 < share < 1, f"the {name} should hold a fraction of the GPU, holds {share}"
        bad = []
        with SSDClient(dep.address) as client:
            for i, ids in enumerate(prompts[:2]):
                res = client.complete(ids, SamplingParams(max_new_tokens=NEW))
                log(f"service prompt {i}: {len(res.token_ids)} tokens")
                if (msg := compare(f"service prompt {i}", list(res.token_ids), hf_greedy(ids, NEW), ids)):
                    bad.append(msg)
        assert not bad, "\n".join(bad)
    finally:
        dep.shutdown(grace_s=5)
