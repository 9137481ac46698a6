"""`kvd-loadgen`: play engines against a live kvd and measure them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvd.config_values import MODEL_PRESETS
from kvd_client import eventloop
from kvd_client.cli_args import number
from kvd_loadgen.intent_trace import TraceError as IntentTraceError
from kvd_loadgen.local import KvdStartError
from kvd_loadgen.trace_reader import TraceError as RequestTraceError
from kvd_loadgen.trace_reader import tenant_rule


POSITIVE_INT = number(int, 0, strictly=True)
POSITIVE = number(float, 0, strictly=True)
COUNT = number(int, 0)  # 0 allowed: none, or "as the option says"


def _existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return path


def _tenant_rule(text: str) -> str:
    try:
        tenant_rule(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _demo(args) -> int:
    from kvd_client import KvdClientError, UnavailableError
    from kvd_loadgen.demo import run_demo

    token = args.token
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            print(f"kvd-loadgen demo: cannot read --token-file: {exc}", file=sys.stderr)
            return 2
    try:
        summary = eventloop.run(run_demo(args.target, token=token, tenant=args.tenant))
    except UnavailableError as exc:
        print(f"kvd-loadgen demo: cannot reach kvd at {args.target} ({exc.details}); is it "
              "running? `make run` starts one", file=sys.stderr)
        return 3
    except KvdClientError as exc:
        print(f"kvd-loadgen demo: kvd refused: {exc}", file=sys.stderr)
        return 1
    return 0 if summary["all_intact"] else 1


def _bench(args) -> int:
    from kvd_loadgen.bench import run_bench

    return run_bench(args)


def _replay(args) -> int:
    from kvd_loadgen.replay import run_replay_cli

    return run_replay_cli(args)


def _whale_minnows(args) -> int:
    from kvd_loadgen.whale_minnows import run_cli

    return run_cli(args)


def _soak(args) -> int:
    from kvd_loadgen.soak import run_cli

    return run_cli(args)


def _bandwidth_hog(args) -> int:
    from kvd_loadgen.bandwidth_hog import run_cli

    return run_cli(args)


def _hostile(args) -> int:
    from kvd_loadgen.hostile import run_cli

    return run_cli(args)


def _disagg(args) -> int:
    from kvd_loadgen.disagg import run_cli

    return run_cli(args)


def _cluster(args) -> int:
    from kvd_loadgen.cluster import run_cli

    return run_cli(args)


def _request_trace(args) -> int:
    from kvd_loadgen.request_trace import run_cli

    return run_cli(args)


def _demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="memory pressure against a running kvd, and a table")
    demo.add_argument("--target", required=True, help="unix:///path or host:port")
    demo.add_argument("--tenant", default="demo", help="the tenant the requests are admitted as "
                      "(a token names its own)")
    demo.add_argument("--token", default=None, help="bearer token (default: $KVD_TOKEN)")
    demo.add_argument("--token-file", default=None, help="read the bearer token from this file")
    demo.set_defaults(func=_demo)


def _bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="control-plane and copy benchmarks")
    bench.add_argument("--json", type=Path, help="write figures to this file")
    bench.add_argument("--quick", action="store_true", help="fewer iterations")
    bench.set_defaults(func=_bench)


def _replay_intents_parser(sub) -> None:
    from kvd_loadgen.replay import PIN_MODES

    replay = sub.add_parser("replay-intents", help="replay intent-event traces through kvd")
    replay.add_argument("trace", nargs="+",
                        help="trace files, profile names, or 'all' for the five profiles")
    replay.add_argument("--policy", default="all", help="a policy, a,b,c, or 'all'")
    replay.add_argument("--device-pages", type=POSITIVE_INT, default=128)
    replay.add_argument("--host-pages", type=COUNT, default=4096)
    replay.add_argument("--page-bytes", type=POSITIVE_INT, default=4096,
                        help="scaled-down page size (page counts decide misses)")
    replay.add_argument("--pins", choices=PIN_MODES, default="trace",
                        help="hold the trace's pins as written (never let go), or until the "
                        "pinned block's read (as an engine pins for the step that reads it)")
    replay.add_argument("--target", help="an existing kvd (default: start one per policy)")
    replay.add_argument("--json", type=Path, help="write results to this file")
    replay.add_argument("--report", type=Path, help="directory for REPORT.md and PNG plots")
    replay.set_defaults(func=_replay)


def _whale_minnows_parser(sub) -> None:
    wm = sub.add_parser("whale-minnows", help="one whale and forty minnows on one device: lru against fair")
    wm.add_argument("--whales", type=POSITIVE_INT, default=1)
    wm.add_argument("--whale-tokens", type=POSITIVE_INT, default=131072)
    wm.add_argument("--minnows", type=POSITIVE_INT, default=40)
    wm.add_argument("--minnow-tokens", type=POSITIVE_INT, default=2048)
    wm.add_argument("--minnow-tenants", type=POSITIVE_INT, default=1,
                    help="split the minnows across this many tenants")
    wm.add_argument("--duration-s", type=POSITIVE, default=3.0,
                    help="how long both engines decode side by side")
    wm.add_argument("--block-tokens", type=POSITIVE_INT, default=64)
    wm.add_argument("--page-bytes", type=POSITIVE_INT, default=16384)
    wm.add_argument("--device-pages", type=COUNT, default=0,
                    help="0: 90%% of the whole demand")
    wm.add_argument("--step-ms", type=POSITIVE, default=20.0, help="engine step pace")
    wm.add_argument("--json", type=Path)
    wm.add_argument("--report", type=Path, help="directory for REPORT.md and PNG plots")
    wm.set_defaults(func=_whale_minnows)


def _soak_parser(sub) -> None:
    soak = sub.add_parser("soak", help="many clients, mixed workload, minutes: leaks and drift")
    soak.add_argument("--clients", type=POSITIVE_INT, help="default: as many as make bench's soak")
    soak.add_argument("--duration-s", type=POSITIVE, help="default: as long as make bench's soak")
    soak.add_argument("--interval-s", type=POSITIVE, default=30.0, help="report period")
    soak.add_argument("--policy", default="fair")
    soak.add_argument("--json", type=Path)
    soak.set_defaults(func=_soak)


def _request_trace_parser(sub) -> None:
    rt = sub.add_parser("request-trace", help="play a request trace (Mooncake or simulator)")
    rt.add_argument("trace", type=_existing_file)
    rt.add_argument("--policy", default="lru,fair,deadline",
                    help="a,b,c: one run each; POLICY@reservation admits while pages fit "
                    "both tiers instead of the working sets the device")
    rt.add_argument("--speed", type=POSITIVE, default=4.0, help="time compression")
    rt.add_argument("--limit", type=COUNT, default=600, help="first N requests (0: all)")
    rt.add_argument("--tenants", type=_tenant_rule, default="length:16384",
                    help="length:N | round-robin:K | field:NAME")
    rt.add_argument("--block-tokens", type=POSITIVE_INT, default=512)
    rt.add_argument("--model", default="", choices=sorted(MODEL_PRESETS),
                    help="a model preset (llama-3-8b, ...): page bytes = block tokens x its "
                         "bytes per token; default: --page-bytes")
    rt.add_argument("--page-bytes", type=POSITIVE_INT, default=16384,
                    help="scaled-down page size (page counts decide evictions)")
    rt.add_argument("--device-pages", type=POSITIVE_INT, default=1200)
    rt.add_argument("--host-pages", type=COUNT, default=40000)
    rt.add_argument("--step-ms", type=POSITIVE, default=20.0)
    rt.add_argument("--max-output-tokens", type=COUNT, default=128)
    rt.add_argument("--no-share", action="store_true",
                    help="ignore the trace's prefix blocks (hash_ids): every prompt's blocks "
                         "are its own")
    rt.add_argument("--skip-bad", action="store_true", help="leave out bad lines")
    rt.add_argument("--json", type=Path)
    rt.add_argument("--report", type=Path, help="directory for REPORT.md and PNG plots")
    rt.set_defaults(func=_request_trace)


def _bandwidth_hog_parser(sub) -> None:
    hog = sub.add_parser("bandwidth-hog",
                         help="a tenant's bulk promotions beside a latency-sensitive one, on one link")
    hog.add_argument("--link-mib-s", type=POSITIVE, default=16.0, help="the link's cap")
    hog.add_argument("--hog-streams", type=POSITIVE_INT, default=8)
    hog.add_argument("--hog-weight", type=POSITIVE, default=1.0)
    hog.add_argument("--sensitive-weight", type=POSITIVE, default=1.0)
    hog.add_argument("--duration-s", type=POSITIVE, default=4.0, help="per phase")
    hog.add_argument("--json", type=Path)
    hog.add_argument("--report", type=Path, help="directory for REPORT.md and PNG plots")
    hog.set_defaults(func=_bandwidth_hog)


def _hostile_parser(sub) -> None:
    hos = sub.add_parser("hostile", help="a victim tenant's steps under another's flood, "
                         "against a control flooding a second kvd")
    hos.add_argument("--duration-s", type=POSITIVE, default=6.0, help="per phase")
    hos.add_argument("--step-ms", type=POSITIVE, default=2.0, help="the victim's pace")
    hos.add_argument("--streams", type=POSITIVE_INT, default=64, help="the attacker's Step streams")
    hos.add_argument("--json", type=Path)
    hos.set_defaults(func=_hostile)


def _disagg_parser(sub) -> None:
    dis = sub.add_parser("disagg", help="prefill and decode pools, handoff, reservation")
    dis.add_argument("--requests", type=POSITIVE_INT, default=120)
    dis.add_argument("--link-mib-s", type=POSITIVE, default=64.0, help="the handoff link's cap")
    dis.add_argument("--rate", type=POSITIVE, default=40.0, help="arrivals per second")
    from kvd_loadgen.disagg import min_decode_pages

    dis.add_argument("--decode-pages", type=number(int, min_decode_pages()),
                     default=192, help="the decode pool's device tier: at least a request's "
                     "smallest prompt and longest output")
    dis.add_argument("--json", type=Path)
    dis.add_argument("--report", type=Path, help="directory for REPORT.md and PNG plots")
    dis.set_defaults(func=_disagg)


class _WithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, where it has one worth saying."""

    def _get_help_string(self, action):
        if action.default in ("", None, False, []):
            return action.help
        return super()._get_help_string(action)


