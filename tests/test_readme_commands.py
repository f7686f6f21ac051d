"""Every command in README.md and docs/*.md works as written, so that the documentation stays
true.

The commands are read from the pages themselves (no second copy here), README.md first and then
the docs pages in PAGES' order: each line of their ```bash blocks (comments dropped, `\\`
continuations joined, split at `&&`) and each inline code span that starts with `python `, a
page's blocks before its spans. They run in a temporary directory (holding a link to configs/),
in that order, so that later commands find the runs that earlier ones wrote (sample.py and
quantize use the default run of README.md's `python train.py`, export the RoPE run ...):
PAGES is fixed here, not globbed, and must name every page under docs/.

What runs, and how, to fit the budget (measured: ~45 s of CPU time for all of them):
- train.py, sample.py and the `python -m moe_jax.*` tools (summary, plot, quantize, interop,
  prepare, eval: the harness offline, on the repository's local task; profile)
  run for real, in this process through `runpy` (no interpreter start-up per command, and one
  compile serves the commands that share a program): train.py with FAST_TRAIN appended (3
  steps of a smaller model; a shipped fine-tune config's with FAST_FINETUNE too), sample.py
  with FAST_SAMPLE. An `XLA_FLAGS=...device_count=N`
  prefix is checked against this process's devices (conftest's 8) instead of being applied,
  and MOE_JAX_HUGEPAGES=0 keeps the CLIs from restarting this process. Each train.py command
  must log its last step: one that resumed another's finished run would train nothing.
- The two-process commands (`mesh.num_processes=2`, one of them in the background) run for
  real in tests/test_distributed.py, as two processes with 2 CPU devices each, on a free port
  instead of the page's, and must train as one process does.
- `python -m moe_jax.aot` compiles full-size models for minutes (tests/test_aot.py covers
  compiling): its command line is parsed, its config loaded with the overrides and its
  topology name checked to be one it knows.
- The "real cluster" line (`mesh.distributed=true`) needs a cluster: its config is loaded.
- `HF_DIR` (a placeholder) is the Hugging Face directory the export line of docs/hf.md
  writes; the commands that name it run last.
- `curl` downloads, and tests never do: the file it would fetch is copied from LOCAL_COPIES,
  or stood in for by README.md's own text where this machine has no copy.
- Not run: the install lines (`python3[.N] -m venv`, `. .venv/bin/activate`, `pip`,
  `.ci/install`) and the
  test suite's own lines (`ruff`, `pytest`).
A command this file does not know how to run fails `test_every_readme_command_is_known`.
Every relative link of these pages must point at a file (and a heading) that exists:
`test_readme_and_docs_links_resolve`.
"""

from __future__ import annotations

import importlib.util
import re
import runpy
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import jax

