"""`python -m moe_jax.prepare` and training on its stores: text, JSONL and Parquet inputs give
the tokens a direct encoding gives (byte, and a byte-level BPE trained here with `tokenizers`),
the store reads back at random, bad input stops with one line and leaves nothing, the run
refuses data of another tokenizer, and a `data.path=DIR` / `data.mixture` run resumes exactly.
Packing and mixing themselves are tested in test_data.py. Budget: ~25 s (three tiny runs)."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_jax.config import ConfigError
from moe_jax.data import load_data
from moe_jax.data.prepared import PreparedData
from moe_jax.data.token_store import TokenStore
from moe_jax.inference.load import load_run
from moe_jax.observe.writers import read_metrics
from moe_jax.prepare import main, prepare
from moe_jax.tokenizer import ByteTokenizer, CharTokenizer, DataError, load_tokenizer
from moe_jax.train.loop import train
from moe_jax.train.step import make_eval_step
from tests.helpers import TINY_BASE, tiny_config
from tests.test_train import TINY, _data_position, _losses

DOCS = ["To be, or not to be:", "that is the question.\n", "Whether 'tis nobler ✓", "x"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    """A byte-level BPE (vocabulary < 300) with an end-of-sequence token, as a tokenizer
    directory: tokenizer.json + tokenizer_config.json naming the EOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS * 20, trainer)
    d = tmp_path_factory.mktemp("bpe")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return d


def _inputs(tmp_path: Path) -> list[Path]:
    """DOCS as one text file per document, a JSONL file and a Parquet file (all four each)."""
    paths = []
    for i, doc in enumerate(DOCS):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_text(doc)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS)))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), parquet)
    return [*paths, jsonl, parquet]


def _direct(tok, docs: list[str]) -> list[np.ndarray]:
    """Each document as the tokenizer encodes a sequence, ended by EOS where it has one."""
    ends = [] if tok.eos_id is None else [tok.eos_id]
    return [np.concatenate([tok.encode(d, add_special_tokens=True), ends]) for d in docs]


def _text(paths: list[str]) -> str:
    return "".join(Path(p).read_text() for p in paths)


