"""Correctness on a GPU: the Triton backend on CUDA against the torch backend on CPU.

    python bench/gpu_check.py        (needs CUDA; exits non-zero on any mismatch)

The same random workload (shared prefixes, chunked captures with gaps in one snapshot, late
hashes, finishes, eviction pressure, single and batched reads) runs on a CUDA cache with
``backend="triton"`` and on a CPU cache with ``backend="torch"``; every read and every stat
must agree. (The kernel itself is checked against its torch twin over dtypes and shapes by
``ROUTED_EXPERTS_TEST_DEVICE=cuda pytest tests/test_kernels.py``, which run_gpu.sh runs first.)
Also checks that the workload compiles no kernel variant beyond those the pool precompiled, and
that ``SideStream`` (the connector's output-thread stream) never reads a step's snapshot
before the model's stream has written it (with a control run without the wait, which does).
"""

import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from routed_experts_cache import RoutedExpertsCache, RoutedExpertsCacheError  # noqa: E402
from routed_experts_cache.connector.vllm.side_stream import SideStream  # noqa: E402


def differential_workload(device, steps: int = 3000) -> int:
    rng = random.Random(0)
    caches = [
        RoutedExpertsCache(64, 16, (48, 8), device=device, backend="triton"),
        RoutedExpertsCache(64, 16, (48, 8), device="cpu", backend="torch"),
    ]
    prefixes = [[rng.randrange(1000) for _ in range(200)] for _ in range(3)]
    live: dict[str, dict] = {}
    reads = 0

    def apply(method, *args):
        outcomes = []
        for cache in caches:
            try:
                outcomes.append(("ok", getattr(cache, method)(*args)))
            except RoutedExpertsCacheError as error:
                outcomes.append(("error", type(error).__name__))
        if outcomes[0][0] != outcomes[1][0]:
            raise SystemExit(f"{method}{args[:1]}: outcomes differ {outcomes[0][0]} vs {outcomes[1][0]}")
        return outcomes

    for step in range(steps):
        action = rng.random()
        if (action < 0.15 and len(live) < 8) or not live:
            name = f"r{step}"
            tokens = rng.choice(prefixes)[: rng.randrange(20, 200)] + [rng.randrange(1000) for _ in range(rng.randrange(40))]
            # Sometimes a prefix hit: the first capture starts after k blocks known by hash.
            hit_blocks = rng.randrange(len(tokens) // 16 + 1) if rng.random() < 0.4 else 0
            live[name] = {"tokens": tokens, "cursor": hit_blocks * 16, "hashed": hit_blocks}
            hashes = [bytes(str(hash(tuple(tokens[: (b + 1) * 16]))), "ascii") for b in range(hit_blocks)]
            apply("add_block_hashes", name, hashes)
        elif action < 0.55:
            batch = rng.sample(sorted(live), min(len(live), rng.randrange(1, 5)))
            snapshot, spans = [], []
            offset = 0
            for name in batch:
                request = live[name]
                count = min(rng.randrange(1, 40), len(request["tokens"]) - request["cursor"])
                if count <= 0:
                    continue
                rows = torch.tensor(
                    [[(hash(tuple(request["tokens"][: p + 1])) >> s) % 128 for s in range(8)] for p in range(request["cursor"], request["cursor"] + count)],
                    dtype=torch.int32,
                ).unsqueeze(1).expand(count, 48, 8)
                gap = rng.randrange(3)  # rejected drafts between spans
                snapshot += [rows, torch.zeros((gap, 48, 8), dtype=torch.int32)]
                spans.append((name, request["cursor"], offset, count))
                offset += count + gap
                request["cursor"] += count
            if spans:
                source = torch.cat(snapshot)
                names, starts, source_starts, counts = (list(column) for column in zip(*spans))
                outcome = apply("capture_batch", source.to(device), names, starts, source_starts, counts)
                if outcome[0][0] == "error":
                    for name, start, _, count in spans:
                        live[name]["cursor"] = start
        elif action < 0.75:
            name = rng.choice(sorted(live))
            request = live[name]
            full = min(len(request["tokens"]) // 16, request["cursor"] // 16 + rng.randrange(2))
            hashes = [bytes(str(hash(tuple(request["tokens"][: (b + 1) * 16]))), "ascii") for b in range(request["hashed"], full)]
            request["hashed"] = max(request["hashed"], full)
            apply("add_block_hashes", name, hashes)
        elif action < 0.92:
            names = rng.sample(sorted(live), min(len(live), rng.randrange(1, 4)))
            starts, ends = [], []
            for name in names:
                ends.append(rng.randrange(0, live[name]["cursor"] + 1))
                starts.append(rng.randrange(0, ends[-1] + 1))
            outcome = apply("read_batch", names, starts, ends)
            if outcome[0][0] == "ok":
                (gpu, gpu_offsets), (cpu, cpu_offsets) = outcome[0][1], outcome[1][1]
                if gpu_offsets.tolist() != cpu_offsets.tolist() or not torch.equal(gpu.cpu(), cpu):
                    raise SystemExit(f"step {step}: read mismatch for {list(zip(names, starts, ends))}")
                reads += 1
        else:
            name = rng.choice(sorted(live))
            apply("finish", name)
            del live[name]
        if caches[0].stats() != caches[1].stats():
            raise SystemExit(f"step {step}: stats differ\n{caches[0].stats()}\n{caches[1].stats()}")
    for cache in caches:
        cache.check_consistency()
    return reads


def side_stream_ordering(device, trials: int = 10) -> tuple[int, int]:
    """The connector's pattern: a snapshot finished late on the model's stream (after a GPU
    spin), captured and read on the side stream. Returns (exact reads through SideStream,
    stale reads of the same pattern without the wait: the hazard it prevents)."""
    side, stale = SideStream(device), 0
    row_shape, n = (48, 8), 40
    for trial in range(2 * trials):
        ordered = trial < trials
        cache = RoutedExpertsCache(8, 16, row_shape, device=device, backend="triton")
        snapshot = torch.zeros((n, *row_shape), dtype=torch.uint8, device=device)
        torch.cuda._sleep(20_000_000)  # ~10 ms of work on the model's stream before the rows exist
        snapshot.fill_(trial + 1)
        ready = side.mark_ready()

        def capture_and_read():
            cache.capture_batch(snapshot, ["r"], [0], [0], [n])
            return cache.read("r", 0, n).cpu()

        if ordered:
            rows = side.run(capture_and_read, snapshot, ready)
            if not bool((rows == trial + 1).all()):
                raise SystemExit(f"side stream read rows before the model's stream wrote them (trial {trial})")
        else:
            with torch.cuda.stream(side.stream):  # no wait: may copy the zeros
                stale += not bool((capture_and_read() == trial + 1).all())
        torch.cuda.synchronize()
    return trials, stale


def decode_setup(backend: str, device, n: int, steps: int):
    """A cache with ``n`` requests past a 64-row prefill, and the arguments of the connector's
    ``capture_step`` for decode step ``step`` (one row per request from the step's snapshot)."""
    cache = RoutedExpertsCache(4 * n * (64 + steps) // 16 + 64, 16, (48, 8), device=device, backend=backend)
    ids = [f"r{i}" for i in range(n)]
    prefill = torch.randint(0, 128, (n * 64, 48, 8), dtype=torch.int32, device=device)
    cache.capture_batch(prefill, ids, [0] * n, list(range(0, 64 * n, 64)), [64] * n)
    slots, rows, ones = cache.slots(ids), np.arange(n, dtype=np.int64), np.ones(n, dtype=np.int64)
    snapshot = torch.randint(0, 128, (n, 48, 8), dtype=torch.int32, device=device).to(cache.dtype)  # narrowed, as vLLM's capturer hands it

    def step_arguments(step: int):
        return snapshot, ids, slots, np.full(n, 64 + step, dtype=np.int64), rows, ones

    return cache, step_arguments


def decode_step_cost(setups, sizes=(16, 256, 1024), steps: int = 200) -> list[dict]:
    """The connector's per-step device calls in steady decode (``capture_step`` of one row per
    request from the step's snapshot, then the snapshot's device-to-host copy-out): host CPU
    time of the calling thread and wall time to completion per step, Triton on this GPU
    against the torch backend on CPU, the same calls. ``setups``: (backend, device) pairs."""
    results = []
    for backend, where in setups:
        for n in sizes:
            cache, step_arguments = decode_setup(backend, where, n, steps)
            cpu_ns, wall_ns = [], []
            for step in range(steps):
                arguments = step_arguments(step)
                if where.type == "cuda":
                    torch.cuda.synchronize()
                wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
                cache.capture_step(*arguments)
                host = arguments[0].to(device="cpu", dtype=cache.dtype, copy=True).numpy()
                cpu_ns.append(time.thread_time_ns() - cpu)
                wall_ns.append(time.perf_counter_ns() - wall)
            tail = cache.read("r0", 64, 64 + steps).cpu()
            if not torch.equal(tail[-1], torch.from_numpy(host[0])):
                raise SystemExit(f"decode steps on {backend}: the last captured row differs from the snapshot")
            results.append({
                "backend": f"{backend}/{where.type}", "requests": n,
                "host_cpu_us": statistics.median(cpu_ns[20:]) / 1e3, "wall_us": statistics.median(wall_ns[20:]) / 1e3,
            })
    return results


def compiled_registers() -> list[str]:
    """Registers and spills of each compiled variant, as the driver loaded them (to set beside
    ``kernel_static.py``'s ahead-of-time figures)."""
    from routed_experts_cache.kernels.segment_copy import _segment_copy_kernel

    figures = []
    for caches in _segment_copy_kernel.device_caches.values():
        for kernel in caches[0].values():
            kernel._init_handles()
            figures.append(f"{kernel.name}: {kernel.n_regs} registers, {kernel.n_spills} spills, "
                           f"{kernel.metadata.num_warps} warps, constants {sorted(kernel.src.constants.items())}")
    return figures


def compiled_variants() -> int:
    """Kernels Triton has compiled in this process (its per-device kernel caches)."""
    from routed_experts_cache.kernels.segment_copy import _segment_copy_kernel

    return sum(len(caches[0]) for caches in _segment_copy_kernel.device_caches.values())


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs CUDA")
    device = torch.device("cuda")
    print(f"GPU check on {torch.cuda.get_device_name(device)}", flush=True)
    before = compiled_variants()
    RoutedExpertsCache(8, 16, (48, 8), device=device, backend="triton")  # precompiles its row width
    precompiled = compiled_variants() - before
    try:
        print("\n".join(compiled_registers()))
    except Exception as error:  # only a report: triton's kernel cache layout differs between releases
        print(f"registers not read: {error!r}")
    reads = differential_workload(device)
    print(f"differential workload triton/cuda vs torch/cpu: {reads} reads equal", flush=True)
    compiled_while_serving = compiled_variants() - before - precompiled
    print(f"kernel variants: {precompiled} precompiled for the pool, {compiled_while_serving} compiled during the workload")
    exact, stale = side_stream_ordering(device)
    print(f"side stream: {exact} late snapshots read exactly; without the wait {stale} of {exact} reads were stale")
    print("connector's device calls per decode step (capture_step + copy-out), medians:")
    for row in decode_step_cost([("triton", device), ("torch", torch.device("cpu"))]):
        print(f"  {row['backend']:12s} {row['requests']:5d} requests: host CPU {row['host_cpu_us']:8.1f} us, wall {row['wall_us']:8.1f} us")
    if compiled_while_serving:
        raise SystemExit("the workload compiled kernel variants that the pool did not precompile")
    print("GPU CHECK PASSED")


if __name__ == "__main__":
    main()
