"""What a numpy block index would cost a step: a prototype, not the project's code.

The page pool keys its state by block hash (Python dicts of ``bytes``); every pin, unpin,
publish and retain is a few dict operations per hash. This prototype keys the same state by a
dense id from a bucketed table over the hashes' first 8 bytes (full key checked once
per batch), so that a step's operations are array passes: a batch lookup (or insert), then
counts and states updated with ``np.add.at`` / fancy indexing. It models the operations'
dominant work only (no eviction order, no host tier), so its figures are a lower bound for
such a design. Per-step operation counts are the replay's (``pool_hash_ops_*.txt``).

    .venv/bin/python bench/results/<this folder>/block_index_prototype.py    # prints CSV: size, operation, hashes, dicts_us, numpy_us
"""

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from routed_experts_cache.connector.page_pool import PagePool  # noqa: E402

# Per step at the default trace (pool_hash_ops_*.txt): hashes per operation
STEP_OPS = {
    256: {"pin": 112, "unpin": 172, "publish_many": 92, "retain": 68, "release": 2},
    1024: {"pin": 449, "unpin": 704, "publish_many": 369, "retain": 276, "release": 18},
}
CALLS = {"pin": 1, "unpin": 4, "publish_many": 3, "retain": 1, "release": 1}  # calls per step (rounded)
ITEM = 32


class NumpyIndex:
    """Buckets of 8 slots over the first word of each hash (one probe round: a lookup
    compares its bucket's 8 first words at once); ids are dense. Full keys are checked once
    per batch."""

    WAYS = 8

    def __init__(self, buckets_log2: int) -> None:
        self.mask = (1 << buckets_log2) - 1
        self.first_word = np.zeros((1 << buckets_log2, self.WAYS), dtype=np.uint64)
        self.id_at = np.full((1 << buckets_log2, self.WAYS), -1, dtype=np.int64)
        self.fill = np.zeros(1 << buckets_log2, dtype=np.int64)
        self.keys = np.zeros((0, ITEM // 8), dtype=np.uint64)
        self.pins = np.zeros(0, dtype=np.int64)
        self.page = np.zeros(0, dtype=np.int64)

    def lookup(self, packed: bytes) -> np.ndarray:
        words = np.frombuffer(packed, dtype=np.uint64).reshape(-1, ITEM // 8)
        bucket = (words[:, 0] & np.uint64(self.mask)).astype(np.int64)
        match = self.first_word[bucket] == words[:, :1]
        way = match.argmax(1)
        ids = self.id_at[bucket, way]
        if not match[np.arange(len(way)), way].all() or not (self.keys[ids] == words).all():
            raise KeyError("a hash is not in the index (or a first-word collision)")
        return ids

    def insert(self, packed: bytes, pages: np.ndarray) -> np.ndarray:
        """New hashes (distinct, absent); each takes the next free way of its bucket."""
        words = np.frombuffer(packed, dtype=np.uint64).reshape(-1, ITEM // 8)
        bucket = (words[:, 0] & np.uint64(self.mask)).astype(np.int64)
        order = np.argsort(bucket, kind="stable")
        sorted_buckets = bucket[order]
        first = np.searchsorted(sorted_buckets, sorted_buckets)  # rank within the batch's bucket
        way = np.empty(len(words), dtype=np.int64)
        way[order] = self.fill[sorted_buckets] + np.arange(len(words)) - first
        if len(way) and way.max() >= self.WAYS:
            raise OverflowError("a bucket is full (a real design would grow the table)")
        ids = np.arange(len(self.keys), len(self.keys) + len(words))
        self.first_word[bucket, way] = words[:, 0]
        self.id_at[bucket, way] = ids
        np.add.at(self.fill, bucket, 1)
        self.keys = np.concatenate([self.keys, words])
        self.pins = np.concatenate([self.pins, np.ones(len(words), dtype=np.int64)])
        self.page = np.concatenate([self.page, pages])
        return ids

    def add_pins(self, packed: bytes, delta: int) -> np.ndarray:
        ids = self.lookup(packed)
        np.add.at(self.pins, ids, delta)
        return ids[self.pins[ids] == 0]  # those now unpinned (would enter the eviction order)


def main() -> None:
    rng = np.random.default_rng(0)
    num_pages = 31000  # the 1024-request replay's pool
    print("size,operation,hashes_per_step,dicts_us,numpy_us")
    for size, ops in STEP_OPS.items():
        raw = rng.bytes(ITEM * num_pages)
        hashes = [raw[i * ITEM : (i + 1) * ITEM] for i in range(num_pages)]
        pool = PagePool(num_pages + 4096)
        pool.publish_many(hashes, pool.allocate_many(num_pages))
        index = NumpyIndex(15)
        index.insert(raw, np.arange(num_pages))
        for operation, count in ops.items():
            dict_times, numpy_times = [], []
            for _ in range(15):
                per_call = max(1, count // CALLS[operation])
                calls = [rng.choice(num_pages, per_call, replace=False) for _ in range(CALLS[operation])]
                packed = [b"".join(hashes[i] for i in pick) for pick in calls]
                lists = [[hashes[i] for i in pick] for pick in calls]
                fresh = [rng.bytes(ITEM * per_call) for _ in calls]
                fresh_lists = [[data[i * ITEM : (i + 1) * ITEM] for i in range(per_call)] for data in fresh]
                pages = np.arange(per_call)
                if operation == "unpin":  # from one pin to none: the costly case (enters the eviction order)
                    for values in lists:
                        pool.pin(values)
                started = time.thread_time()
                for values, new in zip(lists, fresh_lists):
                    if operation == "pin":
                        pool.pin(values)
                    elif operation == "unpin":
                        pool.unpin(values)
                    elif operation == "publish_many":
                        pool.publish_many(new, list(range(len(new))))
                    elif operation == "retain":
                        pool.retain(values)
                    else:
                        pool.retain(values)
                dict_times.append(time.thread_time() - started)
                started = time.thread_time()
                for data, new in zip(packed, fresh):
                    if operation == "publish_many":
                        index.insert(new, pages)
                    else:
                        index.add_pins(data, -1 if operation in ("unpin", "release") else 1)
                numpy_times.append(time.thread_time() - started)
                # undo, untimed
                for values, new in zip(lists, fresh_lists):
                    if operation in ("pin", "retain", "release"):
                        if operation == "pin":
                            pool.unpin(values)
                        else:
                            pool.release(values)
                    elif operation == "publish_many":
                        for block_hash in new:
                            pool.unpublish(block_hash)
                for data in packed:
                    if operation in ("pin", "retain"):
                        index.add_pins(data, -1)
                    elif operation in ("unpin", "release"):
                        index.add_pins(data, 1)
            print(f"{size},{operation},{count},{statistics.median(dict_times) * 1e6:.0f},{statistics.median(numpy_times) * 1e6:.0f}")


if __name__ == "__main__":
    main()
