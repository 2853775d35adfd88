"""Session fixture that starts the real multi-node Slurm test cluster.

`cluster.sh up` builds the cluster (network + UTS namespaces per node, munge,
MariaDB, slurmdbd, slurmctld, slurmds); `cluster.sh down` removes every trace
of it and verifies that.  Where the machine cannot host it (not root, no
network namespaces, packages not installable) the tests are skipped with the
precise reason -- unless DDPFLOW_REQUIRE_SLURM=1 (CI), where that is a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "cluster.sh"
CANNOT_RUN_HERE = 77  # cluster.sh's exit code for "this machine cannot host it"
UP_TIMEOUT_S = 900  # apt install on a cold machine dominates (10-45 s measured)
DOWN_TIMEOUT_S = 180

# Payload modules (slurm_payloads.py) are imported by tests and, by
# reference, by submitit jobs: make them importable whatever pytest's import mode.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


@dataclass(frozen=True)
class SlurmCluster:
    partition: str
    short_partition: str
    account: str
    nodes: tuple[str, ...]
    state_dir: Path
    script: Path
    env: dict[str, str]  # the exports of `cluster.sh env`

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "log"


def _unavailable(reason: str) -> None:
    """Skip, or fail where CI demands the cluster (DDPFLOW_REQUIRE_SLURM=1)."""
    if os.environ.get("DDPFLOW_REQUIRE_SLURM") == "1":
        pytest.fail(f"Slurm test cluster required (DDPFLOW_REQUIRE_SLURM=1) but: {reason}")
    pytest.skip(f"Slurm test cluster unavailable: {reason}")


def _can_use_netns() -> str | None:
    """None if `ip netns add` works here, else why not (checked before any install)."""
    name = f"ddpf-probe-{uuid.uuid4().hex[:6]}"
    try:
        res = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    if res.returncode != 0:
        return f"'ip netns add' not permitted: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], check=False)
    return None


def _script(cmd: str, timeout: float, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), cmd, *args], capture_output=True, text=True, timeout=timeout
    )


def _parse_env(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value.strip('"')
    return env


def _cluster(env: dict[str, str]) -> SlurmCluster:
    return SlurmCluster(
        partition=env["DDPFLOW_SLURM_PARTITION"],
        short_partition=env["DDPFLOW_SLURM_SHORT_PARTITION"],
        account=env["DDPFLOW_SLURM_ACCOUNT"],
        nodes=tuple(env["DDPFLOW_SLURM_NODES"].split()),
        state_dir=Path(env["DDPFLOW_SLURM_DIR"]),
        script=SCRIPT,
        env=env,
    )


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.geteuid() != 0:
        _unavailable("needs root (network namespaces, mknod, daemons run as root)")
    why = _can_use_netns()
    if why:
        _unavailable(why)

    up = _script("up", UP_TIMEOUT_S)
    if up.returncode == CANNOT_RUN_HERE:
        _unavailable(up.stderr.strip().splitlines()[-1])
    try:
        assert up.returncode == 0, f"cluster.sh up failed:\n{up.stdout}\n{up.stderr}"
        env = _parse_env(_script("env", 30).stdout)
        with pytest.MonkeyPatch.context() as mp:
            # SLURM_CONF lets every client find the cluster without /etc/slurm.
            for key, value in env.items():
                mp.setenv(key, value)
            yield _cluster(env)
    finally:
        down = _script("down", DOWN_TIMEOUT_S)
        assert down.returncode == 0, f"cluster.sh down left things behind:\n{down.stderr}"


@pytest.fixture(scope="module")
def eight_node_cluster(slurm_cluster):
    """The session's cluster rebuilt at 8 nodes for one module's tests (resized())."""
    yield from resized(slurm_cluster, 8)


@pytest.fixture(scope="module")
def four_node_cluster(slurm_cluster):
    """The session's cluster rebuilt at 4 nodes for one module's tests (resized())."""
    yield from resized(slurm_cluster, 4)


def resized(slurm_cluster, nodes: int):
    """The session's cluster rebuilt at `nodes` nodes, then rebuilt at the session's size
    (`cluster.sh up N` rebuilds a cluster of another size: about 6 s each way, cheaper than
    more nodes for every test, whose checks are written for the session's size). A rebuild
    starts with empty accounting: job ids restart at 1."""
    size = str(len(slurm_cluster.nodes))
    up = _script("up", UP_TIMEOUT_S, str(nodes))
    try:
        assert up.returncode == 0, f"cluster.sh up {nodes} failed:\n{up.stdout}\n{up.stderr}"
        env = _parse_env(_script("env", 30).stdout)
        with pytest.MonkeyPatch.context() as mp:
            for key, value in env.items():
                mp.setenv(key, value)
            yield _cluster(env)
    finally:
        back = _script("up", UP_TIMEOUT_S, size)
        assert back.returncode == 0, f"cluster.sh up {size} failed:\n{back.stdout}\n{back.stderr}"
