"""deploy/: every manifest parses and has its required fields, and the pieces agree with each other and with
the server: the container's arguments are valid `python -m helexa.server` flags, the ports, labels, block
size, topic and probe paths line up between the replicas, the pool and the picker, and the metric names
the docs promise are the ones `/metrics` exports."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from helexa.server.cli import build_parser, configs_from_args
from helexa.server.metrics import METRIC_NAMES, VLLM_METRIC_NAMES

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"

REQUIRED = {  # kind -> dotted paths every manifest of that kind must set
    "Deployment": ["metadata.name", "spec.selector.matchLabels", "spec.template.metadata.labels",
                   "spec.template.spec.containers"],
    "Service": ["metadata.name", "spec.selector", "spec.ports"],
    "InferencePool": ["metadata.name", "spec.selector.matchLabels", "spec.targetPorts", "spec.endpointPickerRef.name",
                      "spec.endpointPickerRef.port.number"],
    "HTTPRoute": ["metadata.name", "spec.parentRefs", "spec.rules"],
    "ConfigMap": ["metadata.name", "data"],
    "ServiceAccount": ["metadata.name"],
    "Role": ["metadata.name", "rules"],
    "RoleBinding": ["metadata.name", "subjects", "roleRef.name"],
}  # fmt: skip
API_VERSIONS = {
    "Deployment": "apps/v1", "Service": "v1", "InferencePool": "inference.networking.k8s.io/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1", "ConfigMap": "v1", "ServiceAccount": "v1",
    "Role": "rbac.authorization.k8s.io/v1", "RoleBinding": "rbac.authorization.k8s.io/v1",
}  # fmt: skip


def _get(obj: dict, path: str):
    for key in path.split("."):
        obj = obj[key]
    return obj


def _manifests() -> dict[tuple[str, str], dict]:
    docs: dict[tuple[str, str], dict] = {}
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((KUBE / name).read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def test_every_manifest_parses_with_its_required_fields() -> None:
    files = sorted(KUBE.glob("*.yaml"))
    assert {f.name for f in files} == {
        "kustomization.yaml",
        "helexa.yaml",
        "inferencepool.yaml",
        "endpoint-picker.yaml",
    }
    docs = _manifests()
    assert {kind for kind, _ in docs} == set(REQUIRED)
    for (kind, name), doc in docs.items():
        assert doc["apiVersion"] == API_VERSIONS[kind], (kind, name)
        for path in REQUIRED[kind]:
            assert _get(doc, path), (kind, name, path)
        if kind == "Deployment":
            spec = doc["spec"]
            assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    picker_config = yaml.safe_load(docs[("ConfigMap", "helexa-epp-config")]["data"]["plugins.yaml"])
    assert picker_config["kind"] == "EndpointPickerConfig"
    plugins = {p["type"] for p in picker_config["plugins"]}
    refs = {r["pluginRef"] for profile in picker_config["schedulingProfiles"] for r in profile["plugins"]}
    assert refs <= plugins and "precise-prefix-cache-scorer" in refs


def test_replicas_pool_and_picker_agree_with_each_other_and_with_the_server() -> None:
    docs = _manifests()
    deployment = docs[("Deployment", "helexa")]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    labels = pod["metadata"]["labels"]

    # The arguments are the server's own flags, with values its config accepts ($(POD_IP) is Kubernetes').
    args = [a.replace("$(POD_IP)", "10.0.0.1") for a in container["args"]]
    engine, _ = configs_from_args(build_parser().parse_args(args))
    assert engine.kv_events_endpoint == f"tcp://*:{ports['kv-events']}"
    assert engine.kv_events_replay_endpoint == f"tcp://*:{ports['kv-replay']}"
    topic_kv, pod_id, model = engine.kv_events_topic.split("@")
    assert (topic_kv, pod_id, model) == ("kv", f"10.0.0.1:{ports['http']}", engine.model)

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    live, ready = container["livenessProbe"], container["readinessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 120  # a reload never gets the pod restarted
    assert ready["failureThreshold"] == 1  # ...but it leaves the pool at once
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["http"])
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"

    service = docs[("Service", "helexa")]
    assert service["spec"]["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]

    pool = docs[("InferencePool", "helexa")]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": ports["http"]}]
    route = docs[("HTTPRoute", "helexa")]
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        "helexa",
    )

    epp_ref = pool["spec"]["endpointPickerRef"]
    epp_service = docs[("Service", epp_ref["name"])]
    assert epp_ref["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    epp = docs[("Deployment", epp_ref["name"])]
    (epp_container,) = epp["spec"]["template"]["spec"]["containers"]
    assert f"--pool-name={pool['metadata']['name']}" in epp_container["args"]
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == epp_ref["name"]
    assert not any(a.endswith("-metric") or "-metric=" in a for a in epp_container["args"])  # defaults: vLLM names

    picker = yaml.safe_load(docs[("ConfigMap", "helexa-epp-config")]["data"]["plugins.yaml"])
    scorer = next(p for p in picker["plugins"] if p["type"] == "precise-prefix-cache-scorer")["parameters"]
    assert scorer["tokenProcessorConfig"]["blockSize"] == engine.block_size
    events = scorer["kvEventsConfig"]
    assert engine.kv_events_topic.startswith(events["topicFilter"])
    assert events["discoverPods"] and events["podDiscoveryConfig"]["socketPort"] == ports["kv-events"]
    key, value = events["podDiscoveryConfig"]["podLabelSelector"].split("=")
    assert labels[key] == value


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_the_images_serve_the_ports_the_manifests_use(name: str) -> None:
    text = (DEPLOY / "container" / name).read_text()
    assert re.search(r"^FROM \S+", text, re.M)
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    (container,) = _manifests()[("Deployment", "helexa")]["spec"]["template"]["spec"]["containers"]
    assert {p["containerPort"] for p in container["ports"]} == exposed
    entry = re.search(r"^ENTRYPOINT (\[.+\])$", text, re.M)
    assert entry is not None
    argv = yaml.safe_load(entry.group(1))
    assert argv[:3] == ["python", "-m", "helexa.server"]
    build_parser().parse_args(argv[3:] + [a.replace("$(POD_IP)", "10.0.0.1") for a in container["args"]])
    assert "pip install ." in text and "COPY helexa" in text


def test_the_docs_name_the_metrics_the_server_exports() -> None:
    doc = (ROOT / "docs" / "scaling.md").read_text()
    named = set(re.findall(r"`((?:vllm:|helexa_)[a-z_:]+)`", doc))
    exported = set(METRIC_NAMES) | set(VLLM_METRIC_NAMES)
    assert set(VLLM_METRIC_NAMES) <= named and "helexa_admission_estimated_wait_seconds" in named
    assert named <= exported, named - exported
    for flag in ("--kv-events-endpoint", "--kv-events-replay-endpoint", "--kv-events-topic"):
        assert flag in doc and flag in shlex.join(build_parser().format_help().split())
