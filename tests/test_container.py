"""machine.container (ddpflow.cluster.container) and the software check (ddpflow.cluster.software):
each runtime's command line parsed against its documented options, the sbatch script a
containerised Slurm job submits (with a machine.setup `module load` line), the binds a job
gets, the checks before submission, no fingerprint change, and the version check refusing a
rank, in a real job, whose software differs from the login node's plan.

Documented forms, as the tools' manuals give them:
- ch-run [OPTION...] IMAGE -- CMD [ARG...]; -b, --bind=SRC[:DST]; -c, --cd=DIR;
  --set-env=VAR=VALUE (charliecloud 0.31, `ch-run --help`, man ch-run)
- apptainer exec [exec options...] <container> <command>; --nv; -B, --bind src[:dest[:opts]];
  --pwd; --env (https://apptainer.org/docs/user/main/cli/apptainer_exec.html)
- podman-hpc run [options] image [command]: podman run's -v/--volume, -w/--workdir, -e/--env
  (a name ending in * passes every host variable with that prefix), --net, --ipc, --rm, and
  podman-hpc's module flags (--gpu, --mpi, --nccl; github.com/NERSC/podman-hpc)
- pyxis: srun --container-image=IMAGE --container-mounts=SRC:DST[:FLAGS][,SRC:DST...]
  --container-workdir=PATH ... COMMAND (github.com/NVIDIA/pyxis/wiki/Usage)
GPUs cannot be used here: --nv and --gpu are checked as arguments only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
from pathlib import Path

import pytest
import submitit
from ddpflow import config as ddpconfig
from ddpflow.checks.container import check_container
from ddpflow.cluster import container, software
from ddpflow.cluster.executor import make_executor, slurm_parameters
from ddpflow.cluster.jobs import EvalJob
from ddpflow.config import ConfigError, evaluation_fingerprint, training_fingerprint
from ddpflow.paths import RunPaths
from submitit.slurm.slurm import _make_sbatch_string
from workflow_helpers import REPO, snakemake, write_config

FOLDER = "/scratch/proj/logs/submitit/big/train"
IMAGE = REPO / "images/ddpflow"  # make image
# what a run's test metrics are: the same inside the image as on the host
METRICS = ("accuracy", "loss", "correct", "samples_evaluated", "test_size", "world_size")
IMAGES = {
    "apptainer": "/scratch/proj/ddpflow.sif",
    "charliecloud": "/scratch/proj/images/ddpflow",
    "podman-hpc": "registry.nersc.gov/proj/ddpflow:1.0",
    "pyxis": "/scratch/proj/ddpflow.sqsh",
}


def resolved_machine(**machine) -> dict:
    cfg = ddpconfig.validate({"launcher": "slurm", "machine": machine, "runs": [{"name": "big"}]})
    return ddpconfig.resolve_runs(cfg)[0]["machine"]


def with_container(runtime: str, gpus: int = 4, **container_keys) -> dict:
    spec = {"runtime": runtime, "image": IMAGES[runtime], **container_keys}
    machine = resolved_machine(nodes=2, gpus_per_node=gpus, container=spec)
    binds = ["/scratch/proj", "/data/imagenet:/data/imagenet:ro"]
    return container.bound(machine, binds if runtime != "charliecloud" else binds[:1])


def documented(prog: str, options: dict[str, str]) -> argparse.ArgumentParser:
    """A parser of the tool's documented options: 'flag' (no value) or 'value' each."""
    parser = argparse.ArgumentParser(prog=prog, add_help=False, exit_on_error=False)
    for names, kind in options.items():
        flags = names.split("|")
        if kind == "flag":
            parser.add_argument(*flags, action="store_true")
        else:
            parser.add_argument(*flags, action="append", default=[])
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


CH_RUN = documented(
    "ch-run",
    {"-b|--bind": "value", "-c|--cd": "value", "--set-env": "value", "--unset-env": "value"},
)
APPTAINER_EXEC = documented(
    "apptainer exec",
    {"--nv": "flag", "--rocm": "flag", "-B|--bind": "value", "--pwd": "value", "--env": "value"},
)
PODMAN_HPC_RUN = documented(
    "podman-hpc run",
    {
        "--rm": "flag",
        "--gpu": "flag",
        "--mpi": "flag",
        "--nccl": "flag",
        "--net|--network": "value",
        "--ipc": "value",
        "-v|--volume": "value",
        "-w|--workdir": "value",
        "-e|--env": "value",
    },
)
PYXIS_SRUN = documented(
    "srun",
    {
        "--container-image": "value",
        "--container-mounts": "value",
        "--container-workdir": "value",
        "--container-remap-root": "flag",
        "--unbuffered": "flag",
        "--output": "value",
        "--error": "value",
        "--cpus-per-task": "value",
        "--kill-on-bad-exit": "value",
    },
)


