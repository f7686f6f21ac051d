"""Tokenizers, corpora, the Grain pipeline (windows, shuffle, sharding, exact state restore)
and the bad-input errors. No model is compiled here; budget: a few seconds."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from moe_jax.data import (
    DataError,
    embedded_sources,
    eval_batches,
    load_data,
    train_dataset,
    train_iterator,
)
from moe_jax.tokenizer import ByteTokenizer, CharTokenizer, tokenizer_from_dict
from tests.helpers import tiny_config

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and list(ids) == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_char_tokenizer_vocabulary_round_trip_and_unknown_characters():
    tok = CharTokenizer.from_text("to be or not to be")
    assert tok.chars == " benort" and tok.vocab_size == 7
    assert list(tok.encode("be")) == [1, 2]
    assert tok.decode(tok.encode("not to be")) == "not to be"
    with pytest.raises(DataError, match=r"not in the char tokenizer's vocabulary: 'x'"):
        tok.encode("box")


@pytest.mark.parametrize("tok", [ByteTokenizer(), CharTokenizer("ab\nc")])
def test_tokenizer_saved_form_round_trips(tok):
    back = tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))
    assert type(back) is type(tok) and back.vocab_size == tok.vocab_size
    np.testing.assert_array_equal(back.encode("cab\n"), tok.encode("cab\n"))


# ----------------------------------------------------------------------------- corpora


def test_embedded_corpus_is_whole_sorted_stdlib_files_within_the_cap():
    cap = 300_000
    a, b = embedded_sources(cap), embedded_sources(cap)
    assert [s.raw for s in a] == [s.raw for s in b]  # deterministic
    names = [s.name.split("/")[-1] for s in a]
    assert names == sorted(names)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    all_files = sorted(p.name for p in stdlib.glob("*.py"))
    assert names == all_files[: len(names)]  # a prefix of the sorted list: nothing skipped
    for s in a:
        assert s.raw == (stdlib / s.name.split("/")[-1]).read_bytes()  # whole files
    total = sum(len(s.raw) for s in a)
    next_size = (stdlib / all_files[len(names)]).stat().st_size
    assert total <= cap < total + next_size


def test_load_data_splits_the_token_stream_at_val_fraction(tmp_path):
    text = "abcdefghij" * 100
    f = tmp_path / "t.txt"
    f.write_text(text)
    cfg = tiny_config(f"data.path={f}", "data.val_fraction=0.25", "train.seq_len=16")
    data = load_data(cfg)
    assert len(data.val) == 250 and len(data.train) == 750
    np.testing.assert_array_equal(
        np.concatenate([data.train, data.val]), np.frombuffer(text.encode(), np.uint8)
    )
    # Uniform over 10 symbols: entropy ln 10.
    assert data.val_unigram_entropy == pytest.approx(math.log(10), abs=1e-12)


def test_files_and_globs_are_read_in_order(tmp_path):
    for name, body in [("b.txt", "BBBB" * 20), ("a.txt", "AAAA" * 20), ("c.md", "CCCC" * 20)]:
        (tmp_path / name).write_text(body)
    cfg = tiny_config(f"data.path='{tmp_path}/c.md,{tmp_path}/*.txt'", "train.seq_len=8")
    data = load_data(cfg)
    tokens = np.concatenate([data.train, data.val]).astype(np.uint8).tobytes().decode()
    assert tokens == "CCCC" * 20 + "AAAA" * 20 + "BBBB" * 20


def test_char_tokenizer_is_built_from_the_corpus(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello world\n" * 50)
    data = load_data(tiny_config(f"data.path={f}", "data.tokenizer=char", "train.seq_len=8"))
    assert data.tokenizer.chars == "\n dehlorw"
    assert data.tokenizer.decode(data.train[:12]) == "hello world\n"


# ----------------------------------------------------------------------------- pipeline


def _starts(batch_BT1: np.ndarray) -> list[int]:
    """Start offsets of windows cut from tokens = arange(N) (each window is consecutive)."""
    assert (np.diff(batch_BT1, axis=1) == 1).all()
    return list(batch_BT1[:, 0])


def test_windows_are_contiguous_and_each_epoch_is_a_fresh_permutation():
    tokens = np.arange(40, dtype=np.int32)  # window 8 -> start offsets 0..32: 33 windows
    ds = train_dataset(tokens, seq_len=7, global_batch=3, seed=5)
    batches = [ds[i] for i in range(22)]  # exactly two epochs of 11 batches
    assert all(b.shape == (3, 8) and b.dtype == np.int32 for b in batches)
    epoch1 = sum((_starts(b) for b in batches[:11]), [])
    epoch2 = sum((_starts(b) for b in batches[11:]), [])
    assert sorted(epoch1) == list(range(33)) == sorted(epoch2)
    assert epoch1 != epoch2 and epoch1 != list(range(33))


def test_a_batch_of_one_walks_the_same_order():
    tokens = np.arange(40, dtype=np.int32)
    ones = train_iterator(tokens, seq_len=7, global_batch=1, seed=5)
    threes = train_iterator(tokens, seq_len=7, global_batch=3, seed=5)
    assert sum((_starts(next(ones)) for _ in range(12)), []) == sum(
        (_starts(next(threes)) for _ in range(4)), []
    )


def test_same_seed_same_order_different_seed_different_order():
    tokens = np.arange(1000, dtype=np.int32)
    take = lambda seed: [
        _starts(next(it)) for it in [train_iterator(tokens, 15, 4, seed)] for _ in range(5)
    ]
    assert take(0) == take(0)
    assert take(0) != take(1)


def test_process_shards_are_contiguous_row_blocks_of_the_global_batch():
    tokens = np.arange(500, dtype=np.int32)
    whole = train_iterator(tokens, 9, 8, seed=3)
    shards = [
        train_iterator(tokens, 9, 8, seed=3, process_index=p, process_count=4) for p in range(4)
    ]
    for _ in range(6):
        np.testing.assert_array_equal(next(whole), np.concatenate([next(s) for s in shards]))
    with pytest.raises(DataError, match="divisible by the number of processes"):
        train_iterator(tokens, 9, 6, seed=3, process_index=0, process_count=4)


@pytest.mark.parametrize("num_threads", [0, 2])
def test_iterator_state_restores_the_exact_position(num_threads):
    tokens = np.arange(3000, dtype=np.int32)
    it = train_iterator(tokens, 31, 4, seed=7, num_threads=num_threads)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # what the checkpoint stores
    expected = [next(it) for _ in range(4)]
    fresh = train_iterator(tokens, 31, 4, seed=7, num_threads=num_threads)
    fresh.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(fresh), want)


def test_eval_batches_are_fixed_evenly_spaced_windows():
    tokens = np.arange(1000, dtype=np.int32)
    batches = eval_batches(tokens, seq_len=9, global_batch=4, n_batches=3)
    starts = sum((_starts(b) for b in batches), [])
    assert starts == list(np.linspace(0, 990, 12).round().astype(int))
    halves = [eval_batches(tokens, 9, 4, 3, process_index=p, process_count=2) for p in (0, 1)]
    for i in range(3):
        np.testing.assert_array_equal(np.concatenate([halves[0][i], halves[1][i]]), batches[i])


# ----------------------------------------------------------------------------- bad input


def test_missing_path_glob_and_directory(tmp_path):
    with pytest.raises(DataError, match=r"data file '.*nope.txt' does not exist"):
        load_data(tiny_config(f"data.path={tmp_path}/nope.txt"))
    with pytest.raises(DataError, match=r"glob '.*\*.zzz' matches no file"):
        load_data(tiny_config(f"data.path='{tmp_path}/*.zzz'"))
    with pytest.raises(DataError, match="is a directory"):
        load_data(tiny_config(f"data.path={tmp_path}"))


def test_empty_file(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"data file '.*empty.txt' is empty"):
        load_data(tiny_config(f"data.path={tmp_path}/empty.txt"))


def test_corpus_shorter_than_one_window(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("x" * 300)  # val split: 30 tokens < seq_len + 1 = 33
    with pytest.raises(DataError, match=r"300 tokens: too short for one window of .* = 33"):
        load_data(tiny_config(f"data.path={f}", "train.seq_len=32", "data.val_fraction=0.1"))


def test_undecodable_bytes_for_the_char_tokenizer(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 20)
    cfg = tiny_config(f"data.path={f}", "data.tokenizer=char", "train.seq_len=8")
    with pytest.raises(DataError, match=r"not valid UTF-8 \(byte 0xe9 at offset 3\)"):
        load_data(cfg)
    # The byte tokenizer takes any bytes.
    assert len(load_data(tiny_config(f"data.path={f}", "train.seq_len=8")).train) > 0


def test_vocabulary_larger_than_the_model(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abcdefgh" * 40)
    cfg = tiny_config(
        f"data.path={f}", "data.tokenizer=char", "model.vocab_size=4", "train.seq_len=8"
    )
    with pytest.raises(DataError, match="char tokenizer has 8 tokens .* set model.vocab_size=8"):
        load_data(cfg)


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason=f"{SHAKESPEARE} not present")
def test_tinyshakespeare_char_vocabulary():
    data = load_data(tiny_config(f"data.path={SHAKESPEARE}", "data.tokenizer=char"))
    assert data.tokenizer.vocab_size == 65  # the classic char-rnn alphabet