from moe_jax.aot import command as aot
from moe_jax.aot.topology import TopologyError, get_topology
from moe_jax.cli.train import config_argv
from moe_jax.config import Config, load_config
from tests.helpers import TINY_BASE

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = (  # the order the commands run in: each page's commands may use the runs earlier ones wrote
    "README.md",  # the first command: `python train.py` (runs/tiny), then sample.py
    "docs/install.md",
    "docs/quickstart.md",  # sample.py and plot on runs/tiny
    "docs/configuration.md",
    "docs/data.md",  # the download, then the token store made from it
    "docs/checkpoints.md",
    "docs/scaling.md",  # the 8-device run, then sampling it
    "docs/accelerators.md",
    "docs/serving.md",
    "docs/hf.md",  # the RoPE run and its export (HF_DIR), which the HF_DIR commands read
    "docs/finetuning.md",
    "docs/eval.md",
    "docs/quantization.md",  # quantize runs/tiny, then sample the copy
    "docs/observability.md",  # the profiled run, then its profile
    "docs/speed.md",
    "docs/errors.md",
    "docs/architecture.md",
    "docs/testing.md",
    "docs/reference/config.md",  # the config keys' table: its code spans quote the schema
)
FAST_TRAIN = [  # 3 steps of a smaller model: the documented architecture costs the compiles
    # TINY_BASE's sizes, not the NoPE layer it keeps for the other tests: appended, it would
    # override a documented command's own attention keys
    *[w for w in TINY_BASE if not w.startswith(("attention.nope", "attention.temperature"))],
    "model.n_layers=1",
    "moe.interleave_step=1",  # the one layer a MoE one
    "train.epochs=null",  # a fine-tune config's length in epochs gives way to the 3 steps
    "train.steps=3",
    "train.batch_size=8",  # divides over docs/scaling.md's 8-device and 2 x 2 meshes
    "train.seq_len=32",
    "train.eval_every=3",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.peak_flops=1e11",  # skips the start-up matmul measurement
    "checkpoint.every=3",
    "data.embedded_max_bytes=200000",
]
# A shipped fine-tune config (configs/finetune/): windows that hold its example rows, and a
# GRPO step's rollouts cut short
FAST_FINETUNE = ["train.seq_len=96", "rl.group_size=2", "rl.max_new_tokens=4"]
LAST_STEP = "step 3/3 |"  # what a train.py run with FAST_TRAIN logs last
FAST_SAMPLE = ["--max-new-tokens", "8"]
SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
LOCAL_COPIES = {SHAKESPEARE_URL: ROOT.parent / "shared/data/tinyshakespeare.txt"}
TOOLS = (  # as the pages run them: `python -m` names (plot, profile, summary: kept names)
    "moe_jax.summary",
    "moe_jax.plot",
    "moe_jax.quantize",
    "moe_jax.interop",
    "moe_jax.prepare",
    "moe_jax.eval",
    "moe_jax.profile",
)
DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
COORDINATOR_PORT = re.compile(r"^(mesh\.coordinator_address=.*:)\d+$")


@dataclass
class Command:
    words: list[str]
    env: dict[str, str]  # from `export` lines before it in its block and `NAME=value` prefixes
    background: bool  # ends in `&`

    def __str__(self) -> str:
        return shlex.join(self.words)

    @property
    def trains(self) -> bool:
        """A `python train.py` command that trains (not one that prints its help)."""
        help_ = any(w.startswith("--help") or w == "-h" for w in self.words)
        return self.words[:2] == ["python", "train.py"] and not help_

    @property
    def kind(self) -> str:
        """How this file runs it (see the module doc)."""
        w = self.words
        venv = re.fullmatch(r"python3(\.\d+)?", w[0]) and w[1:3] == ["-m", "venv"]
        if w[0] in (".", "source", "pip", ".ci/install", "ruff", "pytest") or venv:
            return "not run"
        if w[0] == "curl":
            return "download"
        if w[0] != "python" or len(w) < 2:
            return "unknown"
        if w[1] == "train.py":
            if "mesh.distributed=true" in w:
                return "cluster"
            return "processes" if any(a.startswith("mesh.num_processes=") for a in w) else "run"
        module = w[2] if w[1] == "-m" and len(w) > 2 else None
        if w[1] == "sample.py" or module in TOOLS:
            return "run"
        return "aot" if module == "moe_jax.aot" else "unknown"


def _shell_line(line: str, exported: dict[str, str]) -> list[Command]:
    """The commands of one shell line; an `export` adds to `exported` (its block's)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words = [], []
    for token in [*lexer, "&&"]:
        if token not in ("&&", "&"):
            words.append(token)
            continue
        env = dict(exported)
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words[:1] == ["export"]:
            exported.update(word.split("=", 1) for word in words[1:])
        elif words:
            commands.append(Command(_spelled_as_python(words), env, background=token == "&"))
        words = []
    return commands


def _spelled_as_python(words: list[str]) -> list[str]:
    """`moe-jax SUBCOMMAND ...` as the clone spells the same command (moe_jax/cli/main.py runs
    the same mains; tests/test_cli_main.py checks that it does): `python train.py ...`,
    `python sample.py ...`, `python -m moe_jax.SUBCOMMAND ...`."""
    if words[0] != "moe-jax" or len(words) < 2:
        return words
    sub, rest = words[1], words[2:]
    if sub in ("train", "sample"):
        return ["python", f"{sub}.py", *rest]
    return ["python", "-m", f"moe_jax.{sub}", *rest]


def page_commands(text: str) -> list[Command]:
    """One page's commands: its ```bash blocks' lines, then its `python ...` code spans."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        exported = {}
        for line in block.replace("\\\n", " ").splitlines():
            commands += _shell_line(line, exported)
    for span in re.findall(r"`(python [^`]+)`", text):
        commands += _shell_line(span, {})
    return commands