def _cluster_parser(sub) -> None:
    cl = sub.add_parser("cluster", help="three kvds and an etcd: cluster quotas, handoffs "
                        "across nodes, a node killed, etcd stopped and restarted")
    cl.add_argument("--duration-s", type=POSITIVE, default=24.0,
                    help="node c dies at a third of it; etcd is away from half to two thirds")
    cl.add_argument("--link-mib-s", type=POSITIVE, default=8.0,
                    help="each of a's links to b's and c's decode pools")
    cl.add_argument("--chat-limit", type=POSITIVE_INT, default=300, help="chat's cluster limit, pages")
    cl.add_argument("--json", type=Path)
    cl.add_argument("--report", type=Path, help="directory for REPORT.md and PNG plots")
    cl.set_defaults(func=_cluster)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvd-loadgen", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_demo_parser, _bench_parser, _replay_intents_parser, _whale_minnows_parser,
                _soak_parser, _request_trace_parser, _bandwidth_hog_parser, _hostile_parser,
                _disagg_parser, _cluster_parser):
        add(sub)
    for command in sub.choices.values():  # every option's default in its --help
        command.formatter_class = _WithDefaults
        for action in command._actions:
            if (action.help is None and action.option_strings
                    and action.default not in (None, False, argparse.SUPPRESS)):
                action.help = "(default: %(default)s)"
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KvdStartError as exc:  # options kvd refuses: its one line, as argparse's are
        print(f"kvd-loadgen {args.command}: kvd did not start: {exc.line}", file=sys.stderr)
        return 2
    except (RequestTraceError, IntentTraceError) as exc:  # the file and line that do not read
        print(f"kvd-loadgen {args.command}: {exc}", file=sys.stderr)
        return 2


def write_json(path: Path | None, data) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
