"""machine.container on the real Slurm test cluster: the workflow at 2 nodes x 2 ranks inside
the Charliecloud image of `make image` (its staging job too), with a site module loaded by
machine.setup, against the same run on the host's Python; and an image with another torch,
refused inside its job naming both versions. One Snakemake invocation holds the three runs.

GPUs: the test cluster's GPUs are fake GRES devices, so ch-fromhost --nvidia and NCCL inside
the image cannot be run here; the ranks train on CPU with gloo, as every Slurm test does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ddpflow
import pytest
from ddpflow.cluster import software
from slurm_helpers import job_ids, sacct_state
from test_container import METRICS, charliecloud_image
from test_workflow_slurm import CLUSTER_MACHINE, SCIENCE, slurm_snakemake
from workflow_helpers import write_config

pytestmark = pytest.mark.slurm

MODULES_INIT = Path("/usr/share/modules/init/bash")  # Debian's environment-modules


def _unavailable(why: str):
    if os.environ.get("DDPFLOW_REQUIRE_IMAGE") == "1":
        pytest.fail(f"DDPFLOW_REQUIRE_IMAGE=1 but {why}")
    pytest.skip(why)


def _other_torch_wheel() -> Path:
    """A torch wheel of another version than this environment's, from pip's local wheels."""
    planned = software.planned_versions()["torch"]
    folders = (os.environ.get("PIP_FIND_LINKS") or "/opt/wheels").split()
    for wheel in sorted(w for folder in folders for w in Path(folder).glob("torch-*.whl")):
        if wheel.name.split("-")[1] != planned:
            return wheel
    return _unavailable(f"no torch wheel other than {planned} in {folders}")


@pytest.fixture(scope="module")
def stale_image(tmp_path_factory) -> Path:
    """images/ddpflow with another torch (a CPU build of another version): a hard-linked copy
    whose torch folders are replaced (removing a hard link leaves the original image's)."""
    image, wheel = charliecloud_image(), _other_torch_wheel()
    stale = tmp_path_factory.mktemp("images") / "stale"
    subprocess.run(["cp", "-al", str(image), str(stale)], check=True)
    site = stale / "usr/local/lib/python3.11/dist-packages"
    for old in [site / "torch", *site.glob("torch-*.dist-info")]:
        shutil.rmtree(old)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    subprocess.run([*pip, "--target", str(site), str(wheel)], check=True, capture_output=True)
    return stale


@pytest.fixture(scope="module")
def site_module(tmp_path_factory) -> tuple[list[str], Path]:
    """machine.setup lines that load a site module (environment modules' Tcl modulefile), as
    sites ship a container runtime: its ch-run notes each start in a file, then runs
    /usr/bin/ch-run. Returns the lines and that file."""
    if not MODULES_INIT.is_file():
        _unavailable("environment modules are not installed (apt-get install environment-modules)")
    root = tmp_path_factory.mktemp("site")
    bin_dir, started = root / "charliecloud-bin", root / "ch-run-starts.txt"
    bin_dir.mkdir()
    wrapper = bin_dir / "ch-run"
    wrapper.write_text(f'#!/bin/sh\necho "$(hostname)" >> {started}\nexec /usr/bin/ch-run "$@"\n')
    wrapper.chmod(0o755)
    (root / "modulefiles/charliecloud").mkdir(parents=True)
    (root / "modulefiles/charliecloud/0.31").write_text(
        f"#%Module1.0\nprepend-path PATH {bin_dir}\nsetenv DDPFLOW_SITE_MODULE charliecloud/0.31\n"
    )
    lines = [f". {MODULES_INIT}", f"module use {root / 'modulefiles'}", "module load charliecloud"]
    return lines, started


@pytest.fixture(scope="module")
def three_runs(slurm_cluster, stale_image, site_module, tmp_path_factory):
    """host (the host's Python), image (make image's, its ch-run from the site module) and
    stale (another torch): one `snakemake --profile slurm`, which goes on past stale's
    failure (keep-going) and retries nothing."""
    image, (setup, started) = charliecloud_image(), site_module
    workdir = tmp_path_factory.mktemp("container-run")
    charliecloud = {"runtime": "charliecloud", "image": str(image)}
    runs = [
        {"name": "host"},
        {"name": "image", "machine": {"setup": setup, "container": charliecloud}},
        {"name": "stale", "machine": {"container": {**charliecloud, "image": str(stale_image)}}},
    ]
    machine = {**CLUSTER_MACHINE, "stage": {}}  # staging in a Slurm job: inside the image
    configfile = write_config(
        workdir / "config.yaml", {**SCIENCE, "machine": machine, "runs": runs}
    )
    result = slurm_snakemake(workdir, configfile, "--retries", "0")
    return workdir, result, started


def _read(workdir: Path, run: str, name: str) -> dict:
    return json.loads((workdir / f"results/runs/{run}/{name}.json").read_text())


def test_two_nodes_inside_the_image_score_as_on_the_host(three_runs):
    workdir, result, _ = three_runs
    output = (result.stdout + result.stderr)[-4000:]
    assert (workdir / "results/runs/image/eval_metrics.json").is_file(), output
    host, boxed = _read(workdir, "host", "eval_metrics"), _read(workdir, "image", "eval_metrics")
    assert boxed["world_size"] == 4 and sorted(set(boxed["hosts"])) == ["node1", "node2"]
    assert {k: boxed[k] for k in METRICS} == {k: host[k] for k in METRICS}
    # per host, the runtime and image each rank ran in, and its versions (the login node's)
    inside = _read(workdir, "image", "train_summary")["software"]
    assert sorted(inside) == ["node1", "node2"]
    planned = software.planned_versions()
    for node in inside.values():
        assert node["runtime"] == "charliecloud" and node["image"] == str(charliecloud_image())
        assert len(node["ranks"]) == 2 and node["torch"] == planned["torch"]
        assert node["nccl"] == planned["nccl"] and node["cuda"] == planned["cuda"]
        assert node["ddpflow"].startswith(f"{ddpflow.__version__}+src.")  # the project's
    outside = _read(workdir, "host", "train_summary")["software"]
    assert {node["runtime"] for node in outside.values()} == {"host"}
    # the staging job decoded inside the image too
    (stage_log,) = (workdir / "logs/stage").glob("*.log")
    assert "staging inside the charliecloud image" in stage_log.read_text()


def test_a_site_module_loaded_by_machine_setup_starts_the_ranks(three_runs):
    """machine.setup's `module load` ran in the batch script before srun: the module's ch-run
    (first on its PATH) started every rank of both nodes."""
    workdir, _, started = three_runs
    (job,) = job_ids(workdir / "logs/submitit/image/train")
    script = (workdir / f"logs/submitit/image/train/{job}_submission.sh").read_text()
    # the ranks' srun, run by the job's supervisor (machine.restarts_in_job: cluster.in_job)
    [line] = [line for line in script.splitlines() if " -- srun " in line]
    srun = line[line.index("srun ") :]
    assert script.index("module load charliecloud") < script.index(line)
    # ch-run by name, found on the PATH the module set (binds under /tmp are left out: ch-run
    # binds the host's /tmp itself, so a checkout under /tmp has none)
    assert " ch-run --" in srun and "/ch-run" not in srun, srun
    assert sorted(started.read_text().split()) == ["node1", "node1", "node2", "node2"]


def test_an_image_with_another_torch_is_refused_in_its_job_naming_both(three_runs):
    workdir, result, _ = three_runs
    assert result.returncode != 0  # stale failed; host and image finished (keep-going)
    assert not (workdir / "results/runs/stale/model.pt").exists()
    (job,) = job_ids(workdir / "logs/submitit/stale/train")
    assert sacct_state(job) in ("FAILED", "CANCELLED")  # refused on its nodes, not before
    said = (workdir / "logs/train/stale.log").read_text()
    planned = software.planned_versions()
    wheel_version = _other_torch_wheel().name.split("-")[1]
    assert f"torch {wheel_version} here, {planned['torch']} on the login node" in said, said
    assert "on node" in said and "charliecloud image" in said and "make image" in said