def parsed(parser: argparse.ArgumentParser, words: list[str]) -> argparse.Namespace:
    args = parser.parse_args(words)
    unknown = [w for w in args.rest if w.startswith("-") and w not in ("--", "-u", "-m")]
    assert not unknown, f"{parser.prog} does not document {unknown}: {shlex.join(words)}"
    return args


def test_charliecloud_command_line_is_ch_runs_documented_form():
    machine = with_container("charliecloud", env={"OMP_PROC_BIND": "close"})
    words = shlex.split(container.python_command(machine, "slurm"))
    assert words[0] == "ch-run"
    args = parsed(CH_RUN, words[1:])
    # the job's paths at their own paths; /tmp is ch-run's own bind of the host's
    assert args.bind == ["/scratch/proj:/scratch/proj"]
    assert args.cd and args.cd[0].startswith("/")
    env = dict(item.split("=", 1) for item in args.set_env)
    assert env["PATH"] == container.IMAGE_PATH  # not the login node's venv on the host PATH
    assert env["DDPFLOW_CONTAINER_RUNTIME"] == "charliecloud"
    assert env["DDPFLOW_CONTAINER_IMAGE"] == IMAGES["charliecloud"]
    assert env["OMP_PROC_BIND"] == "close"
    assert args.rest == [IMAGES["charliecloud"], "--", "python3"]  # IMAGE -- CMD
    assert container.srun_args(machine) == []
    assert container.setup_lines(machine) == ['export USER="${USER:-$(id -un)}"']


def test_apptainer_command_line_is_apptainer_execs_documented_form():
    words = shlex.split(container.python_command(with_container("apptainer"), "slurm"))
    assert words[:2] == ["apptainer", "exec"]
    args = parsed(APPTAINER_EXEC, words[2:])
    assert args.nv  # GPUs: the host's driver inside (not testable here: no GPU)
    assert args.bind == ["/scratch/proj:/scratch/proj", "/data/imagenet:/data/imagenet:ro"]
    assert "DDPFLOW_CONTAINER_RUNTIME=apptainer" in args.env
    assert args.rest == [IMAGES["apptainer"], "python3"]
    cpu = shlex.split(container.python_command(with_container("apptainer", gpus=0), "slurm"))
    assert not parsed(APPTAINER_EXEC, cpu[2:]).nv  # no GPU asked: no --nv
    amd = with_container("apptainer", options=["--rocm"])  # AMD GPUs (LUMI): --rocm instead
    args = parsed(APPTAINER_EXEC, shlex.split(container.python_command(amd, "slurm"))[2:])
    assert args.rocm and not args.nv


def test_podman_hpc_command_line_passes_slurms_variables_and_the_hosts_network():
    words = shlex.split(container.python_command(with_container("podman-hpc"), "slurm"))
    assert words[:2] == ["podman-hpc", "run"]
    args = parsed(PODMAN_HPC_RUN, words[2:])
    assert args.rm and args.gpu
    assert args.net == ["host"] and args.ipc == ["host"]  # the rendezvous; NCCL's shared memory
    assert "/data/imagenet:/data/imagenet:ro" in args.volume
    # podman passes no host variable it is not told to: Slurm's, submitit's, the rendezvous'
    for name in ("SLURM_*", "SUBMITIT_*", "MASTER_*", "CUDA_VISIBLE_DEVICES", "NCCL_*"):
        assert name in args.env
    assert args.rest == [IMAGES["podman-hpc"], "python3"]


