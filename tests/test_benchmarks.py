"""The training benchmarks run end to end on a shrunk model and report consistent figures.

The figures themselves are machine-dependent and never asserted; what is checked is that the
scripts run (ours and the Hugging Face peer), time the steps they were asked to, and that the
derived columns follow from the raw ones; the turn order is checked on fake workers. Budget:
~70 s of CPU (one-layer models, 2 x 32 tokens; every point is a worker process, the scripts
themselves run in this one).
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their siblings as top-level modules
from balancing import max_vio, summarise  # noqa: E402
from profile_step import _part, control_flow, op_spans  # noqa: E402
from train_throughput import take_turns  # noqa: E402

sys.path.insert(0, str(BENCH / "gpu"))  # the GPU kit's driver

SHRINK = ["--set=model.n_layers=1", "--set=train.seq_len=32", "--set=train.batch_size=2"]


@pytest.fixture
def run(monkeypatch, capsys):
    """run(SCRIPT, *ARGS): `python benchmarks/SCRIPT ARGS`, its `__main__` block included, but
    in this process (only the workers it starts are processes of their own): the script's
    start-up and imports (jax, torch, transformers: seconds) are this process's already."""
    # No huge-page re-exec of this process, nor of each worker (a second start-up each; the
    # re-exec itself is tests/test_process_setup.py's)
    monkeypatch.setenv("MOE_JAX_HUGEPAGES", "0")

    def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
        monkeypatch.setattr(sys, "argv", [str(BENCH / script), *args])
        code = 0
        try:  # an exception instead of an exit fails the test
            runpy.run_path(str(BENCH / script), run_name="__main__")
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return subprocess.CompletedProcess(sys.argv, code, out.out, out.err)

    return run_script


