"""The deployment files in deploy/ work as written, as far as these machines can tell without Docker, Kubernetes,
SLURM or GPUs: real linters and parsers (hadolint, the Compose v2 parser, the Kubernetes schemas, shellcheck),
and every Bios command they run accepted by Bios's own argument parsers."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bios.cli import build_parser
from bios.coordinator.main import parse_args as coordinator_args
from bios.worker.main import parse_args as worker_args

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
PARSERS = {"bios": build_parser().parse_args, "bios-coordinator": coordinator_args, "bios-worker": worker_args}


def tool(name: str) -> str:
    """A linter from the `test` extra, next to this Python or on PATH."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} is missing: pip install -e '.[test]'"
    return found


def run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=DEPLOY.parent)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def assert_bios_command(argv: list[str]) -> None:
    """The command parses with the parser of the program it runs (a typo in an option fails here)."""
    program, *args = argv
    assert program in PARSERS, argv
    PARSERS[program](args)


def test_dockerfile_lints_clean_and_its_command_parses():
    run(tool("hadolint"), "deploy/Dockerfile")
    cmd = next(line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("CMD "))
    assert_bios_command(json.loads(cmd.removeprefix("CMD ")))


def test_compose_file_parses_and_runs_bios_commands():
    config = json.loads(run(tool("docker-compose"), "-f", "deploy/docker-compose.yml", "config", "--format", "json"))
    services = config["services"]
    assert set(services) == {"keys", "coordinator", "worker"}
    assert services["coordinator"]["depends_on"]["keys"]["condition"] == "service_completed_successfully"
    assert any(v["target"] == "/var/lib/bios" and v["source"] == "state" for v in services["coordinator"]["volumes"])
    for service in services.values():
        command = service["command"]
        if command[:2] == ["sh", "-c"]:  # the worker reads its token first, then execs bios-worker
            command = shlex.split(command[2].split("exec ", 1)[1])
        assert_bios_command(command)


def _k8s_documents() -> list[dict]:
    return [doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())]


def test_kubernetes_manifests_match_the_schemas():
    run(tool("kubernetes-validate"), "--strict", *map(str, sorted((DEPLOY / "k8s").glob("*.yaml"))))


def test_kubernetes_manifests_are_wired_as_documented():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _k8s_documents()}
    coordinator = docs[("StatefulSet", "bios-coordinator")]["spec"]
    assert coordinator["volumeClaimTemplates"][0]["metadata"]["name"] == "state"
    pod = coordinator["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    main = pod["spec"]["containers"][0]
    state_dir = main["command"][main["command"].index("--state-dir") + 1]
    assert {m["mountPath"] for m in main["volumeMounts"]} == {state_dir}
    worker = docs[("Deployment", "bios-worker")]["spec"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "bios-worker-token"
    service_ports = {p["port"] for p in docs[("Service", "bios-coordinator")]["spec"]["ports"]}
    assert service_ports == {7600, 7601, 8000, 9600}  # 7601: workers connect to the client port + 1
    for container in [*pod["spec"]["initContainers"], main, worker]:
        assert_bios_command(container["command"])


def test_slurm_script_passes_shellcheck_and_runs_one_worker_per_gpu():
    run(tool("shellcheck"), "deploy/slurm/bios-workers.sbatch")
    script = (DEPLOY / "slurm" / "bios-workers.sbatch").read_text()
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    command = shlex.split(re.sub(r'"\$BIOS_COORDINATOR"', "tcp://head:7600", srun))
    worker = command[command.index("bios-worker"):]
    assert worker[-2:] == ["--gpus", "all"]
    assert_bios_command(worker)


@pytest.mark.parametrize("doc", ["README.md", "deploy/README.md", "docs/run-a-cluster.md"])
def test_docs_link_to_files_that_exist(doc):
    path = DEPLOY.parent / doc
    for target in re.findall(r"\]\(([^)#:]+)\)", path.read_text()):
        assert (path.parent / target).exists(), f"{doc} links to {target}, which does not exist"
