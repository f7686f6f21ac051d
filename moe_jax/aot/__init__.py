"""Ahead-of-time compilation for a slice from this CPU: `python -m moe_jax.aot`.

command.py      the command: compile a train / decode / GRPO step for a topology, its report
report.py       the report's lines and JSON record
grpo.py         a GRPO step's two programs (the recording sampler, the update) and their memory
hlo.py          reading compiled HLO: collectives, their bytes, fusions
collectives.py  the weight collectives a step must make, counted from the config and mesh
topology.py     the TPU / GPU slices a program can be compiled for
"""
