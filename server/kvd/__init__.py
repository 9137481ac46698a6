"""kvd: a KV-cache memory daemon for LLM serving."""

import os
import sys

__version__ = "0.1.0"

# kvd's periodic self-check walks a forked copy of the daemon (kvd.health.check_apart). gRPC's
# fork support, on unless GRPC_ENABLE_FORK_SUPPORT says otherwise when gRPC is loaded, runs
# gRPC's fork handlers around every fork (3-6 ms a fork, against 1-2 ms without, beside a
# small gRPC server here) and restarts gRPC's threads in the child: a child that should be
# the walk alone runs five more threads, and clients' calls were seen to stall past a 3 s
# deadline while kvd forked every few milliseconds. kvd loads gRPC with it off; the variable
# is put back as it was, so the processes kvd starts see what the user set.
if "grpc" not in sys.modules:
    _asked = os.environ.get("GRPC_ENABLE_FORK_SUPPORT")
    os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
    try:
        import grpc  # noqa: F401
    finally:
        if _asked is None:
            del os.environ["GRPC_ENABLE_FORK_SUPPORT"]
        else:
            os.environ["GRPC_ENABLE_FORK_SUPPORT"] = _asked
    # Whether a child forked from this process holds no gRPC thread: kvd loaded gRPC, or the
    # process that loaded it first had fork support off (as far as its variable tells).
    GRPC_FORKS_BARE = True
else:
    GRPC_FORKS_BARE = os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "").lower() in (
        "0", "false", "no")
