"""Reward functions to name in `rl.rewards` (`moe_jax.posttrain.rl.rewards:exact`), called as
TRL calls one: fn(prompts=[str], completions=[str], **columns) -> [float], the columns being
the prompts' other JSONL fields, here "answer".

    exact   1 where the completion, stripped of surrounding whitespace, is the answer
    prefix  1 where the completion, its leading whitespace aside, begins with the answer:
            for a model without an end-of-text token (the byte tokenizer), whose completion
            runs on to rl.max_new_tokens
"""

from __future__ import annotations


def exact(prompts, completions, answer, **_) -> list[float]:
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]


def prefix(prompts, completions, answer, **_) -> list[float]:
    return [
        float(c.lstrip().startswith(a.strip())) for c, a in zip(completions, answer, strict=True)
    ]
