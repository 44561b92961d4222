"""Hits from a CPU KV tier taken with exact rows: this project's scheduler-side connector vs
vLLM's built-in, under the installed vLLM's (0.33 or 0.34) real scheduler with its real
``OffloadingConnector`` and ``SimpleCPUOffloadConnector`` scheduler roles.

The workload (``cpu_harness/vllm_scheduler/multi_turn.py``): multi-turn conversations whose
histories leave the GPU KV cache but stay in the tier, with regenerated turns (whole-prompt
hits). Per configuration: the tokens the tier offered, the share the scheduler may load (every
loaded and computed row is checked against the routing oracle), and the whole-prompt hits.

    .venv-vllm033/bin/python bench/bench_kv_tier.py [--tier-factors 2 4 8 16] [--seeds 0 1 2]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_harness.vllm_scheduler import VLLM_VERSION  # noqa: E402  (first: checks the installed vLLM)
from cpu_harness.vllm_scheduler.kv_tiers import TIER_CONNECTORS  # noqa: E402
from cpu_harness.vllm_scheduler.multi_turn import run_multi_turn  # noqa: E402

from bench.common import print_table, save_csv_to  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier-factors", type=int, nargs="+", default=[2, 4, 8, 16],
                        help="CPU tier size as a multiple of the GPU KV cache (64 blocks)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: bench/out/<run>)")
    args = parser.parse_args()
    rows = []
    for kv_connector in TIER_CONNECTORS:
        for factor in args.tier_factors:
            for scheduler_connector in ("ours", "vllm"):
                runs = [run_multi_turn(kv_connector, scheduler_connector, tier_factor=factor, seed=seed)
                        for seed in args.seeds]
                offered = sum(run.offered_tokens for run in runs)
                accepted = sum(run.accepted_tokens for run in runs)
                whole = [run.whole_prompt() for run in runs]
                rows.append({
                    "vllm": VLLM_VERSION, "kv_connector": kv_connector, "tier_x_gpu_kv": factor,
                    "scheduler_side": "routed-experts-cache" if scheduler_connector == "ours" else "vLLM built-in",
                    "retained_blocks": runs[0].num_gpu_blocks + (runs[0].tier_blocks if scheduler_connector == "ours"
                                                                 else runs[0].num_gpu_blocks),
                    "requests": sum(run.requests_checked for run in runs),
                    "rows_checked": sum(run.rows_checked for run in runs),
                    "offered_tokens": offered, "accepted_tokens": accepted,
                    "accepted_share": round(accepted / offered, 3) if offered else float("nan"),
                    "whole_prompt_offered": sum(w[0] for w in whole), "whole_prompt_accepted": sum(w[1] for w in whole),
                })
    print_table(rows, ["kv_connector", "tier_x_gpu_kv", "scheduler_side", "retained_blocks", "offered_tokens",
                       "accepted_share", "whole_prompt_offered", "whole_prompt_accepted", "rows_checked"])
    save_csv_to(rows, f"kv_tier_vllm{VLLM_VERSION}.csv", args.out)


if __name__ == "__main__":
    main()
