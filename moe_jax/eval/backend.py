"""The harness's model backend for moe_jax runs, registered as "moe_jax".

    lm = MoeJaxLM(run="runs/tiny", batch_size=8)                  # the latest checkpoint
    lm = MoeJaxLM(run="runs/mixtral", step=200, **{"mesh.expert": 2, "sample.weights": "int8"})
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])
    # or by name, once this module is imported: model="moe_jax", model_args="run=runs/tiny,..."

model_args: `run` (the run directory), `step` (default: the latest), `batch_size` (rows per
compiled program), `max_length` (tokens the model reads, default model.max_seq_len), `seed`
(sampled generation), and dotted overrides of the run's config as sample.py takes them
(mesh.*, model.dtype, sample.weights, ...): the run is restored sharded onto that mesh in
that weight form (`moe_jax.inference.load.load_sampler`).

Text becomes tokens as the harness's Hugging Face backend makes them, with the run's own
tokenizer: a text is encoded with the tokenizer's special tokens (a BOS first, where it adds
one) unless it already starts with the prefix token's text; a context and continuation are
encoded together and split where the context's tokens end; an empty context is the prefix
token, the tokenizer's BOS, else its EOS, else (byte and char runs, which have neither) a
newline. `loglikelihood_rolling` scores a document in the harness's disjoint windows of
`max_length` tokens. So a checkpoint gives the same numbers here as exported and evaluated
with the harness's `hf` backend (tests/test_eval_parity.py).
"""

from __future__ import annotations

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from moe_jax.eval import EvalError
from moe_jax.eval.generation import Generator, GenOptions
from moe_jax.eval.scoring import Scorer
from moe_jax.inference.sampling import Sampler
from moe_jax.tokenizer import DataError, Tokenizer

DEFAULT_BATCH_SIZE = 8
MAX_GEN_TOKS = 256  # the harness's default when a task names none
# What the backend takes of a task's generation_kwargs (after the harness normalises them).
GEN_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")
# transformers' continue_final_message marker: where the final message's text ends once rendered
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def prefix_token(tokenizer: Tokenizer) -> tuple[int, str] | None:
    """(id, text) of the token an empty context stands for: BOS, else EOS, else a newline
    that is one token; None when the tokenizer has none of them."""
    for name, i in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
        if i is not None:
            return i, tokenizer.special_tokens[name]
    try:
        ids = tokenizer.encode("\n").tolist()
    except DataError:  # a char vocabulary without a newline
        return None
    return (ids[0], "\n") if len(ids) == 1 else None


