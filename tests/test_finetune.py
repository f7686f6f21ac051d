"""Fine-tuning (moe_jax/train/init_from.py, moe_jax/data/sft.py): `init_from` starts a new run
from another run's params, and `data.sft` trains on JSONL prompt/completion pairs or chat
conversations, the loss on the completion / assistant tokens only.

The source is a tiny Mixtral (2 layers, 4 experts top-2, random weights, transformers; full
attention, no sliding window, so that an answer can look back at its question) with a
byte-level BPE (tests/test_tokenizer.py's, 300 ids, EOS <|im_end|>) and a ChatML chat
template, built here offline and imported with `moe_jax.interop import`. Fine-tuned for
STEPS steps on four examples, it must learn them: its mean cross-entropy on their
completion tokens below LEARNED (nats/token; the imported random model starts near
ln 300 = 5.7), and greedy decoding of each
prompt must give back exactly its completion's tokens and the EOS. The source run directory
must come out byte for byte and mtime for mtime as it went in.

Budget: one train-step program (both SFT forms and the resumed halves share it through the
persistent compilation cache), one sampling program; 29 s measured on 2 busy cores (26 s CPU).
"""

from __future__ import annotations

import json
import math
import re
import runpy
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.config import ConfigError, load_config
from moe_jax.data import load_run_data
from moe_jax.data.sft import Record, encode_examples, pack
from moe_jax.inference.load import load_run
from moe_jax.inference.sampling import Sampler
from moe_jax.quantize import quantize_run
from moe_jax.sharding import make_mesh
from moe_jax.tokenizer import DataError, HFTokenizer, load_tokenizer
from moe_jax.train.init_from import init_source, start_state
from moe_jax.train.loop import train
from moe_jax.train.step import init_state, make_optimizer
from tests.helpers import forward
from tests.test_interop import hf_model
from tests.test_tokenizer import CHAT_TEMPLATE, SHAKESPEARE, write_bpe

pytestmark = pytest.mark.skipif(not SHAKESPEARE.is_file(), reason=f"{SHAKESPEARE} not present")

ROOT = Path(__file__).resolve().parents[1]
STEPS = 32
# Geometric-mean probability of the right token above e^-0.05 = 0.95: learned, against ~5.7 at
# the start (measured after STEPS: 0.003 for the pairs, 0.006 for the conversations).
LEARNED = 0.05
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PAIRS = [  # the last one is the validation split (data.val_fraction=0.2 of 5)
    {"prompt": "Capital of France?", "completion": " Paris."},
    {"prompt": "Two plus two?", "completion": " Four, of course."},
    {"prompt": "Who wrote Hamlet?", "completion": " Shakespeare."},
    {"prompt": "Opposite of up?", "completion": " Down."},
    {"prompt": "Color of grass?", "completion": " Green."},
]


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


CONVERSATIONS = [
    [turn("user", "Hi there."), turn("assistant", "Hello, friend.")],
    [
        turn("user", "Fruit?"),
        turn("assistant", "Mango."),
        turn("user", "Veg?"),
        turn("assistant", "Leek."),
    ],
    [turn("user", "Say yes."), turn("assistant", "Yes indeed.")],
    [turn("user", "Count to three."), turn("assistant", "One, two, three.")],
    [turn("user", "Name a cat."), turn("assistant", "Tom.")],
]


def write_jsonl(path: Path, values: list) -> Path:
    path.write_text("".join(json.dumps(v) + "\n" for v in values))
    return path