def _read(out: Path) -> list[np.ndarray]:
    store = TokenStore.open(out)
    starts = store.doc_starts
    return [store.tokens[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_text_jsonl_and_parquet_give_the_direct_encoding(tmp_path, bpe_dir, kind):
    tok = ByteTokenizer() if kind == "byte" else load_tokenizer(str(bpe_dir))
    inputs = [str(p) for p in _inputs(tmp_path)]
    one = prepare(inputs, tok, tmp_path / "one", workers=1)
    two = prepare(inputs, tok, tmp_path / "two", workers=2)
    want = _direct(tok, DOCS * 3)  # text files, then JSONL, then Parquet
    got = _read(tmp_path / "one")
    assert len(got) == len(want) == one["documents"] == 12
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    if kind == "bpe":
        assert all(g[-1] == tok.eos_id for g in got) and tok.eos_id == 0
        assert tok.vocab_size < 300 and one["dtype"] == "<u2"
    else:
        assert one["dtype"] == "|u1" and one["eos_id"] is None
    # Two workers write the same bytes: chunks are written in input order.
    for name in ("tokens.bin", "documents.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert one["fingerprint"] == two["fingerprint"] and one["tokens"] == sum(map(len, want))


def test_separator_splits_a_text_file_read_in_blocks(tmp_path, monkeypatch):
    from moe_jax.data import inputs

    monkeypatch.setattr(inputs, "TEXT_BLOCK", 7)  # blocks cut the separator and '✓' (3 bytes)
    f = tmp_path / "corpus.txt"
    f.write_text("<sep>".join(DOCS) + "<sep>")  # a trailing separator makes no empty document
    prepare([str(f)], ByteTokenizer(), tmp_path / "out", separator="<sep>")
    assert [bytes(d.astype(np.uint8)).decode() for d in _read(tmp_path / "out")] == DOCS


def test_the_store_reads_back_at_random(tmp_path):
    docs = [f"document {i}: " + "ab" * i for i in range(50)]
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    meta = prepare([str(f)], ByteTokenizer(), tmp_path / "out", field="body")
    store = TokenStore.open(tmp_path / "out")
    stream = "".join(docs).encode()
    assert store.meta == meta | {"inputs": [str(f)]}
    assert meta["documents"] == 50 and meta["tokens"] == len(stream)
    assert meta["tokenizer"] == {"kind": "byte"} and len(meta["tokenizer_hash"]) == 64
    np.testing.assert_array_equal(store.doc_starts, np.cumsum([0] + [len(d) for d in docs]))
    rng = np.random.default_rng(0)
    for a in rng.integers(0, len(stream) - 40, 20):
        assert bytes(store.tokens[a : a + 40]) == stream[a : a + 40]
    assert isinstance(store.tokens, np.memmap)  # random access without reading the file


# ----------------------------------------------------------------------------- bad input


def _fails(capsys, root: Path, argv: list[str], match: str) -> None:
    """The CLI exits 2 with one line naming the problem, and writes nothing under `root`."""
    before = sorted(root.rglob("*"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert match in err, err
    assert sorted(root.rglob("*")) == before  # no store, no temporary sibling, no parent


def test_bad_inputs_stop_with_one_line_and_write_nothing(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "fine"}\n' * 3)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\n\n{"text": "cut\n')
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"text": "a"}\n{"body": "b"}\n')
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["a", "b"]}), table)
    out = str(tmp_path / "new" / "store")  # its parent is made, and removed on failure
    args = ["--tokenizer", "byte", "--out", out, "--workers", "2"]
    # The bad line comes after good input has been written (in a worker): still nothing left.
    fails = lambda argv, match: _fails(capsys, tmp_path, argv, match)
    fails([str(good), str(bad_json), *args], f"{bad_json} line 3 is not JSON")
    fails([str(no_field), *args], f"{no_field} line 2 has no field 'text' (fields: body)")
    fails([str(table), *args], f"Parquet file '{table}' has no column 'text'")
    fails([str(tmp_path / "nope.txt"), *args], "does not exist")
    assert main([str(good), *args]) == 0  # the store exists now: a second run is refused
    capsys.readouterr()
    fails([str(good), "--tokenizer", "byte", "--out", out], "already exists")
    assert main([str(table), "--column", "body", "--tokenizer", "char", "--out", out + "2"]) == 0


# ----------------------------------------------------------------------------- training on it


