"""The rl section: GRPO (`train.objective=grpo`, moe_jax/posttrain/rl/)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_jax.config.checks import non_negative, one_of, positive, require

RL_LEVELS = ("token", "sequence")  # rl.level: the ratio per token (GRPO) or sequence (GSPO)
LOSS_AGGS = ("grpo", "bnpo", "dr_grpo", "dapo")  # rl.loss_agg (posttrain/rl/aggregate.py)
CORRECTIONS = ("none", "tis", "mis")  # rl.correction (posttrain/rl/correction.py)


@dataclass(frozen=True)
class RLConfig:
    # The reward functions, each "pkg.module:function", imported at the start of the run and
    # called on every step's rollouts as TRL calls them: fn(prompts=[str], completions=[str],
    # **columns) -> one float (or None: 0) per completion, `columns` every other field of
    # the prompts' JSONL lines as lists. The reward is their weighted sum.
    rewards: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ()  # one per reward; empty: all 1
    group_size: int = 4  # G completions sampled per prompt (train.batch_size prompts a step)
    max_new_tokens: int = 64  # a completion's most tokens (it ends earlier at EOS)
    # A prompt's most tokens (longer ones are refused by line), which fixes the rollouts'
    # width at its sampler bucket + max_new_tokens (what `moe_jax.aot.command` compiles for GRPO);
    # 0: the longest prompt's (the data's).
    max_prompt_len: int = 0
    temperature: float = 1.0  # the sampler's; the trainer's log-probs are of logits / it
    # The clipped ratio's range [1 - clip_eps, 1 + clip_eps_high] (clip_eps_high 0: clip_eps)
    clip_eps: float = 0.2
    clip_eps_high: float = 0.0  # see clip_eps
    level: str = "token"  # token: GRPO's per-token ratio | sequence: GSPO's per-sequence one
    # Advantages (r - group mean) / (group std + 1e-4) (TRL's); false: r - group mean only
    scale_rewards: bool = True
    # KL to the reference (k3: exp(ref - logp) - (ref - logp) - 1 per token), the reference
    # being, as DPO's, the base with the LoRA adapters off or, in a full fine-tune, a frozen
    # copy of the starting params (posttrain/reference_policy.py, in the optimizer state); both run
    # the rollout's experts (routing_replay). 0: none, no reference forward and no copy.
    kl_beta: float = 0.0
    # PPO-style passes over each batch of rollouts: `epochs` passes, each over `minibatches`
    # splits of the batch (rows m, m + minibatches, ...), one optimizer update a split, all
    # inside one train step (posttrain/rl/passes.py). train.steps counts rollout batches, and
    # the LR schedule advances once a batch. 1 and 1: one update a batch (the ratio is 1 but
    # for the sampler / trainer mismatch).
    epochs: int = 1
    minibatches: int = 1  # see epochs
    # How an update's per-token loss is reduced, as TRL's GRPOConfig.loss_type names it
    # (posttrain/rl/aggregate.py): grpo: each completion's token mean, then the mean over
    # completions | bnpo: the mean over the update's sampled tokens | dr_grpo: their sum over
    # completions x rl.max_new_tokens (Dr. GRPO's constant) | dapo: their sum over the whole
    # batch's sampled tokens / rl.minibatches (a token's weight the same in every split).
    # "": each level's own (token: bnpo, sequence: grpo; the KL then a token mean).
    loss_agg: str = ""
    # Sampler / trainer mismatch correction (posttrain/rl/correction.py): the trainer's
    # log-prob of each sampled token at the sampler's params against the sampler's recorded
    # one, their ratio w a weight on the token's loss (no gradient), and the clipped ratio then
    # taken against the trainer's log-prob (verl's rollout correction, TRL's
    # vllm_importance_sampling_correction). none | tis: w clipped to [rl.correction_min,
    # rl.correction_max] | mis: w, but 0 outside that range. With rl.epochs x rl.minibatches
    # > 1 the trainer's log-probs cost one forward of the batch before the updates.
    correction: str = "none"
    # token: w per token | sequence: one w per completion, the product of its tokens' ratios
    correction_level: str = "token"
    correction_max: float = 2.0  # see correction (TRL's default: 3.0)
    correction_min: float = 0.0  # see correction
    # DAPO's dynamic sampling, as a filter: the completions of a prompt whose rewards are all
    # equal (advantage 0: no signal) leave the loss and all its denominators; the fraction of
    # groups dropped is logged ("zero_var_groups"). The batch is not refilled.
    dynamic_sampling: bool = False
    # Rollout routing replay: the training forward reuses the experts every token took in the
    # sampler (moe_jax/model/routing.py `route`); the router's weights at them still learn.
    routing_replay: bool = True
    # Draw the rollouts with the generation engine (moe_jax/inference/engine/: continuous
    # batching, the G samples of a prompt sharing its prefill's KV pages, recording each
    # token's experts and log-prob) instead of the jitted sampler's one batch program. The
    # same draws (row r of step s keyed by (seed, s, r)) and the same rows; a row that ends
    # early frees its slot instead of idling in the batch to the longest's end.
    rollout_engine: bool = False

    def check(self) -> None:
        positive(
            self, "rl",
            [
                "group_size", "max_new_tokens", "temperature", "clip_eps", "epochs",
                "minibatches", "correction_max",
            ],
        )  # fmt: skip
        non_negative(self, "rl", ["clip_eps_high", "kl_beta", "max_prompt_len"])
        one_of(self.level, RL_LEVELS, "rl.level")
        if self.loss_agg:
            one_of(self.loss_agg, LOSS_AGGS, "rl.loss_agg")
        one_of(self.correction, CORRECTIONS, "rl.correction")
        one_of(self.correction_level, RL_LEVELS, "rl.correction_level")
        non_negative(self, "rl", ["correction_min"])
        require(
            self.correction_min < self.correction_max,
            f"rl.correction_min={self.correction_min} is not below rl.correction_max="
            f"{self.correction_max}: the importance weights' range is empty; lower the min",
        )
        bad = [r for r in self.rewards if r.count(":") != 1 or not all(r.split(":"))]
        require(
            not bad,
            f"rl.rewards has {bad}: name each reward function as pkg.module:function",
        )
        require(
            not self.reward_weights or len(self.reward_weights) == len(self.rewards),
            f"rl.reward_weights has {len(self.reward_weights)} weights for "
            f"{len(self.rewards)} rl.rewards; give one per reward, or none (all 1)",
        )
        require(
            self.group_size > 1,
            f"rl.group_size={self.group_size} leaves no other completion of a prompt to compare "
            "with (every advantage 0); sample at least 2 per prompt",
        )

    @property
    def updates(self) -> int:
        """Optimizer updates per batch of rollouts (one train step)."""
        return self.epochs * self.minibatches