def snapshot(directory: Path) -> dict:
    """Every file and directory under `directory`: its bytes (files) and mtime."""
    state = lambda p: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
    return {str(p.relative_to(directory)): state(p) for p in sorted(directory.rglob("*"))}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(source run directory, its snapshot, the HF directory) of the imported model."""
    from moe_jax.interop.__main__ import main as interop

    root = tmp_path_factory.mktemp("finetune")
    hf_dir, run = root / "hf", root / "source"
    hf_model(
        "mixtral", seed=1, vocab_size=300, num_hidden_layers=2, sliding_window=None
    ).save_pretrained(hf_dir)
    write_bpe(hf_dir)
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHATML}))
    args = ["train.batch_size=8", "train.seq_len=64", "data.embedded_max_bytes=20000"]
    assert interop(["import", str(hf_dir), "--out", str(run), *args]) == 0
    return run, snapshot(run), hf_dir


def finetune_config(source: Path, run_dir: Path, jsonl: Path, form: str, *overrides: str):
    return load_config(
        source / "config.yaml",
        [
            f"init_from={source}",
            f"run_dir={run_dir}",
            f"data.path={jsonl}",
            f"data.sft={form}",
            "data.val_fraction=0.2",
            f"train.steps={STEPS}",
            "train.lr=1e-2",
            "train.warmup_steps=2",
            "train.weight_decay=0",
            f"train.eval_every={STEPS}",
            "train.eval_batches=1",
            "train.log_every=4",
            "train.peak_flops=1e11",
            f"checkpoint.every={STEPS}",
            *overrides,
        ],
    )


# ----------------------------------------------------------------------------- learning


@pytest.mark.parametrize("form", ["prompt_completion", "chat"])
def test_finetuning_learns_the_examples_and_leaves_the_source_untouched(
    source, tmp_path, capsys, form
):
    src, before, _ = source
    values = PAIRS if form == "prompt_completion" else [{"messages": c} for c in CONVERSATIONS]
    jsonl = write_jsonl(tmp_path / "sft.jsonl", values)
    cfg = finetune_config(src, tmp_path / "run", jsonl, form)
    # In two halves: the second resumes the new run's own checkpoint, init_from ignored.
    assert train(cfg, stop_at=STEPS // 2).step == STEPS // 2
    assert f"initialised from {src} step 0" in capsys.readouterr().out
    assert train(cfg).step == STEPS
    out = capsys.readouterr().out
    assert "init_from ignored" in out and f"resumed from {tmp_path / 'run'} at step" in out
    assert snapshot(src) == before

    _, model, tokenizer = load_run(tmp_path / "run")
    train_records = [Record(f"line {i}", v) for i, v in enumerate(values[:-1], 1)]
    examples = encode_examples(train_records, tokenizer, form)
    # Each example alone in a row (right padding, which causal attention keeps out).
    tokens_BT = np.zeros((len(examples), cfg.train.seq_len), np.int32)
    mask_BT = np.zeros_like(tokens_BT)
    for b, (t, m) in enumerate(examples):
        tokens_BT[b, : len(t)], mask_BT[b, : len(m)] = t, m
    logp_BTV = jax.nn.log_softmax(forward(model, jnp.asarray(tokens_BT))[0])
    picked_BT = np.take_along_axis(np.asarray(logp_BTV[:, :-1]), tokens_BT[:, 1:, None], -1)
    ce = -np.sum(picked_BT[..., 0] * mask_BT[:, 1:]) / mask_BT[:, 1:].sum()
    assert ce < LEARNED

    # Greedy decoding of each prompt gives its completion (the last assistant turn) and EOS.
    if form == "prompt_completion":
        prompts = [tokenizer.encode(v["prompt"], add_special_tokens=True) for v in values[:-1]]
        answers = [v["completion"] for v in values[:-1]]
    else:
        history = [v["messages"][:-1] for v in values[:-1]]
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(h)) for h in history]
        answers = [v["messages"][-1]["content"] for v in values[:-1]]
    out = Sampler(model).generate(
        [p.tolist() for p in prompts], 24, temperature=0, stop_tokens=[tokenizer.eos_id]
    )
    for seq, answer in zip(out.sequences(), answers, strict=True):
        assert seq == [*tokenizer.encode(answer).tolist(), tokenizer.eos_id]


# ----------------------------------------------------------------------------- init_from


def test_init_from_restores_the_source_params_onto_the_new_mesh(source, tmp_path):
    """The new run's state: the source's params exactly, laid out over an expert x fsdp mesh
    the source never had; Adam's moments zero, step 0. data.tokenizer may name the source's
    tokenizer files elsewhere (here the HF directory they were imported from)."""
    src, _, hf_dir = source
    jsonl = write_jsonl(tmp_path / "sft.jsonl", PAIRS)
    cfg = finetune_config(
        src,
        tmp_path / "run",
        jsonl,
        "prompt_completion",
        "mesh.data=2",
        "mesh.expert=2",
        "mesh.fsdp=2",
        f"data.tokenizer={hf_dir}",
    )
    tx = make_optimizer(cfg.train)
    mesh = make_mesh(cfg)
    _, abstract = init_state(cfg, tx, abstract=True, mesh=mesh)
    state, _ = start_state(init_source(cfg, None, print), abstract, tx)
    _, model, _ = load_run(src)
    want = nnx.to_flat_state(nnx.state(model, nnx.Param))
    got = dict(nnx.to_flat_state(state["params"]))
    assert len(got) == len(want)
    for path, var in want:
        np.testing.assert_array_equal(np.asarray(got[path][...]), np.asarray(var[...]), str(path))
    expert = next(v[...] for p, v in got.items() if p[-2:] == ("experts", "w_gate"))
    assert "expert" in str(expert.sharding.spec)
    moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0]
    assert len(moments) == 2 * len(want) and not any(np.any(np.asarray(x)) for x in moments)
    assert int(state["step"]) == 0
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- SFT data


def runs(tokenizer, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    """The text of each run of consecutive tokens with mask 1, special tokens spelled out."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [
        tokenizer.library.decode(tokens[a:b].tolist(), skip_special_tokens=False)
        for a, b in zip(edges[::2], edges[1::2], strict=True)
    ]


