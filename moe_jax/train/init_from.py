"""A new run that starts from another run's params (`init_from`).

    source = init_source(cfg, resume_step, log)    # the run to start from, read only; or None
    state, source = start_state(source, abstract_state, tx)  # its params on this mesh, new Adam

init_from: the source's latest checkpoint (or `init_step`) is read, never written or locked:
its params are restored straight onto the new run's mesh and shardings (fp32 master
weights), the optimizer state is new, the step 0, the data from its start. The source must
have this config's architecture (every key `run.policy.incompatible_keys` compares; a
`data.tokenizer` that names the same tokenizer files under another path counts as the same),
and its tokenizer becomes the new run's. The architecture is the source's own
(`with_run_architecture`: a fine-tune's config names none), so only a key the user set to
another value is refused. A run directory that has checkpoints of its own
resumes them and ignores init_from, so rerunning the command after a stop goes on.

init_from may name a Hugging Face model directory instead (`train.py init_from=HF_DIR`):
its architecture and tokenizer become the run's (`with_source_architecture`), its run-time
keys (capacity factor, balancing weights, context) what an import of it sets (the family's)
unless the config file or overrides set them, and its
weights stream from the safetensors files onto the mesh, cast to float32 there
(`interop.as_run.hf_params`); no converted copy is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import jax
import optax
from flax import nnx

from moe_jax.config import Config, validate
from moe_jax.inference.load import read_run_meta, restore_params
from moe_jax.interop.as_run import is_hf_dir, with_hf_architecture
from moe_jax.model.int8 import QUANTIZATIONS
from moe_jax.posttrain import lora as lora_params
from moe_jax.run.layout import RunError
from moe_jax.run.policy import ARCHITECTURE_SECTIONS, RESUMABLE_CHANGES, check_compatible
from moe_jax.tokenizer import DataError, Tokenizer, load_tokenizer
from moe_jax.train.state import make_state


@dataclass(frozen=True)
class InitSource:
    run_dir: Path
    step: int
    tokenizer: Tokenizer
    pinned: bool = False  # init_step named the step: no other will do


def with_source_architecture(cfg: Config, given: Collection[str] | None = None) -> Config:
    """`cfg` as a run from `init_from` trains it: where that names a Hugging Face directory,
    with that checkpoint's architecture (config.json's) and its tokenizer files as
    `data.tokenizer` where it has them, its run-time keys (capacity factor, balancing,
    context...) what an import of it gives: the family's, but those the user set (`given`,
    dotted keys: `config.cli_given_keys`; None: all of cfg's); where it names a run, with
    that run's (`with_run_architecture`); else `cfg` itself."""
    if cfg.init_from is None:
        return cfg
    if is_hf_dir(cfg.init_from):
        return with_hf_architecture(cfg.init_from, cfg, mtp=cfg.model.mtp_depth > 0, given=given)
    # The source's; else, where run_dir resumes its own checkpoints (init_from ignored), the
    # run's, which it took from the source (that may be gone since); else init_source names
    # what is wrong with the source.
    for run, step in ((cfg.init_from, cfg.init_step), (cfg.run_dir, None)):
        try:
            saved = read_run_meta(run, step)["config"]
        except RunError:
            continue
        return with_run_architecture(saved, cfg, given)
    return cfg


def with_run_architecture(saved: Config, cfg: Config, given: Collection[str] | None) -> Config:
    """`cfg` with the architecture (model, attention, moe) and data.tokenizer of a source
    run's `saved` config, as `init_from=HF_DIR` takes a checkpoint's: a fine-tune names the
    source, not its shape. A key the user set (`given`, dotted) stays `cfg`'s: a run-time one
    (`RESUMABLE_CHANGES`: capacity factor, remat, dtype...) applies, another one is refused
    by name when the source is checked (`init_source`). `given` None: all of cfg's run-time
    keys, none of its architecture."""
    keys = set(RESUMABLE_CHANGES) if given is None else set(given)
    mine = lambda key: any(k == key or k.startswith(key + ".") for k in keys)
    sections = {}
    for section in ARCHITECTURE_SECTIONS:
        own = getattr(cfg, section)
        kept = {f.name: getattr(own, f.name) for f in dataclasses.fields(own)
                if mine(f"{section}.{f.name}")}  # fmt: skip
        sections[section] = dataclasses.replace(getattr(saved, section), **kept)
    if not mine("data.tokenizer"):
        sections["data"] = dataclasses.replace(cfg.data, tokenizer=saved.data.tokenizer)
    out = dataclasses.replace(cfg, **sections)
    validate(out)  # e.g. train.seq_len against the source's model.max_seq_len
    return out


