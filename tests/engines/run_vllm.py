"""One vLLM engine run against kvd, in a process of its own (as a fresh engine is): the tiny
random-weight Llama beside this file (its weights made on first use, see `ensure_weights`),
kvd's connector, token-id prompts.

    python run_vllm.py KVD_TARGET SPEC_JSON

SPEC: {"batches": [{"prompts": [[token ids], ...], "params": [kv_transfer_params or null,
...], "abort": [indices of prompts aborted once the engine has stepped] (optional),
"max_tokens": each output's length, past any end of sequence (optional: 8, or less)}, ...],
"pause": false, "kv_events": [endpoint, replay endpoint] (optional: vLLM
publishes its KV cache events there), "tenants": the connector's kvd_tenants (optional),
"step_s": the least time between the engine's steps (optional: see paced_steps.py),
"gpu_blocks": the blocks of vLLM's own cache (optional: what its memory holds),
"save_output": the connector's kvd_save_output (optional: false), "chunk": the most
tokens a step computes, vLLM's max_num_batched_tokens (optional: a prompt in one step)}. The
batches run one after the other in the same engine; after each it prints one line,
`KVD_RESULT {json}`: each prompt's output tokens and cached tokens, the seconds the engine
took to start and the batch to run, and the preemptions vLLM's scheduler made so far (its
`vllm:num_preemptions` counter). With "pause", it then waits for a line on stdin before
the next batch (the test changes kvd meanwhile).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

MODEL = Path(__file__).resolve().parent / "tiny_llama"
BLOCK_SIZE = 32  # the CPU backend's block size must be a multiple of 32
# vLLM's dummy weights (load_format="dummy", uniform in +-1e-3) leave the model's attention all
# but uniform: its tokens hardly depend on what its KV cache holds, and a block loaded into
# the wrong place, or with another block's bytes, changes none of them. Weights at unit scale
# (each layer's output about as large as its input) make every token depend on its context,
# so wrong KV bytes show in the tokens that follow.
WEIGHTS = MODEL / "model.safetensors"  # made from a seed on first use; not committed
SEED = 0


def weights_made_for() -> dict[str, str]:
    """What the weights are made from: the model's config and the seed (kept in the weights
    file's metadata, so a changed config makes them again)."""
    import hashlib

    config = hashlib.sha256((MODEL / "config.json").read_bytes()).hexdigest()
    return {"format": "pt", "config_sha256": config, "seed": str(SEED)}


