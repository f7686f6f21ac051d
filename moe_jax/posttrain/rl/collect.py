"""Each GRPO step's rollouts, from the train state's params in memory (no checkpoint round
trip): the trainer hands over a batch of prompt indices and trains on what this returns.

    rollouts = Rollouts(cfg, graphdef, data, mesh)      # data: data.prompts.PromptData
    batch = rollouts(state, {"index": idx_B}, step)     # numpy rows for grpo.compute_grads

The jitted sampler (`moe_jax.inference.sampling`, made once, its weights swapped every step)
draws rl.group_size completions of every prompt at rl.temperature, seeded by (seed, step) so
a resumed run draws what the uninterrupted one did, recording each token's experts and
log-prob (`generate(record=True)`), or with rl.rollout_engine the generation engine draws
them from the sampler's weights, keyed alike (`engine_draws`); the completions end at the
tokenizer's EOS or after rl.max_new_tokens. On the trainer's mesh the sampler decodes from a
copy of the params laid out for sampling (`sharding.rollout_mesh`: no weight split over fsdp),
made once a step (one all-gather of the weights, where the training layout gathered them at
every decode step) and dropped after the draw. The reward functions score the decoded
completions (text without the EOS), their weighted sum is each completion's reward, and
`grpo.group_advantages` compares it with its group's; with rl.dynamic_sampling "keep" [R]
marks the rows of groups whose rewards differ (`informative`). Rows are the data's prompt bucket +
max_new_tokens wide whatever the batch, so one train step program serves every step.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from moe_jax.data.prompts import prompt_text
from moe_jax.errors import MoeJaxError
from moe_jax.inference.decoding import unstack_blocks
from moe_jax.inference.sampling import Sampler
from moe_jax.posttrain.rl.engine_draws import engine_generation
from moe_jax.posttrain.rl.grpo import group_advantages
from moe_jax.posttrain.rl.rollouts import rollout_rows
from moe_jax.run import programs
from moe_jax.sharding import INFERENCE_RULES, rollout_mesh, state_shardings


class RewardError(MoeJaxError, ValueError):
    """A reward function gave something other than one number per completion."""


def score(rewards: list, prompts: list[str], completions: list[str], columns: dict):
    """-> (the weighted reward sum [R] float64, each function's mean {name: float})."""
    total, means = np.zeros(len(completions)), {}
    for name, fn, weight in rewards:
        values = fn(prompts=prompts, completions=completions, **columns)
        try:
            values = np.array([np.nan if v is None else v for v in values], np.float64)
        except (TypeError, ValueError):
            values = None
        if values is None or values.shape != (len(completions),):
            raise RewardError(
                f"reward {name} must return one number per completion ({len(completions)}); "
                "fix the function"
            )
        values = np.nan_to_num(values, nan=0.0)  # None: no opinion, 0 (as TRL sums them)
        total, means[name] = total + weight * values, float(values.mean())
    return total, means


def informative(rewards_PG: np.ndarray) -> np.ndarray:
    """1.0 for each group whose rewards differ, 0.0 where they are all equal (every
    advantage 0: DAPO's dynamic sampling drops the group), float32 [P]."""
    return (np.ptp(rewards_PG, axis=1) > 0).astype(np.float32)


class Rollouts:
    def __init__(self, cfg, graphdef, data, mesh=None):
        """`mesh`: the trainer's; the sampler draws on its devices from a copy of the params
        laid out for sampling (module doc). None: from the params as they are."""
        self.cfg, self.graphdef, self.data = cfg, graphdef, data
        self.width = data.bucket + cfg.rl.max_new_tokens
        self.mesh = rollout_mesh(mesh) if mesh is not None else None
        self.sampler = None

    def _laid_out(self, params):
        """`params` as the sampler takes them: on the mesh, a copy in the sampling layout whose
        stacked blocks are fresh arrays (never the train state's), which the sampler consumes
        as it splits them (`decoding.unstack_blocks`), so one weight at a time is held twice."""
        if self.mesh is None:
            return params
        shardings = state_shardings(params, self.mesh, INFERENCE_RULES)
        # shallow copies to pop the blocks from, so that each array is put once
        params, shardings = (jax.tree.map(lambda a: a, t) for t in (params, shardings))
        blocks, block_shardings = params.pop("blocks", None), shardings.pop("blocks", None)
        out = jax.device_put(params, shardings)  # the same arrays where nothing moves
        if blocks is not None:
            out["blocks"] = jax.device_put(blocks, block_shardings, may_alias=False)
        return out

    def _sampler(self, params) -> Sampler:
        """The sampler, its weights `params` (built once: its programs stay compiled)."""
        params = self._laid_out(params)
        model = nnx.merge(self.graphdef, params)
        consume = self.mesh is not None  # its blocks are ours to take (`_laid_out`)
        if self.sampler is None:  # an earlier run's of this model in the process, or a new one
            built = []
            build = lambda mesh, take: built.append(1) or Sampler(model, mesh=mesh, consume=take)
            self.sampler = programs.kept("rollout_sampler", self.cfg, build, self.mesh, consume)
            if built:
                return self.sampler
        state = nnx.state(model, nnx.Param)
        blocks = state.pop("blocks") if model.n_blocks else None
        self.sampler.params = state
        self.sampler.param_blocks = (
            unstack_blocks(blocks, model.n_blocks, consume) if blocks else []
        )
        return self.sampler

    def _release(self) -> None:
        """Drop the sampler's weights once a draw is done: its copy laid out for sampling (its
        layer blocks copies of the stacked params, `decoding.unstack_blocks`, without a
        mesh), which would otherwise stay in device memory beside the train step's
        (`moe_jax.aot.command`'s GRPO figures count it while it samples only)."""
        self.sampler.params, self.sampler.param_blocks = None, []

    def __call__(self, state, batch: dict, step: int) -> dict:
        """A batch of prompt indices -> the rollouts' rows (`grpo`'s module doc)."""
        rl = self.cfg.rl
        index = [int(i) for i in np.asarray(batch["index"])]
        seed = (self.cfg.seed * 1_000_003 + step) % 2**31
        prompts, gen, rewards = self._draw(state["params"], index, seed)
        rows = rollout_rows(prompts, gen, self.width)
        rewards_PG = rewards.reshape(-1, rl.group_size)
        adv = group_advantages(rewards_PG, rl.scale_rewards).reshape(-1)
        rows["routes"] = np.ascontiguousarray(np.swapaxes(rows["routes"], 0, 1))  # rows first
        if rl.dynamic_sampling:
            rows["keep"] = np.repeat(informative(rewards_PG), rl.group_size)
        return rows | {"adv": adv, "rewards": rewards.astype(np.float32)}

    def held_out(self, state) -> float:
        """The mean reward of rl.group_size completions of each validation prompt (at most
        train.eval_batches x batch_size of them), drawn batch_size prompts at a time as a
        step's are (the same program; the last batch filled with repeats, not counted), from
        one seed at every eval, so that evals differ by their params alone."""
        t, data, G = self.cfg.train, self.data, self.cfg.rl.group_size
        val = list(range(data.n_train, len(data.ids)))[: t.eval_batches * t.batch_size]
        rewards = []
        for i in range(0, len(val), t.batch_size):
            index = val[i : i + t.batch_size]
            padded = index + [index[-1]] * (t.batch_size - len(index))
            got = self._draw(state["params"], padded, seed=self.cfg.seed)[2]
            rewards.append(got[: len(index) * G])
        return float(np.mean(np.concatenate(rewards)))

    def _draw(self, params, index: list[int], seed: int):
        """(the prompts' rows, rl.group_size of each of `index`; the generation; each
        completion's reward [R])."""
        cfg, rl, data, tok = self.cfg, self.cfg.rl, self.data, self.data.tokenizer
        G = rl.group_size
        prompts = [data.ids[i] for i in index for _ in range(G)]  # row r: prompt r // G
        eos = [] if tok.eos_id is None else [tok.eos_id]
        vocab_size = min(tok.vocab_size, cfg.model.vocab_size)
        sampler = self._sampler(params)
        if rl.rollout_engine:
            gen = engine_generation(
                sampler, prompts, rl, seed=seed, stop_ids=eos, vocab_size=vocab_size,
                width=self.width,
            )  # fmt: skip
        else:
            gen = sampler.generate(
                prompts, rl.max_new_tokens, temperature=rl.temperature, seed=seed,
                stop_tokens=eos, vocab_size=vocab_size, record=True,
            )  # fmt: skip
        self._release()
        texts = []
        for seq in gen.sequences():
            texts.append(tok.decode(seq[:-1] if seq and seq[-1] in eos else seq))
        records = [data.records[i].value for i in index for _ in range(G)]
        names = sorted({k for r in records for k in r} - {"prompt"})
        columns = {k: [r.get(k) for r in records] for k in names}
        prompt_texts = [prompt_text(r, tok) for r in records]
        rewards, _ = score(data.rewards, prompt_texts, texts, columns)
        return prompts, gen, rewards
