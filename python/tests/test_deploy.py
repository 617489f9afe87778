"""The Kubernetes manifests under deploy/kubernetes/ (they cannot run here): they parse, every
daemon flag they pass is one feedstored accepts, and the daemon and the trainer pod agree on the
socket directory, the job's uid and the cluster secret's file mode."""

import subprocess

import pytest

yaml = pytest.importorskip("yaml")

from conftest import REPO, binary  # noqa: E402

DEPLOY = REPO / "deploy" / "kubernetes"


def load(name):
    return list(yaml.safe_load_all((DEPLOY / name).read_text()))


def test_the_daemonset_and_trainer_pod_agree_with_each_other_and_feedstored():
    service, daemonset = load("feedstored-daemonset.yaml")
    (trainer,) = load("trainer-pod.yaml")
    assert (service["kind"], daemonset["kind"], trainer["kind"]) == ("Service", "DaemonSet", "Pod")
    pod = daemonset["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["clusterIP"] == "None", "headless: the name resolves to every daemon"

    (daemon,) = pod["spec"]["containers"]
    help_text = subprocess.run(
        [binary("feedstored"), "--help"], capture_output=True, check=True
    ).stdout.decode()
    flags = dict((a.split("=", 1) + [None])[:2] for a in daemon["args"])
    for flag in flags:
        assert (
            f"{flag} " in help_text or f"{flag}=" in help_text or f"{flag}\n" in help_text
        ), f"feedstored has no {flag}"
    assert flags["--peers"].startswith(service["metadata"]["name"] + ".")
    metrics_port = flags["--metrics-addr"].rsplit(":", 1)[1]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == metrics_port
    # A rolling update starts the new pod beside the old one, which the pod allows: its daemon
    # takes the old one over or starts afresh, and no host port is declared twice.
    update = daemonset["spec"]["updateStrategy"]["rollingUpdate"]
    assert (update["maxSurge"], update["maxUnavailable"]) == (1, 0)
    assert flags["--takeover"] == "auto" and "--stay-after-handover" in flags
    assert "ports" not in daemon, "on the node's network a port would be a host port"
    probe = daemon["readinessProbe"]["exec"]["command"]
    assert probe == ["test", "-e", flags["--ready-file"]]

    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in daemon["volumeMounts"]}
    assert flags["--socket"].startswith(mounts["socket-dir"] + "/")
    assert flags["--cluster-secret-file"].startswith(mounts["cluster-secret"] + "/")
    assert volumes["cluster-secret"]["secret"]["defaultMode"] == 0o400

    (container,) = trainer["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    trainer_volumes = {v["name"]: v for v in trainer["spec"]["volumes"]}
    trainer_mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert (
        trainer_volumes["socket-dir"]["hostPath"]["path"]
        == volumes["socket-dir"]["hostPath"]["path"]
    )
    assert int(env["FEEDSTORE_RECONNECT_TIMEOUT"]) > 0, "a trainer goes on across an update"
    socket_in_trainer = env["FEEDSTORE_SOCKET"]
    assert socket_in_trainer.startswith(trainer_mounts["socket-dir"] + "/")
    assert socket_in_trainer.rsplit("/", 1)[1] == flags["--socket"].rsplit("/", 1)[1]
    assert str(trainer["spec"]["securityContext"]["runAsUser"]) == flags["--allow-uid"]
    compile(container["args"][0], "trainer", "exec")


def test_the_examples_compile():
    for example in sorted((REPO / "python" / "examples").glob("*.py")):
        compile(example.read_text(), str(example), "exec")


def test_the_network_policy_guards_the_daemonsets_ports():
    service, daemonset = load("feedstored-daemonset.yaml")
    (policy,) = load("feedstored-networkpolicy.yaml")
    assert policy["kind"] == "NetworkPolicy"
    pod = daemonset["spec"]["template"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (daemon,) = pod["spec"]["containers"]
    flags = dict((a.split("=", 1) + [None])[:2] for a in daemon["args"])
    ports = {
        "peer": int(flags["--listen"].rsplit(":", 1)[1]),
        "metrics": int(flags["--metrics-addr"].rsplit(":", 1)[1]),
    }
    rules = {r["ports"][0]["port"]: r["from"] for r in policy["spec"]["ingress"]}
    # Exactly the daemon's two ports are admitted, the peer port from node addresses only.
    assert set(rules) == {ports["peer"], ports["metrics"]}
    assert [list(f) for f in rules[ports["peer"]]] == [["ipBlock"]]
    assert {p["port"] for p in service["spec"]["ports"]} == {ports["peer"]}