def int_arg(name: str, value) -> int:
    """A model_args number (the harness passes some as strings, e.g. batch_size)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EvalError(f"model_args {name}={value!r} is not a whole number") from None


class MoeJaxLM(TemplateLM):
    """A moe_jax run as an lm-evaluation-harness model (see the module doc)."""

    def __init__(
        self,
        run: str | None = None,
        step: int | None = None,
        batch_size: int | str = DEFAULT_BATCH_SIZE,
        max_length: int | None = None,
        seed: int = 0,
        *,
        sampler: Sampler | None = None,
        tokenizer: Tokenizer | None = None,
        max_batch_size=None,  # the harness passes these two to every backend; the mesh
        device=None,  # (mesh.* overrides) places this one's work
        **overrides,
    ):
        """`run` (+ `step`, `overrides`) loads a checkpoint; `sampler` and `tokenizer` serve a
        model already in memory instead (the trainer's eval)."""
        super().__init__()
        if (run is None) == (sampler is None):
            raise EvalError("give the backend run=RUN_DIR (model_args), or a sampler")
        if unknown := [k for k in overrides if "." not in k]:
            raise EvalError(
                f"unknown model_args {', '.join(unknown)}; the moe_jax backend takes run, step, "
                "batch_size, max_length, seed and section.key overrides (mesh.*, sample.weights)"
            )
        if run is not None:
            from moe_jax.inference.load import load_sampler

            step = None if step is None else int_arg("step", step)
            settings = [f"{k}={v}" for k, v in overrides.items()]
            _, sampler, tokenizer = load_sampler(run, settings, step)
        self.run, self.step, self.tokenizer = run, step, tokenizer
        context = sampler.cfg.model.max_seq_len
        length = context if max_length is None else int_arg("max_length", max_length)
        if not 1 < length <= context:
            raise EvalError(f"max_length must be within [2, {context}] (the model's context)")
        rows = int_arg("batch_size", batch_size)
        if rows < 1:
            raise EvalError(f"batch_size must be >= 1, got {rows}")
        self.seed = int_arg("seed", seed)
        self._max_length = length
        self.scorer = Scorer(sampler, rows, length)
        self.generator = Generator(sampler, tokenizer, rows, length)
        self._prefix = prefix_token(tokenizer)

    # ------------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        if self._prefix is None:
            raise EvalError(
                f"the run's {self.tokenizer.kind} tokenizer has no BOS, EOS or newline token to "
                "stand for an empty context or start a document"
            )
        return self._prefix[0]

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return f"moe_jax-{self.tokenizer.kind}-{self.run}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        """As the Hugging Face backend: special tokens unless the text starts with the
        prefix token's text. DataError where the tokenizer cannot represent the text."""
        if add_special_tokens is None:
            add_special_tokens = not (self._prefix and string.startswith(self._prefix[1]))
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens).tolist()

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt=True) -> str:
        """The conversation through the run's chat template; without a generation prompt the
        final message is left open (transformers' continue_final_message, as the harness's
        Hugging Face backend asks for it)."""
        if add_generation_prompt:
            return self.tokenizer.apply_chat_template(chat_history, True)
        *head, last = chat_history
        tagged = [*head, {**last, "content": last["content"] + CONTINUE_TAG}]
        text = self.tokenizer.apply_chat_template(tagged, False)
        at = text.rindex(CONTINUE_TAG.strip())
        kept_spacing = text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG
        return text[:at] if kept_spacing else text[:at].rstrip()  # else trailing space was cut

    def get_model_info(self) -> dict:
        return {"moe_jax_run": self.run, "moe_jax_step": self.step}

    def stats(self) -> dict:
        """Requests answered, seconds spent on them (compiling included) and compiled
        programs (distinct batch shapes), scoring and generation together."""
        parts = (self.scorer, self.generator)
        return {
            "requests": sum(p.requests for p in parts),
            "seconds": sum(p.seconds for p in parts),
            "programs": sum(len(p.programs) for p in parts),
        }

    # ------------------------------------------------------------------ requests

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
        answers = self.scorer.loglikelihood(
            [(context, continuation) for _, context, continuation in requests],
            progress=not disable_tqdm,
        )
        for (key, _, _), answer in zip(requests, answers, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood, its tokens predicted once each in disjoint
        windows of `max_length` (the harness's rolling windows, context 1)."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string)
            for w in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1):
                windows.append(make_disjoint_window(w))
                owner.append(i)
        totals = [0.0] * len(requests)
        scores = self.scorer.loglikelihood(windows, progress=not disable_tqdm)
        for i, (logprob, _) in zip(owner, scores, strict=True):
            totals[i] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        work = []
        for req in requests:
            context, gen_kwargs = req.args
            ids = self.tok_encode(context) or [self.prefix_token_id]
            work.append((ids, self._options(gen_kwargs)))
        texts = self.generator.generate(work, progress=not disable_tqdm)
        for req, text in zip(requests, texts, strict=True):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _options(self, gen_kwargs: dict) -> GenOptions:
        kw = dict(normalize_gen_kwargs(gen_kwargs, MAX_GEN_TOKS))
        if unknown := sorted(set(kw) - set(GEN_KEYS)):
            raise EvalError(
                f"generation option(s) {', '.join(unknown)} are not supported by the moe_jax "
                f"backend (it takes {', '.join(GEN_KEYS)})"
            )
        eos = self.tokenizer.eos_id
        eos_text = None if eos is None else self.tokenizer.special_tokens["eos_token"]
        sampled = bool(kw.get("do_sample"))
        return GenOptions(
            until=tuple(handle_stop_sequences(kw.get("until"), eos=eos_text)),
            max_gen_toks=int(kw["max_gen_toks"]),
            temperature=float(kw.get("temperature") or 0.0) if sampled else 0.0,
            top_k=int(kw.get("top_k") or 0),
            top_p=float(kw.get("top_p") or 1.0),
            seed=self.seed,
        )


if "moe_jax" not in model_registry:  # once: a module imported again keeps the first class
    model_registry.register("moe_jax", target=MoeJaxLM)
