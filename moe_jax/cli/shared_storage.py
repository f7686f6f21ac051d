"""Check, before a multi-host run starts, that every host sees the run directory and the data.

    python -m moe_jax.cli.shared_storage write TOKEN CONFIG [section.key=value ...]   # one host
    python -m moe_jax.cli.shared_storage check TOKEN CONFIG [section.key=value ...]   # every host
    python -m moe_jax.cli.shared_storage clean TOKEN CONFIG [section.key=value ...]   # one host

The rule of a multi-host run: every process reads the config, the data and the tokenizer, and
process 0 with the others writes one run directory (Orbax writes each host's shards there;
process 0 the metadata), so all of them must be at the same paths on storage every host sees:
NFS, Filestore, Lustre, a gcsfuse mount. A run directory on each host's local disk trains,
then leaves checkpoints that no host holds whole; data on one host stops the others at their
first batch. The launchers (launch/) run these three steps first: one host writes a marker
file beside the run directory, every host looks for it and for the inputs, and one host
removes it. A host that misses either fails the check with one line naming it (exit 2).
"""

from __future__ import annotations

import glob
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from moe_jax.config import Config, cli_config
from moe_jax.config.shipped import config_argv, config_path
from moe_jax.run.door import command, say

USAGE = (
    "usage: python -m moe_jax.cli.shared_storage write|check|clean TOKEN [CONFIG] [key=value ...]"
)
SHARED_STORAGE_FIX = (
    "put it on storage every host sees (NFS, Filestore, Lustre, a gcsfuse mount) at the same "
    "path, not on a host's local disk"
)


def marker(cfg: Config, token: str) -> Path:
    """The marker file: beside the run directory, which need not exist yet."""
    return Path(cfg.run_dir).absolute().parent / f".moe_jax_shared_{token}"


def inputs(cfg: Config) -> list[tuple[str, str]]:
    """(config key, path or glob) of everything a run reads from files."""
    d = cfg.data
    found = [("data.path", p.strip()) for p in (d.path or "").split(",") if p.strip()]
    for entry in (d.mixture or "").split(","):
        if entry.strip():
            found.append(("data.mixture", entry.strip().rsplit(":", 1)[0]))
    if d.tokenizer not in ("byte", "char"):
        found.append(("data.tokenizer", d.tokenizer))
    if cfg.init_from:
        found.append(("init_from", cfg.init_from))
    return found


def problems(cfg: Config, token: str) -> list[str]:
    """What this host misses: the marker another host wrote, or an input."""
    here, found = socket.gethostname(), []
    mark = marker(cfg, token)
    if not mark.is_file():
        found.append(
            f"host {here} does not see {mark} that the first host wrote beside run_dir "
            f"'{cfg.run_dir}': {SHARED_STORAGE_FIX}"
        )
    for key, pattern in inputs(cfg):
        if not glob.glob(pattern):
            found.append(f"host {here} does not see {key} '{pattern}': {SHARED_STORAGE_FIX}")
    return found


@command
def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__.strip()}")
        return 0
    if len(args) < 2 or args[0] not in ("write", "check", "clean"):
        print(USAGE, file=sys.stderr)
        return 2
    verb, token, rest = args[0], args[1], args[2:]
    cfg = cli_config(config_argv(rest), default_path=config_path("tiny"))
    mark = marker(cfg, token)
    if verb == "write":
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(socket.gethostname() + "\n")
    elif verb == "clean":
        mark.unlink(missing_ok=True)
    elif found := problems(cfg, token):
        return say("; ".join(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
