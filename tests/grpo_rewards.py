"""Reward functions the GRPO tests name in rl.rewards (TRL's calling convention)."""


def exact(prompts, completions, answer, **_):
    """1 where the completion is the record's answer (its leading spaces aside)."""
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def digits(prompts, completions, **_):
    """The fraction of a completion's characters that are digits (a dense signal)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def too_few(prompts, completions, **_):
    return [0.0]


calls = 0  # exact_or_stop's calls since the test reset it


def exact_or_stop(prompts, completions, answer, **_):
    """`exact`; and SIGTERM to this process on the call numbered $GRPO_SIGTERM_AT_CALL (a
    stop asked for while a step's rollouts are scored, before its updates run)."""
    import os
    import signal

    global calls
    calls += 1
    if str(calls) == os.environ.get("GRPO_SIGTERM_AT_CALL"):
        os.kill(os.getpid(), signal.SIGTERM)
    return exact(prompts, completions, answer)
