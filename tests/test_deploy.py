"""The deployment files in deploy/ work as written, as far as these machines can tell without Docker, Kubernetes,
SLURM or GPUs: real linters and parsers (hadolint, the Compose v2 parser, the Kubernetes schemas, shellcheck),
every Bios command they run accepted by Bios's own argument parsers, and every process that runs Bios given the
model map where BIOS_MODEL_MAP points and the models volume under every directory the map names."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from bios.cli.main import build_parser
from bios.cli.coordinator import parse_args as coordinator_args
from bios.models.registry import model_map, resolve_model_dir
from bios.cli.worker import parse_args as worker_args

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
FETCH_MODELS = "bios-fetch-models"  # deploy/fetch-models.py as the Dockerfile installs it; it takes no arguments


def _no_arguments(args: list[str]) -> None:
    assert not args, args


PARSERS = {"bios": build_parser().parse_args, "bios-coordinator": coordinator_args, "bios-worker": worker_args,
           FETCH_MODELS: _no_arguments}
MAP_READERS = {"bios-coordinator", "bios-worker", FETCH_MODELS}  # the programs that resolve base-model names


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


def _pinned_torch() -> str:
    dependencies = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d for d in dependencies if d.startswith("torch==")).removeprefix("torch==")


def _dockerfile_stages() -> tuple[dict[str, str], dict[str, list[str]]]:
    """The build args declared before the first FROM (with their defaults), and each stage's name -> instructions
    (continuation lines joined; the FROM line first)."""
    lines = re.sub(r"\s*\\\n\s*", " ", (DEPLOY / "Dockerfile").read_text()).splitlines()
    args: dict[str, str] = {}
    stages: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in (raw.strip() for raw in lines):
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            name = line.split(" AS ")[1].strip()
            current = stages[name] = [line]
        elif current is None:
            assert line.startswith("ARG "), line
            key, _, default = line.removeprefix("ARG ").partition("=")
            args[key] = default
        else:
            current.append(line)
    return args, stages


def test_dockerfile_lints_clean_and_its_command_parses():
    run(tool("hadolint"), "deploy/Dockerfile")
    cmd = next(line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("CMD "))
    assert_bios_command(json.loads(cmd.removeprefix("CMD ")))


def test_dockerfile_builds_the_cpu_image_by_default_and_the_cuda_image_on_request():
    """`docker build` alone gives today's CPU image; `--build-arg BIOS_DEVICE=cuda` swaps in the CUDA torch stage
    and nothing else. Both install torch at pyproject.toml's pin, so `pip install .` keeps the stage's build."""
    args, stages = _dockerfile_stages()
    assert args == {"BIOS_DEVICE": "cpu"}
    assert set(stages) == {"torch-cpu", "torch-cuda", "bios"}
    assert stages["bios"][0] == "FROM torch-${BIOS_DEVICE} AS bios"
    assert list(stages)[-1] == "bios"  # the default target, built whatever BIOS_DEVICE selects
    pin = f"torch=={_pinned_torch()}"
    cpu, cuda = stages["torch-cpu"], stages["torch-cuda"]
    assert cpu[0] == "FROM python:3.11-slim AS torch-cpu"
    cpu_wheel = f"RUN pip install --no-cache-dir {pin} --index-url https://download.pytorch.org/whl/cpu"
    assert [i for i in cpu if pin in i] == [cpu_wheel]
    # PyPI's wheel of the pinned torch is the CUDA 13.0 build: the base image's CUDA must be 13.0 too.
    assert re.fullmatch(r"FROM nvidia/cuda:13\.0\.\d+-base-ubuntu24\.04 AS torch-cuda", cuda[0])
    assert [i for i in cuda if pin in i] == [f"RUN pip install --no-cache-dir {pin}"]  # PyPI, no CPU index
    assert "ENV PATH=/opt/venv/bin:$PATH VIRTUAL_ENV=/opt/venv" in cuda  # the venv's pip and Bios's commands
    for stage in (cpu, cuda):
        assert any("gcc libc6-dev" in i for i in stage)  # a CPU worker's C kernels, in either image
    bios = stages["bios"]
    assert not any("torch" in i for i in bios if i.startswith("RUN"))
    assert f"COPY deploy/fetch-models.py /usr/local/bin/{FETCH_MODELS}" in bios
    assert any(f"chmod 755 /usr/local/bin/{FETCH_MODELS}" in i for i in bios)
    assert bios[-1].startswith("CMD ") and "USER 10001" in bios


def test_build_commands_in_the_docs_match_the_dockerfile():
    header = [line.removeprefix("#").strip() for line in (DEPLOY / "Dockerfile").read_text().splitlines()
              if line.startswith("#   docker build")]
    commands = [line.split("  #")[0].strip() for line in header]
    assert commands == ["docker build -f deploy/Dockerfile -t bios:cpu .",
                        "docker build -f deploy/Dockerfile --build-arg BIOS_DEVICE=cuda -t bios:cuda ."]
    readme = (DEPLOY / "README.md").read_text()
    for command in commands:
        assert command in readme
    _, stages = _dockerfile_stages()
    for command in commands:  # the value given selects a stage that exists
        device = re.search(r"BIOS_DEVICE=(\w+)", command)
        assert f"torch-{device.group(1) if device else 'cpu'}" in stages


def test_dockerignore_lets_through_exactly_what_the_dockerfile_copies():
    rules = [line for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
             if line and not line.startswith("#")]
    assert rules[0] == "*"
    allowed = {rule[1:] for rule in rules if rule.startswith("!")}
    _, stages = _dockerfile_stages()
    sources = {part for i in stages["bios"] if i.startswith("COPY ")
               for part in i.split()[1:-1] if not part.startswith("--")}
    assert sources == allowed
    for source in sources:
        assert (DEPLOY.parent / source).exists(), source


def _compose(*files: str, profile: str | None = None) -> dict:
    command = [tool("docker-compose")]
    for name in files:
        command += ["-f", f"deploy/{name}"]
    if profile:
        command += ["--profile", profile]
    return json.loads(run(*command, "config", "--format", "json"))


def _compose_commands(service: dict) -> list[list[str]]:
    """The Bios commands a service runs: its command, or each Bios command of its `sh -c` script (the keys
    service writes the worker token to a file, the worker reads it, then execs bios-worker)."""
    command = service["command"]
    if command[:2] != ["sh", "-c"]:
        return [command]
    steps = [shlex.split(step.split("exec ", 1)[-1].split(">", 1)[0]) for step in command[2].split("&&")]
    return [step for step in steps if step and step[0].startswith("bios")]


def test_compose_workers_get_the_worker_token_and_never_the_state_volume():
    """The state volume holds the server's secret key, the admin key and every API key: a worker needs only its
    token, which the keys service writes alone into a volume of its own."""
    services = _compose("docker-compose.yml")["services"]
    assert [["bios", "keys", "init"], ["bios", "keys", "worker-token"]] == _compose_commands(services["keys"])
    assert "> /run/bios-worker/token" in services["keys"]["command"][2]
    for worker in (services["worker"], _compose("docker-compose.yml", "docker-compose.cuda.yml")["services"]["worker"]):
        volumes = {v["source"]: v for v in worker["volumes"]}
        assert "state" not in volumes
        assert volumes["worker-token"]["target"] == "/run/bios-worker" and volumes["worker-token"]["read_only"]
        assert "$(cat /run/bios-worker/token)" in worker["command"][2]


def test_compose_file_parses_and_runs_bios_commands():
    config = _compose("docker-compose.yml")
    services = config["services"]
    assert set(services) == {"keys", "coordinator", "worker"}  # the download service only on request
    assert services["coordinator"]["depends_on"]["keys"]["condition"] == "service_completed_successfully"
    assert any(v["target"] == "/var/lib/bios" and v["source"] == "state" for v in services["coordinator"]["volumes"])
    assert {s["image"] for s in services.values()} == {"bios:cpu"}
    for service in services.values():
        for command in _compose_commands(service):
            assert_bios_command(command)
    download = _compose("docker-compose.yml", profile="download")["services"]["models"]
    assert download["command"] == [FETCH_MODELS] and download["profiles"] == ["download"]
    assert "HF_TOKEN" in download["environment"]


def test_compose_cuda_file_puts_the_workers_on_the_gpus():
    services = _compose("docker-compose.yml", "docker-compose.cuda.yml")["services"]
    worker = services["worker"]
    assert worker["image"] == "bios:cuda"
    assert worker["build"]["args"] == {"BIOS_DEVICE": "cuda"}
    assert worker["build"]["dockerfile"] == "deploy/Dockerfile"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": -1, "capabilities": ["gpu"]}]  # -1: all
    assert worker["deploy"]["replicas"] == 1  # one container forks a worker per GPU; more would share the GPUs
    command, = _compose_commands(worker)
    assert command[-2:] == ["--gpus", "all"]
    assert_bios_command(command)
    assert int(worker["shm_size"]) >= 2**30
    assert services["coordinator"]["image"] == "bios:cpu"


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
    assert main["image"] == "bios:cpu"
    state_dir = main["command"][main["command"].index("--state-dir") + 1]
    assert {m["mountPath"]: m["name"] for m in main["volumeMounts"]}[state_dir] == "state"
    worker = docs[("Deployment", "bios-worker")]["spec"]["template"]["spec"]["containers"][0]
    assert worker["image"] == "bios:cuda"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert worker["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "bios-worker-token"
    service_ports = {p["port"] for p in docs[("Service", "bios-coordinator")]["spec"]["ports"]}
    assert service_ports == {7600, 7601, 8000, 9600}  # 7601: workers connect to the client port + 1
    assert docs[("PersistentVolumeClaim", "bios-models")]["spec"]["accessModes"] == ["ReadWriteMany"]
    download = docs[("Job", "bios-models-download")]["spec"]["template"]["spec"]
    for container in [*pod["spec"]["initContainers"], main, worker, *download["containers"]]:
        assert_bios_command(container["command"])


# ------------------------------------------------------------------------------------------ models and the map


def _read_map(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The map as Bios's own reader takes it from a file named by BIOS_MODEL_MAP (raises on what a worker would
    refuse)."""
    path = tmp_path / "model-map.json"
    path.write_text(text)
    monkeypatch.setenv("BIOS_MODEL_MAP", str(path))
    mapping = model_map()
    assert mapping == json.loads(text) and mapping
    return mapping


