"""Downstream evaluation (moe_jax/eval) on a tiny trained run: the scores against the model's
own forward pass, batched against one request at a time, sharded (data 2 x expert 2 x
tensor 2 on 8 simulated devices) against one device, the trainer's task eval against the
command at the same step, and the command's one-line errors.

Tasks are defined here from local JSONL files (tests/eval_tasks.py); nothing is downloaded.
Tolerances: float32 throughout; a request's log-likelihood is a sum of up to ~600 log-probs
of magnitude ~5, computed by programs of different shapes (another batch, bucket or mesh
reorders the attention's and experts' sums), measured to differ by < 1e-5; 1e-4 absolute
leaves room. Greedy choices, generated text and accuracies must be identical.
Budget: ~40 s on 2 cores (two tiny training runs, a dozen small compiles).
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="eval tests need lm-eval (the `eval` extra)")

from tests.eval_tasks import answers, offline, requests_of, write_tasks  # noqa: E402
from tests.helpers import TINY_BASE, forward  # noqa: E402

TOL = 1e-4
TASKS = "toy_mc,toy_roll,toy_gen"
RUN_ARGS = [
    *TINY_BASE, "train.steps=2", "train.batch_size=2", "train.seq_len=16",
    "train.warmup_steps=1", "train.eval_batches=1", "train.peak_flops=1e12",
    "data.embedded_max_bytes=100000", "checkpoint.async_save=false",
]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(task dir, a byte run trained 2 steps with the tasks evaluated at step 2, its stdout)."""
    from moe_jax.config import load_config
    from moe_jax.train.loop import train

    offline()
    root = tmp_path_factory.mktemp("eval")
    tasks = write_tasks(root / "tasks")
    run = root / "run"
    over = [f"eval.tasks={TASKS}", f"eval.include_path={tasks}", "eval.batch_size=4"]
    cfg = load_config("configs/tiny.yaml", [*RUN_ARGS, *over, f"run_dir={run}"])
    assert train(cfg).step == 2
    return tasks, run


@pytest.fixture(scope="module")
def suite(setup):
    from moe_jax.eval.tasks import load_suite

    return load_suite(TASKS, str(setup[0]), None)


def cli(argv, capsys):
    from moe_jax.eval.__main__ import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------- scores


def test_scores_equal_the_models_own_log_softmax(setup):
    """Each request's sum of log-probs and is_greedy from a plain forward of the whole
    sequence, a request longer than max_length truncated on the left as the harness does."""
    from moe_jax.eval.scoring import Scorer
    from moe_jax.inference.load import load_sampler

    _, sampler, _ = load_sampler(setup[1])
    model = sampler.inference_model()  # no capacity drops: a row's logits are its own
    L = 48

    def log_softmax(ids):  # the full forward of one sequence, padded to one shape
        logits, _ = forward(model, jnp.asarray([ids + [0] * (L - len(ids))]))
        return np.asarray(jax.nn.log_softmax(logits[0, : len(ids)], axis=-1))

    rng = np.random.default_rng(0)
    requests = [
        (rng.integers(0, 256, n).tolist(), rng.integers(0, 256, k).tolist())
        for n, k in [(5, 3), (30, 1), (70, 9), (1, 1), (20, 0)]  # 70 + 9 > L: truncated
    ]
    # A continuation that is the model's own greedy choice: is_greedy must say so.
    context = rng.integers(0, 256, 12).tolist()
    greedy = []
    for _ in range(3):
        greedy.append(int(np.argmax(log_softmax(context + greedy)[-1])))
    requests.append((context, greedy))

    def reference(context, continuation):
        whole = (context + continuation)[-(L + 1) :]
        logp = log_softmax(whole[:-1])
        at = range(len(whole) - 1 - len(continuation), len(whole) - 1)
        picked = [logp[t, c] for t, c in zip(at, continuation, strict=True)]
        hits = [np.argmax(logp[t]) == c for t, c in zip(at, continuation, strict=True)]
        return sum(picked), all(hits)

    got = Scorer(sampler, batch_size=4, max_length=L).loglikelihood(requests, progress=False)
    for request, (logprob, is_greedy) in zip(requests, got, strict=True):
        ref_logprob, ref_greedy = reference(*request)
        assert logprob == pytest.approx(ref_logprob, abs=TOL)
        assert is_greedy == ref_greedy
    assert got[-1][1] and got[-2] == (0.0, True)  # the greedy one; an empty continuation


