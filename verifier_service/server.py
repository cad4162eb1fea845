"""The verifier's public gRPC server (``ssd.v1.Generation``) over an :class:`EngineLoop`.

One in-process front end (:class:`verifier_service.frontend.FrontEnd`: validation, limits, request ids, stats)
over the engine loop; the gRPC handlers (:mod:`verifier_service.servicer`, with their status codes) and the OpenAI
HTTP handlers both call it. The HTTP server runs on the gRPC server's event loop: no loopback channel, one loop.
``drain`` turns health to NOT_SERVING, refuses new calls and lets in-flight streams finish.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import grpc

from protos import codec
from protos.security import read_secret
from protos.serving import ServerThread, add_health_and_reflection, set_health
from protos.ssd.v1 import ssd_pb2 as pb
from spec_core import chat
from spec_core.arch import decode_params
from spec_core.chat import Prompt
from spec_core.config import CacheConfig, ModelConfig, SpeculationConfig
from spec_core.kv_budget import pool_blocks
from spec_core.models import load_pair, vocab_hash
from verifier_service.engine import VerifierEngine
from verifier_service.engine_builder import EnginePlan, build_engine
from verifier_service.frontend import FrontEnd
from verifier_service.run_ahead_proposer import RunAheadProposer
from verifier_service.scheduler import SchedulerConfig
from verifier_service.service import EngineLoop
from verifier_service.servicer import SERVICE, GenerationServicer, add_generation_servicer
from verifier_service.stats_log import counter_totals

logger = logging.getLogger(__name__)

#: Text may shrink this much under a tokenizer's normalisation (e.g. composed Hangul: 3 characters to 1) before
#: the length bound of :meth:`VerifierServer.surely_too_long` would be wrong.
NORMALISATION_SLACK = 4


def longest_token(tokenizer) -> int | None:
    """The most characters one token's string spans (None: unknown)."""
    try:
        return max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t)
    except Exception:  # noqa: BLE001 - a tokenizer without a listable vocabulary: no bound, just slower refusals
        return None


@dataclass(frozen=True, slots=True)
class VerifierServerConfig:
    """The verifier service, composed from its parts: the target model (and in SD mode the draft; in SSD mode the
    draft lives in the drafter), the speculation, the KV cache and the scheduler; then the server's own settings."""

    target: ModelConfig
    draft: ModelConfig | None = None
    spec: SpeculationConfig = field(default_factory=SpeculationConfig)
    #: The target's KV pool (and SD's draft pool); no size given: from free device memory (a CPU: 2048 blocks)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_queue: int = 64
    host: str = "127.0.0.1"
    port: int = 0
    drain_grace_s: float = 30.0
    #: Bearer-token authentication on the public API: the token is read from this file, or from the environment
    #: variable named by ``auth_token_env`` (never stored in the config itself, never logged).
    auth_token_file: str | None = None
    auth_token_env: str | None = None
    #: TLS for the public API (server certificate and key, PEM).
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Mutual TLS to the drafter: our client certificate and key, and the CA both sides trust.
    internal_tls: object | None = None  # protos.security.TLSFiles
    #: Per-client limits (a client is its bearer token if any, else its peer address). None: no extra limit.
    max_prompt_tokens: int | None = None
    max_new_tokens_limit: int | None = None
    max_streams_per_client: int | None = 32
    #: How often a dead drafter link is retried (the drafter may be restarted, e.g. by Ray).
    reconnect_interval_s: float = 0.5
    #: Prometheus exposition port (None: off; 0: any free port).
    metrics_port: int | None = None
    #: OpenAI-compatible HTTP (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``,
    #: ``/metrics``) on this port, next to gRPC, over the same engine (None: off; 0: any free port).
    http_port: int | None = None
    #: The largest HTTP request body accepted (413 beyond it, refused before it is read or parsed).
    max_body_bytes: int = 4 * 1024 * 1024
    #: The name clients give as ``model`` over HTTP, and the metrics' ``model_name`` (None: the target's name).
    served_model_name: str | None = None
    #: A one-line stats log (throughput, acceptance, cache hits, KV usage, running/waiting) every this many seconds
    #: after an interval with activity (None: off).
    stats_log_interval_s: float | None = 10.0
    #: A request's context limit, prompt and output together (None: the model's own position limit).
    max_model_len: int | None = None
    #: The drafter's core, when it is pinned on this node beside this server's own pinned core: a step where
    #: nothing speculates runs on both (:mod:`verifier_service.core_lending`; CPU, never fp32). None: never.
    lend_core: int | None = None

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if self.spec.mode == "sd" and self.draft is None:
            raise ValueError("mode sd needs a draft model")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.http_port is not None and self.tls_cert:
            raise ValueError("the HTTP port does not serve TLS yet: terminate TLS in front of it, or use gRPC")


