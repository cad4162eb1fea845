"""``ssd batch --mode ssd`` on a Ray cluster (what ``ray job submit -- ssd batch ...`` runs).

The job's driver places the drafter–verifier pair exactly as ``ssd serve`` does (one placement group, one bundle
each), then sends every request through the verifier's gRPC API with ``concurrency`` requests in flight, and
writes the results in input order with the same fields as the local ``ssd batch``.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from pathlib import Path

import ray
from tqdm import tqdm

from cluster.launch import launch
from protos import codec
from protos.ssd.v1 import ssd_pb2 as pb
from spec_core.settings import ServiceConfig
from verifier_service.batch_requests import BatchSettings
from verifier_service.client import SSDClient

logger = logging.getLogger(__name__)


def result_row(rid: str, res: pb.GenerateResult) -> dict:
    s = res.stats
    return {"id": rid, "text": res.text, "token_ids": list(res.token_ids), "num_generated": len(res.token_ids),
            "finish_reason": codec.finish_reason_name(res.finish_reason), "num_prompt_tokens": res.num_prompt_tokens,
            "num_rounds": s.num_rounds, "mean_tokens_per_round": s.mean_tokens_per_round or None}


def _in_order(futures: list[Future]) -> list:
    """The futures' results in submission order; a progress bar (one step per finished request, in completion
    order) goes to stderr when it is a terminal (not under ``ray job submit``, whose logs are piped)."""
    with tqdm(total=len(futures), desc="batch (ray)", unit="req", disable=None) as bar:
        for _ in as_completed(futures):
            bar.update(1)
    return [f.result() for f in futures]


def job_config(config: ServiceConfig, settings: BatchSettings) -> ServiceConfig:
    """The pair a batch job places: ``config`` (its ``--config`` file and flags) with the job's own needs: a
    public port that is free on any node, ``k`` and room for ``concurrency`` requests at once."""
    return config.model_copy(update={"host": "node-ip", "port": 0, "k": settings.k,
                                     "max_num_seqs": settings.concurrency,
                                     "max_queue": max(config.max_queue, settings.concurrency)})


def run_batch_on_ray(address: str | None, rows: list, output_path: Path, settings: BatchSettings,
                     config: ServiceConfig) -> dict:
    """``rows``: the requests from :func:`verifier_service.batch_requests.read_requests`; ``config``: the pair's
    settings (:func:`job_config`; ``device`` ``auto``: each actor's GPU if Ray gave it one)."""
    ray.init(address=address or "auto", logging_level=logging.WARNING)
    dep = launch(job_config(config, settings))
    try:
        info = dep.info()
        logger.info("pair placed: drafter pid %s on %s, verifier pid %s on %s", info["drafter"]["pid"],
                    info["drafter"]["node_ip"], info["verifier"]["pid"], info["verifier"]["node_ip"])
        t0 = time.perf_counter()
        with SSDClient(dep.address) as client, ThreadPoolExecutor(settings.concurrency) as pool:
            futures = [pool.submit(client.complete, prompt, params, rid) for rid, prompt, params in rows]
            results = _in_order(futures)
            stats = codec.stats_from_pb(client.stats())
        wall = time.perf_counter() - t0
    finally:
        dep.shutdown(grace_s=10)
    with output_path.open("w", encoding="utf-8") as f:
        for (rid, _, _), res in zip(rows, results):
            f.write(json.dumps(result_row(rid, res)) + "\n")
    total = sum(len(r.token_ids) for r in results)
    return {"requests": len(rows), "generated_tokens": total, "wall_s": wall, "tokens_per_s": total / wall,
            "cache_hit_rate": stats.get("cache_hit_rate"), "placement": {k: info[k] for k in ("drafter", "verifier")}}