def _assert_map_and_models_mounted(where: str, program: str, env: dict[str, str], mounts: dict[str, dict],
                                   mapping: dict[str, str], map_mount: tuple[str, str],
                                   models_mount: tuple[str, str]) -> None:
    """`mounts`: mount path -> {"volume": the volume's kind/name, "readOnly": bool}. BIOS_MODEL_MAP names a file
    inside the map's mount, and every directory of the map lies inside the models volume's mount, read-only for
    the processes that only read models."""
    path = Path(env.get("BIOS_MODEL_MAP", ""))
    assert path.is_absolute(), f"{where}: {program} runs without BIOS_MODEL_MAP"
    assert path.parent.as_posix() in mounts and mounts[path.parent.as_posix()]["volume"] == map_mount, \
        f"{where}: BIOS_MODEL_MAP={path} but the map is not mounted at {path.parent}"
    models = [p for p, m in mounts.items() if m["volume"] == models_mount]
    assert len(models) == 1, f"{where}: the models volume is mounted {len(models)} times"
    for name, directory in mapping.items():
        if Path(directory).is_absolute():
            assert Path(directory).is_relative_to(models[0]), f"{where}: {name} -> {directory} is outside {models[0]}"
    assert mounts[models[0]]["readOnly"] == (program != FETCH_MODELS), where