class VerifierServer:
    """Loads the target, connects to the drafter (mode ssd), and serves ``ssd.v1.Generation`` on its own thread."""

    def __init__(self, config: VerifierServerConfig) -> None:
        self.config = config
        self.pair = load_pair(config.target, config.draft if config.spec.mode == "sd" else None)
        self.vocab_hash = vocab_hash(self.pair.tokenizer)
        self.max_token_chars = longest_token(self.pair.tokenizer)
        self.link = None
        self.engine_loop: EngineLoop | None = None
        self.frontend: FrontEnd | None = None
        self.thread: ServerThread | None = None
        self.health = None
        self.address: str | None = None
        self.metrics = None
        self.metrics_address: str | None = None
        self.http = None
        self.http_handlers = None
        self.http_address: str | None = None
        self._stopping = threading.Event()
        self.reconnects = 0
        self.link_bytes_base = (0, 0)
        self._pieces: dict[int, str] = {}
        #: The public API's bearer token, also carried to the drafter (never logged).
        self._token = read_secret(config.auth_token_file, config.auth_token_env)

    # ---- requests --------------------------------------------------------------------------------------------
    def surely_too_long(self, prompt: Prompt) -> bool:
        """Whether a text prompt cannot fit the context whatever it encodes to: no token spans more than
        ``max_token_chars`` characters, so such a prompt is refused without the time and memory of encoding it."""
        if self.max_token_chars is None or isinstance(prompt, list):
            return False
        chars = len(prompt) if isinstance(prompt, str) else sum(len(c) for _, c in prompt.messages)
        return chars > NORMALISATION_SLACK * self.max_token_chars * self.context_limit

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids for a prompt, validated against the vocabulary and the context limit (ValueError)."""
        if self.surely_too_long(prompt):
            raise ValueError(f"prompt is longer than the context limit of {self.context_limit} tokens")
        ids = chat.encode(self.pair.tokenizer, prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.pair.target.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids out of vocabulary (size {vocab}): {bad[:5]}")
        limit = self.context_limit
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; the context limit is {limit}")
        return ids

    @property
    def context_limit(self) -> int:
        """Prompt plus output tokens one request may hold: the model's limit, or ``max_model_len`` below it."""
        own = self.pair.target.spec.max_positions
        return min(own, self.config.max_model_len) if self.config.max_model_len else own

    def token_piece(self, token_id: int) -> str:
        """One token's text, as OpenAI's logprobs show it (cached: the vocabulary is fixed)."""
        pieces = self._pieces
        if token_id not in pieces:
            pieces[token_id] = self.pair.tokenizer.decode([token_id])
        return pieces[token_id]

    def check_limits(self, ids: list[int], params) -> None:
        """The whole request must fit the context (as vLLM does), and stop ids must be real tokens."""
        limit = self.context_limit
        if len(ids) + params.max_new_tokens > limit:
            raise ValueError(f"this model's context is {limit} tokens; the prompt has {len(ids)} and "
                             f"max_new_tokens asks for {params.max_new_tokens} more")
        vocab = self.pair.target.vocab_size
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids out of vocabulary (size {vocab})")

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def hello(self) -> pb.Hello:
        sp = self.config.spec
        return codec.make_hello(self.vocab_hash, self.pair.target.vocab_size, sp.k, sp.budget,
                                codec.sampling_mode(sp.saguaro_c, sp.fanout, sp.tree), sp.backup, sp.wait_fraction,
                                target_params=decode_params(self.pair.target.hf_config))

    def _build_engine(self, drafter_address: str | None) -> VerifierEngine:
        c, sp, cache = self.config, self.config.spec, self.config.cache
        proposer, branching = None, 1
        if sp.mode == "ssd":
            from verifier_service.drafter_link import GrpcDrafterLink
            from verifier_service.ssd_proposer import SSDProposer

            if not drafter_address:
                raise ValueError("mode ssd needs a drafter address")
            self.link = GrpcDrafterLink(drafter_address, self.hello(), self.pair.target.vocab_size,
                                        tls=c.internal_tls, token=self._token)
            run_ahead = self.link.ack is not None and self.link.ack.strategy == "run-ahead"
            kind = RunAheadProposer if run_ahead else SSDProposer
            proposer = kind(self.link, self.pair.target.vocab_size, backup=sp.backup, wait_fraction=sp.wait_fraction,
                            backup_policy=sp.backup_policy, device=self.pair.target.device)
            logger.info("drafter strategy: %s", "run-ahead" if run_ahead else "fanout")
        elif sp.mode == "sd":
            from spec_core.draft_engine import BatchDrafter, DraftConfig

            draft = self.pair.draft
            blocks = pool_blocks(cache.num_blocks, cache.kv_memory_fraction, draft.kv_bytes_per_token(),
                                 cache.block_size, draft.device, 2048)
            proposer = BatchDrafter(draft, DraftConfig(k=sp.k, num_blocks=blocks, block_size=cache.block_size))
        nodes = sp.tree.max_nodes(sp.k) if sp.mode == "ssd" else sp.k * branching
        target = self.pair.target
        blocks = pool_blocks(cache.num_blocks, cache.kv_memory_fraction, target.kv_bytes_per_token(),
                             cache.block_size, target.device, 2048)
        logger.info("verifier KV pool: %d blocks of %d tokens", blocks, cache.block_size)
        plan = EnginePlan(blocks, cache.block_size, c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens,
                          k=sp.k, max_spec_nodes=nodes, sampling=sp.sampling, adaptive_k=sp.adaptive_k)
        engine = build_engine(target, plan, proposer, self._lending(target))
        if engine.lending is not None:
            logger.info("plain steps borrow the drafter's core %d", c.lend_core)
            with engine.lending.lent():
                target.row_padding()  # measured per thread count: now, not in the first lent step
        return engine

    def _lending(self, target):
        """Core lending where it applies: this process pinned to one core, the drafter to another of this node."""
        from verifier_service.core_lending import core_lending

        own = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if self.config.lend_core is None or len(own) != 1:
            return None
        return core_lending(own[0], [self.config.lend_core], target)

    def start(self, drafter_address: str | None = None, drafter_resolver=None) -> str:
        """Serve. ``drafter_resolver()`` returns the drafter's current address when its link must be re-established
        (default: ``drafter_address`` again)."""
        engine = self._build_engine(drafter_address)
        from verifier_service.metrics import ServiceMetrics

        # Always built: the engine thread counts into it, and the stats log reads it, endpoint or not.
        self.metrics = ServiceMetrics(self.stats, model_name=self.model_name, max_model_len=self.context_limit)
        if self.config.metrics_port is not None:
            port = self.metrics.serve(self.config.metrics_port, self.config.host)
            self.metrics_address = f"{self.config.host}:{port}"
        self.engine_loop = EngineLoop(engine, self.pair.tokenizer, self.pair.eos_ids, self.config.max_queue,
                                      metrics=self.metrics)
        self.engine_loop.start()
        if self.config.stats_log_interval_s:
            self.metrics.start_stats_log(self.config.stats_log_interval_s)
        self.frontend = FrontEnd(self)
        servicer = GenerationServicer(self.frontend)

        async def setup(server: grpc.aio.Server) -> None:
            add_generation_servicer(servicer, server)
            self.health = add_health_and_reflection(server, [SERVICE])
            await set_health(self.health, [SERVICE], serving=True)

        from protos.security import BearerTokenInterceptor, TLSFiles

        c, token = self.config, self._token
        interceptors = [BearerTokenInterceptor(token)] if token else []
        creds = TLSFiles(c.tls_cert, c.tls_key).server_credentials() if c.tls_cert and c.tls_key else None
        self.thread = ServerThread(f"{c.host}:{c.port}", setup, name="verifier-grpc", interceptors=interceptors,
                                   credentials=creds)
        port = self.thread.start()
        self.address = f"{self.config.host}:{port}"
        if c.http_port is not None:
            self._start_http(token)
        if self.link is not None:
            resolver = drafter_resolver or (lambda: drafter_address)
            threading.Thread(target=self._watch_drafter, args=(resolver,), name="drafter-watch", daemon=True).start()
        logger.info("verifier serving %s on %s (mode %s)", SERVICE, self.address, self.config.spec.mode)
        return self.address

    def _start_http(self, token: str | None) -> None:
        """The OpenAI-compatible HTTP server, on the gRPC server's event loop: its handlers call the in-process front
        end directly; its front door checks the same bearer token as the gRPC server, before anything else."""
        from verifier_service.openai_http import HttpServer, OpenAIHandlers, create_app

        c = self.config
        self.http_handlers = OpenAIHandlers(self.frontend, [self.model_name], metrics=self.metrics.exposition,
                                            max_body_bytes=c.max_body_bytes, token=token)
        self.http = HttpServer(create_app(self.http_handlers), c.host, c.http_port)
        self.http_address = f"{c.host}:{self.http.start(self.thread.loop)}"
        logger.info("OpenAI-compatible HTTP on http://%s (model %s)", self.http_address, self.model_name)

    @property
    def model_name(self) -> str:
        """The name clients give as ``model`` (``served_model_name``, else the target folder's name)."""
        from spec_core.model_paths import model_name

        return self.config.served_model_name or model_name(self.config.target.path)

    def _watch_drafter(self, resolver) -> None:
        """Reconnect a dead drafter link (the engine uses its backup meanwhile; nothing waits on this)."""
        from verifier_service.drafter_link import GrpcDrafterLink

        while not self._stopping.wait(self.config.reconnect_interval_s):
            link, loop = self.link, self.engine_loop
            if link is None or link.alive or loop is None or loop.pending_link is not None:
                continue
            try:
                new = GrpcDrafterLink(resolver(), self.hello(), self.pair.target.vocab_size, connect_timeout_s=5.0,
                                      tls=self.config.internal_tls, token=self._token)
            except Exception as exc:  # noqa: BLE001 - keep trying; the backup serves meanwhile
                logger.info("drafter not back yet: %s", exc)
                continue
            self.link_bytes_base = (self.link_bytes_base[0] + link.bytes_sent,
                                    self.link_bytes_base[1] + link.bytes_received)
            self.link = new
            loop.pending_link = new
            self.reconnects += 1
            logger.warning("reconnected to the drafter at %s", new.address)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def drain(self, grace_s: float | None = None) -> bool:
        """Health NOT_SERVING, refuse new requests (UNAVAILABLE), finish in-flight ones, then stop the server.
        Requests still running when the grace runs out end with UNAVAILABLE (HTTP 503), so every handler has
        answered before the servers stop."""
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        if self.thread is not None and self.health is not None:
            self.thread.call(lambda: set_health(self.health, [SERVICE], serving=False))
        done = self.engine_loop.drain(grace) if self.engine_loop is not None else True
        if not done:
            self.engine_loop.shed("the server is shutting down; retry on another replica")
        self.stop(grace_s=1.0)
        return done

    def stop(self, grace_s: float = 1.0) -> None:
        self._stopping.set()
        if self.http is not None:
            self.http.stop()
        if self.thread is not None:
            self.thread.stop(grace_s)
        if self.engine_loop is not None:
            self.engine_loop.stop()
        if self.link is not None:
            self.link.close()
        if self.metrics is not None:
            self.metrics.stop()

    def stats(self) -> dict:
        loop = self.engine_loop
        out = {"mode": self.config.spec.mode, "address": self.address, "running": 0, "queued": 0, "kv_usage": 0.0,
               "tokens_emitted": 0, "rounds": 0, "acceptance_rate": None, "mean_tokens_per_round": None,
               "cache_hit_rate": None, "drafter_connected": bool(self.link is not None and self.link.alive),
               "uptime_s": time.time() - loop.started_at if loop else 0.0}
        if loop is None:
            return out
        eng = loop.engine
        m = eng.metrics.stats
        out.update(running=len(eng.scheduler.running), queued=len(eng.scheduler.waiting),
                   kv_usage=eng.blocks.usage, tokens_emitted=eng.metrics.tokens_emitted, rounds=m.num_rounds,
                   acceptance_rate=m.acceptance_rate,
                   mean_tokens_per_round=m.mean_tokens_per_round,
                   acceptance_by_position=m.acceptance_by_position(), admitted=loop.num_admitted,
                   engine_failures=loop.failures, forward_s=eng.metrics.forward_s, draft_s=eng.metrics.draft_s,
                   batch_k=eng.adaptive.batch_k if eng.adaptive is not None else self.config.spec.lookahead)
        out.update(counter_totals(eng))
        proposer = eng.drafter
        if self.config.spec.mode == "ssd" and proposer is not None:
            s = proposer.stats
            step_s = eng.metrics.step_s
            out.update(cache_hit_rate=s.cache_hit_rate, ssd_rounds=s.rounds, ssd_hits=s.hits, jit=s.jit,
                       backup_rounds=s.backup, verifier_wait_s=s.wait_s, verifier_max_wait_s=s.max_wait_s,
                       accepted_histogram=list(s.accepted_hist),
                       tokens_per_round_on_hit=s.tokens_on_hit / s.hit_rounds if s.hit_rounds else None,
                       tokens_per_round_on_miss=(s.tokens_on_miss / (s.jit_rounds + s.backup_rounds
                                                                     + s.bundle_wait_rounds)
                                                 if s.jit_rounds + s.backup_rounds + s.bundle_wait_rounds else None),
                       fast_backup_steps=s.fast_backup_steps, backup_switch_rounds=proposer.switch_rounds,
                       tree=str(self.config.spec.tree), mean_tree_nodes=s.mean_tree_nodes,
                       max_tree_nodes=s.max_tree_nodes, off_spine_rounds=s.off_spine_rounds,
                       lookup_nodes=s.lookup_nodes, lookup_tokens=s.lookup_tokens,
                       hits_by_outcome={"all_accepted": s.hits_all_accepted, "rejected": s.hits_rejected,
                                        "off_spine": s.hits_off_spine},
                       misses_by_cause={"late": s.misses_late, "unpredicted": s.misses_unpredicted,
                                        "no_bundle": s.misses_no_bundle, "other_base": s.misses_other_base},
                       bundle_waits={"attempts": s.bundle_wait_attempts, "rounds_served": s.bundle_wait_rounds,
                                     "wait_s": s.bundle_wait_s},
                       verifier_wait_fraction=s.wait_s / step_s if step_s > 0 else None)
        if self.link is not None:
            out.update(link_bytes_sent=self.link_bytes_base[0] + self.link.bytes_sent,
                       link_bytes_received=self.link_bytes_base[1] + self.link.bytes_received,
                       drafter_error=self.link.error, drafter_reconnects=self.reconnects)
        return out
