"""What every rank runs for `snakemake generate`: its unpadded shard of the prompts through
the run's model; rank 0 merges the shards in prompt order into generations.jsonl.

Prompt i has its place in the request (ddpflow.generate). Rank r continues the prompts
[start, stop) of evaluate.shard_bounds, the same contiguous unpadded shards as the
evaluation, so each prompt is continued once at any world size, one prompt at a time (a
batch of one: a completion never depends on which prompts share a rank), with the KV cache
(training.gpt.generate) and draws from the prompt's own seed. Each rank writes one JSON line
per prompt to results/work/<run>/generate/part-<r>.jsonl; after a barrier rank 0 reads the
parts in rank order, checks that every prompt appears exactly once, and writes
generations.jsonl atomically. The model runs in eval mode in fp32.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import torch

from ddpflow import runtime
from ddpflow.cluster.distenv import DistEnv
from ddpflow.config import uses_channels_last
from ddpflow.config.typed import RunSpec
from ddpflow.data.codec import codec_for
from ddpflow.generate import REQUEST
from ddpflow.paths import GENERATE_WORK
from ddpflow.training import evaluate
from ddpflow.training.entry import DistributedTask
from ddpflow.training.gpt import generate
from ddpflow.training.models import from_checkpoint
from ddpflow.words import counted

log = logging.getLogger(__name__)


class GenerateTask(DistributedTask):
    def work(self, spec: RunSpec, env: DistEnv, device, hosts) -> dict:
        begin = time.perf_counter()
        folder = Path(self.paths.work) / GENERATE_WORK
        request = json.loads((folder / REQUEST).read_text())
        manifest = json.loads((Path(self.paths.staged) / "manifest.json").read_text())
        checkpoint = runtime.safe_torch_load(self.paths.model, device)
        model = from_checkpoint(checkpoint, device, uses_channels_last(spec))
        prompts, settings = request["prompts"], request["settings"]
        start, stop = evaluate.shard_bounds(len(prompts), env.world_size, env.rank)
        codec = codec_for(manifest, self.paths.staged)
        with (folder / f"part-{env.rank}.jsonl").open("w") as part:
            for index in range(start, stop):
                line = continued(model, prompts[index], settings, manifest, codec)
                part.write(json.dumps({"index": index, **line}) + "\n")
        log.info(
            "rank %d continued prompts %d..%d in %.1fs",
            env.rank,
            start,
            stop - 1,
            time.perf_counter() - begin,
        )
        if env.world_size > 1:
            torch.distributed.barrier()  # every part is closed before rank 0 reads them
        if not env.is_master:
            return {"rank": env.rank, "host": socket.gethostname()}
        return merge(folder, env.world_size, len(prompts), request["out"], hosts, begin)


def continued(model, prompt: dict, settings: dict, manifest: dict, codec) -> dict:
    """One prompt's line: its text, the completion decoded, the new token ids, its seed and
    how many of its tokens were cropped (ddpflow.generate)."""
    tokens = generate(
        model,
        prompt["tokens"],
        settings["max_new_tokens"],
        int(manifest["block_size"]),
        prompt["seed"],
        temperature=settings["temperature"],
        top_k=settings["top_k"],
    )
    return {
        "prompt": prompt["text"],
        "completion": codec.decode(tokens),
        "tokens": tokens,
        "seed": prompt["seed"],
        "cropped": prompt["cropped"],
    }


def merge(folder: Path, world: int, n: int, out: dict, hosts, begin: float) -> dict:
    """generations.jsonl in prompt order from the ranks' parts (every prompt exactly once)."""
    lines: list[dict | None] = [None] * n
    for rank in range(world):
        with (folder / f"part-{rank}.jsonl").open() as part:
            for text in part:
                line = json.loads(text)
                index = line.pop("index")
                if lines[index] is not None:
                    raise RuntimeError(f"prompt {index} was continued twice: the shards overlap")
                lines[index] = line
    missing = [i for i, line in enumerate(lines) if line is None]
    if missing:
        raise RuntimeError(f"{counted(len(missing), 'prompt')} not continued, e.g. {missing[:5]}")
    body = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
    runtime.atomic_write_bytes(out["generations"], body.encode("utf-8"))
    return {
        "prompts": n,
        "tokens": sum(len(line["tokens"]) for line in lines if line),
        "world_size": world,
        "hosts": sorted(set(hosts)),
        "seconds": time.perf_counter() - begin,
    }
