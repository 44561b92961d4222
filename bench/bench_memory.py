"""Memory per cached token and for a whole KV capacity: this cache (device) vs vLLM (host).

    python bench/bench_memory.py [--kv-tokens 1000000]

Both designs hold the same rows: one block of rows per KV-cache block (vLLM's host store
defaults to exactly that) plus a working set for tails and not-yet-hashed blocks (vLLM's
RoutedExpertsBuffer bound, which this cache reuses). The difference is where they live:
vLLM keeps them in host memory (an mmap arena plus a numpy buffer), this cache in one
device tensor. Serving parameters: block 16, max_num_batched_tokens 8192, max_num_seqs 256,
max_concurrent_batches 2.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import print_table, save_csv  # noqa: E402
from routed_experts_cache.connector.vllm.worker import working_set_pages  # noqa: E402

# (layers captured, top_k, number of experts): vLLM captures every hidden layer's row.
MODELS = {
    "Qwen3-30B-A3B": (48, 8, 128),
    "DeepSeek-V3": (61, 8, 256),
    "Kimi-K2": (61, 8, 384),
}
BLOCK, MAX_BATCHED, MAX_SEQS, MAX_CONCURRENT = 16, 8192, 256, 2


def rows_for(kv_tokens: int) -> list[dict]:
    rows = []
    for model, (layers, top_k, experts) in MODELS.items():
        itemsize = 1 if experts <= 256 else 2
        token_bytes = layers * top_k * itemsize
        kv_blocks = -(-kv_tokens // BLOCK)
        block_bytes = BLOCK * token_bytes
        working = working_set_pages(BLOCK, MAX_BATCHED, MAX_SEQS, MAX_CONCURRENT) * block_bytes
        rows.append({
            "model": model,
            "row": f"{layers}x{top_k} {'uint8' if itemsize == 1 else 'uint16'}",
            "bytes_per_token": token_bytes,
            "kv_tokens": kv_tokens,
            "this_cache_device_MiB": (kv_blocks * block_bytes + working) / 2**20,
            "vllm_host_store_MiB": kv_blocks * block_bytes / 2**20,
            "vllm_host_buffer_MiB": working / 2**20,
            "vllm_host_total_MiB": (kv_blocks * block_bytes + working) / 2**20,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-tokens", type=int, default=1_000_000)
    args = parser.parse_args()
    rows = rows_for(args.kv_tokens)
    print_table(rows, list(rows[0]))
    save_csv(rows, "memory.csv", torch.device("cpu"))


if __name__ == "__main__":
    main()
