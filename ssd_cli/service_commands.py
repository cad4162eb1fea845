"""``ssd serve`` (Ray-placed drafter and verifier behind the gRPC API) and ``ssd client`` (its command-line client)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time

from ssd_cli.main import CliError, print_json

logger = logging.getLogger("ssd")


def add_parsers(sub) -> None:
    _add_serve(sub)
    _add_client(sub)
    c = sub.add_parser("config", help="the one configuration model: its keys as Markdown or JSON schema, or the "
                       "settings a --config file and flags resolve to")
    what = c.add_mutually_exclusive_group()
    what.add_argument("--markdown", action="store_true", help="every key, by section (docs/configuration.md)")
    what.add_argument("--schema", action="store_true", help="the JSON schema of the Serve app's arguments")
    c.add_argument("--config", help="with neither: print this YAML file's settings, every default filled in")


def _add_serve(sub) -> None:
    """``ssd serve``: one flag per key of the one configuration model (:class:`spec_core.settings.ServiceConfig`,
    tested); none has a parser default, so the ones given override the config file."""
    from spec_core.settings import ServiceConfig
    from ssd_cli.config_flags import add_model_flags

    s = sub.add_parser("serve", argument_default=argparse.SUPPRESS,
                       help="serve the gRPC API (and OpenAI-compatible HTTP) with drafter and verifier as Ray actors")
    s.add_argument("--config", help="a YAML file of these settings (keys are the flag names: `max-model-len: "
                   "2048`; docs/configuration.md lists them); flags given here override it; an unknown key is an "
                   "error")
    add_model_flags(s, ServiceConfig)


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

    from cluster.launch import LaunchOptions, launch, verifier_config
    from spec_core.config import resolve_dtype
    from spec_core.model_paths import check_model_dir, model_name
    from spec_core.settings import ServiceConfig
    from ssd_cli.config_flags import given

    try:
        cfg = ServiceConfig.load(getattr(args, "config", None), given(args, ServiceConfig))
        target, draft = cfg.model_paths()
        verifier_config(cfg, target)  # validate before starting Ray
    except ValueError as exc:
        raise CliError(str(exc)) from None
    check_model_dir(target)
    check_model_dir(draft)
    if not cfg.address:  # an embedded Ray: the actors bind on this machine, so say now if they cannot
        _check_ports(cfg.host, {"--port": cfg.port, "--http-port": cfg.http_port, "--metrics-port": cfg.metrics_port})
    t0 = time.monotonic()
    if cfg.address:
        _progress(f"joining the Ray cluster at {cfg.address}")
        ray.init(address=cfg.address, logging_level=logging.WARNING)
    else:
        _progress("starting a local Ray")
        ray.init(address="local", num_cpus=cfg.num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    _progress(f"Ray up ({ray.cluster_resources().get('CPU', 0):.0f} CPUs) in {time.monotonic() - t0:.1f} s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    dtype = cfg.dtype if cfg.dtype != "auto" else f"auto: {resolve_dtype('auto', 'cpu', target)} on a CPU"
    _progress(f"loading target {model_name(target)} (dtype {dtype}) in the verifier actor")
    _progress(f"loading draft {model_name(draft)} in the drafter actor")
    t0 = time.monotonic()
    try:  # the actors log as the driver does
        deployment = launch(cfg, options=LaunchOptions(log_level=logging.getLogger().getEffectiveLevel()))
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
    logger.warning("draining (up to %.0f s) ...", cfg.drain_grace)
    deployment.shutdown(cfg.drain_grace)
    ray.shutdown()
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from spec_core.settings import ServeAppConfig, ServiceConfig, markdown

    if args.markdown:
        print(markdown(), end="")
    elif args.schema:
        print_json(ServeAppConfig.model_json_schema())
    else:
        import yaml

        try:
            cfg = ServiceConfig.load(args.config)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        print(yaml.safe_dump({k.replace("_", "-"): v for k, v in cfg.model_dump().items()}, sort_keys=False), end="")
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