def test_pyxis_options_go_to_srun_in_the_batch_script():
    machine = with_container("pyxis", options=["--container-remap-root"])
    assert container.python_command(machine, "slurm") == "python3"
    script = _make_sbatch_string(
        command=f"python3 -u -m submitit.core._submit {FOLDER}",
        folder=FOLDER,
        **slurm_parameters(machine, "ddpflow-train-big", folder=FOLDER),
    )
    [srun] = [line for line in script.splitlines() if line.startswith("srun ")]
    args = parsed(PYXIS_SRUN, shlex.split(srun)[1:])
    assert args.container_image == [IMAGES["pyxis"]]
    assert args.container_mounts == ["/scratch/proj:/scratch/proj,/data/imagenet:/data/imagenet:ro"]
    assert args.container_remap_root
    assert args.rest[:3] == ["python3", "-u", "-m"]
    # the job's environment reaches the image through srun: the runtime's word for the ranks
    assert "export DDPFLOW_CONTAINER_RUNTIME=pyxis" in script.splitlines()


def test_the_sbatch_script_loads_the_site_module_then_starts_the_ranks_in_the_image(
    monkeypatch,
):
    """machine.setup's `module load` lines run in the batch script before srun, whose command
    is the image's Python (what the Slurm test cluster runs: tests/slurm/test_container_slurm)."""
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    machine = container.bound(
        resolved_machine(
            nodes=2,
            setup=["module load apptainer/1.3.4"],
            container={"runtime": "apptainer", "image": IMAGES["apptainer"]},
        ),
        ["/scratch/proj"],
    )
    executor = make_executor("slurm", machine, FOLDER, "ddpflow-train-big")
    script = executor._make_submission_file_text(executor._submitit_command_str, "uid")
    lines = script.splitlines()
    [srun] = [line for line in lines if line.startswith("srun ")]
    assert lines.index("module load apptainer/1.3.4") < lines.index(srun)
    assert " apptainer exec --bind=/scratch/proj:/scratch/proj " in srun
    assert srun.endswith(f"{IMAGES['apptainer']} python3 -u -m submitit.core._submit {FOLDER}")
    assert "--nv" not in srun  # a CPU job


def test_without_a_container_the_job_is_todays():
    machine = resolved_machine(nodes=2)
    assert machine["container"] is None
    assert container.python_command(machine, "slurm") is None  # submitit's: this Python
    assert container.srun_args(machine) == container.setup_lines(machine) == []
    params = slurm_parameters(machine, "job", folder=FOLDER)
    assert params["srun_args"] == ["--cpus-per-task=1", "--kill-on-bad-exit=1"]


def test_a_container_changes_no_fingerprint_and_no_stage_param():
    plain = ddpconfig.resolve_runs(ddpconfig.load(None, {}))[0]
    spec = {"runtime": "charliecloud", "image": "images/ddpflow", "binds": ["/data"]}
    boxed = ddpconfig.resolve_runs(ddpconfig.load(None, {"machine": {"container": spec}}))[0]
    assert training_fingerprint(boxed) == training_fingerprint(plain)
    assert evaluation_fingerprint(boxed) == evaluation_fingerprint(plain)
    assert ddpconfig.stage_params(boxed["data"]) == ddpconfig.stage_params(plain["data"])


def test_a_job_binds_what_it_reads_and_writes_at_their_own_paths(tmp_path, monkeypatch):
    project, data, scratch = tmp_path / "project", tmp_path / "data", tmp_path / "scratch"
    for folder in (project, data, scratch / "logs/train", project / "results/work/cnn"):
        folder.mkdir(parents=True)
    monkeypatch.chdir(project)
    run = {
        "data": {"root": str(data), "loading": {"node_local_dir": "$TMPDIR/ddpflow"}},
        "model": {"weights": None},
        "machine": {"container": {"runtime": "apptainer", "image": "x.sif", "binds": ["/opt"]}},
    }
    work = str(project / "results/work/cnn/x")
    binds = container.job_binds(run, [work], scratch / "logs/train")
    assert str(project) in binds and str(data) in binds and str(scratch / "logs/train") in binds
    assert str(project / "results/work/cnn") not in binds  # inside the project, bound already
    assert "$TMPDIR/ddpflow" in binds and binds[-1] == "/opt"  # the user's binds last
    # the node-local copy expands where the job runs: in the batch script (Slurm)
    machine = container.bound({"gpus_per_node": 0, **run["machine"]}, binds)
    bind = "--bind=$TMPDIR/ddpflow:$TMPDIR/ddpflow"
    assert f'"{bind}"' in container.python_command(machine, "slurm")
    monkeypatch.setenv("TMPDIR", "/local/job1")  # the local runner splits: expanded here
    words = shlex.split(container.python_command(machine, "local"))
    assert "--bind=/local/job1/ddpflow:/local/job1/ddpflow" in words