def readme_commands() -> list[Command]:
    """The commands of README.md and the docs pages, in PAGES' order."""
    pages = [p for p in PAGES if not p.startswith("docs/reference/")]  # generated: no how-to
    return [c for page in pages for c in page_commands((ROOT / page).read_text(encoding="utf-8"))]


def test_pages_name_every_docs_page():
    """A page missing from PAGES would have its commands untested."""
    docs = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert len(set(PAGES)) == len(PAGES)
    assert set(PAGES) == {"README.md"} | docs


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_and_docs_links_resolve():
    """Every relative link `[text](target)` of README.md and the docs pages names an existing
    file, and a `#anchor` one of that page's headings."""
    broken = []
    for page in PAGES:
        path = ROOT / page
        text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto: ...
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{page}: {target}")
            elif anchor and linked.suffix == ".md":
                heads = re.findall(r"^#+ (.*)$", linked.read_text(encoding="utf-8"), re.M)
                if anchor not in map(_anchor, heads):
                    broken.append(f"{page}: {target} (no such heading)")
    assert not broken, f"links to nothing: {broken}"


def test_every_readme_command_is_known():
    commands = readme_commands()
    unknown = [str(c) for c in commands if c.kind == "unknown"]
    assert not unknown, f"tests/test_readme_commands.py cannot run these yet: {unknown}"
    assert "python train.py" in map(str, commands)  # the parse finds README.md's commands


def _train_config(cmd: Command, monkeypatch) -> Config:
    """The config a `python train.py [CONFIG.yaml] [key=value ...]` command trains."""
    monkeypatch.chdir(ROOT)
    args = config_argv(cmd.words[2:])  # a shipped config by name (finetune/dpo) as train.py
    path = args.pop(0) if args and "=" not in args[0] else "configs/tiny.yaml"
    return load_config(path, args)


def test_each_readme_training_has_its_own_run_dir(monkeypatch):
    """A train.py command on another one's run directory resumes that run, and does nothing
    where that run is finished; the processes of one multi-process run share theirs."""
    runs = {}
    for cmd in readme_commands():
        if cmd.trains:
            one_run = re.sub(r" mesh\.process_id=\d+", "", str(cmd))
            runs.setdefault(_train_config(cmd, monkeypatch).run_dir, set()).add(one_run)
    shared = {run: cmds for run, cmds in runs.items() if len(cmds) > 1}
    assert not shared, f"train.py commands that share a run directory: {shared}"


# ----------------------------------------------------------------------------- run for real


def _download(cmd: Command, workdir: Path) -> None:
    """What the download would fetch, from LOCAL_COPIES (or a stand-in text)."""
    (url,) = [w for w in cmd.words if w.startswith("https://")]
    assert url in LOCAL_COPIES, f"no local copy of {url} for `{cmd}`: add one to LOCAL_COPIES"
    out = workdir / cmd.words[cmd.words.index("-o") + 1]
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(LOCAL_COPIES[url] if LOCAL_COPIES[url].is_file() else README, out)