def test_batched_equals_one_at_a_time_and_compiles_a_few_programs(setup, suite):
    from moe_jax.eval.backend import MoeJaxLM

    requests = requests_of(suite)
    # max_length 64 splits the rolling documents into several windows
    batched = MoeJaxLM(run=str(setup[1]), batch_size=4, max_length=64)
    single = MoeJaxLM(run=str(setup[1]), batch_size=1, max_length=64)
    a, b = answers(batched, requests), answers(single, requests)
    assert_same(a, b)
    assert len(a["loglikelihood"]) == 18 and len(a["loglikelihood_rolling"]) == 4
    # Programs: one per (rows, bucket) shape, and jax compiled no more than that.
    assert len(batched.scorer.programs) == batched.scorer.jitted._cache_size() <= 3
    # Generation (the engine's): prefill chunks of 64 and decode steps, rows 1, 2 or 4.
    shapes = {tokens_shape for tokens_shape, _, _ in batched.generator.programs}
    assert shapes <= {(rows, T) for rows in (1, 2, 4) for T in (1, 64)}


def assert_same(a: dict, b: dict) -> None:
    for (lp_a, greedy_a), (lp_b, greedy_b) in zip(
        a["loglikelihood"], b["loglikelihood"], strict=True
    ):
        assert lp_a == pytest.approx(lp_b, abs=TOL) and greedy_a == greedy_b
    np.testing.assert_allclose(a["loglikelihood_rolling"], b["loglikelihood_rolling"], atol=TOL)
    assert a["generate_until"] == b["generate_until"]


def test_sharded_equals_one_device(setup, suite):
    from moe_jax.eval.backend import MoeJaxLM

    requests = requests_of(suite)
    mesh = {"mesh.data": 2, "mesh.expert": 2, "mesh.tensor": 2}
    sharded = MoeJaxLM(run=str(setup[1]), batch_size=4, max_length=64, **mesh)
    assert sharded.scorer.sampler.mesh.size == 8
    one = MoeJaxLM(run=str(setup[1]), batch_size=4, max_length=64)
    assert_same(answers(sharded, requests), answers(one, requests))


# ----------------------------------------------------------------------------- the command


def test_training_eval_equals_the_command_at_that_step(setup, capsys):
    """The trainer's step-2 task metrics (metrics.jsonl, TensorBoard, downstream.png) equal
    `python -m moe_jax.eval` on the step-2 checkpoint."""
    from moe_jax.observe.plot import main as plot
    from moe_jax.observe.writers import read_metrics

    tasks, run = setup
    records = [r for r in read_metrics(run) if r["kind"] == "downstream"]
    assert [r["step"] for r in records] == [2]
    trained = {k: v for k, v in records[0].items() if k not in ("kind", "step")}
    assert set(trained) == {"toy_mc/acc", "toy_roll/word_perplexity", "toy_gen/exact_match"}
    assert all(math.isfinite(v) for v in trained.values())
    code, out, err = cli(
        [run, "--tasks", TASKS, "--include-path", tasks, "--batch-size", 4,
         "--bootstrap-iters", 0],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    (written,) = (run / "eval" / "2").iterdir()
    results = json.loads(written.read_text())
    assert f"results: {written}" in out and results["moe_jax"]["step"] == 2
    from moe_jax.eval.tasks import metrics

    standalone = metrics(results)
    assert standalone.keys() == trained.keys()
    for name, value in trained.items():
        assert value == pytest.approx(standalone[name], rel=1e-6), name
        assert f"{name}: {standalone[name]:.4f}" in out
    events = b"".join(p.read_bytes() for p in (run / "tb").iterdir())
    assert b"downstream/toy_mc/acc" in events
    assert plot([str(run), "--out", str(run / "plots")]) == 0
    assert (run / "plots" / "downstream.png").stat().st_size > 0


@pytest.fixture(scope="module")
def char_run(setup, tmp_path_factory):
    """A char-tokenized run whose alphabet lacks most of the tasks' characters."""
    from moe_jax.config import load_config
    from moe_jax.train.loop import train

    root = tmp_path_factory.mktemp("char")
    text = root / "corpus.txt"
    text.write_text("abc abc cab\n" * 400, encoding="utf-8")
    over = ["data.tokenizer=char", f"data.path={text}", "train.steps=1", f"run_dir={root}/run"]
    train(load_config("configs/tiny.yaml", [*RUN_ARGS, *over]))
    return root / "run"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tasks", "toy_mcq"], "error: unknown task 'toy_mcq'; did you mean toy_mc?"),
        (
            ["--tasks", "toy_mc", "--num-fewshot", "6"],
            "error: 6-shot: task 'toy_mc' has 5 example(s) in its 'test' split besides the "
            "document evaluated; lower --num-fewshot to at most 5",
        ),
        (["--tasks", "toy_mc", "--limit", "0"], "error: --limit must be >= 1, got 0"),
        (["--tasks", "toy_mc", "model.n_layers=2"], "error: 'model.n_layers' cannot be set"),
        (["--tasks", "toy_mc,"], "error: tasks 'toy_mc,' has an empty name"),
    ],
)
def test_command_errors_are_one_line_and_write_nothing(setup, capsys, extra, message):
    tasks, run = setup
    before = sorted((run / "eval").rglob("*")) if (run / "eval").exists() else []
    code, out, err = cli([run, "--include-path", tasks, *extra], capsys)
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err
    after = sorted((run / "eval").rglob("*")) if (run / "eval").exists() else []
    assert after == before


