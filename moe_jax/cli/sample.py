"""Generate text from a trained run.

    moe-jax sample runs/tiny                                # latest checkpoint
    moe-jax sample runs/tiny --prompt "def " --max-new-tokens 300 --temperature 0.7
    moe-jax sample runs/tiny --prompt-file prompt.txt --num-samples 4 --top-k 40 --seed 1
    moe-jax sample runs/imported --chat --prompt "Hi!"    # through the chat template
    moe-jax sample runs/tiny sample.weights=int8          # int8 weights
    moe-jax sample runs/mixtral mesh.expert=2 model.dtype=bfloat16   # over 2 devices

(`moe-jax-sample` and `python sample.py` are the same command; `--run RUN` is the same as the
positional RUN.)
Defaults for the sampling flags come from the run's saved config (its `sample` section), with
`section.key=value` overrides of the mesh, the compute dtype and the sample section (as
train.py takes them). A mesh of more than one device restores each weight straight onto its
shard and generates expert/tensor/fsdp-parallel (moe_jax.inference.sampling). One
sample streams to the terminal as it is decoded; several are decoded as one batch in one
compiled program and printed one after the other. The output includes the prompt.

Tokens: a prompt is encoded with the special tokens the run's tokenizer adds to a sequence
(e.g. a BOS first, as transformers' `tokenizer(text)` does); `--chat` renders it as a user
message through the tokenizer's chat template instead, which writes its own special tokens.
A sample ends at the tokenizer's end-of-sequence token, where it has one (Hugging Face and
SentencePiece tokenizers; `--ignore-eos` generates on). Text is decoded from all the tokens
so far, so tokens that are parts of a character or a word print as the whole.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moe_jax.config import SAMPLING_RANGES, sampling_problem
from moe_jax.config.run import WEIGHT_KINDS
from moe_jax.errors import MoeJaxError
from moe_jax.process_setup import import_jax, reexec_with_hugepages
from moe_jax.run.door import HelpFormatter, command

SEPARATOR = "\n" + "-" * 40 + "\n"
# The counting flags' ranges, (argparse dest, test, requirement), checked before jax is imported;
# the sampling values' (temperature, top-k, top-p, seed) are the config's SAMPLING_RANGES.
FLAG_RANGES = (
    ("num_samples", lambda v: v >= 1, "must be >= 1"),
    ("max_new_tokens", lambda v: v >= 1, "must be >= 1"),
)


class FlagError(MoeJaxError, ValueError):
    """A flag's value that no run can use; the message names the flag."""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="moe-jax sample",
        formatter_class=HelpFormatter,
        usage="%(prog)s RUN [section.key=value ...] [flags]",
        description=__doc__.strip().splitlines()[0],
        epilog="Sampling flags left out take the run's config values (sample.*).",
    )
    p.add_argument(
        "--run", help="the run directory (as the positional RUN; a Hugging Face one works too)"
    )
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (default: sample.prompt)")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this UTF-8 file")
    p.add_argument(
        "--num-samples", type=int, help="samples of the prompt, one batch (sample.batch_size)"
    )
    p.add_argument("--max-new-tokens", type=int, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, help="0 = greedy")
    p.add_argument("--top-k", type=int, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, help="nucleus: keep the top mass p; 1 = off")
    p.add_argument("--seed", type=int, help="same seed, same text")
    p.add_argument(
        "--chat",
        action="store_true",
        help="render the prompt as a user message through the tokenizer's chat template",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="do not stop at the tokenizer's end-of-sequence token",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="RUN (a run directory written by train, or a Hugging Face one), then mesh.*, "
        "model.dtype and sample.* overrides of the run's config, e.g. mesh.expert=2 "
        f"sample.weights=int8 (sample.weights: {' | '.join(WEIGHT_KINDS)})",
    )
    args = p.parse_intermixed_args(argv)
    if args.run is None and args.overrides and "=" not in args.overrides[0]:
        args.run = args.overrides.pop(0)
    if args.run is None:
        p.error("no run directory given: moe-jax sample RUN (or --run RUN)")
    return args


def checked_prompt(args: argparse.Namespace) -> str | None:
    """The prompt the flags give (None: the run's sample.prompt), after checking every flag's
    value: all of it before jax is imported and the run loaded, which take seconds."""
    for dest, ok, requirement in FLAG_RANGES:
        value = getattr(args, dest)
        if value is not None and not ok(value):
            raise FlagError(f"--{dest.replace('_', '-')} {requirement}, got {value}")
    given = {n: getattr(args, n) for n, _, _ in SAMPLING_RANGES if getattr(args, n) is not None}
    if problem := sampling_problem(given, "--"):
        raise FlagError(problem)
    if args.prompt_file is None:
        prompt, flag = args.prompt, "--prompt"
    else:
        flag = f"--prompt-file '{args.prompt_file}'"
        try:
            prompt = args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) else "not valid UTF-8"
            raise FlagError(f"cannot read {flag}: {reason}") from None
    if prompt == "":
        raise FlagError(f"{flag} is empty; give at least one character (e.g. a newline)")
    return prompt


