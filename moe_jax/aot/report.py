"""`python -m moe_jax.aot`'s report as it prints it: per-device memory, FLOPs against the
model's, collectives against the weights' floor (the report dict is `aot.compile_step`'s)."""

from __future__ import annotations

GIB = 1 << 30


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f}"


def format_report(r: dict, config_name: str) -> str:
    if r["step"] == "grpo":  # two programs (moe_jax/aot/grpo.py)
        from moe_jax.aot.grpo import format_grpo

        return format_grpo(r, config_name)
    b = r["bytes"]
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
    lines = [
        f"{config_name}: {r['step']} step on {r['topology']} ({r['devices']} x {r['device_kind']}, "
        f"{r['hosts']} host(s)), compiled in {r['compile_s']:.1f} s",
        f"mesh {mesh}; batch {r['batch']} ({r['batch_per_device']:g} per device) x "
        f"{r['seq_len']} tokens",
        "",
        "per device              GiB",
    ]
    for key in ("arguments", "outputs", "aliased", "temps", "host_temps"):
        lines.append(f"  {key.replace('_', ' '):<16}{_gib(b[key])}")
    verdict = "fits" if r["fits"] else "does not fit"
    lines.append(
        f"  {'peak':<16}{_gib(b['peak'])}   of {r['hbm_bytes_per_device'] / GIB:.2f} HBM: {verdict}"
    )
    compiled, model = r["flops_per_device"], r["model_flops_per_device"]
    lines += [
        "",
        f"FLOPs per device: compiled {compiled:.4g}, model {model:.4g} "
        f"(compiled / model {compiled / model if model else 0:.3f})",
        "",
        "collectives per device per step   count        GiB   weights' floor (GiB)",
    ]
    floor = r.get("weight_collectives_floor", {})
    for op, c in r["collectives"].items():
        least = f"{floor[op] / GIB:>14.3f}" if op in floor else ""
        lines.append(f"  {op:<28}{c['count']:>9}{c['bytes'] / GIB:>11.3f}{least}")
    if not r["collectives"]:
        lines.append("  (none)")
    extra = []
    if r["conditionals"]:
        extra.append(f"{r['conditionals']} conditionals executed per step")
    if r["uncosted_kernels"]:
        extra.append(
            f"{r['uncosted_kernels']} kernel calls without a cost estimate (splash or cuDNN "
            "attention) "
            "left out of the compiled FLOPs"
        )
    if r["loops_of_unknown_trip_count"]:
        extra.append(
            f"{r['loops_of_unknown_trip_count']} loop(s) counted at sample.max_new_tokens - 1 "
            "iterations (the decode loop's most)"
        )
    if r.get("exchange_round_loops"):
        extra.append(
            f"{r['exchange_round_loops']} loop(s) of the ragged exchange's extra rounds counted "
            "at none (one round: moe.recv_factor)"
        )
    if "host_peak_rss_bytes" in r:
        extra.append(f"host peak RSS {r['host_peak_rss_bytes'] / GIB:.2f} GiB")
    if extra:
        lines += ["", "; ".join(extra)]
    return "\n".join(lines)
