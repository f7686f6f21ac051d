"""Shared by the eval tests: harness tasks defined from local JSONL files (the harness reads
them with `dataset_path: json`), and no network for the harness or `datasets`."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Before the harness and `datasets` import (they read these once); set again on their
# modules' constants below where another test module imported them first.
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
os.environ.update(OFFLINE)


def offline() -> None:
    """`datasets` and `huggingface_hub` told to stay offline even if already imported."""
    import datasets.config
    import huggingface_hub.constants

    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True


MC = [
    {
        "q": f"What is {a} plus {b}?",
        "choices": [str(a + b), str(a + b + 1), str(a * b + 7)],
        "label": 0,
    }
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (6, 6)]
]
ROLL = [
    {"text": "The quick brown fox jumps over the lazy dog. " * k + "End."} for k in (1, 3, 9, 14)
]
GEN = [{"q": f"Count on from {i}:", "a": str(i + 1)} for i in range(5)]

TASKS = {
    "toy_mc": (
        MC,
        "output_type: multiple_choice\nfewshot_split: test\n"
        'doc_to_text: "Question: {{q}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n    aggregation: mean\n"
        "    higher_is_better: true\n",
    ),
    "toy_roll": (
        ROLL,
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n    aggregation: weighted_perplexity\n"
        "    higher_is_better: false\n",
    ),
    "toy_gen": (
        GEN,
        'output_type: generate_until\ndoc_to_text: "{{q}}"\ndoc_to_target: "{{a}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n"
        "    higher_is_better: true\n",
    ),
}


def write_tasks(directory: Path) -> Path:
    """The three tasks' data and YAMLs in `directory` (the harness's --include_path)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, (rows, spec) in TASKS.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        head = (
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n"
        )
        (directory / f"{name}.yaml").write_text(head + spec, encoding="utf-8")
    return directory


def requests_of(suite) -> dict[str, list]:
    """The suite's requests, zero-shot, by kind (loglikelihood, loglikelihood_rolling,
    generate_until), as the harness builds them before it calls a model."""
    out: dict[str, list] = {}
    for task in suite.objects:
        task.set_config(key="num_fewshot", value=0)
        task.build_all_requests()
        for instance in task.instances:
            out.setdefault(instance.request_type, []).append(instance)
    return out


def answers(lm, requests: dict[str, list]) -> dict[str, list]:
    """`lm`'s answer to every request, by kind."""
    return {kind: getattr(lm, kind)(reqs, disable_tqdm=True) for kind, reqs in requests.items()}
