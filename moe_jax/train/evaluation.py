"""The trainer's validation at eval steps, by objective, and the line that closes a run.

    val = Validation(cfg, graphdef, data, on_mesh, rollouts)
    record, line = val.run(state, step)      # {"kind": "eval", "step", "val_loss", ...}
    print(closing_line(cfg, step, record))

Every objective reports the language-model loss of its validation rows ("val_loss",
"val_ppl": the held-out text, SFT's completions, DPO's answers, GRPO's prompts as a drift
check), and each judges itself by its own held-out metrics besides:
- lm: the loss against the validation unigram entropy, the loss of a model that ignores
  context (a pretraining baseline; meaningless for the others, so shown for lm only);
- dpo: the validation pairs as training reads them (`posttrain.dpo.eval_sums`, against the
  same reference): "val_dpo_loss", "val_reward_accuracy", "val_reward_margin" (means over
  the pairs) and "val_ce_chosen", the chosen answers' cross-entropy, which must not climb:
  DPO can widen a margin by making both answers unlikely;
- grpo: "val_reward_mean", the mean reward of rl.group_size completions of each validation
  prompt, drawn as a step's rollouts are (the same program, a fixed seed).
A fine-tune started from another run is evaluated at step 0 too, so its first record is the
source's own figures (loop.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np

from moe_jax.posttrain.reference_policy import reference_params
from moe_jax.run import programs
from moe_jax.run.layout import CHECKPOINT_DIR
from moe_jax.train.step import make_eval_step

# The held-out metric each objective is judged by: the closing line's figure.
HEADLINE = {"lm": "val_loss", "dpo": "val_reward_accuracy", "grpo": "val_reward_mean"}


class Validation:
    def __init__(self, cfg, graphdef, data, on_mesh, rollouts=None):
        pi, pc = jax.process_index(), jax.process_count()
        self.cfg, self.objective = cfg, cfg.train.objective
        self.unigram = data.val_unigram_entropy
        self.val = [on_mesh(b) for b in data.eval_batches(cfg, pi, pc)]
        # Sums and counts: packed batches count different numbers of targets, so the
        # validation loss is their total over the total count, not a mean of batch means.
        build = lambda: make_eval_step(graphdef, True)  # sums=True
        self.eval_step = programs.kept("eval_step", cfg, build)
        self.pairs, self.rollouts = [], rollouts
        if self.objective == "dpo":
            from moe_jax.posttrain import dpo

            self.pairs = [on_mesh(b) for b in data.eval_pairs(cfg, pi, pc)]
            self.pair_step = jax.jit(
                lambda params, batch, ref: dpo.eval_sums(params, graphdef, batch, ref)
            )

    def run(self, state, step: int) -> tuple[dict, str]:
        """This step's eval record and its console line."""
        params = state["params"]
        ce_sum, count = np.sum(
            jax.device_get([self.eval_step(params, b) for b in self.val]), 0, np.float64
        )
        loss = float(ce_sum / max(count, 1.0))
        record = {"kind": "eval", "step": step, "val_loss": loss, "val_ppl": math.exp(loss)}
        line = f"eval step {step}: val loss {loss:.4f}, ppl {math.exp(loss):.2f}"
        if self.objective == "lm":
            return record, line + f" (unigram baseline {self.unigram:.4f})"
        if self.objective == "dpo":
            record |= self._pairs(state)
            return record, (
                f"eval step {step}: held-out pairs: dpo loss {record['val_dpo_loss']:.4f}, "
                f"reward accuracy {record['val_reward_accuracy']:.2f}, margin "
                f"{record['val_reward_margin']:.4f}; chosen ce {record['val_ce_chosen']:.4f} "
                f"(answers' val loss {loss:.4f})"
            )
        record["val_reward_mean"] = self.rollouts.held_out(state)
        return record, (
            f"eval step {step}: held-out prompts: reward mean {record['val_reward_mean']:.4f} "
            f"(prompts' val loss {loss:.4f}, a drift check)"
        )

    def _pairs(self, state) -> dict:
        """DPO's held-out metrics over the validation pairs (means over the pairs)."""
        reference = reference_params(state["opt_state"])  # None: LoRA's base
        sums = jax.device_get([self.pair_step(state["params"], b, reference) for b in self.pairs])
        total = {k: float(np.sum([s[k] for s in sums], dtype=np.float64)) for k in sums[0]}
        n = max(total["pairs"], 1.0)
        out = {f"val_{k}": total[k] / n for k in ("dpo_loss", "reward_accuracy", "reward_margin")}
        out["val_ce_chosen"] = total["ce_chosen"] / max(total["tokens_chosen"], 1.0)
        return out


def closing_line(cfg, step: int, record: dict | None) -> str:
    """Where the run's last checkpoint is, its held-out figure, and what to run next."""
    run, objective = cfg.run_dir, cfg.train.objective
    key = HEADLINE[objective]
    figure = f"; {key} {record[key]:.4f}" if record and key in record else ""
    ckpt = Path(run) / CHECKPOINT_DIR / str(step)
    nexts = [f"python sample.py --run {run}", f"python -m moe_jax.plot {run}"]
    if cfg.lora.rank:
        nexts.append(f"python -m moe_jax.interop export-adapter {run} --out ADAPTER_DIR")
    return f"done: step {step} in {ckpt}{figure}; next: {', '.join(nexts)}"