def _same_tokenizer(spec: str, tokenizer: Tokenizer) -> bool:
    """Whether the path `spec` holds the same tokenizer files as `tokenizer`."""
    if spec in ("byte", "char"):
        return False
    try:
        return load_tokenizer(spec).to_dict() == tokenizer.to_dict()
    except DataError:
        return False


def init_source(
    cfg: Config, resume_step: int | None, log: Callable[[str], None]
) -> InitSource | None:
    """The run `cfg.init_from` names, checked (read only): None without init_from, or when
    run_dir resumes its own checkpoint `resume_step`. RunError (nothing written) for a
    source that is run_dir itself, missing, without checkpoints (or `init_step`), int8, or of
    another architecture."""
    if cfg.init_from is None:
        return None
    source = Path(cfg.init_from)
    if source.resolve() == Path(cfg.run_dir).resolve():
        raise RunError(
            f"init_from '{source}' is run_dir itself; the run to start from is only read: "
            "choose a new run_dir"
        )
    if resume_step is not None:
        log(
            f"init_from ignored: run_dir '{cfg.run_dir}' has checkpoints of its own, resuming "
            f"step {resume_step}"
        )
        return None
    try:
        meta = read_run_meta(source, cfg.init_step)
    except RunError as e:
        raise RunError(f"init_from: {e}") from None
    tokenizer = meta["tokenizer"]
    # a data.tokenizer naming the same tokenizer files under another path is the same
    same = lambda d: (
        d.startswith("data.tokenizer:") and _same_tokenizer(cfg.data.tokenizer, tokenizer)
    )
    check_compatible(meta, cfg, "start", source, same)
    return InitSource(source, meta["step"], tokenizer, pinned=cfg.init_step is not None)


def start_state(
    source: InitSource, abstract_state: dict, tx: optax.GradientTransformation, cfg=None
):
    """-> (the train state of a new run from `source`: its params restored onto the
    shardings of `abstract_state` (`init_state(cfg, tx, abstract=True, mesh=mesh)`), a new
    optimizer state laid out like its abstract one, step 0; `source` with the step read: the
    newest instead, unless pinned, if training there removed the one checked meanwhile).
    With LoRA (`cfg.lora.rank`), the source is the frozen base, restored in
    lora.base_dtype (int8 or mxfp4: read in bfloat16, then quantised weight by weight), and
    the adapters are new (`posttrain.lora.fresh_adapters`, from cfg.seed)
    or, with lora.init_adapter, a PEFT adapter's (`interop.peft.adapters_from_peft`)."""
    target, adapters = abstract_state["params"], None
    if lora_params.has_adapters(target):
        adapters, target = nnx.split_state(target, lora_params.is_adapter, ...)
    # an int8 / mxfp4 base: the source's float weights read in bfloat16, then quantised
    quantized = adapters is not None and cfg.lora.base_dtype in QUANTIZATIONS
    read_into = lora_params.float_target(target) if quantized else target
    params, step = restore_params(
        source.run_dir, source.step, read_into, or_newest=not source.pinned
    )
    if quantized:
        params = lora_params.quantize_restored(params, target)
    if adapters is not None:
        params = lora_params.start_adapters(params, adapters, cfg)
    opt_sharding = jax.tree.map(lambda a: a.sharding, abstract_state["opt_state"])
    opt_state = jax.jit(tx.init, out_shardings=opt_sharding)(params)
    state = make_state(0, params, opt_state, abstract_state["step"].sharding)
    return state, dataclasses.replace(source, step=step)
