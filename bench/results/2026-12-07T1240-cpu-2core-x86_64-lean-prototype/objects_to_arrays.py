"""What per-request objects as the one source of truth would cost a large step's array passes:
gathering a step's fields from the objects into arrays, and writing the results back.

    .venv-vllm033/bin/python bench/results/<this folder>/objects_to_arrays.py

Against the per-slot arrays this project keeps (one fancy-index gather and one scatter per
field). Thread CPU, best of 7 repeats, microseconds per step.
"""

import time
from itertools import repeat
from operator import attrgetter

import numpy as np


class Request:
    __slots__ = ("slot", "emit", "captured", "scheduled", "pending", "first_block")

    def __init__(self, slot: int) -> None:
        self.slot, self.emit, self.captured, self.scheduled, self.pending, self.first_block = slot, 5, 7, 9, 0, 0


def best(fn, number: int = 200) -> float:
    times = []
    for _ in range(7):
        started = time.thread_time()
        for _ in range(number):
            fn()
        times.append((time.thread_time() - started) / number)
    return min(times) * 1e6


def main() -> None:
    fields = ("emit", "captured", "scheduled", "first_block")  # read by a large step
    written = ("emit", "captured", "scheduled")  # written back
    for n in (64, 256, 1024):
        rng = np.random.default_rng(0)
        slots = rng.permutation(4 * n)[:n]
        requests = [Request(int(slot)) for slot in slots]
        arrays = {field: np.arange(4 * n, dtype=np.int64) for field in fields}
        index = slots.astype(np.int64)
        values = np.arange(n, dtype=np.int64)

        def from_objects():
            gathered = [np.fromiter(map(attrgetter(field), requests), np.int64, n) for field in fields]
            for field in written:
                list(map(setattr, requests, repeat(field), values.tolist()))
            for request in requests:  # pending -= 1 (and += 1 in prepare_output)
                request.pending -= 1
            return gathered

        def from_arrays():
            gathered = [arrays[field][index] for field in fields]
            for field in written:
                arrays[field][index] = values
            arrays["captured"][index] -= 1  # stands for the pending count's update
            return gathered

        objects, slot_arrays = best(from_objects), best(from_arrays)
        print(f"{n:5d} requests: from objects {objects:7.1f} us, from per-slot arrays {slot_arrays:6.1f} us, "
              f"difference {objects - slot_arrays:7.1f} us")


if __name__ == "__main__":
    main()