def test_loss_mask_covers_exactly_the_completion_and_the_assistant_turns(source):
    tok = load_tokenizer(str(source[2]))
    spelled = lambda ids: tok.library.decode(ids.tolist(), skip_special_tokens=False)
    [(tokens, mask)] = encode_examples([Record("x", PAIRS[1])], tok, "prompt_completion")
    assert runs(tok, tokens, mask) == [" Four, of course.<|im_end|>"]
    assert spelled(tokens) == "<|endoftext|>Two plus two? Four, of course.<|im_end|>"

    chat = [
        turn("system", "Be brief."),
        turn("user", "How are you?"),
        turn("assistant", "Fine, thanks."),
        turn("user", "Bye."),
        turn("assistant", "Bye!"),
        turn("user", "Still there?"),  # after the last assistant turn: dropped
    ]
    [(tokens, mask)] = encode_examples([Record("x", {"messages": chat})], tok, "chat")
    assert runs(tok, tokens, mask) == ["Fine, thanks.<|im_end|>\n", "Bye!<|im_end|>\n"]
    whole = tok.apply_chat_template(chat, add_generation_prompt=False)
    assert spelled(tokens) == whole[: whole.index("<|im_start|>user\nStill")]

    # A template whose generation prompt is not how it starts an assistant turn ("(N turns)"):
    # the whole turn is learned, its header included.
    other = HFTokenizer(tok.files | {"chat_template.jinja": CHAT_TEMPLATE.encode()}, "test")
    [(tokens, mask)] = encode_examples([Record("x", {"messages": chat[:3]})], other, "chat")
    assert runs(other, tokens, mask) == ["<|im_start|>assistant\nFine, thanks.<|im_end|>\n"]

    # A template that renders earlier turns otherwise once more turns follow: refused.
    shifting = "{% for m in messages %}{{ m.content }}{{ messages | length }}{% endfor %}"
    bad = HFTokenizer(tok.files | {"chat_template.jinja": shifting.encode()}, "test")
    with pytest.raises(DataError, match="^line 7: the chat template renders the conversation"):
        encode_examples([Record("line 7", {"messages": chat})], bad, "chat")


def test_examples_are_packed_whole_into_windows():
    """Hand-built examples of 3, 4, 2, 5 and 1 tokens into windows of 8: [3 4] [2 5 1]."""
    sizes = [3, 4, 2, 5, 1]
    examples = [
        (np.arange(10 * (i + 1), 10 * (i + 1) + n, dtype=np.int32), np.int32([0] * (n - 1) + [1]))
        for i, n in enumerate(sizes)
    ]
    packed = pack(examples, [f"line {i}" for i in range(5)], 8)
    assert len(packed) == 2
    w0, w1 = packed.window(0), packed.window(1)
    np.testing.assert_array_equal(w0["tokens"], [10, 11, 12, 20, 21, 22, 23, 0])
    np.testing.assert_array_equal(w0["segments"], [1, 1, 1, 2, 2, 2, 2, 0])
    np.testing.assert_array_equal(w0["positions"], [0, 1, 2, 0, 1, 2, 3, 0])
    np.testing.assert_array_equal(w0["loss_mask"], [0, 0, 1, 0, 0, 0, 1, 0])
    np.testing.assert_array_equal(w1["tokens"], [30, 31, 40, 41, 42, 43, 44, 50])
    np.testing.assert_array_equal(w1["segments"], [1, 1, 2, 2, 2, 2, 2, 3])
    np.testing.assert_array_equal(w1["positions"], [0, 1, 0, 1, 2, 3, 4, 0])
    np.testing.assert_array_equal(w1["loss_mask"], [0, 1, 0, 0, 0, 0, 1, 1])
    assert set(packed.window(0)) == {"tokens", "segments", "positions", "loss_mask"}
    assert "positions" not in pack(examples, [""] * 5, 8, positions=False).window(0)
    with pytest.raises(DataError, match="^line 3 is 5 tokens, longer than a window of .* = 4"):
        pack(examples, [f"line {i}" for i in range(5)], 4)


