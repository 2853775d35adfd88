"""`snakemake generate`, on the login node: the prompts read, checked and encoded with the
run's tokens (ddpflow.data.codec), each given its seed, and the request the ranks read
(ddpflow.training.generate_ranks does the work on the run's machine).

Prompt i (line i + 1 of generate.prompts, counted from 0) is continued with draws from a
generator seeded with prompt_seed(generate.seed, i): a function of the seed and the prompt's
place, never of the rank that computes it, so every world size writes the same lines. A
prompt longer than data.block_size tokens keeps its last block_size (the model reads no
more), said in the log and in its line's `cropped`. The prompts are read once, here; the
ranks read them from the request. Nothing here imports torch (the Snakefile's parse calls
it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from ddpflow.config import ConfigError
from ddpflow.data.codec import codec_for
from ddpflow.paths import GENERATE_WORK, RunPaths
from ddpflow.runtime import atomic_write_json
from ddpflow.words import counted

REQUEST = "request.json"
SHOWN = 5  # prompts named in a refusal or a warning
log = logging.getLogger(__name__)


def generate_run_names(generate: dict, run_names) -> list[str]:
    """generate.runs (checked: each a run of this config), or every run."""
    unknown = [name for name in generate["runs"] if name not in run_names]
    if unknown:
        raise ConfigError(
            f"generate.runs names {unknown}, which are not runs of this config; the runs are "
            f"{sorted(run_names)} (or leave generate.runs empty for all)"
        )
    return list(generate["runs"]) or list(run_names)


def check_can_generate(run: dict) -> None:
    """Only a language model (a task that reads tokens) generates text: refuse another
    task before any job."""
    from ddpflow.task import TaskError, run_task

    try:
        reads = run_task(run).reads
    except TaskError as err:
        raise ConfigError(f"generate: run {run['name']!r}: {err}") from err
    if reads == "tokens":
        return
    raise ConfigError(
        f"generate: run {run['name']!r} has task {run['task']!r}; `snakemake generate` "
        "continues text with a language model (task: language_model). Name the language "
        "model runs in generate.runs"
    )


def read_prompts(generate: dict) -> list[str]:
    """generate.prompts' lines, one prompt each; a ConfigError naming the key and the fix for
    a file that is not set, missing, empty, not UTF-8 or with an empty line."""
    given = generate["prompts"]
    if not given:
        raise ConfigError(
            "generate.prompts is not set: set it to a text file with one prompt per line "
            "(in config.yaml, or --config 'generate={prompts: prompts.txt}')"
        )
    path = Path(given).expanduser()
    if not path.is_file():
        what = "a folder, not a file" if path.is_dir() else f"no such file ({path.resolve()})"
        raise ConfigError(f"generate.prompts {given}: {what}; give a text file, one prompt a line")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"generate.prompts {given}: not UTF-8 text ({err})") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the file's last line break ends a line, it does not start one
    prompts = [line.removesuffix("\r") for line in lines]
    if not prompts:
        raise ConfigError(f"generate.prompts {given} is empty: write one prompt per line")
    empty = [i + 1 for i, prompt in enumerate(prompts) if not prompt]
    if empty:
        raise ConfigError(
            f"generate.prompts {given}: {_lines(empty)} empty; a prompt needs at least one "
            "character: remove the empty lines"
        )
    return prompts


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:SHOWN])) + (", ..." if len(numbers) > SHOWN else "")
    return f"line {shown} is" if len(numbers) == 1 else f"lines {shown} are"


def prompt_seed(seed: int, index: int) -> int:
    """The seed of prompt `index`'s draws: from (generate.seed, index) alone."""
    key = np.random.SeedSequence([seed, index]).generate_state(2, np.uint64)
    return int(key[0] >> np.uint64(1))


def encode_prompts(prompts: list[str], generate: dict, manifest: dict, staged) -> list[dict]:
    """Each prompt as the ranks take it: its text, token ids (the last block_size), how many
    were cropped from its start, and its seed. A prompt the run's tokens cannot express is
    refused, naming its line."""
    codec, block = codec_for(manifest, staged), int(manifest["block_size"])
    encoded = []
    for index, text in enumerate(prompts):
        try:
            ids = codec.encode(text)
        except ValueError as err:
            raise ConfigError(f"generate.prompts line {index + 1}: {err}") from None
        if not ids:
            raise ConfigError(
                f"generate.prompts line {index + 1}: no token in it; write a prompt (for "
                "data.source tokens: its token ids separated by spaces)"
            )
        seed = prompt_seed(generate["seed"], index)
        kept, cropped = ids[-block:], max(0, len(ids) - block)
        encoded.append({"text": text, "tokens": kept, "cropped": cropped, "seed": seed})
    return encoded


def write_request(work: str, prompts: list[dict], generate: dict, out: dict) -> Path:
    """The ranks' request in results/work/<run>/generate/ (the work folder: never a declared
    output), and the parts of an earlier attempt removed."""
    folder = Path(work) / GENERATE_WORK
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("part-*.jsonl"):
        stale.unlink()
    atomic_write_json(folder / REQUEST, {"prompts": prompts, "settings": generate, "out": out})
    return folder / REQUEST


def generate_run(run: dict, paths: RunPaths, logs_dir: str, generate: dict, out: dict) -> dict:
    """The generate rule: read and encode generate.prompts, write the ranks' request, submit
    the run's job (its machine: one Slurm job, or the local ranks) and wait for it."""
    from ddpflow.cluster import submit
    from ddpflow.cluster.jobs import GenerateJob

    check_can_generate(run)  # refused at parse already (generate.smk): here for API callers
    manifest = json.loads((Path(paths.staged) / "manifest.json").read_text())
    prompts = encode_prompts(read_prompts(generate), generate, manifest, paths.staged)
    cropped = [i + 1 for i, p in enumerate(prompts) if p["cropped"]]
    if cropped:
        block = manifest["block_size"]
        log.warning(
            "generate.prompts %s: %s longer than data.block_size (%d tokens): the model reads "
            "the last %d tokens of each (`cropped` in its line: how many were left out)",
            generate["prompts"],
            _lines(cropped),
            block,
            block,
        )
    write_request(paths.work, prompts, generate, out)
    placed, exclude = submit.placed(run, paths, "generate")
    computes = {"generate": generate, "generate_prompts": [p["text"] for p in prompts]}
    summary = submit.submit_and_wait(
        GenerateJob, "generate", placed, paths, logs_dir, exclude, computes=computes
    )[0]
    log.info(
        "generate %r: %s, %s on %s in %.1fs -> %s",
        run["name"],
        counted(summary["prompts"], "prompt"),
        counted(summary["tokens"], "new token"),
        counted(summary["world_size"], "rank"),
        summary["seconds"],
        out["generations"],
    )
    return summary
