"""`kvctl`: kvd for people. Tables on a terminal, `--json` for scripts.

Exit codes: 0 done; 1 kvd refused (the message says why); 2 bad usage; 3 kvd unreachable.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.live import Live
from rich.table import Table

from kvd.config_values import bytes_of
from kvd.core.errors import KvdError
from kvd_client import (Client, DrainingError, KvdClientError, Tls, UnavailableError,
                        default_target, pb)
from kvd_client.cli_args import UINT32_MAX, number

EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells say of a command stopped by Ctrl-C


_INT64 = frozenset({FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64,
                    FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_FIXED64,
                    FieldDescriptor.TYPE_SFIXED64})


def _json(message) -> dict:
    """A message as JSON data, 64-bit integers as numbers (protobuf's JSON mapping writes
    them as strings, which jq and most tools then compare as text)."""
    data = MessageToDict(message, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)
    _numbers(message, data)
    return data


def _numbers(message, data: dict) -> None:
    for field in message.DESCRIPTOR.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                entry = field.message_type.fields_by_name["value"]
                if entry.type in _INT64:
                    data[field.name] = {k: int(v) for k, v in value.items()}
                elif entry.type == FieldDescriptor.TYPE_MESSAGE:
                    source = getattr(message, field.name)
                    for key, item in value.items():
                        _numbers(source[key], item)
            elif field.is_repeated:
                for sub, item in zip(getattr(message, field.name), value):
                    _numbers(sub, item)
            else:
                _numbers(getattr(message, field.name), value)
        elif field.type in _INT64:
            data[field.name] = [int(v) for v in value] if field.is_repeated else int(value)


class Shown(Console):
    """A console for what kvd says: much of it is the tenants' own words (request ids,
    which any tenant chooses), shown as written. Not read as rich's markup: an id like
    "[/]" stopped every table with a traceback, and "[link=...]" hid part of itself. And
    its control characters written escaped (ESC as \\x1b): raw, they would drive the
    operator's terminal (clear it, retitle it, hide what follows)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(markup=False, emoji=False, **kwargs)

    def render_str(self, text: str, **kwargs):
        return super().render_str(printable(text), **kwargs)


