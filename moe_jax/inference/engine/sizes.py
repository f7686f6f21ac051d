"""What an engine runs, checked before anything is built: the sizes (the engine's own
constructor and the server's flags, before the model loads, ask the same `size_problem`) and
the model (`model_problem`)."""

# The least value of each size an engine runs with (its keyword): a page size of 0 divides
# by zero, a chunk of 0 never prefills a token, a queue of 0 refuses every request.
SIZE_LEAST = {"max_slots": 1, "page_size": 1, "n_pages": 1, "chunk": 1, "max_queue": 1}


def size_problem(sizes: dict, spell=lambda name: name) -> str | None:
    """The first of `sizes` (an Engine keyword -> its value, None: the default) below its
    least, as a message naming it as `spell(keyword)` does; None if all can run."""
    for name, value in sizes.items():
        if value is not None and value < SIZE_LEAST[name]:
            return f"{spell(name)} must be >= {SIZE_LEAST[name]}, got {value}"
    return None


def model_problem(cfg, speculative: bool = False) -> str | None:
    """Why the engine cannot serve the model of `cfg` (a Config), or None; `speculative`:
    with speculative decoding."""
    if speculative and cfg.attention.linear != "none":  # a state steps forward only
        return (
            "speculative decoding would roll the linear-attention layers' states back past "
            f"rejected drafts, which the engine does not do (attention.linear="
            f"{cfg.attention.linear}: Qwen3-Next, Qwen3.5); serve these models without it"
        )
    if cfg.attention.index_topk > 0:  # the indexer's keys and selections, not pages yet
        return (
            "the engine's paged cache holds keys and values, not DeepSeek sparse attention's "
            f"indexer keys (attention.index_topk={cfg.attention.index_topk}: DeepSeek-V3.2, "
            "GLM-5); sample these models with the Sampler (sample.py) instead"
        )
    return None
