"""`kvd`: run the daemon."""

from __future__ import annotations

import argparse
import sys

from kvd import __version__
from kvd.config import MODEL_PRESETS, load_config, log_created_tokens, override_default_pool
from kvd.core.errors import InvalidArgument
from kvd.core.policies import accepted_policy_names
from kvd.log import configure_logging

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells say of a command stopped by Ctrl-C


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvd", description="KV-cache memory daemon for LLM serving")
    p.add_argument("--version", action="version", version=f"kvd {__version__}")
    p.add_argument("--config", help="TOML config file (default: the embedded default)")
    p.add_argument("--socket", help="unix socket path to listen on ('' for none)")
    p.add_argument("--tcp", help="also listen on HOST:PORT")
    p.add_argument("--log-format", choices=["auto", "json", "console"])
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--grace-s", type=float, help="drain grace period in seconds")
    p.add_argument("--lease-ttl-s", type=float,
                   help="release a silent client's requests after this many seconds")
    p.add_argument("--metrics", help="Prometheus exposition HOST:PORT ('' for none)")
    p.add_argument("--health", help="gRPC health checks only, in clear, on HOST:PORT (for "
                   "Kubernetes grpc: probes; '' for none)")
    g = p.add_argument_group("default pool (the first pool of the config)")
    g.add_argument("--model", choices=sorted(MODEL_PRESETS))
    g.add_argument("--block-tokens", type=int)
    g.add_argument("--page-bytes", type=int, help="overrides model x block tokens")
    g.add_argument("--device-pages", type=int)
    g.add_argument("--host-pages", type=int)
    g.add_argument("--policy", choices=accepted_policy_names())
    g.add_argument("--device-backend", choices=["auto", "cupy", "host"])
    g.add_argument("--admission", choices=["working_set", "reservation"],
                   help="admit while running requests' working sets fit the device "
                   "(working_set), or while their pages fit both tiers (reservation)")
    p.add_argument("--demo-hint", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = from_file = load_config(args.config, create_tokens=True)
        server_changes = {
            k: v for k, v in (("socket", args.socket), ("tcp", args.tcp),
                              ("log_format", args.log_format), ("log_level", args.log_level),
                              ("grace_s", args.grace_s), ("lease_ttl_s", args.lease_ttl_s),
                              ("metrics", args.metrics), ("health", args.health))
            if v is not None
        }
        from dataclasses import replace

        config = replace(config, **server_changes)
        config = override_default_pool(
            config, model=args.model, block_tokens=args.block_tokens, page_bytes=args.page_bytes,
            device_pages=args.device_pages, host_pages=args.host_pages, policy=args.policy,
            device_backend=args.device_backend, admission=args.admission,
        )
        config.validate()
    except InvalidArgument as exc:
        print(f"kvd: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_format, config.log_level)
    log_created_tokens()
    if args.demo_hint:
        print(f"kvd: listening on unix://{config.socket}; in another terminal run `make demo`."
              " Ctrl-C stops kvd.", file=sys.stderr, flush=True)
    from kvd.daemon import Daemon, StartupError

    try:
        return _run(Daemon(config, from_file).serve())
    except StartupError as exc:
        print(f"kvd: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before kvd served (once serving, it drains)
        print("kvd: interrupted while starting; stopped", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(coro) -> int:
    from kvd_client.eventloop import run

    return run(coro)