def test_sft_batches_split_and_resume_exactly(tmp_path):
    """Byte tokenizer, 30 pairs: the last 6 validate; train batches cross epochs, and an
    iterator restored from a JSON state (as a checkpoint holds it) goes on exactly as the
    uninterrupted one; the two processes' rows make up the global batch."""
    pairs = [{"prompt": f"q{i}:", "completion": "a" * (1 + i % 7)} for i in range(30)]
    cfg = load_config(
        "configs/tiny.yaml",
        [
            f"data.path={write_jsonl(tmp_path / 'pairs.jsonl', pairs)}",
            "data.sft=prompt_completion",
            "data.val_fraction=0.2",
            "train.seq_len=15",
            "train.batch_size=4",
            "train.eval_batches=3",
        ],
    )
    data = load_run_data(cfg)
    # 24 train examples of 4-11 tokens (no EOS: the byte tokenizer has none) in 16-token windows
    assert len(data.train.starts) - 1 == 24 and len(data.val.starts) - 1 == 6
    assert data.n_train_tokens == sum(len(f"q{i}:") + 1 + i % 7 for i in range(24))
    evals = data.eval_batches(cfg)
    assert len(evals) == 3 and all(b["tokens"].shape == (4, 16) for b in evals)
    # The validation windows, then empty ones (no target) up to 3 x 4.
    assert sum(int(b["segments"].any(axis=1).sum()) for b in evals) == len(data.val)
    learned = sum(int(b["loss_mask"].sum()) for b in evals)
    assert learned == sum(1 + i % 7 for i in range(24, 30))
    # Fewer windows asked for than the split has: evenly spaced ones, the first and the last.
    ends = data.eval_windows(2)
    for got, w in zip(ends, [0, len(data.val) - 1], strict=True):
        np.testing.assert_array_equal(got["tokens"], data.val.window(w)["tokens"])

    straight = data.train_iterator(cfg)
    expected = [next(straight) for _ in range(12)]  # 3 epochs of the train windows and more
    assert 2 * len(data.train) < 12 * 4
    first = data.train_iterator(cfg)
    for _ in range(5):
        next(first)
    state = json.loads(json.dumps(first.get_state()))
    resumed = load_run_data(cfg).train_iterator(cfg)
    resumed.set_state(state)
    for want in expected[5:]:
        got = next(resumed)
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    halves = [data.train_iterator(cfg, p, 2) for p in range(2)]
    for want in expected[:3]:
        rows = [next(h) for h in halves]
        np.testing.assert_array_equal(np.concatenate([r["tokens"] for r in rows]), want["tokens"])


# ----------------------------------------------------------------------------- bad input


