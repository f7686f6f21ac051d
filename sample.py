"""Generate text from a trained run.

    python sample.py --run runs/tiny                              # latest checkpoint
    python sample.py --run runs/tiny --prompt "def " --max-new-tokens 300 --temperature 0.7
    python sample.py --run runs/tiny --prompt-file prompt.txt --num-samples 4 --top-k 40 --seed 1
    python sample.py --run runs/tiny --quantize int8              # int8 weights (moe_jax.quantize)

Defaults for the sampling flags come from the run's saved config (its `sample` section). One
sample streams to the terminal as it is decoded; several are decoded as one batch in one
compiled program and printed one after the other. The output includes the prompt.
"""

import argparse
import sys
from pathlib import Path

DEFER_JAX_IMPORT = True  # see moe_jax/__init__.py: jax only once the input is checked

from moe_jax.runtime import import_jax, reexec_with_hugepages  # noqa: E402

if __name__ == "__main__":  # first: a glibc tunable is read only when a process starts
    reexec_with_hugepages()

import numpy as np  # noqa: E402

from moe_jax.config import MAX_TEMPERATURE, MIN_TEMPERATURE  # noqa: E402

SEPARATOR = "\n" + "-" * 40 + "\n"
# Each sampling flag's own range: (argparse dest, test, rule), checked before jax is imported.
FLAG_RULES = (
    ("num_samples", lambda v: v >= 1, "must be >= 1"),
    ("max_new_tokens", lambda v: v >= 1, "must be >= 1"),
    (
        "temperature",
        lambda v: v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE,
        f"must be 0 (greedy) or within [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
    ),
    ("top_k", lambda v: v >= 0, "must be >= 0 (0 = off)"),
    ("top_p", lambda v: 0 < v <= 1, "must be within (0, 1] (1 = off)"),
    ("seed", lambda v: 0 <= v < 2**32, "must be within [0, 2^32)"),  # a PRNG key's 32 bits
)


class FlagError(ValueError):
    """A flag's value that no run can use; the message names the flag."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.strip().splitlines()[0],
        epilog="Sampling flags left out take the run's config values (sample.*).",
    )
    p.add_argument("--run", required=True, help="run directory written by train.py")
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
        "--quantize",
        metavar="MODE",
        help="quantise the weights after loading, e.g. int8 (a run written by `python -m "
        "moe_jax.quantize` is int8 already)",
    )
    return p.parse_args(argv)


def checked_prompt(args: argparse.Namespace) -> str | None:
    """The prompt the flags give (None: the run's sample.prompt), after checking every flag's
    value: all of it before jax is imported and the run loaded, which take seconds."""
    for dest, ok, rule in FLAG_RULES:
        value = getattr(args, dest)
        if value is not None and not ok(value):
            raise FlagError(f"--{dest.replace('_', '-')} {rule}, got {value}")
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


class Streamer:
    """Prints the prompt, then one sequence's text as its tokens arrive from the compiled loop.

    A byte token may end inside a multi-byte character, which decodes to U+FFFD until its last
    byte comes, so a trailing U+FFFD is held back until the next token (or the end) settles it.
    """

    def __init__(self, tokenizer, prompt: str):
        self.tokenizer, self.ids = tokenizer, []
        self.pending, self.shown = prompt, 0  # the prompt goes out with the first token

    def __call__(self, step: int, tokens_B: np.ndarray) -> None:
        if tokens_B[0] >= 0:
            self.ids.append(int(tokens_B[0]))
            self.flush(final=False)

    def flush(self, final: bool = True) -> None:
        text = self.tokenizer.decode(self.ids)
        end = len(text) if final or not text.endswith("\ufffd") else len(text) - 1
        sys.stdout.write(self.pending + text[self.shown : end])
        sys.stdout.flush()
        self.pending, self.shown = "", max(end, self.shown)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        prompt = checked_prompt(args)
    except FlagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import_jax()
    return sample(args, prompt)


def sample(args: argparse.Namespace, prompt: str | None) -> int:
    """Load the run and print its samples (the flags are checked)."""
    from moe_jax.checkpoint import RunError, load_run
    from moe_jax.data import DataError
    from moe_jax.quantize import QuantizeError, check_quantization, quantize_model
    from moe_jax.sampling import Sampler, SamplingError

    try:
        if args.quantize is not None:
            check_quantization(args.quantize)  # before the (slow) load
        cfg, model, tokenizer = load_run(args.run, args.step)
        if args.quantize is not None:
            model = quantize_model(model, args.quantize)
        s = cfg.sample
        num_samples = args.num_samples if args.num_samples is not None else s.batch_size
        new_tokens = s.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
        prompt = s.prompt if prompt is None else prompt
        ids = tokenizer.encode(prompt).tolist()
        if len(ids) + new_tokens > cfg.model.max_seq_len:  # as the Sampler would, in flags
            raise SamplingError(
                f"the prompt's {len(ids)} tokens + --max-new-tokens {new_tokens} exceed the "
                f"model's context (model.max_seq_len={cfg.model.max_seq_len}); shorten the "
                "prompt or lower --max-new-tokens"
            )
        sampler = Sampler(model)
        streamer = Streamer(tokenizer, prompt) if num_samples == 1 else None
        out = sampler.generate(
            [ids] * num_samples,
            new_tokens,
            temperature=args.temperature if args.temperature is not None else s.temperature,
            top_k=args.top_k if args.top_k is not None else s.top_k,
            top_p=args.top_p if args.top_p is not None else s.top_p,
            seed=args.seed if args.seed is not None else s.seed,
            vocab_size=tokenizer.vocab_size,
            on_token=streamer,
        )
    except (RunError, DataError, SamplingError, QuantizeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if streamer is not None:
        streamer.flush()
        print()
    else:
        texts = [prompt + tokenizer.decode(seq) for seq in out.sequences()]
        print(SEPARATOR.join(texts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
