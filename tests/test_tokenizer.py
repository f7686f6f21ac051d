"""Hugging Face and SentencePiece tokenizers against their own libraries and transformers,
their files kept in a run directory, and the bad-input errors.

The tokenizers are built here, offline, on Tiny Shakespeare: a byte-level BPE trained with
`tokenizers` (300 ids: 256 bytes, 3 special tokens, 41 merges) with a tokenizer_config.json
naming BOS / EOS and a chat template, and a SentencePiece BPE model (256 pieces). Token ids
are compared exactly (both sides run the same library code). Budget: one tiny training run
(2 steps, the programs of tests/test_train.py) and a CLI's failures; ~15 s on 2 cores.
"""

from __future__ import annotations

import io
import json
import runpy
import shutil
from pathlib import Path

import jinja2
import numpy as np
import pytest
import sentencepiece
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from moe_jax.inference.load import read_run_meta
from moe_jax.quantize import quantize_run
from moe_jax.run.checkpoints import keep_tokenizer_files
from moe_jax.run.layout import RunError
from moe_jax.tokenizer import (
    CharTokenizer,
    DataError,
    HFTokenizer,
    SentencePieceTokenizer,
    load_tokenizer,
    tokenizer_from_dict,
)
from moe_jax.tokenizer.files import sha256, write_files
from moe_jax.train.loop import train
from tests.helpers import tiny_config
from tests.test_train import TINY

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"
pytestmark = pytest.mark.skipif(not SHAKESPEARE.is_file(), reason=f"{SHAKESPEARE} not present")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML with what templates from the Hub use: a namespace, loop controls, raise_exception,
# tojson, a {% generation %} block, and whitespace control that trim/lstrip_blocks shape.
CHAT_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(turns=0) %}
{%- for m in messages %}
  {%- if m.role not in ['system', 'user', 'assistant'] %}
    {{- raise_exception('unknown role ' ~ m.role) }}
  {%- endif %}
  {%- if m.content == '' %}{% continue %}{% endif %}
  {%- set ns.turns = ns.turns + 1 %}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}
{%- else %}{{ m.content }}{% endif %}
{% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}
{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant ({{ ns.turns }} turns)
{% endif %}"""
CONVERSATIONS = [
    [{"role": "user", "content": "héllo, 日本 ✓"}],
    [
        {"role": "system", "content": "Speak in verse."},
        {"role": "user", "content": "Who art thou?"},
        {"role": "assistant", "content": "A humble player.", "tool_calls": None},
        {"role": "user", "content": ""},
        {"role": "user", "content": "Say more."},
    ],
    [{"role": "user", "content": "x", "tool_calls": [{"name": "f", "arguments": {"a": "<b>"}}]}],
]


def corpus() -> str:
    return SHAKESPEARE.read_text(encoding="utf-8")


def write_bpe(directory: Path, text: str | None = None) -> Tokenizer:
    """A byte-level BPE (`tokenizers`, 300 ids, trained on `text`, default the corpus' first
    200 kB) that puts <|endoftext|> before a sequence, with tokenizer_config.json: BOS
    <|endoftext|>, EOS <|im_end|>, CHAT_TEMPLATE."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus()[:200_000] if text is None else text], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def write_sentencepiece(path: Path) -> sentencepiece.SentencePieceProcessor:
    """A SentencePiece BPE model of 256 pieces (the tiny model's vocabulary) at `path`."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()[:200_000].splitlines()),
        model_writer=model,
        vocab_size=256,
        model_type="bpe",
        character_coverage=1.0,
        minloglevel=2,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.getvalue())
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bpe")
    return directory, write_bpe(directory)


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    return path, write_sentencepiece(path)


TEXTS = ["First Citizen:\nBefore we proceed", "héllo, 日本 ✓ <|im_end|>", "", " \n\t x"]


# ----------------------------------------------------------------------------- the libraries


def test_hf_tokenizer_encodes_and_decodes_as_its_library(bpe):
    directory, library = bpe
    tok = load_tokenizer(str(directory))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 300
    assert (tok.bos_id, tok.eos_id) == (0, 2)  # <|endoftext|>, <|im_end|>
    text = corpus()[-5000:]
    for t in [text, *TEXTS]:
        ids = tok.encode(t)
        assert (
            ids.dtype == np.int32
            and ids.tolist() == library.encode(t, add_special_tokens=False).ids
        )
        assert tok.encode(t, add_special_tokens=True).tolist() == library.encode(t).ids
        assert tok.decode(ids) == library.decode(ids.tolist())
    assert tok.decode(tok.encode(TEXTS[0])) == TEXTS[0]  # byte-level: lossless
    batch = tok.encode_batch(TEXTS)
    assert [b.tolist() for b in batch] == [tok.encode(t).tolist() for t in TEXTS]
    assert tok.encode_bytes(text.encode(), "f").tolist() == tok.encode(text).tolist()
    # A file of tokenizer.json alone: no config, so no special tokens or template.
    alone = load_tokenizer(str(directory / "tokenizer.json"))
    assert (alone.bos_id, alone.eos_id, alone.chat_template) == (None, None, None)
    assert alone.encode(text).tolist() == tok.encode(text).tolist()


def test_sentencepiece_tokenizer_encodes_and_decodes_as_its_library(spm, tmp_path):
    path, library = spm
    tok = load_tokenizer(str(path))  # the .model file itself
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 256
    assert (tok.bos_id, tok.eos_id) == (library.bos_id(), library.eos_id())
    text = corpus()[-5000:]
    for t in [text, *TEXTS]:
        ids = tok.encode(t)
        assert ids.dtype == np.int32 and ids.tolist() == library.encode(t)
        assert tok.encode(t, add_special_tokens=True).tolist() == library.encode(t)
        assert tok.decode(ids) == library.decode(ids.tolist())
    batch = tok.encode_batch(TEXTS)
    assert [b.tolist() for b in batch] == [library.encode(t) for t in TEXTS]
    # Control tokens written in the text are tokens (as a chat template writes them).
    mixed = tok.encode("<s>First Citizen</s>").tolist()
    assert mixed == [library.bos_id(), *library.encode("First Citizen"), library.eos_id()]
    # A directory: tokenizer_config.json says what add_special_tokens adds.
    shutil.copy(path, tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text('{"add_bos_token": true}')
    in_dir = load_tokenizer(str(tmp_path))
    assert in_dir.encode("Citizen", add_special_tokens=True).tolist() == [
        library.bos_id(),
        *library.encode("Citizen"),
    ]


def test_chat_template_renders_as_transformers(bpe):
    transformers = pytest.importorskip("transformers", reason="the reference is transformers")
    directory, _ = bpe
    ours = load_tokenizer(str(directory))
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    for messages in CONVERSATIONS:
        for opened in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=opened)
            want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=opened)
            assert text == want
            ids = ref.apply_chat_template(messages, add_generation_prompt=opened, return_dict=False)
            assert ours.encode(text).tolist() == ids
    with_bos = ours.encode("Thou art", add_special_tokens=True)
    assert with_bos.tolist() == ref("Thou art")["input_ids"]
    robot = [{"role": "robot", "content": "beep"}]
    with pytest.raises(jinja2.TemplateError, match="robot"):
        ref.apply_chat_template(robot, tokenize=False)
    with pytest.raises(
        DataError, match=r"^the tokenizer's chat template failed: unknown role robot$"
    ):
        ours.apply_chat_template(robot)


def test_chat_template_sources_in_transformers_order(bpe, tmp_path):
    """chat_template.jinja over tokenizer_config.json over chat_template.json; named
    templates pick "default"; a tokenizer without one says so."""
    directory, _ = bpe
    shutil.copy(directory / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {
        "chat_template": [{"name": "default", "template": "A"}, {"name": "x", "template": "X"}]
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.json").write_text('{"chat_template": "C"}')
    assert load_tokenizer(str(tmp_path)).apply_chat_template([]) == "A"
    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token }}")
    assert load_tokenizer(str(tmp_path)).apply_chat_template([]) == "J"  # no eos_token: ''
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").unlink()
    assert load_tokenizer(str(tmp_path)).apply_chat_template([]) == "C"
    (tmp_path / "chat_template.json").unlink()
    with pytest.raises(DataError, match="has no chat template"):
        load_tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "hi"}])
    # the built-in tokenizers' plain-text template: a turn a line, the reply after "assistant: "
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for kind in ("byte", CharTokenizer("abcdefghijklmnopqrstuvwxyzBH.: \n")):
        tok = load_tokenizer(kind) if isinstance(kind, str) else kind
        assert tok.apply_chat_template(turns) == "system: Be brief.\nuser: Hi\nassistant: "
        done = [*turns, {"role": "assistant", "content": "Hello"}]
        text = tok.apply_chat_template(done, add_generation_prompt=False)
        assert text == "system: Be brief.\nuser: Hi\nassistant: Hello\n"
        assert tok.decode(tok.encode(text)) == text


SAMPLE = runpy.run_path(str(ROOT / "sample.py"))


def test_sample_py_streams_whole_characters_and_keeps_spaces(bpe, spm, capsys):
    """A character split over byte tokens prints whole (no U+FFFD on the way), and a token
    decoded after the prompt keeps the space SentencePiece drops at the start of a text."""
    tok = load_tokenizer(str(bpe[0]))
    prompt, new = "Say ", "日本 ✓"
    ids = tok.encode(new).tolist()
    assert len(ids) > len(new)  # the characters span several tokens
    streamer, chunks = SAMPLE["Streamer"](tok, prompt, tok.encode(prompt).tolist()), []
    for i in ids:
        streamer(0, np.array([i]))
        chunks.append(capsys.readouterr().out)
    streamer.flush()
    chunks.append(capsys.readouterr().out)
    assert "".join(chunks) == prompt + new and not any("\ufffd" in c for c in chunks)

    path, library = spm
    sp = load_tokenizer(str(path))
    prompt_ids, whole = sp.encode("First").tolist(), library.encode("First Citizen")
    assert whole[: len(prompt_ids)] == prompt_ids
    new_ids = whole[len(prompt_ids) :]
    assert library.decode(new_ids) == "Citizen"  # alone, the space is lost
    assert SAMPLE["continuation"](sp, prompt_ids, new_ids) == " Citizen"


def test_saved_form_reads_the_files_back_and_checks_them(bpe, tmp_path):
    directory, _ = bpe
    tok = load_tokenizer(str(directory))
    d = json.loads(json.dumps(tok.to_dict()))
    names = ["tokenizer.json", "tokenizer_config.json"]
    assert d == {"kind": "hf", "files": {n: sha256((directory / n).read_bytes()) for n in names}}
    saved = tmp_path / "tokenizer"
    write_files(tok.files, saved)
    back = tokenizer_from_dict(d, saved)
    assert back.to_dict() == d and back.encode(TEXTS[1]).tolist() == tok.encode(TEXTS[1]).tolist()
    config = saved / "tokenizer_config.json"
    config.write_text(config.read_text().replace("<|im_end|>", "<|im_start|>"))
    with pytest.raises(DataError, match=r"tokenizer_config.json' changed after the checkpoint"):
        tokenizer_from_dict(d, saved)
    config.unlink()
    with pytest.raises(DataError, match=r"tokenizer_config.json' is missing; a run directory"):
        tokenizer_from_dict(d, saved)


def test_a_run_dir_gets_the_files_once_and_keeps_the_ones_its_checkpoints_need(bpe, tmp_path):
    directory, _ = bpe
    tok = load_tokenizer(str(directory))
    run, saved = tmp_path / "run", tmp_path / "run" / "tokenizer"
    run.mkdir()
    keep_tokenizer_files(run, tok, checkpointed=False)
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == tok.files
    (saved / "notes.txt").write_text("mine")  # another file there does no harm
    keep_tokenizer_files(run, tok, checkpointed=True)
    other_dir = tmp_path / "other"
    shutil.copytree(directory, other_dir)
    (other_dir / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    other = load_tokenizer(str(other_dir))
    with pytest.raises(RunError, match="holds other files than the tokenizer this run trains"):
        keep_tokenizer_files(run, other, checkpointed=True)
    keep_tokenizer_files(run, other, checkpointed=False)  # a start that saved no checkpoint
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == other.files


# ----------------------------------------------------------------------------- a training run


def test_a_run_keeps_its_tokenizer_files_and_needs_no_other_copy(spm, tmp_path):
    """train.py's data.tokenizer=PATH: the files go to RUN_DIR/tokenizer with their SHA-256s in
    the checkpoint, so the run resumes after the source is gone and the run dir has moved,
    and an int8 copy carries them too; a changed or missing saved file is refused by name."""
    path, library = spm
    source = tmp_path / "source" / "tokenizer.model"
    source.parent.mkdir()
    shutil.copy(path, source)
    run, moved = tmp_path / "run", tmp_path / "moved"
    over = [f"data.tokenizer={source}", f"data.path={SHAKESPEARE}"]
    assert train(tiny_config(*TINY, f"run_dir={run}", *over), stop_at=1).step == 1
    assert (run / "tokenizer" / "tokenizer.model").read_bytes() == path.read_bytes()
    recorded = json.loads(next((run / "checkpoints/1/meta").glob("*")).read_text())["tokenizer"]
    assert recorded == {
        "kind": "sentencepiece",
        "files": {"tokenizer.model": sha256(path.read_bytes())},
    }

    shutil.rmtree(source.parent)
    run.rename(moved)
    assert train(tiny_config(*TINY, f"run_dir={moved}", *over), stop_at=2).step == 2
    tok = read_run_meta(moved)["tokenizer"]
    assert tok.encode(TEXTS[0]).tolist() == library.encode(TEXTS[0])
    quantize_run(moved, tmp_path / "int8")  # the other writer of run directories
    assert read_run_meta(tmp_path / "int8")["tokenizer"].to_dict() == recorded

    saved = moved / "tokenizer" / "tokenizer.model"
    saved.write_bytes(saved.read_bytes() + b"\0")
    with pytest.raises(
        RunError, match=r"^checkpoint 2 in '.*moved': its tokenizer file .* changed"
    ):
        read_run_meta(moved)
    saved.unlink()
    with pytest.raises(RunError, match=r"tokenizer.model' is missing; a run directory must be"):
        read_run_meta(moved)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "none", r"tokenizer path '{d}/none' does not exist; a tokenizer is byte"),
        (lambda d: d, r"directory '{d}' holds neither tokenizer.json nor tokenizer.model"),
        (lambda d: _write(d / "vocab.txt", b"a"), r"tokenizer path '{d}/vocab.txt' is not a .json"),
        (
            lambda d: _write(d / "tokenizer.json", b'{"model": 3}'),
            r"'{d}/tokenizer.json' is not a valid Hugging Face tokenizer.json \(",
        ),
        (
            lambda d: _write(d / "x.model", b"\x01garbage"),
            r"'{d}/x.model' is not a valid SentencePiece model \(",
        ),
    ],
    ids=["missing", "no-tokenizer-in-dir", "other-file", "bad-json", "bad-model"],
)
def test_unreadable_tokenizer_paths_are_named(tmp_path, make, message):
    with pytest.raises(DataError, match="^" + message.format(d=tmp_path)):
        load_tokenizer(str(make(tmp_path)))


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_bad_tokenizer_configs_are_named(bpe, tmp_path):
    directory, _ = bpe
    shutil.copy(directory / "tokenizer.json", tmp_path / "tokenizer.json")
    config = tmp_path / "tokenizer_config.json"
    for text, message in [
        ("{", r"tokenizer_config.json next to '.*' is not valid JSON"),
        ('{"eos_token": "<eos>"}', r"eos_token '<eos>' of the config .* is not in the tokenizer's"),
        ('{"bos_token": 3}', r"bos_token in the config next to .* must be a string"),
    ]:
        config.write_text(text)
        with pytest.raises(DataError, match=message):
            load_tokenizer(str(tmp_path))


TRAIN_MAIN = runpy.run_path(str(ROOT / "train.py"))["main"]


def test_train_py_refuses_a_bad_tokenizer_before_writing(bpe, tmp_path, capsys, monkeypatch):
    """One line, exit 2, no run directory: a missing path, a file that does not parse, and a
    vocabulary larger than model.vocab_size (the BPE has 300 ids, tiny.yaml's model 256)."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "bad.json").write_text("not json")
    directory, _ = bpe
    run = tmp_path / "run"
    for spec, message in [
        (tmp_path / "missing", f"tokenizer path '{tmp_path}/missing' does not exist"),
        (tmp_path / "bad.json", "is not a valid Hugging Face tokenizer.json"),
        (
            directory,
            "the hf tokenizer has 300 tokens but model.vocab_size is 256; set "
            "model.vocab_size=300 (or larger)",
        ),
    ]:
        assert TRAIN_MAIN([f"run_dir={run}", f"data.tokenizer={spec}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
        assert not run.exists()


@pytest.mark.parametrize("kind", ["byte", "char"])
def test_builtin_tokenizers_export_as_files_transformers_loads_alike(kind, tmp_path):
    """An exported byte- or char-tokenized model leaves with a tokenizer.json and its chat
    template: transformers' tokenizer encodes, decodes and renders chats as ours does."""
    transformers = pytest.importorskip("transformers", reason="the interop extra")
    from moe_jax.tokenizer.as_hf import hf_files

    text = "héllo wörld\n  x 日本: \x00\xff" if kind == "byte" else "the cat: sat\n\n on  a mat"
    tok = load_tokenizer("byte") if kind == "byte" else CharTokenizer.from_text(text + "usera")
    for name, data in hf_files(tok).items():
        (tmp_path / name).write_bytes(data)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = theirs.encode(text, add_special_tokens=False)
    assert ids == tok.encode(text).tolist()
    assert theirs.decode(ids) == tok.decode(ids) == text
    assert theirs.decode(ids[:3]) == tok.decode(ids[:3])  # a cut character: U+FFFD alike
    turns = [{"role": "user", "content": "a cat"}]
    rendered = theirs.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert rendered == tok.apply_chat_template(turns)
