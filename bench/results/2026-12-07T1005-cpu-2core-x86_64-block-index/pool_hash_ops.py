"""Per step of bench_host's replay (this checkout's connector, the installed vLLM): the page
pool's calls, the hashes (or pages) they take, and their thread-CPU time (outermost calls).

    .venv-vllm033/bin/python bench/results/<this folder>/pool_hash_ops.py 1024 [24 96]
"""
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench.bench_host import record_trace, replay
from cpu_harness.vllm_scheduler import build_our_connector
from routed_experts_cache.connector.page_pool import PagePool
n = int(sys.argv[1]); out = sys.argv[2:4]
setup, events, trace = record_trace(n, 120, output_tokens=tuple(map(int, out)) if out else (24, 96))
stats = {}
inside = [0]
for name in ("pin", "unpin", "publish_many", "retain", "release", "allocate_many", "next_pages", "released_by", "publish"):
    m = getattr(PagePool, name)
    def make(m, name):
        @functools.wraps(m)
        def t(self, *a):
            args = [list(x) if not isinstance(x, int) else x for x in a]
            k = len(args[0]) if args and not isinstance(args[0], int) else (args[0] if args else 0)
            outer = inside[0] == 0
            inside[0] += 1
            s = time.thread_time()
            try: return m(self, *args)
            finally:
                inside[0] -= 1
                d = stats.setdefault(name, [0, 0, 0.0]); d[0] += 1; d[1] += k
                if outer: d[2] += time.thread_time() - s
        return t
    setattr(PagePool, name, make(m, name))
r = replay(setup, events, lambda s, c: build_our_connector(s, c))
steps = len(r["per_step"])
tot = 0
for k, (c, h, t) in stats.items():
    print(f"{k:14s} calls {c/steps:6.2f}/step  items {h/steps:8.1f}/step  {t/steps*1e3:.3f} ms/step (outermost)")
    tot += t
print("pool total", round(tot / steps * 1e3, 3), "ms/step")
