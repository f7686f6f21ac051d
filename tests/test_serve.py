"""The OpenAI-compatible server (moe_jax/serve) through the official `openai` client against a
live server on 127.0.0.1: a tiny run with a byte-level BPE and a ChatML template, served by
uvicorn in a thread of this process (the run loaded as `python -m moe_jax.serve` loads it).

Greedy texts are checked against `Sampler.generate` decoded (the engine equals it token for
token, tests/test_engine.py); streams against the same request unstreamed.
Budget: ~20 s on 2 CPU cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (fastapi, uvicorn) is not installed")
openai = pytest.importorskip("openai", reason="the openai client is not installed")

import httpx  # noqa: E402  (after the skips: installed with openai)
import uvicorn  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from moe_jax.data.corpus import train_iterator  # noqa: E402
from moe_jax.inference.engine import Engine  # noqa: E402
from moe_jax.inference.load import load_sampler  # noqa: E402
from moe_jax.run.checkpoints import Checkpointer  # noqa: E402
from moe_jax.serve.app import create_app  # noqa: E402
from moe_jax.serve.worker import Worker, stats_line  # noqa: E402
from moe_jax.tokenizer import load_tokenizer  # noqa: E402
from moe_jax.train.step import init_state, make_optimizer  # noqa: E402
from tests.helpers import forward, tiny_config  # noqa: E402

CORPUS = "the quick brown fox jumps over the lazy dog. " * 20
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
N = 12


def write_tokenizer(directory):
    """A byte-level BPE (262 ids: 256 bytes, 3 specials, a few merges) with ChatML."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=262,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(str(directory))


def write_run(root, tokenizer, *overrides):
    """A tiny run (one checkpoint of its initial params) -> its directory."""
    run = root / "tiny"
    cfg = tiny_config(
        "model.init_std=0.05", "model.n_layers=2", "attention.nope_interval=2",
        "model.vocab_size=264", "model.max_seq_len=128", "train.seq_len=64", f"run_dir={run}",
        *overrides,
    )  # fmt: skip
    _, state = init_state(cfg, make_optimizer(cfg.train))
    batches = train_iterator(tokenizer.encode(CORPUS), 16, 4, cfg.seed)
    ckpt = Checkpointer(cfg)
    ckpt.save(1, state["params"], state["opt_state"], batches,
              {"config": cfg, "tokenizer": tokenizer, "fingerprint": "test"})  # fmt: skip
    ckpt.close()
    return run


