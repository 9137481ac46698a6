"""Who is calling: a bearer token in the call's metadata names a tenant or the admin; a
unix-socket caller without one acts as the configured unix tenant; TCP needs a token."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from kvd.config import Config
from kvd.core.errors import InvalidArgument, KvdError, PermissionDenied, Unauthenticated
from kvd.core.prefix import check_namespace
from kvd.leases import LEASE_METADATA


# Why a tenant's Admit without a lease is refused on the unix socket (see identify).
UNLEASED = ("name a lease in the call's kvd-lease metadata (the client library sends one "
            "per client): kvd cannot tell unix-socket connections apart, so a request "
            "admitted without one could never be released if its client went away")


def namespace(tenant: str) -> str:
    """The prefix of a tenant's request ids inside kvd (see Caller.ns)."""
    return f"{tenant}/"


def unprefixed(text: str, ns: str) -> str:
    """kvd's text as a caller whose ids are kept under `ns` names them: without the
    namespace (ids are quoted, 'alpha/r1', in kvd's messages)."""
    return text.replace("'" + ns, "'") if ns else text


def lease_holder(lease: str) -> str:
    """The holder of what a client's unary calls under this lease are handed."""
    return f"lease:{lease}"


@dataclass(slots=True)
class Caller:  # not frozen: made on every call, and a frozen dataclass is 3x slower to make
    tenant: str  # "" for the admin identity, which acts for no tenant in particular
    admin: bool
    lease: str = ""  # the client's lease id (kvd-lease metadata), "" for none

    def may_touch(self, tenant: str) -> bool:
        return self.admin or self.tenant == tenant

    @property
    def holder(self) -> str:
        """Who holds the pages this caller's unary calls hand out: its lease, else its
        tenant. Its next call ends the hold."""
        return lease_holder(self.lease) if self.lease else f"tenant:{self.tenant}"

    @property
    def ns(self) -> str:
        """The prefix of this caller's request ids inside kvd: each tenant names its requests
        in a namespace of its own (so whether another tenant uses an id is not its to learn,
        and two tenants may use the same id); the admin names them whole, `<tenant>/<id>`."""
        return "" if self.admin else namespace(self.tenant)

    @property
    def scope(self) -> str | None:
        """The tenant whose requests this caller may touch; None: any (admin)."""
        return None if self.admin else self.tenant


class Authenticator:
    def __init__(self, config: Config, leases=None) -> None:
        self.leases = leases
        self.generation = 0
        self.configure(config)

    def configure(self, config: Config) -> None:
        """(Re)load identities; called at start and on SIGHUP. Long-lived streams compare
        `generation` at each message and identify their caller again when it changed, so
        a revoked token stops working on streams opened before too."""
        self.generation += 1
        self._tokens = {t.token: t.name for t in config.tenants if t.token}
        self._admin_token = config.auth.admin_token
        self._unix_tenant = config.auth.unix_tenant
        self._unix_admin = config.auth.unix_admin
        self._plaintext_tokens_ok = bool(config.tls_cert) or config.allow_plaintext_tokens
        self._private_prefixes = frozenset(t.name for t in config.tenants
                                           if not t.share_prefixes)

    def identify(self, context) -> Caller:
        token = lease = ""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                scheme, _, token = value.partition(" ")
                if scheme.lower() != "bearer" or not token:
                    raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
            elif key == LEASE_METADATA:
                lease = value[:128]
        peer = context.peer() or ""
        tenant, admin = self._who(token, peer)
        if not lease and not admin and not peer.startswith("unix:"):
            # No lease named: the connection is the lease (over TCP its address and port),
            # so what a client that never says who it is admits is still released when it
            # goes quiet. gRPC names every unix-socket connection alike ("unix:"): one such
            # lease would be every lease-less client's, and a dead client's requests would
            # live on while any other called. There the caller has none, and Admit asks for
            # one (UNLEASED).
            lease = f"peer:{peer or '?'}"
        if lease:
            # A lease belongs to its tenant: another tenant naming the same id gets a lease
            # of its own, and cannot keep this one's requests alive.
            lease = f"{'admin' if admin else tenant}/{lease}"
        if lease and self.leases is not None:
            self.leases.renew(lease)
        return Caller(tenant, admin, lease)

    def private_prefixes(self, tenant: str) -> bool:
        """Whether the tenant keeps its prefix blocks apart (`share_prefixes = false`)."""
        return tenant in self._private_prefixes

    def prefix_namespace(self, caller: Caller, namespace: str) -> str:
        """The namespace in kvd of the prefix blocks a caller names in `namespace`.

        Prefix blocks are shared by name: a tenant reads the bytes another stored under the
        same name, and two engines storing one name at once both write its page. A tenant
        with `share_prefixes = false` stores and looks up its blocks in a space of its own
        (`NUL tenant /` before its namespace, which no tenant may name itself): it reads no
        other tenant's bytes, and no other tenant reads or writes its. The admin names
        namespaces whole, as they are kept (a peer's handoff carries a tenant's private
        blocks so)."""
        if caller.admin:
            return namespace
        check_namespace(namespace)
        if "\0" in namespace:
            raise InvalidArgument("a namespace may not hold a NUL character")
        if caller.tenant in self._private_prefixes:
            return f"\0{caller.tenant}/{namespace}"
        return namespace

    def stream_owner(self, context) -> str | None:
        """The tenant whose open streams a new stream counts among (max_streams_per_tenant):
        None for the admin token's, which are not counted (a unix caller that may call
        admin calls counts as its unix_tenant); "" for callers kvd cannot identify
        (grpc's health watches ask for no identity; kvd's own streams refuse them)."""
        try:
            caller = self.identify(context)
        except KvdError:
            return ""
        return caller.tenant if caller.tenant or not caller.admin else None

    def refusal(self, context) -> KvdError | None:
        """Why kvd cannot identify this caller (a token it does not know, say), or None when
        it can: what a stream refused before its handler runs should say first."""
        try:
            self.identify(context)
        except KvdError as exc:
            return exc
        return None

    def _who(self, token: str, peer: str) -> tuple[str, bool]:
        """(tenant, admin?) of the caller, calling from `peer` (its address)."""
        if token:
            if not self._plaintext_tokens_ok and not peer.startswith("unix:"):
                raise Unauthenticated(
                    "bearer tokens over plaintext TCP are refused (they would travel in "
                    "clear): kvd needs tls_cert and tls_key, or allow_plaintext_tokens = true")
            if self._admin_token and hmac.compare_digest(token, self._admin_token):
                return "", True
            for known, tenant in self._tokens.items():
                if hmac.compare_digest(token, known):
                    return tenant, False
            raise Unauthenticated("unknown bearer token")
        if peer.startswith("unix:"):
            if self._unix_tenant or self._unix_admin:
                return self._unix_tenant, self._unix_admin
            raise Unauthenticated("this kvd wants a bearer token on the unix socket too")
        raise Unauthenticated("TCP callers must present a bearer token (authorization metadata)")

    @staticmethod
    def require_admin(caller: Caller) -> None:
        if not caller.admin:
            raise PermissionDenied("this call needs the admin identity")