def continuation(tokenizer, prompt_ids: list[int], ids: list[int]) -> str:
    """The text `ids` add after the prompt: decoded together with the prompt's tokens, since
    alone a token may decode otherwise (SentencePiece drops the space that starts a text)."""
    head, whole = tokenizer.decode(prompt_ids), tokenizer.decode([*prompt_ids, *ids])
    return whole[len(head) :] if whole.startswith(head) else tokenizer.decode(ids)


class Streamer:
    """Prints the prompt, then one sequence's text as its tokens arrive from the compiled loop.

    A token may end inside a multi-byte character (a byte, a byte-level BPE piece), which
    decodes to U+FFFD until its last byte comes, so trailing U+FFFDs are held back until the
    next token (or the end) settles them.
    """

    def __init__(self, tokenizer, prompt: str, prompt_ids: list[int]):
        self.tokenizer, self.prompt_ids, self.ids = tokenizer, prompt_ids, []
        self.pending, self.shown = prompt, 0  # the prompt goes out with the first token

    def __call__(self, step: int, tokens_B: np.ndarray) -> None:
        if tokens_B[0] >= 0:
            self.ids.append(int(tokens_B[0]))
            self.flush(final=False)

    def flush(self, final: bool = True) -> None:
        text = continuation(self.tokenizer, self.prompt_ids, self.ids)
        end = len(text) if final else len(text.rstrip("\ufffd"))
        sys.stdout.write(self.pending + text[self.shown : end])
        sys.stdout.flush()
        self.pending, self.shown = "", max(end, self.shown)


@command
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from moe_jax.config import Config, sampling_config

    prompt = checked_prompt(args)
    sampling_config(Config(), args.overrides)  # keys and values, before the slow imports
    import_jax()
    return sample(args, prompt)


def sample(args: argparse.Namespace, prompt: str | None) -> int:
    """Load the run and print its samples (the flags are checked)."""
    from moe_jax.inference.load import load_sampler, read_run_meta
    from moe_jax.inference.sampling import SamplingError

    if args.chat:  # a tokenizer without a chat template is refused before the weights load
        saved = read_run_meta(args.run, args.step)["tokenizer"]
        if saved.chat_template is None:
            saved.apply_chat_template([])  # DataError, naming the fix
    cfg, sampler, tokenizer = load_sampler(args.run, args.overrides, args.step)
    s = cfg.sample
    num_samples = args.num_samples if args.num_samples is not None else s.batch_size
    new_tokens = s.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
    prompt = s.prompt if prompt is None else prompt
    if args.chat:  # the template writes the special tokens
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = tokenizer.encode(prompt, add_special_tokens=not args.chat).tolist()
    stop = [] if args.ignore_eos or tokenizer.eos_id is None else [tokenizer.eos_id]
    if len(ids) + new_tokens > cfg.model.max_seq_len:  # as the Sampler would, in flags
        raise SamplingError(
            f"the prompt's {len(ids)} tokens + --max-new-tokens {new_tokens} exceed the "
            f"model's context (model.max_seq_len={cfg.model.max_seq_len}); shorten the "
            "prompt or lower --max-new-tokens"
        )
    streamer = Streamer(tokenizer, prompt, ids) if num_samples == 1 else None
    out = sampler.generate(
        [ids] * num_samples,
        new_tokens,
        temperature=args.temperature if args.temperature is not None else s.temperature,
        top_k=args.top_k if args.top_k is not None else s.top_k,
        top_p=args.top_p if args.top_p is not None else s.top_p,
        seed=args.seed if args.seed is not None else s.seed,
        stop_tokens=stop,
        vocab_size=tokenizer.vocab_size,
        on_token=streamer,
    )
    if streamer is not None:
        streamer.flush()
        print()
    else:
        texts = [prompt + continuation(tokenizer, ids, seq) for seq in out.sequences()]
        print(SEPARATOR.join(texts))
    if hasattr(out, "acceptance_rate"):  # sample.speculative (moe_jax/inference/speculative.py)
        print(speculation_report(out), file=sys.stderr)
    return 0


def speculation_report(out) -> str:
    """One line on a SpeculativeGeneration: the drafts kept, per depth where several draft
    (depth k is checked only after depths 1..k-1 were kept), and the steps taken."""
    percent = lambda kept, checked: f"{100 * kept / checked:.1f}%" if checked else "-"
    kept_K, checked_K = out.accepted_by_depth.sum(0), out.drafted_by_depth.sum(0)
    line = (
        f"speculative decoding: {percent(kept_K.sum(), checked_K.sum())} of "
        f"{int(checked_K.sum())} drafts accepted"
    )
    if len(checked_K) > 1:
        depths = enumerate(zip(kept_K, checked_K, strict=True), start=1)
        per_depth = [f"depth {k}: {percent(a, d)} of {int(d)}" for k, (a, d) in depths]
        line += f" ({', '.join(per_depth)})"
    return line + f", {out.steps} steps for {int(out.lengths.max())} tokens"


def script() -> None:
    """The `moe-jax-sample` console script: huge-page malloc first (a glibc tunable is read
    only when a process starts, moe_jax/process_setup.py), then main."""
    reexec_with_hugepages()
    sys.exit(main())
