"""Reward functions the GRPO tests name in rl.rewards (TRL's calling convention)."""


def exact(prompts, completions, answer, **_):
    """1 where the completion is the record's answer (its leading spaces aside)."""
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def digits(prompts, completions, **_):
    """The fraction of a completion's characters that are digits (a dense signal)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def too_few(prompts, completions, **_):
    return [0.0]
