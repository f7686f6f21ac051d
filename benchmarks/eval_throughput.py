"""Downstream-eval throughput: the moe_jax harness backend against the harness's own `hf`
backend, on one checkpoint and the same tasks.

    python benchmarks/eval_throughput.py                       # medium, Mixtral-like (~6 min)
    python benchmarks/eval_throughput.py --size small --docs 32 --batch-size 4

The checkpoint: the peer's random Mixtral-like model of `--size` (benchmarks/common.py) with a
300-id byte-level BPE (trained on standard-library sources, BOS first) saved by transformers,
imported into a run directory, and that run exported again (`moe_jax.interop`): our backend
reads the run, the `hf` backend (float32, torch on 2 threads) the export. The tasks, defined
from local JSONL files as the tests do: a HellaSwag-like multiple choice (`--docs` contexts
of 100-1200 bytes of Python source, 4 endings of 60-200 bytes: 4 loglikelihood requests a
document) and a rolling-loglikelihood task (`--docs / 8` documents of 2-6 kB, several
windows of the model's 1024-token context each). Both backends take `--batch-size` rows.

Requests/s = the tasks' requests / the harness's wall time (`simple_evaluate`: building the
requests, tokenizing, scoring, metrics). Ours runs twice: cold (its programs compiled in the
run; `programs` counts them) and warm (the same backend again); the peer runs once, between.
Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from common import SIZES, bench_config, count, hf_model, machine

from moe_jax.process_setup import reexec_with_hugepages

os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
VOCAB = 300


def corpus() -> str:
    """Standard-library sources: the text the tokenizer learns and the tasks are cut from."""
    import email
    import json as json_module

    files = sorted(Path(json_module.__file__).parent.glob("*.py"))
    files += sorted(Path(email.__file__).parent.glob("*.py"))
    return "".join(f.read_text(encoding="utf-8") for f in files)


def write_tokenizer(directory: Path, text: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def write_tasks(directory: Path, text: str, docs: int) -> int:
    """The two tasks' data and YAMLs; -> their number of requests."""
    rng = random.Random(0)

    def cut(lo: int, hi: int) -> str:
        n = rng.randint(lo, hi)
        start = rng.randrange(len(text) - n)
        return text[start : start + n]

    mc = [{"ctx": cut(100, 1200), "endings": [cut(60, 200) for _ in range(4)], "label": 0}
          for _ in range(docs)]  # fmt: skip
    roll = [{"text": cut(2000, 6000)} for _ in range(max(1, docs // 8))]
    specs = {
        "bench_mc": (mc, 'output_type: multiple_choice\ndoc_to_text: "{{ctx}}"\n'
                     'doc_to_choice: "{{endings}}"\ndoc_to_target: label\n'
                     "metric_list:\n  - metric: acc\n"),
        "bench_roll": (roll, 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
                       'doc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'),
    }  # fmt: skip
    directory.mkdir()
    for name, (rows, spec) in specs.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n{spec}",
            encoding="utf-8",
        )
    return 4 * len(mc) + len(roll)


def timed(suite, lm) -> tuple[float, dict]:
    from moe_jax.eval.tasks import metrics

    t0 = time.perf_counter()
    results = suite.run(lm, None)
    return time.perf_counter() - t0, metrics(results)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--size", choices=SIZES, default="medium")
    p.add_argument("--docs", type=count(), default=64, help="multiple-choice documents")
    p.add_argument("--batch-size", type=count(), default=8)
    args = p.parse_args(argv)

    import torch
    from lm_eval.models.huggingface import HFLM

    from moe_jax.eval.backend import MoeJaxLM
    from moe_jax.eval.tasks import load_suite
    from moe_jax.interop.__main__ import export_run, import_run

    torch.set_num_threads(2)
    info = machine()
    cfg = bench_config(args.size, "mixtral", f"model.vocab_size={VOCAB}")
    text = corpus()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf_model(cfg, "mixtral").save_pretrained(root / "hf")
        write_tokenizer(root / "hf", text)
        import_run(root / "hf", root / "run", None, ["data.embedded_max_bytes=100000"])
        export_run(root / "run", root / "export", None, None)
        n = write_tasks(root / "tasks", text, args.docs)
        suite = load_suite("bench_mc,bench_roll", str(root / "tasks"), None)
        ours = MoeJaxLM(run=str(root / "run"), batch_size=args.batch_size)
        cold, ours_metrics = timed(suite, ours)
        peer = HFLM(pretrained=str(root / "export"), dtype="float32", device="cpu",
                    batch_size=args.batch_size, max_length=cfg.model.max_seq_len)  # fmt: skip
        peer_s, peer_metrics = timed(suite, peer)
        warm, _ = timed(suite, ours)
    row = {
        "size": args.size,
        "requests": n,
        "ours_cold_req_s": n / cold,
        "ours_warm_req_s": n / warm,
        "peer_req_s": n / peer_s,
        "ratio_warm": peer_s / warm,
        "ratio_cold": peer_s / cold,
        "programs": len(ours.scorer.programs),
        "compile_s": cold - warm,
        "metrics_ours": ours_metrics,
        "metrics_peer": peer_metrics,
    }
    print(
        f"# {info['cpu']}, {info['cores']} cores; jax {info['jax']}, torch {info['torch']} "
        f"(2 threads), batch {args.batch_size}, fp32; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'size':7s} {'requests':>8s} {'ours req/s':>10s} {'cold':>6s} {'peer req/s':>10s} "
          f"{'ratio':>6s} {'programs':>8s} {'compile s':>9s}")  # fmt: skip
    print(f"{args.size:7s} {n:8d} {row['ours_warm_req_s']:10.2f} {row['ours_cold_req_s']:6.2f} "
          f"{row['peer_req_s']:10.2f} {row['ratio_warm']:5.2f}x {row['programs']:8d} "
          f"{row['compile_s']:9.1f}")  # fmt: skip
    print(json.dumps({"benchmark": "eval_throughput", "batch_size": args.batch_size, **info,
                      "load_average_end": os.getloadavg()[0], "results": [row]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    reexec_with_hugepages()
    sys.exit(main(sys.argv[1:]))