def test_bad_input_exits_2_and_writes_nothing(source, tmp_path, capsys):
    src, before, _ = source
    main = runpy.run_path(str(ROOT / "train.py"))["main"]
    lines = {
        "pairs": PAIRS,
        "chats": [{"messages": c} for c in CONVERSATIONS],
        "missing": [PAIRS[0], {"prompt": "no answer"}],
        "array": [PAIRS[0], [1, 2]],
        "no_content": [{"messages": [{"role": "user"}]}],
        "no_assistant": [{"messages": CONVERSATIONS[0]}, {"messages": [turn("user", "Hi.")]}],
        "nothing_to_learn": [{"prompt": "q", "completion": ""}, PAIRS[0]],  # byte: no EOS
        "one": [PAIRS[0]],
        # BOS, 80 x's (the BPE merges none) and EOS: 82 tokens, for a window of 65
        "long": [*PAIRS, {"prompt": "x" * 80, "completion": ""}],
    }
    f = {name: write_jsonl(tmp_path / f"{name}.jsonl", v) for name, v in lines.items()}
    f["broken"] = tmp_path / "broken.jsonl"
    f["broken"].write_text(json.dumps(PAIRS[0]) + "\n\n{not json\n")
    (tmp_path / "empty_run").mkdir()
    plain = tmp_path / "plain_bpe"  # the test tokenizer without its chat template
    write_bpe(plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    quantize_run(src, tmp_path / "int8")
    new = tmp_path / "new"
    base = [str(src / "config.yaml"), f"run_dir={new}", f"init_from={src}"]
    sft = lambda name, form="prompt_completion": [f"data.path={f[name]}", f"data.sft={form}"]
    at = lambda name, line: f"data file '{f[name]}' line {line}"
    cases = [
        ([*base, "moe.top_k=1"], "is a run of another architecture (moe.top_k: 2 -> 1); the"),
        # the default config (tiny's 4 layers) takes the source's 2, but not one given
        ([f"run_dir={new}", f"init_from={src}", "model.n_layers=4"], "(model.n_layers: 2 -> 4)"),
        ([*base[:2], f"init_from={tmp_path / 'none'}"], "init_from: run directory '"),
        ([*base[:2], f"init_from={tmp_path / 'empty_run'}"], "init_from: no checkpoint in"),
        ([*base, "init_step=5"], "init_from: no checkpoint for step 5"),
        ([*base[:2], f"init_from={tmp_path / 'int8'}"], "holds an int8 copy of a run, for infer"),
        ([*base[:1], f"run_dir={src}", f"init_from={src}"], "is run_dir itself"),
        ([*base, *sft("broken")], f"{at('broken', 3)} is not JSON (Expecting property name"),
        ([*base, *sft("missing")], f"{at('missing', 2)} has no 'completion' field"),
        ([*base, *sft("array")], f"{at('array', 2)} holds a JSON list, not an object"),
        ([*base, *sft("no_content", "chat")], f"{at('no_content', 1)} has a message 0 without"),
        ([*base, *sft("no_assistant", "chat")], f"{at('no_assistant', 2)} has no assistant"),
        ([*sft("nothing_to_learn"), f"run_dir={new}"], f"{at('nothing_to_learn', 1)} has no tok"),
        ([*base, *sft("one")], "holds 1 example(s); SFT needs at least 2"),
        ([*base, *sft("long")], f"{at('long', 6)} is 82 tokens, longer than a window of"),
        # a tokenizer without a chat template (the byte one has its built-in template)
        (
            [
                *sft("chats", "chat"),
                f"run_dir={new}",
                f"data.tokenizer={plain}",
                "model.vocab_size=300",
            ],
            "tokenizer has none; use a tokenizer with one",
        ),  # fmt: skip
        ([*sft("pairs"), f"run_dir={new}", "data.tokenizer=char"], "data.tokenizer=char: a char"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
        assert not new.exists()
    assert snapshot(src) == before


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.sft=jsonl", "data.path=x"], "data.sft='jsonl' is not supported"),
        (["data.sft=chat"], "data.sft=chat reads JSONL files: name them with data.path"),
        (
            [
                "data.sft=chat",
                "data.path=x",
                "data.document_mask=false",
                "data.document_positions=false",
            ],
            "needs data.document_mask=true",
        ),
        (["init_step=3"], "init_step is set but init_from is not"),
        (["init_from=''"], "init_from is empty"),
    ],
)
def test_config_refuses_bad_finetuning_keys(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/tiny.yaml", overrides)


def test_a_finetune_from_the_default_config_is_sized_in_epochs(source, tmp_path, capsys):
    """`train.py init_from=SRC train.epochs=3 ...` with no config named: tiny's 4 layers and
    byte vocabulary give way to the source's architecture and tokenizer, tiny's train.steps
    to the epochs; the data line counts them (ceil(3 x windows / batch) steps), the source is
    evaluated at step 0, the run ends at that step with its closing line, and its saved
    config holds the steps, not the epochs (reading it back is no config setting both).
    The same command once the source is gone: the run's own architecture, nothing to do."""
    import shutil

    from moe_jax.config import config_from_yaml

    src = tmp_path / "src"  # a copy, to delete
    shutil.copytree(source[0], src)
    main = runpy.run_path(str(ROOT / "train.py"))["main"]
    jsonl = write_jsonl(tmp_path / "sft.jsonl", PAIRS * 2)
    new = tmp_path / "new"
    argv = [f"init_from={src}", f"run_dir={new}", f"data.path={jsonl}",
            "data.sft=prompt_completion", "train.epochs=3", "train.batch_size=2",
            "train.seq_len=32", "train.eval_batches=1", "train.peak_flops=1e11",
            "train.log_every=1", "train.trackers=[]", "data.val_fraction=0.2"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    windows = load_run_data(
        load_config(new / "config.yaml"), load_tokenizer(str(src / "tokenizer"))
    )
    steps = math.ceil(3 * windows.rows_per_epoch / 2)
    assert windows.rows_per_epoch >= 2 and steps >= 3
    assert (
        f"data: {windows.rows_per_epoch} train windows, 3 epochs: {steps} steps of 2 windows" in out
    )
    assert "eval step 0: val loss" in out and "(unigram baseline" in out
    assert f"step {steps}/{steps} |" in out
    assert f"done: step {steps} in {new / 'checkpoints' / str(steps)}; val_loss " in out
    saved = config_from_yaml((new / "config.yaml").read_text())
    assert (saved.train.steps, saved.train.epochs, saved.model.n_layers) == (steps, None, 2)
    shutil.rmtree(src)
    assert main(argv) == 0
    assert (
        f"is already at step {steps} (asked for {steps}); nothing to do" in capsys.readouterr().out
    )
