"""``ssd serve`` (Ray-placed drafter and verifier behind the gRPC API) and ``ssd client`` (its command-line client)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from ssd_cli.main import CliError, print_json

logger = logging.getLogger("ssd")


def add_parsers(sub) -> None:
    s = sub.add_parser("serve", help="serve the gRPC API with drafter and verifier as Ray actors")
    s.add_argument("--address", help="join this Ray cluster (default: start an embedded local Ray)")
    s.add_argument("--host", default="127.0.0.1", help="public bind host (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=50051, help="public gRPC port (default 50051; 0 = any free)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (same host as the gRPC API; 0 = any free port)")
    s.add_argument("--k", type=int, default=2, help="lookahead K (default 2, the best measured on CPU)")
    s.add_argument("--budget", type=int, default=None, help="pre-drafted branches per request (fan-out budget)")
    s.add_argument("--saguaro-c", type=float, default=1.0, help="Saguaro down-weighting C in (0, 1]")
    s.add_argument("--fixed-k", action="store_true",
                   help="always speculate K tokens (default: adaptive K per step, down to 0, from measured costs)")
    s.add_argument("--backup-policy", choices=["auto", "neural", "fast"], default="auto",
                   help="on a miss: wait for a just-in-time draft (neural), n-gram at once (fast), or by batch size "
                        "from measured timings (auto, the paper's b*)")
    s.add_argument("--max-num-seqs", type=int, default=16, help="requests batched per verify step")
    s.add_argument("--max-queue", type=int, default=64, help="admitted requests before RESOURCE_EXHAUSTED")
    s.add_argument("--gpu", choices=["auto", "yes", "no"], default="auto",
                   help="GPUs for the actors (auto: if the cluster has 2 x --gpu-fraction of them)")
    s.add_argument("--gpu-fraction", type=float, default=1.0,
                   help="each actor's share of a GPU: 1 = a GPU each, 0.5 = drafter and verifier on one GPU")
    s.add_argument("--kv-memory-fraction", type=float, default=None,
                   help="each KV pool's share of its device's free memory (default: 0.4 on a GPU; fixed on a CPU)")
    s.add_argument("--device", default="auto",
                   help="auto (the actor's GPU if it has one, else cpu) | cpu | cuda | cuda:N, for both actors")
    s.add_argument("--strategy", default="PACK", help="placement strategy: PACK | SPREAD | STRICT_SPREAD | ...")
    s.add_argument("--num-cpus", type=int, default=None, help="CPUs of the embedded local Ray (default: all)")
    s.add_argument("--drain-grace", type=float, default=30.0, help="seconds in-flight streams get on SIGTERM")
    s.add_argument("--auth-token-file", help="require `authorization: Bearer <token>` (token read from this file)")
    s.add_argument("--auth-token-env", help="... or from this environment variable")
    s.add_argument("--tls-cert", help="TLS certificate (PEM) for the public API")
    s.add_argument("--tls-key", help="TLS private key (PEM) for the public API")
    s.add_argument("--target", help="target: an HF model folder or a .gguf file (default: `ssd models`)")
    s.add_argument("--draft", help="draft: an HF model folder or a .gguf file (default: `ssd models`)")
    s.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (default auto)")

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

    from cluster.launch import PairConfig, launch
    from spec_core.fanout import FanoutConfig
    from spec_core.model_paths import check_model_dir, default_pair

    pair = default_pair()
    target, draft = args.target or pair["target"], args.draft or pair["draft"]
    check_model_dir(target)
    check_model_dir(draft)
    cfg = PairConfig(target, draft, k=args.k, budget=args.budget or FanoutConfig().budget,
                     saguaro_c=args.saguaro_c, dtype=args.dtype, host=args.host, port=args.port,
                     max_num_seqs=args.max_num_seqs, max_queue=args.max_queue,
                     use_gpu={"auto": None, "yes": True, "no": False}[args.gpu], strategy=args.strategy,
                     gpu_fraction=args.gpu_fraction, device=args.device, kv_memory_fraction=args.kv_memory_fraction,
                     metrics_port=args.metrics_port, adaptive_k=not args.fixed_k,
                     backup_policy=args.backup_policy,
                     extra_verifier={"auth_token_file": _abs(args.auth_token_file),
                                     "auth_token_env": args.auth_token_env,
                                     "tls_cert": _abs(args.tls_cert), "tls_key": _abs(args.tls_key)})
    cfg.verifier_config()  # validate before starting Ray
    if args.address:
        ray.init(address=args.address, logging_level=logging.WARNING)
    else:
        ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deployment = launch(cfg)
    except Exception as exc:
        ray.shutdown()
        raise CliError(f"could not start the service: {exc}") from exc
    info = deployment.info()
    print(f"ssd serve: gRPC address {deployment.address}", flush=True)
    if info["verifier"].get("metrics_address"):
        print(f"ssd serve: Prometheus metrics at http://{info['verifier']['metrics_address']}/metrics", flush=True)
    print_json(info)
    sys.stdout.flush()
    stop.wait()
    logger.warning("draining (up to %.0f s) ...", args.drain_grace)
    deployment.shutdown(args.drain_grace)
    ray.shutdown()
    return 0


def _abs(path: str | None) -> str | None:
    import os

    return os.path.abspath(path) if path else None


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
                print_json(__import__("json").loads(client.stats().json))
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
