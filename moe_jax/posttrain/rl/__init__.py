"""Reinforcement learning for the MoE decoder (issue 53): GRPO / GSPO with rollout routing
replay, `train.objective=grpo` (the rl config section).

- `rollouts.py`: the jitted sampler's generations (with their recorded experts and
  log-probs, `Sampler.generate(record=True)`) as training rows, and the trainer's log-probs
  of the sampled tokens, replaying the rollout's experts (`Transformer(routes=)`);
- `collect.py`: each step's rollouts from the train state's params, the reward functions'
  scores and the group-relative advantages (the trainer's hook);
- `grpo.py`: the advantages, the clipped objective and an update's gradients (the KL's
  reference: LoRA's base, or a full fine-tune's frozen copy, `moe_jax.posttrain.reference_policy`);
- `aggregate.py`: rl.loss_agg, the reductions of the per-token loss (TRL's loss types);
- `correction.py`: rl.correction, the sampler / trainer mismatch's importance weights (TIS,
  MIS) and the metrics that show the mismatch;
- `passes.py`: the train step's rl.epochs x rl.minibatches updates on one batch of rollouts;
- `aot.py`: a GRPO step's two programs (the recording sampler, the update) compiled ahead of
  time by `moe_jax.aot.command`, and a chip's memory across them.
The prompts and the reward functions: `moe_jax.data.prompts`.
"""
