"""`python -m rollout [checkpoint]`: generate rollouts and print them with logprobs and throughput.

The RL main job (GRPO on the built-in model, the reward rising) is `python3 examples/grpo.py`: it uses the
trainer-side helpers in `integrations/`, which this package never imports.
"""

from __future__ import annotations

import argparse
import logging
import time

from rollout import Engine, SamplingParams
from rollout.models.toy import default_model_dir
from rollout.usage import die, mistake

PROMPTS = ["12+7=", "3*4=", "copy: abc ", "hello ", "99-9=", "2+2=", "the sky ", "count: 1 2 3 "]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m rollout", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("model", nargs="?", help="HF checkpoint folder (default: a built-in tiny random model)")
    ap.add_argument("--generate", action="store_true", help="plain generation (the default)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (default: 4)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="(default: 32)")
    ap.add_argument("--temperature", type=float, default=1.0, help="(default: 1.0)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    args = ap.parse_args(argv)
    wrong = mistake(args.model, args.device)
    if wrong:
        die(ap.prog, wrong)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    engine = Engine(str(args.model or default_model_dir()), device=args.device)
    params = SamplingParams(
        n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens, logprobs=True, seed=0
    )
    t0 = time.perf_counter()
    outs = engine.generate(PROMPTS, params)
    elapsed = time.perf_counter() - t0
    tokens = 0
    for req in outs:
        for c in req.outputs:
            tokens += len(c.token_ids)
            lps = " ".join(f"{lp:.2f}" for lp in c.logprobs[:8])
            print(
                f"{req.prompt!r} [{c.index}] -> {c.text!r} ({c.finish_reason}, {len(c.token_ids)} tok) "
                f"logprobs: {lps}{' ...' if len(c.logprobs) > 8 else ''}"
            )
    print(
        f"{len(outs)} prompts x {args.n} samples, {tokens} tokens in {elapsed:.2f}s: "
        f"{tokens / elapsed:.0f} output tokens/s on {engine.device}"
    )
    print("RL on this engine, the reward rising: python3 examples/grpo.py (or examples/ppo.py)")


if __name__ == "__main__":
    main()
