"""What the train rule admits a run with, written to its work folder's admitted.json just
before the job is queued, for rank 0 to record in train_summary.json: the memory estimate
(ddpflow.checks.memory, as the run as placed is judged), the FLOPs of one micro-batch
(ddpflow.training.footprint counts them with the memory, on the same fake tensors) and the
evaluation batch eval.batch_size auto chose (the ranks read it: training.evaluate). Both come
from the footprint the parse and the train rule measured already (ddpflow.checks.early's
cache): nothing is measured twice.

    admit(run, manifest, ".snakemake/ddpflow", work)   # writes work/admitted.json
"""

from __future__ import annotations

import logging
from pathlib import Path

from ddpflow.checks import early, memory
from ddpflow.checks.model_kwargs import GPT_DEFAULTS
from ddpflow.monitoring.flops import ADMITTED, admission_record, gpt_formula_flops
from ddpflow.runtime import atomic_write_json

log = logging.getLogger(__name__)


def admission(run: dict, manifest: dict, cache_dir: str | Path) -> dict:
    """admitted.json's content for run (with "why" in place of what could not be had)."""
    inputs = early.input_of(run, manifest)
    request = early.footprint_request(run, inputs) if inputs is not None else None
    if inputs is None or request is None:
        return {"why": "the input's shape is not known before the job"}
    key = early.footprint_key(request)
    _, measured = early.measure({}, {key: request}, Path(cache_dir) / early.CACHE)
    figures = measured.get(key) or {"error": "the measurement did not run"}
    if "error" in figures:
        return {"why": f"the footprint could not be measured: {figures['error']}"}
    process = measured.get(early.RUNTIME) or {"anon": 0, "file": 0}
    auto = run["eval"]["batch_size"] == "auto"
    if auto:  # the evaluation batch the ranks use, chosen as the memory check chose it
        room, _ = early.room_of(run, measured, None)
        size = memory.auto_eval_batch(run, figures, process, inputs[2], room)
        figures = memory.with_eval_batch(figures, size)
    est = memory.estimate(run, figures, process, inputs[2])
    # a CPU rank's resident memory counts every library page it maps; a GPU rank's
    # torch.cuda.max_memory_allocated the tensors alone, not the CUDA context
    cpu = est.device == "cpu"
    comparable = est.total + process["file"] if cpu else est.total - est.runtime
    parts = ("parameters", "gradients", "optimizer", "activations", "evaluation", "data")
    estimate = {
        "total_bytes": est.total,
        "comparable_bytes": comparable,
        "device": est.device,
        "parts": {name: getattr(est, name) for name in (*parts, "runtime")},
        "library_bytes": process["file"],
        "world_size": run["world_size"],
        "strategy": run["train"]["strategy"],
        "micro_batch": run["train"]["micro_batch_size"],
    }
    record = admission_record(figures, int(run["train"]["micro_batch_size"]), estimate)
    if auto and figures.get("eval_batch"):
        record["eval_batch"] = int(figures["eval_batch"])  # eval.batch_size auto's choice
    if run["model"]["name"] == "gpt" and "flops" in record:  # the formula, to cross-check
        record["flops"]["formula_per_sample"] = _gpt_formula(run, figures, inputs[0][0])
    return record


def _gpt_formula(run: dict, figures: dict, block_size: int) -> float:
    """The gpt's FLOPs per sample (a block of tokens) by 6N + 12 L H Q T: N from the
    measured fp32 parameters (the tied output layer once) less the position embedding."""
    sizes = {**GPT_DEFAULTS, **(run["model"].get("kwargs") or {})}
    parameters = figures["parameters"] // 4 - block_size * sizes["n_embd"]
    per_token = gpt_formula_flops(parameters, sizes["n_layer"], sizes["n_embd"], block_size)
    return float(per_token * block_size)


def admit(run: dict, manifest: dict, cache_dir: str | Path, work: str | Path) -> dict:
    """Write run's admission into its work folder (never refusing: a run the estimate cannot
    judge trains, and its records say that nothing was admitted)."""
    try:
        record = admission(run, manifest, cache_dir)
    except Exception as err:  # noqa: BLE001 - a record, never a reason not to train
        record = {"why": f"{type(err).__name__}: {err}"[:300]}
    if "why" in record:
        why = record["why"]
        log.info("run %r: no memory estimate or FLOP count to record: %s", run["name"], why)
    atomic_write_json(Path(work) / ADMITTED, record)
    return record