def test_charliecloud_mount_points_are_made_in_a_directory_image(tmp_path):
    image = tmp_path / "image"
    (image / "etc").mkdir(parents=True)
    spec = {"runtime": "charliecloud", "image": str(image), "binds": ["/scratch/a", "/x:/mnt/0"]}
    assert container.make_mount_points({"container": spec}) == ["/scratch/a", "/mnt/0"]
    assert (image / "scratch/a").is_dir() and (image / "mnt/0").is_dir()
    assert container.make_mount_points({"container": spec}) == []  # there now


@pytest.mark.parametrize(
    ("launcher", "spec", "said"),
    [
        ("local", {"runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch"}, "--profile slurm"),
        ("local", {"runtime": "charliecloud", "image": "/nonexistent/img"}, "make image"),
        ("slurm", {"runtime": "apptainer", "image": "x", "binds": ["/a:b"]}, "not an absolute"),
        ("slurm", {"runtime": "podman-hpc", "image": "x", "binds": ["/a:/b:nosuid"]}, "ro or rw"),
        ("slurm", {"runtime": "podman-hpc", "image": "x", "binds": ["/a:/b:c:d"]}, "SRC:DST"),
    ],
)
def test_a_container_that_cannot_start_is_refused_before_submission(launcher, spec, said):
    machine = resolved_machine(container=spec)
    with pytest.raises(ConfigError, match=r"machine\.container") as err:
        check_container("runs ('big')", machine, launcher)
    assert said in str(err.value)


def test_an_image_missing_on_the_login_node_is_said_under_slurm():
    """A site may keep images where only the compute nodes see them: a warning, not a stop."""
    spec = {"runtime": "pyxis", "image": "/n/x.sqsh"}
    run = ddpconfig.resolve_runs(
        ddpconfig.validate({"launcher": "slurm", "machine": {"container": spec}})
    )[0]
    (said,) = [w for w in ddpconfig.run_warnings(run, "slurm") if "machine.container" in w]
    assert "/n/x.sqsh: no such file or directory here" in said
    assert not [w for w in ddpconfig.run_warnings(run, "local") if "machine.container" in w]


def test_ch_run_takes_no_bind_options(tmp_path):
    machine = resolved_machine(
        container={"runtime": "charliecloud", "image": str(tmp_path), "binds": ["/a:/a:ro"]}
    )
    with pytest.raises(ConfigError, match="ch-run's --bind does not take"):
        check_container("runs ('big')", machine, "slurm")


def test_the_login_nodes_plan_is_what_a_rank_of_this_environment_runs():
    """Read from the files without importing torch, then from the imported torch: the same."""
    planned, mine = software.planned_versions(), software.rank_versions()
    assert planned == mine and mine["torch"].startswith("2.")
    software.check_planned(planned, rank=0)  # no refusal


def test_a_rank_whose_torch_differs_from_the_plan_names_both_sides():
    planned = {**software.rank_versions(), "torch": "2.99.0+cu999", "cuda": "99.9"}
    with pytest.raises(software.SoftwareMismatch) as err:
        software.check_planned(planned, rank=3)
    mine = software.rank_versions()
    assert f"torch {mine['torch']} here, 2.99.0+cu999 on the login node" in str(err.value)
    assert f"CUDA {mine['cuda']} here, 99.9 on the login node" in str(err.value)
    assert "rank 3 on" in str(err.value) and "make image" in str(err.value)


def test_ddpflow_from_another_folder_is_compared_by_its_source():
    """An image's own copy of ddpflow: its digest and folder are named; the project's
    package (the same folder) is the same files, edited since the plan or not."""
    mine = software.rank_versions()
    software.check_planned({**mine, "ddpflow": "0.1.0+src.000000000000"}, rank=0)  # same folder
    stale = {**mine, "ddpflow": "0.1.0+src.000000000000", "at": "/usr/lib/ddpflow"}
    with pytest.raises(software.SoftwareMismatch, match=r"0\.1\.0\+src\.000000000000 \(/usr"):
        software.check_planned(stale, rank=0)