@contextlib.contextmanager
def serving(engine, tokenizer):
    """The app on `engine` served by uvicorn in a thread -> its base URL."""
    config = uvicorn.Config(create_app(engine, tokenizer, "tiny"), host="127.0.0.1", port=0,
                            log_level="warning")  # fmt: skip
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, engine, sampler, tokenizer, run dir) of a live server on a fresh tiny run."""
    root = tmp_path_factory.mktemp("serve")
    run = write_run(root, write_tokenizer(root / "tok"))
    _, sampler, tokenizer = load_sampler(run)
    engine = Engine(sampler, max_slots=4, page_size=16, chunk=16, max_queue=64,
                    vocab_size=tokenizer.vocab_size)  # fmt: skip
    with serving(engine, tokenizer) as base:
        yield base, engine, sampler, tokenizer, run


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def greedy_text(server, ids, n=N) -> tuple[str, str]:
    """(text, finish reason) of Sampler greedy for `ids`, cut at EOS as the server cuts."""
    sampler, tok = server[2], server[3]
    out = sampler.generate(
        [ids], n, temperature=0, stop_tokens=[tok.eos_id], vocab_size=tok.vocab_size
    ).sequences()[0]
    if out[-1] == tok.eos_id:
        return tok.decode(out[:-1]), "stop"
    return tok.decode(out), "length"


def test_health_and_models(server, client):
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert "moe_jax_pages_total" in httpx.get(server[0] + "/metrics").text


def test_completion_is_greedy_and_the_stream_concatenates_to_it(server, client):
    prompt = "the quick brown"
    ids = server[3].encode(prompt, add_special_tokens=True).tolist()
    text, reason = greedy_text(server, ids)
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=N, temperature=0)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (text, reason)
    assert whole.usage.prompt_tokens == len(ids)
    chunks = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=N, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == text


def test_chat_with_the_template_streamed_and_not_with_seeds(server, client):
    messages = [{"role": "user", "content": "a lazy dog?"}]
    tok = server[3]
    ids = tok.encode(tok.apply_chat_template(messages)).tolist()
    text, _ = greedy_text(server, ids)
    greedy = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=N, temperature=0
    )
    assert greedy.choices[0].message.content == text
    ask = dict(model="tiny", messages=messages, max_tokens=N, temperature=1.0, top_p=0.95)
    a, b = (client.chat.completions.create(**ask, seed=7, n=2) for _ in range(2))
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]  # same seed, same texts
    stream = client.chat.completions.create(**ask, seed=7, n=2, stream=True)
    streamed = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts


def test_stop_strings_end_the_text_before_them(server, client):
    prompt = "the lazy"
    ids = server[3].encode(prompt, add_special_tokens=True).tolist()
    text, _ = greedy_text(server, ids)
    stop = text[3:5]
    assert stop and text.find(stop) >= 0
    for stream in (False, True):
        got = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=N, temperature=0, stop=[stop], stream=stream
        )
        got = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
        assert got == text[: text.find(stop)]


def test_logprobs_are_the_models_for_completions_and_chat(server, client):
    """Greedy: each token's log-probability is its top alternative's, and equals the full
    forward's log-softmax (the sampler's own model) at that position."""
    prompt, tok, sampler = "the quick", server[3], server[2]
    got = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    lp = got.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert [max(top.values()) for top in lp.top_logprobs] == pytest.approx(lp.token_logprobs)
    ids = tok.encode(prompt).tolist()
    seq = ids + sampler.generate([ids], 6, temperature=0, vocab_size=tok.vocab_size).sequences()[0]
    logits = np.array(forward(sampler.inference_model(), jnp.asarray([seq]))[0][0])
    logits[:, tok.vocab_size :] = -np.inf  # ids past the tokenizer's are never sampled
    ref = jax.nn.log_softmax(logits, axis=-1)
    want = [ref[len(ids) + t - 1, seq[len(ids) + t]] for t in range(6)]
    np.testing.assert_allclose(lp.token_logprobs, want, atol=1e-4)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "fox"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2,
    ).choices[0]  # fmt: skip
    content = chat.logprobs.content
    assert 0 < len(content) <= 4
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob for c in content)


def test_64_concurrent_clients_each_get_their_solo_greedy_text(server, client):
    """64 clients at once with prompts of 1-11 words (4 slots, the rest queued): every one
    answered with the text its prompt gets alone (Sampler greedy: a batch of rows gives
    each row's solo tokens, tests/test_sampling.py)."""
    sampler, tok = server[2], server[3]
    rng = np.random.default_rng(3)
    words = CORPUS.split()
    prompts = [" ".join(rng.choice(words, rng.integers(1, 12))) for _ in range(64)]
    ids = [tok.encode(p).tolist() for p in prompts]
    eos = tok.eos_id
    out = sampler.generate(
        ids, N, temperature=0, stop_tokens=[eos], vocab_size=tok.vocab_size
    ).sequences()
    want = [tok.decode(o[:-1] if o[-1] == eos else o) for o in out]
    ask = lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=N, temperature=0)
    with ThreadPoolExecutor(64) as pool:
        got = [r.choices[0].text for r in pool.map(ask, prompts)]
    assert got == want
    metrics = dict(
        line.rsplit(" ", 1) for line in httpx.get(server[0] + "/metrics").text.splitlines()
        if not line.startswith("#")
    )  # fmt: skip
    assert int(metrics["moe_jax_time_to_first_token_seconds_count"]) >= 64
    assert int(metrics["moe_jax_inter_token_latency_seconds_count"]) >= 64
    assert metrics["moe_jax_running_slots"] == "0" and metrics["moe_jax_pages_in_use"] == "0"


def test_bad_requests_answer_400_and_a_full_queue_429(server, client):
    with pytest.raises(openai.BadRequestError, match="not served here"):
        client.completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="x" * 200, max_tokens=10)
    r = httpx.post(server[0] + "/v1/completions", content=b"{nope")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    engine = server[1]
    engine.max_queue, saved = 0, engine.max_queue
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="tiny", prompt="x")
        assert e.value.response.headers["retry-after"] == "1"
    finally:
        engine.max_queue = saved