def printable(text: str) -> str:
    """The text with each control character (but line breaks) escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == "\n" else c.encode("unicode_escape").decode()
                   for c in text)


def _mib(pages: int, page_bytes: int) -> str:
    return f"{pages * page_bytes / 2**20:,.0f} MiB"


def status_table(stats: pb.GetPoolStatsResponse) -> Table:
    t = Table(title=f"kvd {stats.version} — up {stats.uptime_s:,.0f} s")
    for col in ("pool", "policy", "tier", "backend", "used / capacity", "pinned", "requests",
                "queued", "evictions", "promotions", "stall s", "prefix hits / asked"):
        t.add_column(col, justify="left" if col in ("pool", "policy", "tier", "backend")
                     else "right", no_wrap=True)
    for p in stats.pools:
        for i, tier in enumerate(p.tiers):
            first = i == 0
            t.add_row(p.pool if first else "", p.policy if first else "",
                      pb.Tier.Name(tier.tier).removeprefix("TIER_").lower(), tier.backend,
                      f"{tier.used_pages:,} / {tier.capacity_pages:,} "
                      f"({_mib(tier.capacity_pages, p.page_bytes)})",
                      f"{tier.pinned_pages:,}" if first else "",
                      f"{p.num_requests:,}" if first else "", f"{p.num_queued:,}" if first else "",
                      f"{p.num_evictions:,}" if first else "",
                      f"{p.num_promotions:,}" if first else "",
                      f"{p.stall_seconds_total:.3f}" if first else "",
                      f"{p.num_prefix_hits:,} / {p.num_prefix_looked_up:,}" if first else "")
    return t


def tenants_table(tenants) -> Table:
    t = Table(title="tenants: usage vs fair share vs quota (device pages)")
    gpu = any(x.engine_gpu_blocks for x in tenants)
    for col in ("pool", "tenant", "weight", "device", "charged", "shared (saved)", "fair share",
                "guaranteed", "limit", "reserved", "queued", "evictions suffered / caused",
                "stalled s (by whom)") + (("engine GPU blocks",) if gpu else ()):
        t.add_column(col, justify="left" if col in ("pool", "tenant", "stalled s (by whom)")
                     else "right")
    for x in tenants:
        causes = ", ".join(f"{c.cause_tenant or '(engine)'}: {c.stall_seconds:.3f}"
                           for c in x.stalls_by_cause) or "-"
        t.add_row(x.pool, x.tenant + (" (own prefixes)" if x.private_prefixes else ""),
                  f"{x.weight:g}", f"{x.device_pages:,}",
                  f"{x.charged_pages:,.1f}",
                  f"{x.shared_pages:,} ({x.shared_saved_pages:,.1f})" if x.shared_pages else "-",
                  f"{x.fair_share_pages:,.1f}", f"{x.guaranteed_pages:,}",
                  f"{x.limit_pages:,}" if x.limit_pages else "none", f"{x.reserved_pages:,}",
                  f"{x.queued_pages:,}", f"{x.evictions_suffered:,} / {x.evictions_caused:,}",
                  causes, *((f"{x.engine_gpu_blocks:,.1f}",) if gpu else ()))
    return t


def requests_table(requests, title: str) -> Table:
    t = Table(title=title)
    for col in ("request", "tenant", "pool", "state", "blocks", "on device", "reserved",
                "stalled s", "evictions suffered"):
        t.add_column(col, justify="left" if col in ("request", "tenant", "pool", "state")
                     else "right")
    for r in requests:
        t.add_row(r.request_id, r.tenant, r.pool, r.state, f"{r.num_blocks:,}",
                  f"{r.device_blocks:,}", f"{r.reserved_pages:,}", f"{r.stall_seconds:.3f}",
                  f"{r.evictions_suffered:,}")
    return t


def explain_table(e: pb.ExplainResponse) -> Table:
    t = Table(title=f"{e.request_id} (tenant {e.tenant}, pool {e.pool}, "
                    f"{'active' if e.active else 'released'}): stalled {e.stall_seconds:.4f} s "
                    f"over {e.num_stalls} access(es)"
                    + (f"; {e.num_recomputes} block(s) dropped and handed back to recompute"
                       if e.num_recomputes else ""),
              caption=_shares_line("it", e.request_shares)
              + _shares_line(f"tenant {e.tenant}", e.tenant_shares))
    t.add_column("because of")
    t.add_column("stalled s", justify="right")
    t.add_column("evicted us", justify="right")
    t.add_column("we evicted", justify="right")
    rows: dict[tuple[str, str], list] = {}
    for s in e.stalls_by_cause:
        rows.setdefault((s.cause.tenant, s.cause.request_id), [0.0, 0, 0])[0] = s.stall_seconds
    for x in e.evictions_suffered:
        rows.setdefault((x.other.tenant, x.other.request_id), [0.0, 0, 0])[1] = x.count
    for x in e.evictions_caused:
        rows.setdefault((x.other.tenant, x.other.request_id), [0.0, 0, 0])[2] = x.count
    for (tenant, rid), (secs, suffered, caused) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        # No request id: the tenant's kept prefix blocks, or another tenant's request.
        who = (f"{tenant}/{rid}" if rid else f"tenant {tenant}") if tenant or rid \
            else "(the engine itself)"
        t.add_row(who, f"{secs:.4f}", str(suffered), str(caused))
    return t


def _shares_line(who: str, s: pb.Shares) -> str:
    if not s.num_blocks:
        return ""
    return (f"{who} uses {s.num_blocks} shared prefix block(s), {s.shared_pages} of them in "
            f"device pages shared with other tenants; charged {s.charged_pages:.2f} device "
            f"page(s), {s.saved_pages:.2f} saved by the split\n")


def links_table(links) -> Table:
    t = Table(title="links")
    for col in ("link", "scheduling", "cap MiB/s", "use (last s)", "moved MiB", "queued",
                "by tenant MiB"):
        t.add_column(col, justify="left" if col in ("link", "by tenant MiB") else "right")
    for link in links:
        queued = " ".join(f"{q.transfer_class}:{q.transfers}" for q in link.queues
                          if q.transfers) or "-"
        tenants = ", ".join(f"{x.tenant} {x.bytes / 2**20:.1f}"
                            + (f" (cap {x.cap_bytes_per_s / 2**20:.0f}/s)" if x.cap_bytes_per_s
                               else "") for x in link.tenants) or "-"
        t.add_row(link.link, link.scheduling, f"{link.capacity_bytes_per_s / 2**20:,.0f}",
                  f"{link.utilisation:.0%}", f"{link.bytes_total / 2**20:,.1f}", queued,
                  tenants)
    return t


def _top(client: Client, console: Console, interval_s: float, count: int | None) -> None:
    def render():
        stats = client.pool_stats()
        busiest = client.list_requests(limit=15)
        grid = Table.grid()
        grid.add_row(status_table(stats))
        grid.add_row(tenants_table(client.list_tenants()))
        grid.add_row(links_table(client.list_links()))
        grid.add_row(requests_table(busiest, "busiest requests (device pages)"))
        return grid

    if not console.is_terminal:  # a pipe or a log: one full view per refresh, as `top -b`
        n = 0
        while count is None or n < count:
            if n:
                time.sleep(interval_s)
            console.print(render())
            sys.stdout.flush()
            n += 1
        return
    with Live(render(), console=console, refresh_per_second=4, screen=False) as live:
        n = 1
        while count is None or n < count:
            time.sleep(interval_s)
            live.update(render())
            n += 1


def _quota_size(text: str) -> tuple[str, int]:
    """A guarantee or a limit: pages ("4096"), or bytes with a unit ("8GiB", "512MB") as
    the config takes them."""
    if text.strip().isdigit():
        pages = int(text)
        if pages > UINT32_MAX:
            raise argparse.ArgumentTypeError(f"{pages} pages: at most {UINT32_MAX}")
        return "pages", pages
    try:
        size = int(bytes_of(text))
    except KvdError:
        raise argparse.ArgumentTypeError(
            f"not pages or a size: {text!r} (e.g. 4096 pages, or 8GiB)") from None
    if size >= 2**64:  # kvd says whether it is too many pages
        raise argparse.ArgumentTypeError(f"{text}: at most {2**64 - 1} bytes")
    return "bytes", size


def _rate(text: str) -> float:
    """Bytes per second: a number, or with a unit ("8GiB/s", "500MB")."""
    try:
        return bytes_of(text)
    except KvdError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (e.g. 8GiB/s)") from None


def cluster_tables(view: pb.GetClusterResponse, peer_links=()):
    """Nodes, tenants' cluster usage against their share and each node's part, and the links
    from this node to its peers' pools."""
    from rich.console import Group

    links = None
    if peer_links:
        links = Table(title="links to other nodes' pools (handoffs across nodes)")
        for col in ("link", "capacity", "utilisation", "moved", "queued", "bytes by tenant"):
            links.add_column(col, justify="left" if col == "link" else "right")
        for link in peer_links:
            links.add_row(link.link, f"{link.capacity_bytes_per_s / 2**20:,.0f} MiB/s",
                          f"{link.utilisation:.0%}", f"{link.bytes_total / 2**20:,.1f} MiB",
                          str(sum(q.transfers for q in link.queues)),
                          ", ".join(f"{t.tenant} {t.bytes / 2**20:,.1f} MiB"
                                    for t in link.tenants))
    if not view.enabled:
        return Group(view.detail, links) if links else view.detail
    etcd = "reachable" if view.etcd_up else "UNREACHABLE"
    nodes = Table(title=f"cluster as node {view.node} sees it — etcd {view.etcd} {etcd}"
                  + ("" if view.etcd_up else f" ({view.detail})"))
    for col in ("node", "pool", "device pages", "reserved", "queued"):
        nodes.add_column(col, justify="left" if col in ("node", "pool") else "right")
    for n in view.nodes:
        nodes.add_row(n.node + (" (this node)" if n.node == view.node else ""), n.pool,
                      f"{n.device_pages:,}", f"{n.reserved_pages:,}", f"{n.queued_pages:,}")
    tenants = Table(title="tenants with a cluster quota (pages): cluster-wide, and each "
                    "node's part")
    for col in ("pool", "tenant", "weight", "guaranteed", "limit", "reserved", "wants",
                "fair share", "per node: reserved / entitled / may reserve"):
        tenants.add_column(col, justify="left" if col in ("pool", "tenant") else "right")
    for t in view.tenants:
        parts = "  ".join(
            f"{p.node}: {p.reserved_pages} / {p.entitlement_pages} / "
            f"{'-' if p.may_reserve_pages < 0 else p.may_reserve_pages}" for p in t.nodes)
        tenants.add_row(t.pool, t.tenant, f"{t.weight:g}", str(t.guaranteed_pages),
                        str(t.limit_pages or "none"), str(t.reserved_pages),
                        str(t.demand_pages), f"{t.share_pages:.1f}", parts)
    return Group(nodes, tenants, *([links] if links else []))