@pytest.fixture(scope="module")
def stores(tmp_path_factory, bpe_dir):
    """Two byte stores of different text (a document a line), a char store and a BPE store."""
    root = tmp_path_factory.mktemp("stores")
    # Some real text that does not change with this project: the standard library's sources
    # (the embedded corpus's), 24 of them.
    py = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:24]
    paths = {
        "code": prepare(py[: len(py) // 2], ByteTokenizer(), root / "code", separator="\n"),
        "more": prepare(py[len(py) // 2 :], ByteTokenizer(), root / "more", separator="\n"),
        "char": prepare(py[:2], CharTokenizer.from_text(_text(py[:2])), root / "char"),
        "bpe": prepare(py[:2], load_tokenizer(str(bpe_dir)), root / "bpe"),
    }
    return {name: root / name for name in paths}


def test_data_of_another_tokenizer_is_refused(stores, bpe_dir):
    cfg = lambda *o: tiny_config("train.seq_len=32", *o)
    assert isinstance(load_data(cfg(f"data.path={stores['code']}")), PreparedData)
    with pytest.raises(DataError, match=r"made with tokenizer byte .*not data.tokenizer 'char'"):
        load_data(cfg(f"data.path={stores['code']}", "data.tokenizer=char"))
    with pytest.raises(DataError, match=r"made with tokenizer hf .*not data.tokenizer 'byte'"):
        load_data(cfg(f"data.path={stores['bpe']}"))
    bpe = cfg(f"data.path={stores['bpe']}", f"data.tokenizer={bpe_dir}", "model.vocab_size=300")
    assert load_data(bpe).tokenizer.kind == "hf"
    # Resuming a run whose tokenizer is another one (its saved tokenizer is passed in).
    with pytest.raises(DataError, match=r"but run_dir .* trains with char"):
        load_data(cfg(f"data.path={stores['code']}"), CharTokenizer("abc"))
    with pytest.raises(DataError, match=r"mixture: .* were prepared with different tokenizers"):
        load_data(cfg(f"data.mixture='{stores['code']}:1,{stores['bpe']}:1'"))
    with pytest.raises(DataError, match=r"'.*' is not a prepared dataset \(no prepared.json\)"):
        load_data(cfg(f"data.mixture='{stores['code']}:1,{bpe_dir.parent}:1'"))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["data.mixture=a:1,b"], "entry 'b' is not DIR:WEIGHT"),
        (["data.mixture=a:1,b:0"], "entry 'b:0' is not DIR:WEIGHT with a positive weight"),
        (["data.mixture=a:-2"], "positive weight"),
        (["data.mixture=a:1,a:2"], "names a directory twice"),
        (["data.mixture=a:1", "data.path=b"], "data.mixture and data.path are both set"),
        (["data.document_mask=false"], "data.document_positions=true needs data.document_mask"),
    ],
)
def test_bad_mixture_and_packing_settings(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(*overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, stores):
    """A mixture run straight to 4 steps, and a copy of it resumed at its step-2 checkpoint
    (the one a run stopped at 2 saves: checkpoint.every=2; one training run fewer)."""
    root = tmp_path_factory.mktemp("prepared_runs")
    mixture = f"data.mixture='{stores['code']}:3,{stores['more']}:1'"
    cfg = lambda d, *more: tiny_config(*TINY, f"run_dir={d}", mixture, "checkpoint.every=2", *more)
    train(cfg(root / "straight"), stop_at=4)
    shutil.copytree(root / "straight", root / "resumed")
    train(cfg(root / "resumed", "train.resume_step=2"), stop_at=4)
    assert [p.name for p in (root / "resumed/superseded").iterdir()] == ["4"]  # retrained
    return root


def test_a_mixture_run_resumes_exactly(runs):
    straight, resumed = runs / "straight", runs / "resumed"
    # Bit-identical on XLA:CPU (see test_train): any difference in the data would show.
    assert _losses(resumed) == _losses(straight) and sorted(_losses(straight)) == [1, 2, 3, 4]
    for x, y in zip(
        jax.tree.leaves(nnx.state(load_run(straight)[1], nnx.Param)),
        jax.tree.leaves(nnx.state(load_run(resumed)[1], nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(x, y)
    assert _data_position(straight, 4) == _data_position(resumed, 4) == 4


def test_train_on_a_prepared_dir(tmp_path, stores):
    import train as train_py

    run = tmp_path / "run"
    cfg = tiny_config(*TINY, f"run_dir={run}", f"data.path={stores['code']}")
    assert train(cfg, stop_at=2).step == 2  # the mixture runs' compiled step: same shapes
    assert sorted(_losses(run)) == [1, 2] and load_run(run)[2].kind == "byte"
    # The validation loss is the mean over every counted target of the validation batches
    # (they count different numbers: no target across a document boundary), not a mean of
    # the batches' means. Recomputed from the saved model; float32 sums over ~2k targets: 1e-5.
    _, model, _ = load_run(run)
    eval_step = make_eval_step(nnx.graphdef(model), sums=True)
    sums = [eval_step(nnx.state(model, nnx.Param), b) for b in load_data(cfg).eval_batches(cfg)]
    (ce_sums, counts) = np.array(sums, np.float64).T
    assert len(set(counts)) > 1 and counts.max() < 8 * 32  # boundaries in the windows
    val_loss = [r["val_loss"] for r in read_metrics(run) if r["kind"] == "eval"]
    np.testing.assert_allclose(val_loss, [ce_sums.sum() / counts.sum()], rtol=1e-5)
    # Another tokenizer than the prepared one: one line, exit 2, no run dir.
    argv = ["configs/tiny.yaml", *TINY_BASE, *TINY, f"run_dir={tmp_path / 'new'}"]
    assert train_py.main([*argv, f"data.path={stores['char']}"]) == 2
    assert not (tmp_path / "new").exists()
