"""A rank's memory, really spent, in a fresh process (tests/test_fits.py compares it with the
estimate): `python tests/memory_probe.py '<json spec>'` prints one JSON line.

The process does what a CPU rank's training job does to its memory, on one process (no
wrapper, no process group): footprint.process_memory() first (the same function the estimate's
process figure comes from, so the two start alike), then the model built and laid out as the
training does (ddpflow's build_model, channels_last, make_optimizer with its fused kernels),
`steps` training steps at the micro-batch (gradients set to None after each step, as the loop
does), then one evaluation forward in eval mode without gradients at the evaluation's batch.
It reports its peak resident memory (VmHWM: what the ranks record as peak_rss_mib; not
ru_maxrss, which carries the launching pytest process's peak across exec) and its
file-backed resident memory at the end (the libraries' pages).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rss_file_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    return 0


def probe(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F
    from ddpflow.runtime import peak_rss_bytes
    from ddpflow.training import footprint
    from ddpflow.training.build import make_optimizer
    from ddpflow.training.models import build_model

    torch.set_num_threads(1)  # as a local CPU rank
    process = footprint.process_memory()
    shape, micro, outputs = spec["shape"], spec["micro_batch"], 10
    model = build_model(spec["model"], shape, outputs)
    if spec["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    params = [p for p in model.parameters() if p.requires_grad]
    opt_cfg = footprint._optimizer_spec(spec["optimizer"])
    opt = make_optimizer(params, opt_cfg, 1e-3, torch.device("cpu"))
    x, y = torch.randn(micro, *shape), torch.randint(0, outputs, (micro,))
    for _ in range(spec["steps"]):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        model(torch.randn(spec["eval_batch"], *shape))
    peak = peak_rss_bytes()
    return {"process": process, "peak_bytes": peak, "file_bytes": rss_file_bytes()}


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))