def _resolves_as_bios_does(mapping: dict[str, str], models_mount: str, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Each mapped name resolves, through Bios's resolver, to its directory once that holds a model."""
    local = {name: target.replace(models_mount, str(tmp_path / "models"), 1) for name, target in mapping.items()}
    for directory in local.values():
        if Path(directory).is_absolute():
            Path(directory).mkdir(parents=True, exist_ok=True)
            (Path(directory) / "config.json").write_text("{}")
    monkeypatch.setenv("BIOS_MODEL_MAP", json.dumps(local))
    monkeypatch.setenv("BIOS_CACHE_DIR", str(tmp_path / "cache"))
    for name, directory in local.items():
        if Path(directory).is_absolute():
            assert resolve_model_dir(name) == Path(directory).resolve()


def test_kubernetes_model_map_parses_and_every_bios_pod_mounts_it_where_bios_model_map_points(tmp_path, monkeypatch):
    docs = _k8s_documents()
    config_map = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "bios-model-map")
    (key, text), = config_map["data"].items()
    mapping = _read_map(text, tmp_path, monkeypatch)
    checked = set()
    for doc in docs:
        if doc["kind"] not in {"Deployment", "StatefulSet", "Job"}:
            continue
        pod = doc["spec"]["template"]["spec"]
        volumes = {}
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                volumes[volume["name"]] = ("configMap", volume["configMap"]["name"])
            elif "persistentVolumeClaim" in volume:
                volumes[volume["name"]] = ("claim", volume["persistentVolumeClaim"]["claimName"])
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            program = container["command"][0]
            if program not in MAP_READERS:
                continue
            where = f"{doc['kind']}/{doc['metadata']['name']} container {container['name']}"
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            mounts = {m["mountPath"]: {"volume": volumes.get(m["name"]), "readOnly": m.get("readOnly", False)}
                      for m in container["volumeMounts"]}
            _assert_map_and_models_mounted(where, program, env, mounts, mapping,
                                           ("configMap", "bios-model-map"), ("claim", "bios-models"))
            assert Path(env["BIOS_MODEL_MAP"]).name == key, f"{where}: the ConfigMap's key is {key}"
            checked.add(program)
    assert checked == MAP_READERS
    _resolves_as_bios_does(mapping, "/models", tmp_path, monkeypatch)


