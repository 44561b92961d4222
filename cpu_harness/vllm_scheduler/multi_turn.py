"""Multi-turn conversations whose histories leave the GPU KV cache but stay in a CPU-offload tier,
and how much of what the tier offers the scheduler takes with exact rows.

Every turn sends the conversation so far (previous prompt, the model's answer, new user tokens)
as the prompt; some turns are regenerations (the previous turn's exact prompt again, a
whole-prompt hit). Turns run in waves (every conversation's turn t, then turn t + 1), so a
conversation's history is pushed out of the GPU by the others' before its next turn. Prompts are
block-aligned so that a regeneration is a whole-prompt hit where the connector offers one.

What the KV connector offers (``get_num_new_matched_tokens``) and what the aux-output connector
lets the scheduler load (``cap_external_hit``) are recorded per request, the decision the
scheduler acted on (the last one before the request was admitted); every request's client
rows are checked against the routing oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .connectors import build_our_connector
from .engine import RetainedPins, SimEngine
from .scheduler import make_request, make_scheduler
from .toy_model import BLOCK_SIZE, random_prompt


@dataclass
class HitDecision:
    num_tokens: int
    num_local: int = 0
    offered: int = 0  # external tokens the KV connector offered
    accepted: int = 0  # of them, what the scheduler may load


@dataclass
class TierRun:
    kv_connector: str
    scheduler_connector: str
    num_gpu_blocks: int
    tier_blocks: int
    decisions: dict[str, HitDecision] = field(default_factory=dict)
    requests_checked: int = 0
    rows_checked: int = 0
    cache_stats: dict = field(default_factory=dict)  # the worker's cache at the end (host tier use)

    @property
    def offered_tokens(self) -> int:
        return sum(d.offered for d in self.decisions.values())

    @property
    def accepted_tokens(self) -> int:
        return sum(d.accepted for d in self.decisions.values())

    @property
    def accepted_share(self) -> float:
        return self.accepted_tokens / self.offered_tokens if self.offered_tokens else float("nan")

    def whole_prompt(self) -> tuple[int, int]:
        """Requests offered their whole prompt, and of them, accepted whole."""
        whole = [d for d in self.decisions.values() if d.offered and d.num_local + d.offered == d.num_tokens]
        return len(whole), sum(d.accepted == d.offered for d in whole)


def observe_hits(scheduler, run: TierRun) -> None:
    """Record the KV connector's offers and the aux-output connector's caps, per request."""
    connector, aux = scheduler.connector, scheduler.aux_output_connector
    offer, cap = connector.get_num_new_matched_tokens, aux.cap_external_hit

    def offered(request, num_computed_tokens):
        result = offer(request, num_computed_tokens)
        decision = run.decisions[request.request_id] = HitDecision(request.num_tokens, num_computed_tokens)
        decision.offered = result[0] or 0
        return result

    def capped(request, num_local, num_external):
        accepted = cap(request, num_local, num_external)
        decision = run.decisions[request.request_id]
        decision.num_local, decision.accepted = num_local, accepted
        return accepted

    connector.get_num_new_matched_tokens = offered
    aux.cap_external_hit = capped


def aligned_turn(rng: np.random.Generator, history: list[int], low: int, high: int) -> list[int]:
    """``history`` plus new user tokens, the whole a multiple of the block size."""
    n = int(rng.integers(low, high))
    n += -(len(history) + n) % BLOCK_SIZE
    return history + random_prompt(rng, n)


def run_multi_turn(kv_connector: str, scheduler_connector: str, *, conversations: int = 12, turns: int = 4,
                   num_blocks: int = 64, tier_factor: int = 8, regenerate_every: int = 3, seed: int = 0) -> TierRun:
    """Run the workload on the real scheduler with the real ``kv_connector`` (tier of
    ``tier_factor`` x ``num_blocks`` GPU blocks) and the given scheduler-side aux connector; our
    worker connector returns the rows."""
    tier_blocks = tier_factor * num_blocks
    setup = make_scheduler(
        lookahead=0, num_spec_tokens=0, num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=64,
        max_model_len=1024, kv_tier=(kv_connector, tier_blocks), scheduler_connector=scheduler_connector,
    )
    run = TierRun(kv_connector, scheduler_connector, num_blocks, tier_blocks)
    engine = SimEngine(setup, build_our_connector(setup), seed=seed)
    RetainedPins(engine.runner)
    observe_hits(setup.scheduler, run)
    rng = np.random.default_rng(seed)
    prompts = [aligned_turn(rng, [], 24, 48) for _ in range(conversations)]
    for turn in range(turns):
        wave = [(f"c{c}-t{turn}", prompts[c]) for c in range(conversations)]
        if turn:
            wave += [(f"c{c}-t{turn - 1}-again", previous[c]) for c in range(0, conversations, regenerate_every)]
        for request_id, prompt in wave:
            engine.add(make_request(setup, request_id, prompt, int(rng.integers(4, 12))))
        engine.flush()
        run.requests_checked += engine.check_all_finished() - run.requests_checked
        previous = prompts
        prompts = [aligned_turn(rng, list(engine.requests[f"c{c}-t{turn}"].all_token_ids), 8, 24)
                   for c in range(conversations)]
    run.rows_checked = engine.stats.rows_checked
    run.cache_stats = engine.connector.cache.stats()
    engine.close()
    return run
