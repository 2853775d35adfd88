# Validation and helpers shared by every rule file; defines no rules.
# Parse-time code imports no torch or submitit: `snakemake -n` and `--lint` stay fast (the
# memory estimate runs torch in a subprocess, once per model, shape and micro-batch).
import re
import sys

from ddpflow import config as ddpconfig
from ddpflow.config import machine as ddpmachine
from ddpflow import paths as ddppaths
from ddpflow.checks import weight_files as ddpweights
from ddpflow.checks.host import check_output_folders, check_run_folders
from ddpflow.checks.values import run_warnings, tracking_enabled
from ddpflow.data import in_image as ddpimage

try:
    # validate (schema + cluster-independent checks) and fill defaults before any job runs;
    # the schema runs once for the config and once per run
    checked, resolved = ddpconfig.check_runs(config)
    check_output_folders(checked)
    check_run_folders(checked["results_dir"], [run["name"] for run in resolved])
    ddpconfig.check_plugin_tasks(resolved)
except ddpconfig.ConfigError as err:
    sys.exit(f"ddpflow: configuration error: {err}")
config.update(checked)
if workflow.is_main_process:
    for run in resolved:
        for warning in run_warnings(run, config["launcher"]):
            print(f"ddpflow: warning: {warning}", file=sys.stderr)

RESULTS = config["results_dir"]
LOGS = config["logs_dir"]
RUNS = {run["name"]: run for run in resolved}
try:
    # staging: in a Slurm job of its own (machine.stage), or on the login node
    STAGE_WHERE = ddpconfig.stage_where(resolved, config["launcher"])
except ddpconfig.ConfigError as err:
    sys.exit(f"ddpflow: configuration error: {err}")
# a staging job runs its Python in machine.container: the job finds it in its environment
ddpimage.export_staging_machines(resolved, STAGE_WHERE)

# Against the real cluster too (partition, account, nodes, GPUs, time limit), before anything
# is queued. Only in the main process: jobs re-read this file where sacctmgr may be missing.
# each GPU run's GPU types in its partition: the GPU memory the memory estimate compares with
GPU_TYPES = {}
if config["launcher"] == "slurm" and workflow.is_main_process:
    from ddpflow.checks.slurm import check_runs_against_cluster

    try:
        GPU_TYPES = check_runs_against_cluster(
            list(RUNS.values()), stage_in_job=STAGE_WHERE == "job"
        )
    except ddpconfig.ConfigError as err:
        sys.exit(f"ddpflow: configuration error: {err}")
    # the staging job's own Snakemake takes the CPUs and memory fitted here
    ddpmachine.export_fitted_stage(list(RUNS.values()))
elif config["launcher"] == "slurm":
    ddpmachine.apply_fitted_stage(list(RUNS.values()))

# What the train rule would refuse (a model that cannot be built or take the data's shape, a
# global batch larger than the staged split), refused here for every run whose data is staged:
# before Snakemake removes any finished run's outputs to retrain it; and a run whose ranks
# cannot fit their memory, before anything is queued (ddpflow.checks.early).
if workflow.is_main_process:
    from ddpflow.checks.early import check_before_jobs

    try:
        check_before_jobs(
            list(RUNS.values()),
            RESULTS,
            ".snakemake/ddpflow",
            GPU_TYPES,
            warn=lambda text: print(f"ddpflow: warning: {text}", file=sys.stderr),
        )
    except ddpconfig.ConfigError as err:
        sys.exit(f"ddpflow: configuration error: {err}")


wildcard_constraints:
    # a run name is matched literally (a sweep names runs lr-0.05: the dot is no wildcard)
    run="|".join(map(re.escape, RUNS)),
    dataset="[A-Za-z0-9_]+-[0-9a-f]{10}",


def run_file(key):
    """results/runs/{run}/<name>: the declared output `key` of every run (ddpflow.paths)."""
    return f"{RESULTS}/runs/{{run}}/{ddppaths.RUN_FILES[key]}"


def tracking_file():
    """results/runs/{run}/tracking.json: the track rule's record of the tracker runs."""
    return f"{RESULTS}/runs/{{run}}/{ddppaths.TRACKING_FILE}"


def tracked_files():
    """Every run's tracking.json where `tracking:` enables a tracker, else none."""
    if not tracking_enabled(config["tracking"]):
        return []
    return expand(tracking_file(), run=RUNS)