# Numbers kvd can act on: not NaN, not infinite, not negative (nor 0 where that means
# nothing). A negative --limit or page count reached kvd's protobuf as a traceback, a
# negative --count never stopped.
_finite = number(float, 0)
_positive = number(float, 0, strictly=True)


def _count(least: int):
    return number(int, least, most=UINT32_MAX)  # counts go in the API's uint32 fields


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvctl", description="Look at and steer a running kvd.")
    p.add_argument("--target", default=None, help=f"kvd address (default: {default_target()})")
    p.add_argument("--token", default=None, help="bearer token (default: $KVD_TOKEN)")
    p.add_argument("--token-file", default=None,
                   help="read the bearer token from this file (keeps it off the command line)")
    p.add_argument("--json", action="store_true", dest="json_all",
                   help="JSON instead of tables (also accepted after the command)")
    p.add_argument("--tls-ca", default=None,
                   help="TLS to a TCP target: the CA's PEM file (default: $KVD_TLS_CA)")
    p.add_argument("--tls-cert", default=None, help="client certificate for mTLS (PEM)")
    p.add_argument("--tls-key", default=None, help="client key for mTLS (PEM)")
    p.add_argument("--timeout-s", type=_positive, default=10.0)
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("status", "pools, tiers, occupancy, backend, policy, uptime"),
                        ("tenants", "usage vs fair share vs quota"),
                        ("links", "links: capacity, utilisation, queues by class, bytes by "
                                  "tenant")):
        c = sub.add_parser(name, help=help_)
        c.add_argument("--json", action="store_true")
    c = sub.add_parser("requests", help="the busiest requests")
    c.add_argument("--pool", default="")
    c.add_argument("--limit", type=_count(1), default=20)
    c.add_argument("--json", action="store_true")
    c = sub.add_parser("top", help="a refreshing view of pools, tenants, busiest requests")
    # Each refresh asks kvd for its pools, tenants and busiest requests (a walk of every
    # request): at most ten times a second, or kvctl would take kvd's loop from engines.
    c.add_argument("--interval-s", type=number(float, 0.1), default=1.0)
    c.add_argument("--count", type=_count(1), default=None,
                   help="stop after this many refreshes")
    c = sub.add_parser("explain", help="how long a request stalled on memory, because of whom")
    c.add_argument("request_id")
    c.add_argument("--json", action="store_true")
    c = sub.add_parser(
        "set-quota", help="change a tenant's quota (only what you name)",
        description="Change a tenant's quota, only the fields named. The change stands over "
        "the config until --reset, a reload (SIGHUP) included.")
    c.add_argument("tenant")
    c.add_argument("--pool", default="", help="default: every pool")
    c.add_argument("--weight", type=_finite)
    c.add_argument("--guaranteed", type=_quota_size,
                   help="pages, or a size: 4096, 8GiB (rounded up to whole pages)")
    c.add_argument("--limit", type=_quota_size, help="pages or a size; 0 for none")
    c.add_argument("--max-request-pages", type=_count(0))
    c.add_argument("--max-request-fraction", type=_finite)
    c.add_argument("--bandwidth-cap", type=_rate, dest="bandwidth_cap_bytes_per_s",
                   help="over each link: bytes/s or e.g. 8GiB/s; 0 for none")
    c.add_argument("--request-bandwidth-cap", type=_rate,
                   dest="request_bandwidth_cap_bytes_per_s", help="e.g. 2GiB/s; 0 for none")
    c.add_argument("--read-budget", type=_rate, dest="read_budget_bytes_per_s",
                   help="attention reads a request, e.g. 100GiB/s; 0 for none")
    c.add_argument("--create", action="store_true",
                   help="the tenant is new to kvd (without it, an unknown name is an error)")
    c.add_argument("--reset", action="store_true",
                   help="drop the runtime changes: the config's quota applies again")
    c = sub.add_parser("set-policy", help="switch a pool's eviction policy")
    c.add_argument("policy")
    c.add_argument("--pool", default="")
    c = sub.add_parser("events", help="follow kvd's event stream")
    c.add_argument("--kind", action="append", default=[], dest="kinds")
    c.add_argument("--tenant", action="append", default=[], dest="tenants")
    c.add_argument("--pool", action="append", default=[], dest="pools")
    c.add_argument("--count", type=_count(1), default=None, help="stop after this many events")
    c.add_argument("--json", action="store_true", help="one JSON object per line")
    c = sub.add_parser("cluster", help="nodes, and each tenant's cluster usage vs share vs "
                       "each node's part (kvds sharing quotas through etcd)")
    c.add_argument("--pool", default="")
    c.add_argument("--json", action="store_true")
    c = sub.add_parser("self-check", help="check kvd's bookkeeping now (exit 1 if broken)")
    c.add_argument("--json", action="store_true")
    sub.add_parser("drain", help="stop kvd gracefully (NOT_SERVING, finish in-flight calls)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.json = getattr(args, "json", False) or args.json_all
    if args.token_file:
        try:
            args.token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            print(f"kvctl: cannot read --token-file {args.token_file}: {exc}", file=sys.stderr)
            return 2
    console = Console()
    out = Shown(width=max(console.width, 160))
    try:
        tls = (Tls(args.tls_ca, args.tls_cert, args.tls_key)
               if args.tls_ca or args.tls_cert else None)
        client = Client(args.target, token=args.token, timeout_s=args.timeout_s,
                        lease="", tls=tls)
    except ValueError as exc:  # a TLS file or socket path no channel can be made with
        print(f"kvctl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with client:
            return _run(args, client, out)
    except DrainingError:
        print(f"kvctl: kvd at {args.target or default_target()} is draining (stopping)",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    except UnavailableError as exc:
        print(f"kvctl: cannot reach kvd at {args.target or default_target()}: {exc.details}",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    except KvdClientError as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:  # how `top` and `events` are stopped: no traceback
        return EXIT_INTERRUPTED


def _show(args, out: Console, reply, table) -> None:
    """A reply (a message, or a list of them) as JSON with --json, else as its table."""
    if args.json:
        data = [_json(m) for m in reply] if isinstance(reply, list) else _json(reply)
        print(json.dumps(data, indent=2))
    else:
        out.print(table(reply))


def _run(args, client: Client, out: Console) -> int:
    cmd = args.command
    if cmd == "status":
        _show(args, out, client.pool_stats(), status_table)
    elif cmd == "tenants":
        _show(args, out, client.list_tenants(), tenants_table)
    elif cmd == "links":
        _show(args, out, client.list_links(), links_table)
    elif cmd == "requests":
        _show(args, out, client.list_requests(pool=args.pool, limit=args.limit),
              lambda reqs: requests_table(reqs, "busiest requests (device pages)"))
    elif cmd == "top":
        _top(client, out, args.interval_s, args.count)
    elif cmd == "explain":
        _show(args, out, client.explain(args.request_id), explain_table)
    elif cmd == "set-quota":
        fields = {k: getattr(args, k) for k in (
            "weight", "max_request_pages", "max_request_fraction",
            "bandwidth_cap_bytes_per_s", "request_bandwidth_cap_bytes_per_s",
            "read_budget_bytes_per_s") if getattr(args, k) is not None}
        for quota in ("guaranteed", "limit"):
            if getattr(args, quota) is not None:
                unit, value = getattr(args, quota)
                fields[f"{quota}_{unit}"] = value
        if not fields and not args.reset:
            print("kvctl: name at least one of --weight --guaranteed --limit "
                  "--max-request-pages --max-request-fraction --bandwidth-cap "
                  "--request-bandwidth-cap --read-budget, or --reset", file=sys.stderr)
            return EXIT_USAGE
        tenants = client.set_quota(args.tenant, args.pool, create=args.create,
                                   reset=args.reset, **fields)
        _show(args, out, tenants, tenants_table)
    elif cmd == "cluster":
        view = client.get_cluster(args.pool)
        peer_links = [link for link in client.list_links() if "/" in link.link]
        if args.json:
            print(json.dumps({**_json(view), "peer_links": [_json(link) for link in peer_links]},
                             indent=2))
        else:
            out.print(cluster_tables(view, peer_links))
    elif cmd == "self-check":
        problems = list(client.self_check().problems)
        if args.json:
            print(json.dumps({"problems": problems}, indent=2))
        else:
            out.print("\n".join(problems) if problems else "kvd's bookkeeping is sound")
        return EXIT_REFUSED if problems else 0
    elif cmd == "set-policy":
        previous = client.set_policy(args.policy, args.pool).previous_policy
        out.print(f"policy: {previous} -> {args.policy}")
    elif cmd == "events":
        for pool in args.pools:  # a misspelt pool is an error, not an endless silence
            client.pool_stats(pool)
        # Said on stderr (stdout stays the events alone): from now on nothing is missed.
        stream = client.watch_events(
            pools=args.pools, tenants=args.tenants, kinds=args.kinds,
            on_subscribed=lambda: print(f"kvctl: watching kvd's events at {client.target}",
                                        file=sys.stderr, flush=True))
        for n, event in enumerate(stream, start=1):
            if args.json:
                print(json.dumps(_json(event)), flush=True)
            elif event.kind == "gap":
                out.print(f"-- lost {event.lost} event(s) --", style="red")
            else:
                detail = " ".join(f"{k}={v}" for k, v in sorted(event.detail.items()) if v)
                out.print(f"{event.seq:>8} {time.strftime('%H:%M:%S', time.localtime(event.time_s))}"
                          f" {event.kind:<10} {event.pool:<8} {event.tenant:<10} "
                          f"{event.request_id:<16} {event.count:>6} {detail}")
            if args.count is not None and n >= args.count:
                break
    elif cmd == "drain":
        client.drain()
        out.print("kvd is draining")
    return 0


if __name__ == "__main__":
    sys.exit(main())