def _run_in_process(cmd: Command, hf_dir: str, monkeypatch) -> int:
    """`cmd`'s exit status, run as `python ...` would run it, in this process."""
    for name, value in cmd.env.items():
        devices = DEVICE_COUNT.fullmatch(value) if name == "XLA_FLAGS" else None
        assert devices, f"`{cmd}`: this file cannot apply {name}={value} in-process"
        assert int(devices[1]) == jax.device_count(), f"`{cmd}` asks for {value}"
    words = [w.removesuffix("HF_DIR") + hf_dir if w.endswith("HF_DIR") else w for w in cmd.words]
    if cmd.trains:
        words += FAST_TRAIN
        if len(words) > 2 and words[2].startswith("finetune/"):
            words += FAST_FINETUNE
    elif words[1] == "sample.py" and "--help" not in words:
        words += FAST_SAMPLE
    if words[1] == "-m":
        package = importlib.util.find_spec(words[2]).submodule_search_locations is not None
        main = f"{words[2]}.__main__" if package else words[2]
        monkeypatch.delitem(sys.modules, main, raising=False)  # run fresh, as `python -m` does
        monkeypatch.setattr(sys, "argv", [words[2], *words[3:]])
        run = lambda: runpy.run_module(words[2], run_name="__main__", alter_sys=True)
    else:
        monkeypatch.setattr(sys, "argv", words[1:])
        run = lambda: runpy.run_path(str(ROOT / words[1]), run_name="__main__")
    try:
        run()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    return 0


def test_readme_commands_run(tmp_path, monkeypatch, capsys):
    commands = readme_commands()
    (export,) = [c for c in commands if c.words[2:4] == ["moe_jax.interop", "export"]]
    hf_dir = export.words[export.words.index("--out") + 1]
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOE_JAX_HUGEPAGES", "0")  # no re-exec of this process
    todo = [c for c in commands if c.kind in ("run", "download")]
    if importlib.util.find_spec("lm_eval") is None:  # the eval extra: its commands need it
        evals = lambda c: any(w.startswith(("eval.", "moe_jax.eval")) for w in c.words)
        todo = [c for c in todo if not evals(c)]
    else:  # the local task only: no hub, no downloads
        from tests.eval_tasks import OFFLINE, offline

        for name, value in OFFLINE.items():
            monkeypatch.setenv(name, value)
        offline()
    done = set()
    # stable: PAGES' order, those naming HF_DIR (also as `init_from=HF_DIR`) after the export
    for cmd in sorted(todo, key=lambda c: any(w.endswith("HF_DIR") for w in c.words)):
        if str(cmd) in done:  # the same command again (`python train.py` is repeated)
            continue
        done.add(str(cmd))
        if cmd.kind == "download":
            _download(cmd, tmp_path)
            continue
        code = _run_in_process(cmd, hf_dir, monkeypatch)
        out = capsys.readouterr()
        assert code == 0, f"`{cmd}` exited {code}:\n{out.out[-2000:]}\n{out.err[-2000:]}"
        if cmd.trains:  # trained, rather than found a finished run to resume
            assert LAST_STEP in out.out, f"`{cmd}` trained no steps:\n{out.out[-2000:]}"


def test_readme_two_process_commands_start_process_0_in_the_background():
    """They run for real in tests/test_distributed.py (`start_two_processes`), which trains
    them against one process: here, only that docs/scaling.md's shell starts both at once."""
    commands = [c for c in readme_commands() if c.kind == "processes"]
    assert [c.background for c in commands] == [True, False]
    assert [w for c in commands for w in c.words if w.startswith("mesh.process_id=")] == [
        "mesh.process_id=0",
        "mesh.process_id=1",
    ]
    for cmd in commands:  # the address whose port start_two_processes replaces
        assert sum(bool(COORDINATOR_PORT.fullmatch(w)) for w in cmd.words) == 1, str(cmd)


# ----------------------------------------------------------------------------- checked only


def test_readme_aot_and_cluster_commands_load(monkeypatch):
    monkeypatch.chdir(ROOT)
    commands = readme_commands()
    for cmd in [c for c in commands if c.kind == "aot"]:
        args, path, overrides = aot.parse_args(cmd.words[3:])
        cfg = load_config(path, overrides)
        try:
            get_topology(args.topology, cfg.mesh.slices)
        except TopologyError as e:  # without the `aot` extra: the name is known, no compiler
            assert not str(e).startswith("unknown topology"), f"`{cmd}`: {e}"
    for cmd in [c for c in commands if c.kind == "cluster"]:
        _train_config(cmd, monkeypatch)
