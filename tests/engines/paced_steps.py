"""A vLLM logits processor that paces the engine: each sampling step comes at least
`KVD_TEST_STEP_S` seconds after the one before, as a large model's decode steps do (20 to
100 a second), however fast this machine runs the tiny test model. It changes no logit.

run_vllm.py loads it by name (`paced_steps:PacedSteps`) in vLLM's worker, when its spec
asks for `step_s`."""

from __future__ import annotations

import os
import time

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor


class PacedSteps(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.step_s = float(os.environ.get("KVD_TEST_STEP_S", "0"))
        self.last = 0.0

    def is_argmax_invariant(self) -> bool:
        return False  # else greedy sampling would skip it

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        wait = self.last + self.step_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self.last = time.monotonic()
        return logits