@pytest.mark.parametrize("files", [("docker-compose.yml",), ("docker-compose.yml", "docker-compose.cuda.yml")])
def test_compose_model_map_parses_and_every_bios_service_mounts_it_where_bios_model_map_points(
        files, tmp_path, monkeypatch):
    for variable in ("BIOS_MODELS_DIR", "BIOS_MODEL_MAP_FILE"):  # the defaults, as the docs describe them
        monkeypatch.delenv(variable, raising=False)
    config = _compose(*files, profile="download")
    (config_name, source), = config["configs"].items()
    mapping = _read_map(Path(source["file"]).read_text(), tmp_path, monkeypatch)
    models_dir = str(DEPLOY / "models")  # BIOS_MODELS_DIR's default, which compose makes absolute
    checked = set()
    for name, service in config["services"].items():
        program = _compose_commands(service)[-1][0]
        if program not in MAP_READERS:
            continue
        mounts = {c["target"].rsplit("/", 1)[0]: {"volume": ("config", c["source"]), "readOnly": True}
                  for c in service.get("configs", [])}
        mounts.update({v["target"]: {"volume": (v["type"], v["source"]), "readOnly": v.get("read_only", False)}
                       for v in service.get("volumes", [])})
        env = service.get("environment", {})
        _assert_map_and_models_mounted(f"service {name}", program, env, mounts, mapping,
                                       ("config", config_name), ("bind", models_dir))
        target = next(c["target"] for c in service["configs"] if c["source"] == config_name)
        assert env["BIOS_MODEL_MAP"] == target, f"service {name}: the map is mounted at {target}"
        checked.add(program)
    assert checked == MAP_READERS
    _resolves_as_bios_does(mapping, "/models", tmp_path, monkeypatch)


