from pathlib import Path

# kvd first: it loads gRPC as the daemon does (fork support off), so an in-process kvd's forked
# self-check runs here as in the daemon.
import kvd  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