def json_line(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_train_throughput_times_both_sides_and_derives_its_columns(run):
    pytest.importorskip("transformers", reason="the peer needs the interop extra")
    steps = "3"
    args = ["--sizes=small", "--styles=qwen3", f"--steps={steps}", "--chunk=2", "--wait-idle=0"]
    proc = run("train_throughput.py", *args, *SHRINK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json_line(proc.stdout)["results"]
    tokens = 2 * 32
    assert row["tokens_per_step"] == tokens
    for side in ("ours", "peer"):
        times = row[f"{side}_step_times"]
        assert len(times) == int(steps)  # turns of 2 then 1; settle steps are not timed
        assert row[f"{side}_step_s"] == pytest.approx(sorted(times)[1])  # the median of 3
        assert row[f"{side}_tok_s"] == pytest.approx(tokens / row[f"{side}_step_s"])
        assert 0 <= row[f"{side}_sys_s"] <= row[f"{side}_cpu_s"]
        assert row[f"{side}_peak_rss_gb"] > 0.1  # a whole Python process with its framework
    assert row["ratio"] == pytest.approx(row["ours_tok_s"] / row["peer_tok_s"])
    mfu = row["ours_tok_s"] * row["flops_per_token"] / row["peak_flops"]
    assert row["ours_mfu"] == pytest.approx(mfu)


def _worktrees() -> set[str]:
    """The paths of this repository's worktrees (not their HEADs: a commit made elsewhere while
    the test runs must not fail it)."""
    cmd = ["git", "-C", str(BENCH), "worktree", "list", "--porcelain"]
    out = subprocess.run(cmd, capture_output=True).stdout.decode()
    return {line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("worktree ")}


def test_train_throughput_against_a_revision_times_that_checkout_in_turns(run):
    """--against REV: the peer's worker runs the script and package of a checkout of REV (here
    this commit), timed in turns with ours; the temporary worktree goes afterwards."""
    if subprocess.run(
        ["git", "-C", str(BENCH), "rev-parse", "HEAD"], capture_output=True
    ).returncode:
        # --against checks a revision out of this repository: a source tree without .git
        # (an sdist, a copied folder) has none; CI runs on a clone, where this never skips
        pytest.skip("not a git checkout")
    before = _worktrees()
    args = ["--sizes=small", "--styles=mixtral", "--steps=2", "--wait-idle=0", "--against=HEAD"]
    proc = run("train_throughput.py", *args, *SHRINK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "# peer: moe_jax at HEAD (" in proc.stdout
    report = json_line(proc.stdout)
    assert report["against"] == "HEAD"
    (row,) = report["results"]
    assert len(row["ours_step_times"]) == len(row["peer_step_times"]) == 2
    assert row["ratio"] == pytest.approx(row["ours_tok_s"] / row["peer_tok_s"])
    assert _worktrees() <= before  # the temporary checkout is removed (others may come and go)


class FakeWorker:
    """Stands in for a worker process: logs every command it gets; a step takes 1 s."""

    def __init__(self, side: str, log: list):
        self.side, self.log = side, log

    def ask(self, command: str):
        self.log.append((self.side, command))
        cmd, *arg = command.split()
        if cmd == "run":
            return [{"s": 1.0, "cpu": 2.0, "sys": 0.0}] * int(arg[0])
        return {"first": 9.0, "peak": 1e11, "rss": 1e9}[cmd]


def test_take_turns_interleaves_the_workers_and_times_only_the_turns():
    log = []
    workers = {"ours": FakeWorker("ours", log), "peer": FakeWorker("peer", log)}
    timed = take_turns(workers, steps=5, warmup=1, chunk=2, settle=1)
    assert {s: len(t) for s, t in timed["times"].items()} == {"ours": 5, "peer": 5}
    assert len(timed["peaks"]) == 3  # one probe per round of turns: 2 + 2 + 1 steps
    turns = [(s, c) for s, c in log[4:] if c != "rss"]  # after first and warm-up of both
    one_round = lambda n: [
        ("ours", "peak"),
        ("ours", "run 1"),  # the settle step, untimed
        ("ours", f"run {n}"),
        ("peer", "run 1"),
        ("peer", f"run {n}"),
    ]
    assert turns == one_round(2) + one_round(2) + one_round(1)
    assert log[:4] == [("ours", "first"), ("peer", "first"), ("ours", "run 1"), ("peer", "run 1")]


def test_scaling_sweeps_the_experts_at_constant_active_flops(run):
    proc = run("scaling.py", "--size=small", "--sweeps=experts", "--steps=1", *SHRINK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json_line(proc.stdout)["results"]["experts"]
    assert [r["value"] for r in rows] == [8, 16, 32]
    assert all(len(r["ours_step_times"]) == 1 for r in rows)
    # Active FLOPs stay put; only the router's d_model x E matmul grows (~1% of the experts').
    flops = [r["flops_per_token"] for r in rows]
    assert flops == sorted(flops) and flops[-1] / flops[0] < 1.02


def test_scaling_compares_override_sets_side_by_side(run):
    sets = ["", "moe.capacity_factor=2.0,moe.top_k=1"]
    args = [f"--compare={c}" for c in sets]
    proc = run("scaling.py", "--size=small", "--steps=1", *args, *SHRINK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json_line(proc.stdout)["results"]["compare"]
    assert [r["value"] for r in rows] == ["(as configured)", sets[1]]
    assert rows[1]["overrides"][-2:] == ["moe.capacity_factor=2.0", "moe.top_k=1"]
    # top-1 halves the routed experts' FLOPs: the set really reached the worker's config
    assert rows[1]["flops_per_token"] < 0.8 * rows[0]["flops_per_token"]


def test_profile_charges_ops_to_their_innermost_part_and_skips_control_flow():
    import jax
    import jax.numpy as jnp

    scan = "jit(train_step)/while/body/closed_call/transpose(jvp(loss))/embed_head/while/body/"
    assert _part(scan + "closed_call/checkpoint/experts/while/body/cond/dot_general") == "experts"
    # embed_head is the whole forward: inside the layer scan's loop it is the loop's own work
    assert _part(scan + "jit(dynamic_index_in_dim)/dynamic_slice") == "layer_loop"
    assert _part("jit(train_step)/jvp(loss)/embed_head/dot_general") == "embed_head"
    assert _part("jit(train_step)/while/body/add") == "other"
    assert _part("jit(train_step)/adam/mul") == "optimizer"

    # A conditional's or a loop's runtime event spans its bodies' ops, so the profile must
    # know their names
    def f(i, x):
        x = jax.lax.switch(i, [jnp.sin, jnp.cos], x)
        return jax.lax.fori_loop(0, i, lambda _, y: jnp.sin(y) * y, x)

    hlo = jax.jit(f).lower(0, jnp.ones(4)).compile().as_text()
    names = control_flow(hlo)
    lines = [next(line for line in hlo.splitlines() if f"{n} = " in line) for n in names]
    kinds = {k for k in ("conditional", "while") for line in lines if f" {k}(" in line}
    assert len(names) == 2 and kinds == {"conditional", "while"}


def test_profile_times_an_async_op_until_its_end_event():
    def ev(name, ts, dur, op=True):
        return {
            "ph": "X",
            "name": name,
            "ts": ts,
            "dur": dur,
            "args": {"hlo_op": name} if op else {},
        }

    events = [
        ev("dot_general.3", 0, 2),  # dispatched in 2 us, done (its end: event) at 50 us
        ev("fusion.1", 5, 10),  # synchronous: its end: event right after it
        ev("end: fusion.1", 15, 0, op=False),
        ev("ThunkExecutor::Execute", 0, 60, op=False),  # runtime frame, not an op
        ev("end: dot_general.3", 50, 0, op=False),
        ev("copy.2", 55, 1),  # no end: event in the trace: its own duration
        {"ph": "i", "name": "marker", "ts": 1},
    ]
    spans = {e["name"]: (e["dur"], e["done"]) for e in op_spans(events)}
    assert spans == {"dot_general.3": (2, 50), "fusion.1": (10, 10), "copy.2": (1, 1)}


@pytest.mark.parametrize(
    "script, args, named",
    [
        ("train_throughput.py", ["--sizes=huge"], "huge"),
        ("scaling.py", ["--size=huge"], "huge"),
        ("train_throughput.py", ["--sizes=small", "--set=moe.bogus=1"], "moe.bogus"),
        ("train_throughput.py", ["--sizes=small", "--against=no-such-rev"], "no-such-rev"),
        ("scaling.py", ["--size=small", "--compare=moe.n_experts=x"], "moe.n_experts"),
        ("decode.py", ["--styles=bogus", "--no-peer"], "bogus"),
        ("decode.py", ["--batches=1,x"], "--batches: 'x' is not an integer"),
        ("decode.py", ["--repeats=0"], "--repeats: 0 is below 1"),
        ("decode.py", ["--prompt-len=2000", "--no-peer"], "--prompt-len 2000 + --new-tokens"),
        ("int8_decode.py", ["--new-tokens=1"], "--new-tokens: 1 is below 2"),
        ("profile_step.py", ["--size=small", "--set=moe.top_kk=1"], "moe.top_kk"),
    ],
)
def test_bad_arguments_get_one_line_and_exit_2(run, script, args, named):
    proc = run(script, *args)
    assert proc.returncode == 2
    assert named in proc.stderr and "Traceback" not in proc.stderr


def test_aot_figures_runs_a_pair_and_keeps_its_result(tmp_path, monkeypatch):
    """One pair end to end on a shrunk model (2 layers of the shipped Mixtral shapes would
    take minutes; 2 of the tiny model's, a dense and a MoE one, take seconds), its
    --max-batch search cut to one probe (the doubling and bisection: test_aot.py): the row
    is derived from the report, and a rerun takes the kept result instead of compiling."""
    pytest.importorskip("libtpu", reason="the `aot` extra (libtpu) is not installed")
    import aot_figures

    monkeypatch.setitem(aot_figures.CONFIGS, "mixtral", ("configs/tiny.yaml", 2))
    out = tmp_path / "figures.jsonl"
    args = ["--only", "mixtral:v5p-8", "--out", str(out), "model.n_layers=2", "--", "--max-rows=1"]
    monkeypatch.setattr(aot_figures, "TOPOLOGIES", ("v5p-8",))
    assert aot_figures.main(args) == 0
    (kept,) = [json.loads(line) for line in out.read_text().splitlines()]
    report = kept["report"]
    assert kept["exit"] == 0 and report["max_batch"] and report["fits"]
    row = aot_figures.row(kept)
    assert f"{report['batch_per_device']:g}" in row and "all-to-all" in row
    assert aot_figures.main(args) == 0  # kept: no second compile
    assert len(out.read_text().splitlines()) == 1


# ----------------------------------------------------------------------------- the GPU kit


def test_gpu_kit_dry_run_writes_each_stages_records(tmp_path):
    """The kit's driver on two of its stages at dry-run sizes (the whole dry run is CI's
    second leg): each stage in its own process, its records and exit status in
    results.jsonl, the table in summary.txt. The peer records a skip without torch."""
    out = tmp_path / "kit"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "gpu" / "kit.py"), str(out), "--dry-run",
         "--stages", "ceilings,train_peer"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    device = next(r for r in records if r["kind"] == "device")
    assert device["backend"] == "cpu" and device["versions"]["jax"]
    ceilings = {r["what"]: r for r in records if r["kind"] == "ceiling"}
    assert ceilings["bf16 matmul"]["tflops"] > 0 and ceilings["hbm copy"]["gbs"] > 0
    peer = next(r for r in records if r["kind"] == "train")
    assert peer["side"] == "transformers"
    assert "skipped" in peer or peer["tokens_per_s"] > 0
    stages = [r for r in records if r["kind"] == "stage"]
    assert [(r["stage"], r["rc"], r["timed_out"]) for r in stages] == [
        ("ceilings", 0, False),
        ("train_peer", 0, False),
    ]
    assert "ceilings: bf16 matmul" in (out / "summary.txt").read_text()


def test_gpu_kit_summary_derives_mfu_and_the_decode_bound():
    import kit

    records = [
        {"kind": "ceiling", "what": "hbm copy", "gbs": 2000.0},
        {"kind": "train", "variant": "auto", "batch": 4, "seq": 4096, "tokens_per_s": 1e4,
         "model_tflops": 98.9, "mfu_causal": 0.1, "mfu_all_keys": 0.12, "peak_bytes": 2**31},
        # a record up to 2026-11-27: "mfu" counted every key
        {"kind": "train", "variant": "old", "batch": 4, "seq": 4096, "tokens_per_s": 1e4,
         "model_tflops": 98.9, "mfu": 0.12, "mfu_causal": 0.1, "peak_bytes": 2**31},
        {"kind": "decode", "batch": 1, "tokens_per_s": 500.0, "step_ms": 2.0,
         "bytes_per_step": {"total": 2e9}},
        {"kind": "attention", "impl": "cudnn", "case": "window", "error": "RuntimeError: no"},
        {"stage": "train", "kind": "stage", "rc": -9, "timed_out": True, "wall_s": 120.0},
        {"kind": "profile", "variant": "auto", "wall_ms": 357.0, "busy_ms": 340.0,
         "kernels_per_step": 900, "kinds_ms": {"matmul": 250.0, "other": 90.0},
         "parts_ms": {"experts": {"fwd": 60.0, "bwd": 120.5}},
         "top": [["sm90_xmma_gemm_bf16", 40.0, 24]]},
        {"kind": "picked", "impl": "triton (128, 32, 4, 3)", "J": 8, "us": 23.4, "gbs": 1077.0,
         "err": 0.0017},
    ]  # fmt: skip
    text = kit.summary(records)
    assert "device busy 340.0 ms, 900 kernels; ms by kind: matmul 250.0, other 90.0" in text
    assert "ms by part (forward+backward): experts 60.0+120.5" in text
    assert "8 rows: 23.4 us (1077 GB/s of picked weights), err 0.0017" in text
    assert text.count("MFU 10.0% (causal; all keys 12.0%)") == 2 and "peak mem 2.0 GiB" in text
    assert "bound 1.000 ms (2.00x)" in text  # 2 GB at 2000 GB/s; 2 ms measured
    assert "RuntimeError: no" in text and "TIMED OUT" in text


def test_gpu_kit_sorts_kernels_by_kind():
    from stages import kernel_kind

    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "matmul",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1": "attention",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "collective",
        "Memcpy DtoD (Device -> Device)": "copy",
        "loop_multiply_fusion_3": "other",
    }
    assert {n: kernel_kind(n) for n in names} == names


def test_balancing_max_vio_and_the_summary_over_seeds_by_hand():
    """MaxVio per layer averaged over the last logged steps; the summary's means, spreads and
    the val-loss difference to the aux-loss run of the same seed."""
    records = [
        {"kind": "train", "expert_load": [[1, 1, 1, 1], [2, 0, 1, 1]]},  # dropped by tail=2
        {"kind": "eval"},
        {"kind": "train", "expert_load": [[2, 1, 1, 0], [1, 1, 1, 1]]},  # MaxVio 1.0, 0.0
        {"kind": "train", "expert_load": [[1, 1, 1, 1], [4, 0, 0, 0]]},  # 0.0, 3.0
    ]
    assert max_vio(records, tail=2) == pytest.approx([0.5, 1.5])
    rows = [
        {"run": "aux loss 0.01", "seed": 0, "max_vio": [1.0, 0.5], "val_loss": 1.70},
        {"run": "aux loss 0.01", "seed": 1, "max_vio": [0.8, 0.7], "val_loss": 1.80},
        {"run": "aux-loss-free 0.001", "seed": 0, "max_vio": [0.1, 0.2], "val_loss": 1.72},
        {"run": "aux-loss-free 0.001", "seed": 1, "max_vio": [0.3, 0.2], "val_loss": 1.78},
    ]
    s = summarise(rows)
    assert list(s) == ["aux loss 0.01", "aux-loss-free 0.001"]
    free = s["aux-loss-free 0.001"]
    assert free["max_vio"] == pytest.approx([0.2, 0.2]) and free["max_vio_std"] == pytest.approx(
        [0.1, 0]
    )
    assert free["val_loss"] == pytest.approx(1.75) and free["val_loss_std"] == pytest.approx(0.03)
    assert free["val_loss_delta"] == pytest.approx(0.0)  # +0.02 and -0.02
    assert free["val_loss_delta_std"] == pytest.approx(0.02)
    assert s["aux loss 0.01"]["val_loss_delta"] == 0
