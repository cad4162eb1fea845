"""``ssd serve`` (Ray-placed drafter and verifier behind the gRPC API) and ``ssd client`` (its command-line client)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from dataclasses import replace

from spec_core.config import SSD_DEFAULT_TREE
from ssd_cli.main import CliError, print_json

logger = logging.getLogger("ssd")


def add_parsers(sub) -> None:
    _add_serve(sub)
    _add_client(sub)


def _add_serve(sub) -> None:
    """``ssd serve``: every flag is also a key of :class:`cluster.serve_config.ServeSettings` (tested); none has
    a parser default, so the ones given override the config file."""
    s = sub.add_parser("serve", argument_default=argparse.SUPPRESS,
                       help="serve the gRPC API (and OpenAI-compatible HTTP) with drafter and verifier as Ray actors")
    s.add_argument("--config", help="a YAML file of these settings (keys are the flag names: `max-model-len: "
                   "2048`); flags given here override it; an unknown key is an error")
    s.add_argument("--address", help="join this Ray cluster (default: start an embedded local Ray)")
    s.add_argument("--host", help="public bind host (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="public gRPC port (default 50051; 0 = any free)")
    s.add_argument("--http-port", type=int,
                   help="also serve OpenAI-compatible HTTP (/v1/chat/completions, /v1/completions, /v1/models, "
                        "/health, /metrics) on this port, over the same engine (0 = any free; default off)")
    s.add_argument("--metrics-port", type=int,
                   help="serve Prometheus metrics on this port (same host as the gRPC API; 0 = any free port)")
    s.add_argument("--served-model-name", help="the `model` name HTTP clients use (default: the target's name)")
    s.add_argument("--max-body-bytes", type=int, help="the largest HTTP request body; a larger one gets 413 before "
                   "it is read (default 4194304)")
    s.add_argument("--drafter-host", help="where the drafter listens: auto (the default: 127.0.0.1 when it shares "
                   "the verifier's node, else the node IP, then with the public API's TLS and token), node-ip, or "
                   "an address")
    _add_serve_engine(s)


def _add_serve_engine(s) -> None:
    s.add_argument("--k", type=int, help="lookahead K (default 2, the best measured on CPU)")
    s.add_argument("--budget", type=int, help="pre-drafted branches per request (fan-out budget)")
    s.add_argument("--ssd-strategy", choices=["auto", "fanout", "run-ahead"],
                   help="how the drafter drafts: fanout (a tree per likely outcome of every round), run-ahead (one "
                        "chain per request, ahead of the verifier), auto (the default: run-ahead where the draft "
                        "reads a quarter of the target's weights per token or more)")
    s.add_argument("--saguaro-c", type=float, help="Saguaro down-weighting C in (0, 1] (default 1)")
    s.add_argument("--tree", help="SSD's candidate tree per outcome: chain, or WIDTHxLEVELS (the draft's next "
                   f"WIDTH-1 choices beside the spine at its first LEVELS depths; default {SSD_DEFAULT_TREE})")
    s.add_argument("--fixed-k", action="store_true",
                   help="always speculate K tokens (default: adaptive K per step, down to 0, from measured costs)")
    s.add_argument("--backup-policy", choices=["auto", "neural", "fast"],
                   help="on a miss: wait for a just-in-time draft (neural), n-gram at once (fast), or by batch size "
                        "from measured timings (auto, the default: the paper's b*)")
    s.add_argument("--sampling", choices=["auto", "residual", "coupled"],
                   help="how sampled requests draw: residual (accept or resample), coupled (each token an exact race "
                        "keyed by seed and position, verified by argmax match: reproducible at any K), or auto (the "
                        "default: coupled for requests with a seed)")
    s.add_argument("--max-num-seqs", type=int, help="requests batched per verify step (default 16)")
    s.add_argument("--max-num-batched-tokens", type=int, help="tokens per verify step, prefill chunks included "
                   "(default 2048)")
    s.add_argument("--max-model-len", type=int, help="a request's context limit, prompt plus output (default: the "
                   "model's)")
    s.add_argument("--stats-log-interval", type=float, help="seconds between the verifier's one-line stats log "
                   "(throughput, acceptance, hit rate, KV usage; default 10)")
    s.add_argument("--max-queue", type=int, help="admitted requests before RESOURCE_EXHAUSTED (default 64)")
    s.add_argument("--gpu", choices=["auto", "yes", "no"],
                   help="GPUs for the actors (auto, the default: if the cluster has 2 x --gpu-fraction of them)")
    s.add_argument("--gpu-fraction", type=float,
                   help="each actor's share of a GPU: 1 = a GPU each (default), 0.5 = both actors on one GPU")
    s.add_argument("--kv-memory-fraction", type=float,
                   help="each KV pool's share of its device's free memory (default: 0.4 on a GPU; fixed on a CPU)")
    s.add_argument("--device",
                   help="auto (the default: the actor's GPU if it has one, else cpu) | cpu | cuda | cuda:N")
    s.add_argument("--strategy", help="placement strategy: PACK (default) | SPREAD | STRICT_SPREAD | ...")
    s.add_argument("--num-cpus", type=int, help="CPUs of the embedded local Ray (default: all)")
    s.add_argument("--drain-grace", type=float, help="seconds in-flight streams get on SIGTERM (default 30)")
    s.add_argument("--auth-token-file", help="require `authorization: Bearer <token>` (token read from this file)")
    s.add_argument("--auth-token-env", help="... or from this environment variable")
    s.add_argument("--tls-cert", help="TLS certificate (PEM) for the public API")
    s.add_argument("--tls-key", help="TLS private key (PEM) for the public API")
    s.add_argument("--pair", help="a named model pair for --target and --draft when they are not given: "
                   "smollm2-135m (the default) or qwen2.5-coder-1.5b (`ssd install-models --pair ...` first)")
    s.add_argument("--target", help="target: an HF model folder or a .gguf file (default: `ssd models`)")
    s.add_argument("--draft", help="draft: an HF model folder or a .gguf file (default: `ssd models`)")
    s.add_argument("--dtype", help="auto (default) | float32 | bfloat16 | float16 | int8 | int4 | w8a8 | gguf")



def _add_client(sub) -> None:
    c = sub.add_parser("client", help="talk to a running `ssd serve`")
    csub = c.add_subparsers(dest="client_command", required=True)
    g = csub.add_parser("generate", help="stream one generation to the terminal")
    g.add_argument("--address", default="127.0.0.1:50051")
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--chat", help="one user turn, sent as messages (the server applies the chat template)")
    g.add_argument("--messages", help="a JSON file with an OpenAI-style list of {role, content} messages")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", action="store_true")
    g.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    g.add_argument("--json", action="store_true", help="print the same JSON object as `ssd generate --json`")
    st = csub.add_parser("stats", help="print the server's counters as JSON")
    st.add_argument("--address", default="127.0.0.1:50051")
    for p in (g, st):
        p.add_argument("--token-file", help="bearer token file (servers started with --auth-token-file)")
        p.add_argument("--tls-ca", help="CA certificate (PEM) that signed the server's TLS certificate")
        p.add_argument("--retries", type=int, default=6,
                       help="retries on UNAVAILABLE (a restarting or draining server), with capped backoff; a "
                            "stream is retried only before its first token")


def cmd_serve(args: argparse.Namespace) -> int:
    import ray

    from cluster.launch import launch
    from cluster.serve_config import ServeSettings
    from spec_core.config import resolve_dtype
    from spec_core.model_paths import check_model_dir, model_name

    given = {k: v for k, v in vars(args).items() if k in ServeSettings.model_fields}
    try:
        settings = ServeSettings.load(getattr(args, "config", None), given)
        cfg = settings.pair_config()
        cfg = replace(cfg, log_level=logging.getLogger().getEffectiveLevel())  # the actors log as we do
        cfg.verifier_config()  # validate before starting Ray
    except ValueError as exc:
        raise CliError(str(exc)) from None
    check_model_dir(cfg.target_path)
    check_model_dir(cfg.draft_path)
    if not settings.address:  # an embedded Ray: the actors bind on this machine, so say now if they cannot
        _check_ports(cfg.host, {"--port": cfg.port, "--http-port": cfg.http_port, "--metrics-port": cfg.metrics_port})
    t0 = time.monotonic()
    if settings.address:
        _progress(f"joining the Ray cluster at {settings.address}")
        ray.init(address=settings.address, logging_level=logging.WARNING)
    else:
        _progress("starting a local Ray")
        ray.init(address="local", num_cpus=settings.num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    _progress(f"Ray up ({ray.cluster_resources().get('CPU', 0):.0f} CPUs) in {time.monotonic() - t0:.1f} s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    dtype = cfg.dtype if cfg.dtype != "auto" else f"auto: {resolve_dtype('auto', 'cpu', cfg.target_path)} on a CPU"
    _progress(f"loading target {model_name(cfg.target_path)} (dtype {dtype}) in the verifier actor")
    _progress(f"loading draft {model_name(cfg.draft_path)} in the drafter actor")
    t0 = time.monotonic()
    try:
        deployment = launch(cfg)
    except Exception as exc:
        ray.shutdown()
        raise CliError(f"could not start the service: {exc}") from exc
    info = deployment.info()
    logger.info("deployment: %s", json.dumps(info))  # (`ssd -v serve`: ids, pids, cores, addresses)
    verifier = info["verifier"]
    _progress(f"target and draft loaded in {time.monotonic() - t0:.1f} s")
    _progress(f"listening: gRPC at {deployment.address}")
    if verifier.get("http_address"):
        _progress(f"listening: OpenAI-compatible HTTP at http://{verifier['http_address']}/v1 (model "
                  f"{verifier.get('model_name')!r})")
    if verifier.get("metrics_address"):
        _progress(f"listening: Prometheus metrics at http://{verifier['metrics_address']}/metrics")
    stop.wait()
    logger.warning("draining (up to %.0f s) ...", settings.drain_grace)
    deployment.shutdown(settings.drain_grace)
    ray.shutdown()
    return 0


def _progress(line: str) -> None:
    print(f"ssd serve: {line}", flush=True)


def _check_ports(host: str, ports: dict[str, int | None]) -> None:
    """A one-line error for the first given port (not 0) that ``host`` cannot bind, before anything loads."""
    import socket

    for flag, port in ports.items():
        if not port:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no conflict
            try:
                s.bind((host, port))
            except OSError as exc:
                raise CliError(f"{flag} {port}: cannot listen on {host}:{port} ({exc.strerror}); is another "
                               "server running there? Choose another port, or 0 for any free one") from None


def _client(args: argparse.Namespace, **kw):
    from protos.security import read_secret
    from verifier_service.client import SSDClient

    if args.retries < 0:
        raise CliError("--retries must be >= 0")
    return SSDClient(args.address, token=read_secret(args.token_file), tls_ca=args.tls_ca, retries=args.retries,
                     **kw)


def cmd_client(args: argparse.Namespace) -> int:
    import grpc

    from protos import codec
    from spec_core.config import SamplingParams

    if args.client_command == "stats":
        with _client(args) as client:
            try:
                print_json(codec.stats_from_pb(client.stats()))
            except grpc.RpcError as exc:
                raise CliError(f"{exc.code().name}: {exc.details()}") from None
        return 0
    from spec_core.chat import ChatPrompt, read_messages_file

    given = [f for f in ("prompt", "chat", "messages") if getattr(args, f) is not None]
    if len(given) != 1:
        raise CliError("give exactly one of --prompt, --chat or --messages")
    prompt = args.prompt
    if args.chat is not None:
        prompt = ChatPrompt.of([{"role": "user", "content": args.chat}])
    elif args.messages is not None:
        prompt = ChatPrompt.of(read_messages_file(args.messages))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    with _client(args, timeout_s=args.timeout) as client:
        try:
            final = None
            for resp in client.generate(prompt, params):
                if resp.WhichOneof("kind") == "delta":
                    if not args.json:
                        sys.stdout.write(resp.delta.text)
                        sys.stdout.flush()
                else:
                    final = resp.final
        except grpc.RpcError as exc:
            raise CliError(f"{exc.code().name}: {exc.details()}") from None
    if args.json:
        print_json(codec.result_to_json(final))
    else:
        sys.stdout.write("\n")
    return 0