def report_file(key):
    return f"{ddppaths.report_dir(RESULTS)}/{ddppaths.REPORT_FILES[key]}"


def fingerprint_params(fingerprint, recorded_in):
    """Rule params: one `key=value` string per key that determines the rule's result.
    Snakemake reruns a job when its params change and names the differing ones, so an edit
    of config.yaml redoes exactly what it affects and the reason says which keys changed;
    keys that cannot change a result (launcher, partition, time limit, ...) are not in them.
    The run's full config reaches the script through snakemake.config. A rule has one param
    per key of any run; for a run without the key (another model's or task's), see
    absent_param. recorded_in: the run_file key of the output whose record holds the params.
    """
    keys = sorted(set().union(*(fingerprint(run) for run in RUNS.values())))

    def param(key):
        def value(wildcards):
            found = fingerprint(RUNS[wildcards.run])
            if key in found:
                return ddpconfig.as_params({key: found[key]})[0]
            return absent_param(key, run_file(recorded_in).format(run=wildcards.run))

        return value

    return [param(key) for key in keys]


RECORDED_PARAMS = {}


def absent_param(key, output):
    """The param of a key this run does not have: `key=null` where the run's recorded params
    hold it (what ddpflow recorded for such keys until 2026-11: kept, or the run would
    retrain), else Ellipsis, a value Snakemake does not record. So a run added with keys of
    its own (an MLP beside CNNs, a regression beside classifiers, fine-tuning keys) changes
    no other run's params. Without a readable record (another Snakemake), `key=null`."""
    null = ddpconfig.as_params({key: None})[0]
    if output not in RECORDED_PARAMS:
        try:
            from snakemake.io import IOFile

            RECORDED_PARAMS[output] = set(
                workflow.persistence.params(IOFile(output)) or ()
            )
        except Exception:  # noqa: BLE001 - Snakemake's persistence API moved: as before
            RECORDED_PARAMS[output] = None
    recorded = RECORDED_PARAMS[output]
    # Snakemake records each param as its repr()
    return null if recorded is None or repr(null) in recorded else ...


def local_ranks(wildcards):
    """Cores a train/evaluate job occupies on this machine: all its ranks when local."""
    run = RUNS[wildcards.run]
    return run["world_size"] if run["launcher"] == "local" else 1


def staged_dir(wildcards):
    return str(ddppaths.staged_dir(RESULTS, RUNS[wildcards.run]["dataset_id"]))


def run_for_dataset(dataset):
    for run in RUNS.values():
        if run["dataset_id"] == dataset:
            return run
    raise ValueError(f"no run uses dataset {dataset}")


def data_cfg_for(dataset):
    """The stage rule's params: the data keys without those that change no staged byte
    (threads, loading, on_small where it does not act), so that editing those restages
    nothing (ddpflow.config.stage_params)."""
    return ddpconfig.stage_params(run_for_dataset(dataset)["data"])


def stage_threads(wildcards):
    """A staging job's CPUs (machine.stage.cpus), or data.stage_threads on the login node."""
    run = run_for_dataset(wildcards.dataset)
    if STAGE_WHERE == "job":
        return ddpconfig.stage_cpus(run)
    return run["data"]["stage_threads"]


def stage_resources():
    """The staging job's resources for the Slurm executor plugin (none on the login node)."""
    if STAGE_WHERE != "job":
        return {}
    return ddpconfig.stage_rule_resources(list(RUNS.values()), run_for_dataset)


def predict_file(key):
    """results/runs/{run}/predictions.csv (and .json): `snakemake predict`'s outputs."""
    return f"{RESULTS}/runs/{{run}}/{ddppaths.PREDICT_FILES[key]}"


def export_file(fmt):
    return f"{RESULTS}/runs/{{run}}/{ddppaths.EXPORT_FILES[fmt]}"


def export_files():
    """Every run's exports in export.formats (a language model's: safetensors only)."""
    return [
        export_file(fmt).format(run=name)
        for name, run in RUNS.items()
        for fmt in ddpconfig.export_formats(run, config["export"]["formats"])
    ]


def safetensors_export(wildcards):
    """The run's model.safetensors where export.formats makes one (what trackers log)."""
    if "safetensors" not in config["export"]["formats"]:
        return []
    return [export_file("safetensors").format(run=wildcards.run)]


