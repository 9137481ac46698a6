"""The engine tier's processes put their IPC sockets in a directory of this test run's own,
removed when it ends: vLLM names an endpoint per engine under VLLM_RPC_BASE_PATH (the system
temporary directory by default) and leaves it there when its engine is stopped, about 200 a
run of this tier."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

_RPC = tempfile.mkdtemp(prefix="kvd-vllm-rpc-")
os.environ.setdefault("VLLM_RPC_BASE_PATH", _RPC)
atexit.register(shutil.rmtree, _RPC, ignore_errors=True)