def _fetch_models_module():
    spec = importlib.util.spec_from_file_location("fetch_models", DEPLOY / "fetch-models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fetch_models_downloads_what_the_map_names_and_leaves_the_rest(tmp_path, monkeypatch, capsys):
    """bios-fetch-models against a stand-in for the Hub: missing directories are downloaded into a hidden sibling and
    renamed into place, filled ones and names mapped to names are skipped, and one failure does not stop the rest."""
    import huggingface_hub

    repos = {"org/new": ["config.json", "model.safetensors", "pytorch_model.bin"], "org/pickled": ["config.json",
             "pytorch_model.bin"]}
    downloads = []

    def snapshot_download(name, *, local_dir, ignore_patterns):
        if name not in repos:
            raise RuntimeError(f"404 {name}")
        assert Path(local_dir).name.startswith(".") and not Path(local_dir).exists()
        downloads.append((name, "*.bin" in ignore_patterns))
        Path(local_dir, ".cache").mkdir(parents=True)
        Path(local_dir, "config.json").write_text("{}")
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda name: repos.get(name, []))
    models = tmp_path / "models"
    (models / "have").mkdir(parents=True)
    (models / "have" / "config.json").write_text("{}")
    mapping = {"org/new": f"{models}/org--new", "org/pickled": f"{models}/pickled", "org/have": f"{models}/have",
               "alias": "org/new", "org/missing": f"{models}/missing"}
    monkeypatch.setenv("BIOS_MODEL_MAP", json.dumps(mapping))
    fetch = _fetch_models_module()
    assert fetch.main() == 1  # org/missing
    assert downloads == [("org/new", True), ("org/pickled", False)]  # .bin only where there are no safetensors
    assert sorted(p.name for p in models.iterdir()) == ["have", "org--new", "pickled"]  # no partial left over
    assert sorted(p.name for p in (models / "org--new").iterdir()) == ["config.json"]
    assert "not downloaded: org/missing" in capsys.readouterr().err
    del repos["org/new"], repos["org/pickled"]  # a second run finds them there and asks the Hub nothing
    mapping.pop("org/missing")
    monkeypatch.setenv("BIOS_MODEL_MAP", json.dumps(mapping))
    assert fetch.main() == 0
    monkeypatch.setenv("BIOS_MODEL_MAP", '{"org/new": 3}')
    assert fetch.main() == 2  # a map the workers would refuse


def test_slurm_script_passes_shellcheck_and_runs_one_worker_per_gpu():
    run(tool("shellcheck"), "deploy/slurm/bios-workers.sbatch")
    script = (DEPLOY / "slurm" / "bios-workers.sbatch").read_text()
    srun = [line.strip() for line in script.splitlines() if line.strip().startswith("srun ")]
    assert len(srun) == 2
    check = shlex.split(srun[0])
    assert_bios_command(check[check.index("bios"):])  # every node reads BIOS_MODEL_MAP before its workers start
    assert check[check.index("bios"):] == ["bios", "models", "list"]
    command = shlex.split(re.sub(r'"\$BIOS_COORDINATOR"', "tcp://head:7600", srun[1]))
    worker = command[command.index("bios-worker"):]
    assert worker[-2:] == ["--gpus", "all"]
    assert_bios_command(worker)


@pytest.mark.parametrize("doc", ["README.md", "deploy/README.md", "docs/run-a-cluster.md"])
def test_docs_link_to_files_that_exist(doc):
    path = DEPLOY.parent / doc
    for target in re.findall(r"\]\(([^)#:]+)\)", path.read_text()):
        assert (path.parent / target).exists(), f"{doc} links to {target}, which does not exist"