def test_a_client_that_disconnects_frees_its_slot_and_pages(server):
    base, engine = server[0], server[1]
    body = {"model": "tiny", "prompt": "the", "max_tokens": 100, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", base + "/v1/completions", json=body) as r:
        next(r.iter_lines())  # the first delta: the request runs
    deadline = time.time() + 20
    while engine.running() or engine.pool.in_use():
        assert time.time() < deadline, "the request kept its slot after the client left"
        time.sleep(0.05)
    assert np.all(engine.pool.refs >= 0)


@contextlib.contextmanager
def slow_steps(engine, seconds: float):
    """Each engine step `seconds` longer, its lock held meanwhile (a long step, a compile)."""
    step = engine.step

    def slow():
        time.sleep(seconds)
        return step()

    engine.step = slow
    try:
        yield
    finally:
        del engine.step  # the class's own again


@contextlib.contextmanager
def server_errors():
    """The ERROR records uvicorn logs meanwhile (a handler's exception: "Exception in ASGI
    application" and its traceback)."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_a_client_leaving_a_whole_request_frees_it_and_logs_nothing(server):
    """A non-streamed request's client that goes (its timeout) cancels the request, with no
    `aclose(): asynchronous generator is already running` in the server's log."""
    base, engine = server[0], server[1]
    body = {"model": "tiny", "prompt": "the", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with server_errors() as errors, slow_steps(engine, 0.05):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(base + "/v1/completions", json=body, timeout=0.6)
        deadline = time.time() + 20
        while engine.running() or engine.pool.in_use():
            assert time.time() < deadline, "the request kept its slot after the client left"
            time.sleep(0.05)
        time.sleep(0.3)  # the handler's end, after it freed the slot
    assert not errors, "\n".join(r.getMessage() + str(r.exc_info) for r in errors)


def test_metrics_answer_while_a_step_holds_the_engine(server):
    """/metrics reads the gauges of the last step without the engine's lock: a long step
    (here 2 s) held the lock, and with it the event loop, until it ended."""
    base, engine = server[0], server[1]
    body = {"model": "tiny", "prompt": "the", "max_tokens": 1, "temperature": 0}
    with slow_steps(engine, 2.0), ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, base + "/v1/completions", json=body, timeout=60)
        time.sleep(0.3)  # the request submitted, its first step under way
        start = time.perf_counter()
        metrics = httpx.get(base + "/metrics", timeout=10)
        assert time.perf_counter() - start < 1.0 and metrics.status_code == 200
        assert "moe_jax_queue_length" in metrics.text
        assert reply.result().status_code == 200


def test_the_command_finishes_its_requests_on_sigterm_then_stops_with_143(server):
    """`python -m moe_jax.serve RUN`: serves; SIGTERM during a streamed request lets it end
    (uvicorn's graceful shutdown), then the process stops as every command does (docs/errors.md):
    `error: stopped by SIGTERM`, exit 143."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "moe_jax", "serve", str(server[4]), "--port", str(port),
           "--max-slots", "2", "--page-size", "16"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert time.time() < deadline, "the command did not start serving"
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"prompt": "the", "max_tokens": 8, "temperature": 0, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=90) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert first.startswith("data: {") and rest[-1] == "data: [DONE]"
        assert proc.wait(60) == 143
        out = proc.stdout.read().decode()
        assert out.endswith("error: stopped by SIGTERM\n") and "Traceback" not in out, out
        # compiled before it listened (/health answered after), then a line for the request
        assert out.index("compiled the first request's programs in ") < out.index("serving '")
        assert re.search(r"^request \d+: \d+ prompt \+ 8 generated tokens \(length\), ", out, re.M)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_command_refuses_a_missing_run_in_one_line(capsys):
    from moe_jax.serve.__main__ import main

    assert main(["/nonexistent/run", "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: run directory '/nonexistent/run'")


def test_the_command_refuses_a_port_in_use_before_it_loads_in_one_line(capsys):
    """The port is bound before the model loads: one taken fails at once, ahead of the
    missing run (uvicorn bound it, after the load)."""
    from moe_jax.serve.__main__ import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["/nonexistent/run", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert err.count("\n") == 1, err


def test_speculation_through_the_server_gives_the_same_text_and_counts_its_drafts(
    server, tmp_path, capsys
):
    """A run with one MTP layer served as `--speculative` asks (`engine_for`, the command's
    engine): a completion is the plain program's greedy text (cut before a stop string), and
    /metrics counts the drafts checked and kept, in all and per depth. `--speculative` on a
    run without MTP layers: a one-line error, exit 2."""
    from moe_jax.serve.__main__ import engine_for, main, parse_args

    run = write_run(tmp_path, server[3], "model.mtp_depth=1")
    flags = ["--speculative", "--max-slots", "2", "--page-size", "16", "--chunk", "16"]
    cfg, sampler, tok = load_sampler(run)
    engine = engine_for(parse_args([str(run), *flags]), cfg, sampler, tok)
    assert engine.speculation.K == 1
    prompt = "the quick brown"
    ids = tok.encode(prompt, add_special_tokens=True).tolist()
    with serving(engine, tok) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        ask = dict(model="tiny", prompt=prompt, max_tokens=N, temperature=0)
        got = client.completions.create(**ask)
        text, reason = greedy_text((None, None, sampler, tok), ids)
        stop = text[3:5]  # a stop string, wherever in a step's tokens it ends
        stopped = client.completions.create(**ask, stop=[stop]).choices[0].text
        metrics = httpx.get(base + "/metrics").text
    assert (got.choices[0].text, got.choices[0].finish_reason) == (text, reason)
    assert stop and stopped == text[: text.find(stop)]
    counts = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line[0] != "#")
    drafted = int(counts["moe_jax_spec_decode_draft_tokens_total"])
    assert drafted > 0 and drafted == int(engine.speculation.drafted.sum())
    accepted = int(counts["moe_jax_spec_decode_accepted_tokens_total"])
    assert accepted == int(engine.speculation.accepted.sum())
    assert counts['moe_jax_spec_decode_draft_tokens_by_depth_total{depth="1"}'] == str(drafted)
    capsys.readouterr()
    assert main([str(server[4]), "--speculative"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "model.mtp_depth=0" in err, err


def test_the_worker_logs_each_request_and_the_stats_while_it_works(server):
    """A line per finished request (its tokens, time to the first and in all) and the
    periodic stats line, here due after every step (`stats_every_s` tiny); a worker of its own
    on an engine of its own (the same compiled programs as the fixture's)."""
    engine = Engine(server[2], max_slots=4, page_size=16, chunk=16, max_queue=64,
                    vocab_size=server[3].vocab_size)  # fmt: skip
    lines = []
    worker = Worker(engine, lines.append, stats_every_s=1e-9)
    worker.start()

    async def one():
        from moe_jax.inference.engine import SamplingParams

        rid, queue = worker.submit([5, 6, 7], SamplingParams(max_tokens=4))
        while (await queue.get()).finish_reason is None:
            pass
        return rid

    try:
        rid = asyncio.run(one())
    finally:
        worker.stop()
    (done,) = [ln for ln in lines if ln.startswith("request ")]
    assert re.fullmatch(
        rf"request {rid}: 3 prompt \+ 4 generated tokens \(length\), first token \d+\.\d\d s, "
        r"\d+\.\d\d s in all",
        done,
    )
    stats = [ln for ln in lines if ln.startswith("stats: ")]
    assert stats and all("KV pages " in ln and "running " in ln for ln in stats)
    gauges = {"pages": 64, "pages_in_use": 16, "running": 2, "queue": 1}
    assert stats_line(30, 10, 2.0, gauges) == (
        "stats: prompt 15.0 tokens/s, generation 5.0 tokens/s; running 2, waiting 1; "
        "KV pages 16/64 (25.0%)"
    )


def test_a_chat_on_a_byte_tokenized_run_renders_the_built_in_template():
    """The default model (byte tokenizer, no template of its own) answers
    /v1/chat/completions: the conversation rendered as the built-in plain-text turns."""
    from moe_jax.serve.requests import parse
    from moe_jax.tokenizer import load_tokenizer

    byte = load_tokenizer("byte")
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    job = parse(body, byte, "tiny", chat=True, max_len=64)
    assert byte.decode(job.prompt) == "user: Hi\nassistant: "