def ensure_weights() -> None:
    """The test model's weights, the same on every machine (a seeded generator on the CPU),
    made again when the config or the seed changed; written under another name and renamed,
    as engines may start together."""
    from safetensors import safe_open

    made_for = weights_made_for()
    if WEIGHTS.exists():
        with safe_open(str(WEIGHTS), "pt") as f:
            if f.metadata() == made_for:
                return
    import tempfile

    import torch
    from safetensors.torch import save_file

    c = json.loads((MODEL / "config.json").read_text())
    hidden, inner, heads, kv_heads, head_dim, vocab = (
        c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
        c["num_key_value_heads"], c["head_dim"], c["vocab_size"])
    rng = torch.Generator().manual_seed(SEED)

    def linear(out: int, into: int) -> torch.Tensor:
        return (torch.randn(out, into, generator=rng) / into ** 0.5).to(torch.bfloat16)

    def ones() -> torch.Tensor:
        return torch.ones(hidden, dtype=torch.bfloat16)

    weights = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=rng)
               .to(torch.bfloat16),
               "model.norm.weight": ones(), "lm_head.weight": linear(vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        weights |= {
            layer + "self_attn.q_proj.weight": linear(heads * head_dim, hidden),
            layer + "self_attn.k_proj.weight": linear(kv_heads * head_dim, hidden),
            layer + "self_attn.v_proj.weight": linear(kv_heads * head_dim, hidden),
            layer + "self_attn.o_proj.weight": linear(hidden, heads * head_dim),
            layer + "mlp.gate_proj.weight": linear(inner, hidden),
            layer + "mlp.up_proj.weight": linear(inner, hidden),
            layer + "mlp.down_proj.weight": linear(hidden, inner),
            layer + "input_layernorm.weight": ones(),
            layer + "post_attention_layernorm.weight": ones()}
    fd, part = tempfile.mkstemp(dir=MODEL, suffix=".part")
    os.close(fd)
    try:
        save_file(weights, part, metadata=made_for)
        os.replace(part, WEIGHTS)
    finally:
        Path(part).unlink(missing_ok=True)


def main() -> None:
    target, spec = sys.argv[1], json.loads(sys.argv[2])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    started = time.monotonic()
    ensure_weights()
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    paced = []
    if spec.get("step_s"):  # vLLM's worker imports the pacing processor from beside this file
        os.environ["KVD_TEST_STEP_S"] = str(spec["step_s"])
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(MODEL.parent), os.environ.get("PYTHONPATH")]))
        paced = ["paced_steps:PacedSteps"]
    events = spec.get("kv_events")
    kv_events = (KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                endpoint=events[0], replay_endpoint=events[1])
                 if events else None)
    llm = LLM(model=str(MODEL), kv_events_config=kv_events, load_format="safetensors",
              skip_tokenizer_init=True,
              dtype="bfloat16", block_size=BLOCK_SIZE, enable_prefix_caching=True,
              enforce_eager=True, max_model_len=spec.get("max_model_len", 1024),
              gpu_memory_utilization=0.3, seed=0, logits_processors=paced or None,
              disable_log_stats=False,  # for its preemptions counter
              num_gpu_blocks_override=spec.get("gpu_blocks"),
              # vLLM refuses a step budget below its most sequences a step (256).
              **({"max_num_batched_tokens": spec["chunk"], "max_num_seqs": spec["chunk"]}
                 if spec.get("chunk") else {}),
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KvdConnector", kv_role="kv_both",
                  kv_connector_module_path="kvd_client.vllm_connector",
                  kv_connector_extra_config={"kvd_target": target, "kvd_tenant": "engine",
                                             "kvd_tenants": spec.get("tenants", []),
                                             "kvd_save_output": spec.get("save_output",
                                                                         False)}))
    start_s = time.monotonic() - started
    batches = spec["batches"]
    for i, batch in enumerate(batches):
        prompts = batch["prompts"]
        params = batch.get("params") or [None] * len(prompts)
        ran = time.monotonic()
        # One SamplingParams per prompt: kv_transfer_params (the tenant) is per request.
        sampling = [SamplingParams(max_tokens=batch.get("max_tokens", 8), temperature=0,
                                   ignore_eos="max_tokens" in batch,
                                   extra_args={"kv_transfer_params": p} if p else None)
                    for p in params]
        if batch.get("abort"):
            outputs = _run_aborting(llm, prompts, sampling, set(batch["abort"]))
        else:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                   sampling, use_tqdm=False)
        print("KVD_RESULT " + json.dumps({
            "tokens": [list(o.outputs[0].token_ids) if o else None for o in outputs],
            "cached": [o.num_cached_tokens if o else None for o in outputs],
            "start_s": start_s, "run_s": time.monotonic() - ran,
            "preemptions": sum(m.value for m in llm.get_metrics()
                               if m.name == "vllm:num_preemptions"),
        }), flush=True)
        if spec.get("pause") and i + 1 < len(batches):
            sys.stdin.readline()


def _run_aborting(llm, prompts, sampling, aborted: set[int]) -> list:
    """The prompts through the engine step by step, as a server drives it; those in `aborted`
    are aborted (a client that went away) once a step has produced output, and have no
    output (None)."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(zip(prompts, sampling)):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt), params)
    finished: dict[str, object] = {}
    stepped = False
    while engine.has_unfinished_requests():
        outputs = engine.step()
        finished.update((o.request_id, o) for o in outputs if o.finished)
        if outputs and not stepped:
            stepped = True
            engine.abort_request([str(i) for i in aborted])
    return [None if i in aborted else finished[str(i)] for i in range(len(prompts))]


if __name__ == "__main__":
    main()