def test_ranks_that_disagree_are_named_and_agreeing_ones_recorded_per_host():
    line = '["charliecloud", "0.1.0+src.a", "2.14.1", "13.0", "2.30.7"]'
    other = '["charliecloud", "0.1.0+src.a", "2.13.0", "13.0", "2.30.7"]'
    with pytest.raises(software.SoftwareMismatch, match=r"torch 2\.13\.0 on rank 2 \(node2\)"):
        software.agree(["node1", "node1", "node2"], [line, line, other], ["/img"] * 3)
    software.agree(["node1", "node1", "node2"], [line] * 3, ["/img"] * 3)
    record = software.record()
    assert record["node1"]["ranks"] == [0, 1] and record["node2"]["ranks"] == [2]
    assert record["node2"]["runtime"] == "charliecloud" and record["node2"]["image"] == "/img"
    assert record["node1"]["torch"] == "2.14.1"


@pytest.mark.slow
def test_a_real_job_refuses_a_plan_its_torch_does_not_match(tmp_path):
    """submitit's local runner starts a real rank process, which refuses before any task."""
    planned = {**software.planned_versions(), "torch": "1.0.0"}
    executor = submitit.LocalExecutor(folder=str(tmp_path))
    executor.update_parameters(tasks_per_node=1, timeout_min=2)
    paths = RunPaths(*(str(tmp_path / name) for name in "abcdef"))
    job = executor.submit(EvalJob({}, paths, planned=planned))  # refused before its task
    with pytest.raises(submitit.core.utils.FailedJobError, match="1.0.0 on the login node"):
        job.result()
    assert Path(job.paths.stderr).read_text().count("SoftwareMismatch") >= 1


def charliecloud_image() -> Path:
    """images/ddpflow as `make image` built it for this checkout, or a skip naming why
    (DDPFLOW_REQUIRE_IMAGE=1, set by CI after `make image`, fails instead)."""
    pth = IMAGE / "usr/local/lib/python3.11/dist-packages/ddpflow-project.pth"
    why = None
    if shutil.which("ch-run") is None:
        why = "ch-run is not installed (apt-get install charliecloud-runtime)"
    elif not pth.is_file():
        why = f"{IMAGE} is missing: run `make image` (root, debootstrap)"
    elif pth.read_text().strip() != str(REPO / "workflow"):
        why = f"{IMAGE} was built for another checkout ({pth.read_text().strip()})"
    if why and os.environ.get("DDPFLOW_REQUIRE_IMAGE") == "1":
        pytest.fail(f"DDPFLOW_REQUIRE_IMAGE=1 but {why}")
    if why:
        pytest.skip(why)
    return IMAGE


@pytest.mark.e2e
def test_the_local_launcher_trains_inside_the_image_as_on_the_host(workdir):
    """Two runs of the same science, one on the host's Python and one in the Charliecloud
    image of `make image` (the local launcher honours machine.container too): the same test
    metrics, and each train_summary.json says where its ranks ran."""
    image = charliecloud_image()
    boxed = {"container": {"runtime": "charliecloud", "image": str(image)}}
    runs = [{"name": "host"}, {"name": "image", "machine": boxed}]
    configfile = write_config(
        workdir / "config.yaml", {"train": {"epochs": 2, "progress": False}, "runs": runs}
    )
    result = snakemake(workdir, configfile)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = {
        name: json.loads((workdir / f"results/runs/{name}/eval_metrics.json").read_text())
        for name in ("host", "image")
    }
    assert {k: metrics["image"][k] for k in METRICS} == {k: metrics["host"][k] for k in METRICS}
    summaries = {
        name: json.loads((workdir / f"results/runs/{name}/train_summary.json").read_text())
        for name in ("host", "image")
    }
    [(_, inside)] = summaries["image"]["software"].items()
    assert inside["runtime"] == "charliecloud" and inside["image"] == str(image)
    assert inside["ranks"] == [0, 1] and inside["torch"] == software.planned_versions()["torch"]
    [(_, outside)] = summaries["host"]["software"].items()
    assert outside["runtime"] == "host" and outside["image"] is None
    # the terminal says where each run's ranks run
    assert f"(2 ranks in charliecloud image {image}); logs in" in result.stderr
    assert "ddpflow-train-host as local job" in result.stderr
