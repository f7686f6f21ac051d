"""Tokenizers, corpora, the Grain pipeline (windows, shuffle, sharding, exact state restore)
and the bad-input errors. No model is compiled here; budget: a few seconds."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from moe_jax.data import load_data
from moe_jax.data.corpus import embedded_sources, eval_batches, train_dataset, train_iterator
from moe_jax.data.prepared import Part, PreparedData, prepared_train_dataset
from moe_jax.data.token_store import TokenStore
from moe_jax.data.windows import pack_window
from moe_jax.tokenizer import ByteTokenizer, CharTokenizer, DataError, tokenizer_from_dict
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


# ----------------------------------------------------------------------------- packed windows


def _store(tokens, doc_starts) -> TokenStore:
    """An in-memory store: what `TokenStore.open` maps from a prepared directory."""
    tokens, doc_starts = np.asarray(tokens, np.int32), np.asarray(doc_starts, np.int64)
    return TokenStore(Path("mem"), {}, tokens, np.append(doc_starts, len(tokens)))


# Documents [0, 3), [3, 7), [7, 8), [8, 12): hand-computed windows of 6 tokens.
DOC_STARTS = [0, 3, 7, 8]
PACKED = [
    # start, segments, positions
    (0, [1, 1, 1, 2, 2, 2], [0, 1, 2, 0, 1, 2]),  # a document starts the window
    (1, [1, 1, 2, 2, 2, 2], [0, 1, 0, 1, 2, 3]),  # the first document is cut: counts from 0
    (2, [1, 2, 2, 2, 2, 3], [0, 0, 1, 2, 3, 0]),  # one-token piece each side of the window
    (4, [1, 1, 1, 2, 3, 3], [0, 1, 2, 0, 0, 1]),  # a one-token document inside
    (6, [1, 2, 3, 3, 3, 3], [0, 0, 0, 1, 2, 3]),  # the window's last token is a last token
]


@pytest.mark.parametrize(("start", "segments", "positions"), PACKED)
def test_packed_window_segments_and_positions(start, segments, positions):
    store = _store(np.arange(12) + 100, DOC_STARTS)
    w = pack_window(store.tokens, store.doc_starts, start, 6)
    assert w.keys() == {"tokens", "segments", "positions"}
    assert all(a.dtype == np.int32 and a.shape == (6,) for a in w.values())
    assert list(w["tokens"]) == list(range(100 + start, 106 + start))
    assert list(w["segments"]) == segments and list(w["positions"]) == positions
    # Packing switched off: no segments (attention crosses documents), or default positions.
    assert pack_window(store.tokens, store.doc_starts, start, 6, True, False).keys() == {
        "tokens",
        "segments",
    }
    assert pack_window(store.tokens, store.doc_starts, start, 6, False, False).keys() == {"tokens"}


def _packed_cfg(*overrides):
    return tiny_config(
        "train.seq_len=5", "train.batch_size=4", "data.val_fraction=0.25", *overrides
    )


def test_train_windows_step_by_seq_len_and_each_epoch_is_a_fresh_permutation():
    """Train split [0, 41): windows of 6 at starts 0, 5, ..., 35 (8 windows): every train token
    but the first is a target exactly once an epoch; each batch row is `pack_window`'s."""
    store = _store(np.arange(55), [0, 9, 20, 21, 40])
    part = Part(store, 1.0, split=41)
    ds = prepared_train_dataset([part], _packed_cfg(), 0, 1)
    epochs = [[], []]
    for i in range(4):  # 2 epochs of 2 batches of 4
        batch = ds[i]
        assert {k: v.shape for k, v in batch.items()} == {
            k: (4, 6) for k in ("tokens", "segments", "positions")
        }
        for row in range(4):
            start = int(batch["tokens"][row, 0])
            want = pack_window(store.tokens, store.doc_starts, start, 6)
            for k in want:
                np.testing.assert_array_equal(batch[k][row], want[k])
            epochs[i // 2].append(start)
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(0, 40, 5))
    assert epochs[0] != epochs[1]
    # Process p of 2 reads rows [2p, 2p + 2) of each global batch.
    halves = [prepared_train_dataset([part], _packed_cfg(), p, 2) for p in (0, 1)]
    for i in range(4):
        np.testing.assert_array_equal(
            np.concatenate([h[i]["segments"] for h in halves]), ds[i]["segments"]
        )


def test_mixture_follows_the_weights_and_resumes_exactly():
    """Three parts of constant tokens 1, 2, 3 weighted 5:3:2 (any scale): over 800 windows
    each part's share is within 0.5 % of its weight (Grain mixes by a fixed interleave, within
    one window per part of exact at every prefix: 1/800 < 0.5 %)."""
    parts = [
        Part(_store(np.full(300, t), [0, 100, 200]), w, 240) for t, w in [(1, 5), (2, 3), (3, 2)]
    ]
    cfg = _packed_cfg("train.batch_size=8")
    it = PreparedData(ByteTokenizer(), tuple(parts), "", "", 0.0).train_iterator(cfg)
    first = [next(it)["tokens"][:, 0] for _ in range(100)]
    share = np.bincount(np.concatenate(first), minlength=4)[1:] / 800
    np.testing.assert_allclose(share, [0.5, 0.3, 0.2], atol=0.005)
    # The iterator state (what a checkpoint saves) resumes the stream exactly.
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(3)]
    fresh = PreparedData(ByteTokenizer(), tuple(parts), "", "", 0.0).train_iterator(cfg)
    fresh.set_state(state)
    for w in want:
        got = next(fresh)
        for k in w:
            np.testing.assert_array_equal(got[k], w[k])


def test_validation_windows_are_evenly_spaced_in_each_split_by_weight():
    a = Part(_store(np.arange(1000), [0, 500]), 3.0, split=800)
    b = Part(_store(np.arange(1000) + 1000, [0]), 1.0, split=900)
    cfg = _packed_cfg("train.batch_size=4", "train.eval_batches=2")  # 8 windows: 6 + 2
    data = PreparedData(ByteTokenizer(), (a, b), "", "", 0.0)
    batches = data.eval_batches(cfg)
    starts = np.concatenate([v["tokens"][:, 0] for v in batches])
    want = [*np.linspace(800, 994, 6).round(), *(np.linspace(900, 994, 2).round() + 1000)]
    assert list(starts) == want
    halves = [data.eval_batches(cfg, p, 2) for p in (0, 1)]
    for i in range(2):
        np.testing.assert_array_equal(
            np.concatenate([h[i]["positions"] for h in halves]), batches[i]["positions"]
        )