def test_a_tokenizer_that_cannot_write_the_tasks_text_is_refused(setup, char_run, capsys):
    """Found as the harness hands over the requests' text (its request-building progress
    bars come first on stderr): one error line, no traceback, nothing written."""
    code, _, err = cli([char_run, "--tasks", "toy_mc", "--include-path", setup[0]], capsys)
    last = err.splitlines()[-1]
    assert code == 2 and "Traceback" not in err
    assert last.startswith("error: 20 character(s) not in the char tokenizer's vocabulary: ")
    assert not (char_run / "eval").exists()


def test_without_the_harness_the_command_says_so(setup, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name)
    )
    code, _, err = cli([setup[1], "--tasks", "toy_mc"], capsys)
    assert (code, err) == (
        2,
        "error: the evaluation harness is not installed: pip install 'moe_jax[eval]'\n",
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("eval.tasks=a,,b", "eval.tasks 'a,,b' has an empty name"),
        ("eval.limit=0", "eval.limit must be positive (documents per task) or null, got 0"),
        ("eval.every=-1", "eval.every must be >= 0, got -1"),
        ("eval.num_fewshot=-2", "eval.num_fewshot must be >= 0 or null"),
        ("eval.batch_size=0", "eval.batch_size must be positive, got 0"),
    ],
)
def test_eval_section_checks_its_fields(override, message):
    from moe_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        load_config("configs/tiny.yaml", [override])


def test_training_refuses_an_unknown_task_before_writing(setup, tmp_path):
    from moe_jax.config import ConfigError, load_config
    from moe_jax.train.loop import train

    over = ["eval.tasks=toy_mcq", f"eval.include_path={setup[0]}", f"run_dir={tmp_path}/run"]
    with pytest.raises(ConfigError, match="^eval.tasks: unknown task 'toy_mcq'; did you mean"):
        train(load_config("configs/tiny.yaml", [*RUN_ARGS, *over]))
    assert not (tmp_path / "run").exists()


def test_tasks_of_the_include_path_alone_leave_the_harness_tasks_unindexed(setup):
    """Indexing the harness's ~15,000 task files takes seconds: names that are all tasks of
    the include path take that directory's index alone; one more name takes the whole."""
    from moe_jax.eval.tasks import task_manager

    own = task_manager(str(setup[0]), ("toy_mc",))
    assert "toy_mc" in own.all_tasks and "hellaswag" not in own.all_tasks
    whole = task_manager(str(setup[0]), ("toy_mc", "hellaswag"))
    assert {"toy_mc", "hellaswag"} <= set(whole.all_tasks)
    assert task_manager(None) is task_manager(None, ("hellaswag",))  # built once a process