def predict_checked(wildcards):
    """predict.input's signature (predict_signature: listed, and every image decoded, once
    per invocation), after the run's task was checked to predict: each refusal stops
    Snakemake here, while it plans, before any job starts."""
    try:
        ddppredict.check_can_predict(RUNS[wildcards.run])
    except ddpconfig.ConfigError as err:
        sys.exit(f"ddpflow: configuration error: {err}")
    return predict_signature()


def predict_signature(wildcards=None):
    """predict.input's files (path, size, modification time), hashed: listed once per
    invocation, when a predict job is planned; an unset, missing or empty input (or, under
    predict.on_corrupt: fail, an image that does not decode) stops Snakemake there, before
    any job, with the key and the fix."""
    if PREDICT_LISTING.get("signature") is None:
        try:
            listing = ddppredict.list_input(config["predict"])
            ddppredict.check_decodes(listing, config["predict"], ".snakemake/ddpflow")
        except ddpconfig.ConfigError as err:
            sys.exit(f"ddpflow: configuration error: {err}")
        PREDICT_LISTING["signature"] = ddppredict.signature(listing)
    return PREDICT_LISTING["signature"]


def weights_input(wildcards):
    """The file model.weights names (run:NAME: NAME's model.pt, so NAME trains first); a
    missing or wrong file stops Snakemake here, before any job, naming the cause and the fix.
    """
    weights = RUNS[wildcards.run].get("weights")
    if weights is None:
        return []
    if weights["kind"] == "run":
        return run_file("model").format(run=weights["run"])
    problem = ddpweights.refusal(RUNS[wildcards.run])
    if problem:
        sys.exit(f"ddpflow: configuration error: {problem}")
    return weights["path"]


def torchvision_weight_entries():
    """{path: weights entry} of every run's torchvision weights (fetch_weights' outputs)."""
    entries = {}
    for run in RUNS.values():
        weights = run.get("weights")
        if weights and weights["kind"] == "torchvision":
            entries[weights["path"]] = {
                **weights,
                "pin": run["model"]["weights_sha256"],
            }
    return entries


def torchvision_weight_files():
    return sorted(torchvision_weight_entries())


def final_outputs():
    """Every run's model and evaluation (and tracking.json where a tracker is enabled) plus
    the report: all are targets, so deleting any one of them makes a rerun redo exactly it
    and what depends on it."""
    per_run = expand(
        [run_file("model"), run_file("eval_metrics")],
        run=RUNS,
    )
    return [
        *per_run,
        *export_files(),
        *tracked_files(),
        report_file("markdown"),
        report_file("html"),
    ]


# `snakemake predict`: the runs that predict (predict.runs, checked), and what their
# predictions depend on besides the model and the input (predict.runs is not)
from ddpflow import predict as ddppredict

try:
    PREDICT_RUNS = ddppredict.predict_run_names(config["predict"], RUNS)
except ddpconfig.ConfigError as err:
    sys.exit(f"ddpflow: configuration error: {err}")
PREDICT_SETTINGS = {k: v for k, v in config["predict"].items() if k != "runs"}
PREDICT_LISTING = {}

# `snakemake generate`: the runs that generate (generate.runs, checked), and what their
# generations depend on besides the model and the prompts file (generate.runs is not)
from ddpflow import generate as ddpgenerate

try:
    GENERATE_RUNS = ddpgenerate.generate_run_names(config["generate"], RUNS)
except ddpconfig.ConfigError as err:
    sys.exit(f"ddpflow: configuration error: {err}")
GENERATE_SETTINGS = {k: v for k, v in config["generate"].items() if k != "runs"}
GENERATE_PROMPTS = {}


def generate_file(key):
    """results/runs/{run}/generations.jsonl: `snakemake generate`'s output."""
    return f"{RESULTS}/runs/{{run}}/{ddppaths.GENERATE_FILES[key]}"


def generate_prompts(wildcards):
    """generate.prompts, after the run was checked to be a language model and the file read
    (once per invocation): each refusal stops Snakemake here, while it plans, before any
    job starts. An edited prompts file is newer than generations.jsonl: generated again.
    """
    try:
        ddpgenerate.check_can_generate(RUNS[wildcards.run])
        if "path" not in GENERATE_PROMPTS:
            ddpgenerate.read_prompts(config["generate"])
            GENERATE_PROMPTS["path"] = config["generate"]["prompts"]
    except ddpconfig.ConfigError as err:
        sys.exit(f"ddpflow: configuration error: {err}")
    return GENERATE_PROMPTS["path"]
