"""Train a Mixture-of-Experts language model.

    moe-jax train                                     # the tiny config on the embedded corpus
    moe-jax train tiny train.steps=100 moe.top_k=1 moe.renormalize=false
    moe-jax train recipes/mixtral_8x7b_v5p128 run_dir=/nfs/runs/mixtral   # a shipped config by name
    moe-jax train finetune/dpo init_from=runs/tiny data.path=pairs.jsonl  # a fine-tune recipe
    moe-jax train my_exp.yaml run_dir=runs/exp1 data.path=shakespeare.txt data.tokenizer=char
    moe-jax train --help-config [SECTION]             # every config key: type, default, meaning

(`moe-jax-train ...` and `python train.py ...` in a clone are the same command.) The first
argument, unless it is a section.key=value override, names the config: a YAML file, or a
config shipped with moe_jax by its name under configs/ (tiny, mixtral_8x7b, recipes/...,
finetune/sft|lora|dpo|grpo, without .yaml); a file wins. A fine-tune's takes init_from's
architecture and trains train.epochs passes over its data.

A run directory that already holds checkpoints is resumed from the latest one, or from an
earlier one with `train.resume_step=N` (e.g. when the latest is damaged; the checkpoints after N
are moved to RUN_DIR/superseded). SIGTERM or Ctrl-C saves a checkpoint after the current step
and stops; run the same command to resume. One run at a time trains in a run directory (a
second one exits with an error naming the first); sampling and the other readers may read it
meanwhile. A full disk stops training with one error line; the last complete checkpoint stays.
Metrics: RUN_DIR/metrics.jsonl and TensorBoard files in RUN_DIR/tb; plots with
`python -m moe_jax.plot RUN_DIR`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from moe_jax.config import ConfigError, cli_config, cli_given_keys
from moe_jax.config.shipped import config_argv, config_path
from moe_jax.process_setup import import_jax, reexec_with_hugepages
from moe_jax.run.door import command

USAGE = (
    "usage: moe-jax train [CONFIG] [section.key=value ...]   (or: python train.py ...)\n"
    "       moe-jax train --help-config [SECTION | --markdown]"
)


def help_config(args: list[str]) -> int:
    """`--help-config [SECTION]`: the config keys as text; `--help-config --markdown`: as
    docs/reference/config.md holds them."""
    from moe_jax.config import reference

    if args == ["--markdown"]:
        print(reference.markdown(), end="")
    elif len(args) <= 1:
        print(reference.text(args[0] if args else None), end="")
    else:
        raise ConfigError("--help-config takes one section at most, e.g. --help-config train")
    return 0


@command
def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + USAGE)
        return 0
    if argv and argv[0] == "--help-config":
        return help_config(argv[1:])
    args = config_argv(argv)
    cfg = cli_config(args, default_path=config_path("tiny"))
    # Only now jax and what imports it (seconds): a bad config has failed before that.
    import_jax()
    from moe_jax.sharding import init_distributed
    from moe_jax.train.loop import train

    init_distributed(cfg)
    # init_from=HF_DIR: the family's capacity and balancing where the user set none
    result = train(cfg, given=cli_given_keys(args))
    if result.stopped_by is not None:
        return 128 + result.stopped_by  # the shell convention for "terminated by a signal"
    return 0


def script() -> None:
    """The `moe-jax-train` console script: huge-page malloc first (a glibc tunable is read
    only when a process starts, moe_jax/process_setup.py), then main."""
    reexec_with_hugepages()
    sys.exit(main())
