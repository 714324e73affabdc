"""The Helm chart, rendered and linted by the real helm (3.17, 4.1 and 4.2), every object validated
strictly against Kubernetes schemas, and what the rendered pod tells the agent checked by the agent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator.v1 import PrometheusRule, ServiceMonitor

from tfprofd.daemon import config as configmod
from tfprofd.daemon.agent import prepare_state_dir
from tfprofd.daemon.cli import _option_flags, build_parser
from tfprofd.daemon.records import RecordStore

from helpers import ROOT

CHART = ROOT / "helm" / "tfprofd"
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())
CRDS = {"ServiceMonitor": ServiceMonitor, "PrometheusRule": PrometheusRule}

ROUTING = ["--set", "alertRouting.enabled=true", "--set", "alertRouting.forwardNetworks={10.0.0.0/8}",
           "--set", "api.token.existingSecret=tfprofd-token"]
GATES = ["--set", "serviceMonitor.enabled=true", "--set", "prometheusRule.enabled=true",
         "--set", "networkPolicy.enabled=true", *ROUTING]
CASES = {
    "defaults": [],
    "every gate on": GATES,
    "no host network": ["--set", "hostNetwork=false", "--set", "networkPolicy.enabled=true"],
    "other state directory": ["--set", "captureDir.hostPath=/data/gpu-agent", "--set", "captureDir.group=3000"],
    "no pod resources": ["--set", "podResources.enabled=false"],
    "server-mode captures": ["--set", "config.captures.mode=server"],
    "example alert routing": ["-f", str(CHART / "examples" / "alert-routing.yaml")],
    "job-wide captures": [*ROUTING, "--set", "cluster.prometheusUrl=http://prometheus-operated.monitoring.svc:9090"],
}


@pytest.fixture(scope="session")
def helms() -> dict[str, str]:
    """version -> the official helm binary (fetched into .tools/ by scripts/fetch-helm)."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch-helm"), str(ROOT / ".tools")],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


def helm(binary: str, *args: str, cwd: Path = CHART) -> subprocess.CompletedProcess:
    env = {**os.environ, "HELM_CACHE_HOME": "/nonexistent-cache", "HELM_CONFIG_HOME": "/nonexistent-config"}
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


def render(binary: str, *args: str, release: str = "tfprofd", chart: Path = CHART) -> list[dict]:
    result = helm(binary, "template", release, str(chart), "--namespace", "monitoring", *args)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def kind(objects: list[dict], name: str) -> list[dict]:
    return [o for o in objects if o["kind"] == name]


@pytest.mark.parametrize("case", CASES)
def test_chart_lints_strictly_and_renders_valid_objects_with_helm_3_and_4(helms, case):
    for version, binary in helms.items():
        lint = helm(binary, "lint", "--strict", ".", *CASES[case])
        assert lint.returncode == 0, f"helm {version}: {lint.stdout}{lint.stderr}"
        objects = render(binary, *CASES[case])
        assert {"DaemonSet", "ConfigMap", "Service", "ServiceAccount"} <= {o["kind"] for o in objects}
        for obj in objects:
            if obj["kind"] in CRDS:
                CRDS[obj["kind"]].model_validate(obj)
                continue
            for k8s in KUBERNETES_VERSIONS:
                kubernetes_validate.validate(obj, k8s, strict=True)


@pytest.mark.parametrize("case", CASES)
def test_the_rendered_pod_and_config_are_what_the_agent_accepts(helms, tmp_path, case):
    objects = render(helms["v4.2.3"], *CASES[case])
    [daemonset] = kind(objects, "DaemonSet")
    [configmap] = kind(objects, "ConfigMap")
    config = tmp_path / "tfprofd.yaml"
    config.write_text(configmap["data"]["tfprofd.yaml"])
    check = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "check-config", str(config)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    pod = daemonset["spec"]["template"]["spec"]
    [agent] = pod["containers"]
    args = [a if not a.startswith("--config=") else f"--config={config}" for a in agent["args"]]
    env = {e["name"]: e.get("value", "node-a") for e in agent["env"] if e["name"].startswith("TFPROFD_")}
    flags = _option_flags(build_parser().parse_args(args))
    cfg = configmod.load(str(config), env, flags)  # raises ConfigError on any problem

    # One path everywhere: the volume, both mounts, the init step and the agent's --state-dir (defect 4).
    [init] = pod["initContainers"]
    state = next(v for v in pod["volumes"] if v["name"] == "state")["hostPath"]["path"]
    assert cfg.core.state_dir == state
    assert {m["mountPath"] for c in (agent, init) for m in c["volumeMounts"] if m["name"] == "state"} == {state}
    # The init step gives the directory to the agent's own uid and group (defects 3 and 5).
    path, uid, gid = init["command"][3:]
    security = agent["securityContext"]
    assert (path, int(uid), int(gid)) == (state, security["runAsUser"], security["runAsGroup"])
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    expected_group = 3000 if case == "other state directory" else values["captureDir"]["group"]
    assert security["runAsGroup"] == expected_group
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert security["capabilities"] == {"drop": ["ALL"]} and security["readOnlyRootFilesystem"]
    assert cfg.collectors["kubernetes"].enabled == (case != "no pod resources")
    if cfg.collectors["kubernetes"].enabled:
        socket_dir = next(m["mountPath"] for m in agent["volumeMounts"] if m["name"] == "pod-resources")
        assert Path(cfg.collectors["kubernetes"].socket).parent == Path(socket_dir)
    else:
        assert security["runAsNonRoot"] and security["runAsUser"] == 65534
    routed = "alertRouting.enabled=true" in CASES[case] or case == "example alert routing"
    assert bool(cfg.alerts.forward_networks) == routed
    assert (cfg.api.listen[0] == "0.0.0.0") == routed
    # Job-wide captures: the agents find each other in Prometheus (and ask only inside forwardNetworks).
    assert cfg.cluster.prometheus_url == ("http://prometheus-operated.monitoring.svc:9090"
                                          if case == "job-wide captures" else "")


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the init step as root, as the kubelet would")
def test_the_init_step_makes_the_host_directory_usable_by_the_agent_user(helms):
    node = Path(tempfile.mkdtemp(prefix="tfprofd-node-"))  # traversable by others, like /var/lib
    node.chmod(0o755)
    try:
        _init_then_agent(helms["v4.2.3"], node / "state")
    finally:
        shutil.rmtree(node)


def _init_then_agent(binary: str, host_dir: Path) -> None:
    objects = render(binary, "--set", "podResources.enabled=false", "--set", f"captureDir.hostPath={host_dir}")
    pod = kind(objects, "DaemonSet")[0]["spec"]["template"]["spec"]
    [init], [agent] = pod["initContainers"], pod["containers"]
    host_dir.mkdir(mode=0o755)  # what DirectoryOrCreate makes: root:root 0755
    subprocess.run([sys.executable, *init["command"][1:]], check=True, timeout=30)
    user, group = agent["securityContext"]["runAsUser"], agent["securityContext"]["runAsGroup"]
    # The agent's own start-up checks and stores, as that user (a forked child that drops to it: the
    # interpreter under test need not be readable by that user).
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            os.setgroups([])
            os.setgid(group)
            os.setuid(user)
            RecordStore(prepare_state_dir(host_dir)).create_capture_dir("20261121T000000Z-abcdef", 0o770)
            code = 0
        except Exception as exc:
            print(f"as uid {user}: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the agent's user could not use the state directory"
    assert (host_dir / "captures" / "20261121T000000Z-abcdef").is_dir()
    st = host_dir.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (user, group, 0o2770)


def test_prometheus_job_label_is_what_the_alerts_match_whatever_the_release_is_called(helms):
    objects = render(helms["v4.2.3"], *GATES, release="gpu-agents")
    [monitor], [service], [rule] = kind(objects, "ServiceMonitor"), kind(objects, "Service"), kind(objects,
                                                                                                  "PrometheusRule")
    assert service["metadata"]["name"] == "gpu-agents-tfprofd"
    job = service["metadata"]["labels"][monitor["spec"]["jobLabel"]]  # prometheus-operator's `job` value
    assert job == "tfprofd"
    down = next(r for g in rule["spec"]["groups"] for r in g["rules"] if r.get("alert") == "TfprofdDown")
    assert f'up{{job="{job}"}}' in down["expr"]
    # The rules are prometheus/tfprofd-alerts.yaml, untouched by Go templating.
    assert rule["spec"] == yaml.safe_load((ROOT / "prometheus" / "tfprofd-alerts.yaml").read_text())
    assert (CHART / "files" / "tfprofd-alerts.yaml").read_bytes() == \
        (ROOT / "prometheus" / "tfprofd-alerts.yaml").read_bytes()


def test_network_policy_lets_hook_reports_and_the_control_api_in(helms):
    [policy] = kind(render(helms["v4.2.3"], "--set", "hostNetwork=false", "--set", "networkPolicy.enabled=true"),
                    "NetworkPolicy")
    ports = {(p["port"], p["protocol"]) for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert ports == {(9847, "TCP"), (9847, "UDP"), (9848, "TCP")}
    api_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 9848)
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "tfprofd",
                                            "app.kubernetes.io/instance": "tfprofd"}}} in api_rule["from"]


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "serviceMonitor.enabled=true", "--set", "service.enabled=false"], "serviceMonitor.enabled needs"),
    (["--set", "podLabels.app\\.kubernetes\\.io/name=x"], "podLabels.app.kubernetes.io/name"),
    (["--set", "alertRouting.enabled=true", "--set", "alertRouting.forwardNetworks={10.0.0.0/8}"],
     "needs api.token.existingSecret"),
    (["--set", "alertRouting.enabled=true", "--set", "api.token.existingSecret=t"], "needs alertRouting.forwardNet"),
    (["--set", "captureDir.hostPath=relative"], "hostPath"),
    (["--set", "cluster.prometheusUrl=http://prometheus:9090"], "cluster.prometheusUrl needs alertRouting.enabled"),
])
def test_values_that_cannot_work_fail_with_a_reason(helms, args, message):
    for binary in helms.values():
        result = helm(binary, "template", "t", ".", *args)
        assert result.returncode != 0 and message in result.stderr, result.stderr


def test_chart_works_as_a_subchart_of_an_umbrella_chart(helms, tmp_path):
    umbrella = tmp_path / "platform"
    (umbrella / "charts").mkdir(parents=True)
    (umbrella / "templates").mkdir()
    shutil.copytree(CHART, umbrella / "charts" / "tfprofd")
    (umbrella / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0",
        "dependencies": [{"name": "tfprofd", "version": "0.1.0", "condition": "tfprofd.enabled"}]}))
    (umbrella / "values.yaml").write_text(yaml.safe_dump({
        "global": {"imageRegistry": "registry.example.com"},
        "tfprofd": {"enabled": True, "serviceMonitor": {"enabled": True}}}))
    for version, binary in helms.items():
        lint = helm(binary, "lint", "--strict", str(umbrella), cwd=tmp_path)
        assert lint.returncode == 0, f"helm {version}: {lint.stdout}{lint.stderr}"
        objects = render(binary, release="platform", chart=umbrella)
        assert kind(objects, "ServiceMonitor") and kind(objects, "DaemonSet")


def test_helm_values_match_the_schema_and_bad_values_do_not():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)
    jsonschema.validate({**values, "global": {}}, schema)  # what Helm gives a subchart
    for bad in ({**values, "ports": {**values["ports"], "metrics": "9847"}},
                {**values, "captureDir": {"hostPath": "relative/path"}},
                {**values, "alertRouting": {"enabled": True, "forwardNetworks": ["not a network"]}},
                {**values, "serviceMonitr": {"enabled": True}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_the_pod_memory_limit_holds_the_agent_and_two_analyses_at_their_bound(helms, tmp_path):
    """The chart sizes captures.analysis_max_memory to its memory limit: a trace too large for it ends
    ``too_large``, never an OOM kill of the pod."""
    objects = render(helms["v4.2.3"])
    [daemonset] = kind(objects, "DaemonSet")
    [configmap] = kind(objects, "ConfigMap")
    config = tmp_path / "tfprofd.yaml"
    config.write_text(configmap["data"]["tfprofd.yaml"])
    cfg = configmod.load(str(config), {}, {})
    [agent] = daemonset["spec"]["template"]["spec"]["containers"]
    limit = agent["resources"]["limits"]["memory"]
    units = {"Mi": 2**20, "Gi": 2**30}
    limit_bytes = int(limit[:-2]) * units[limit[-2:]]
    assert 2 * cfg.captures.analysis_max_memory + 64 * 2**20 <= limit_bytes
    assert cfg.captures.analysis_max_memory >= 1400 * 2**20  # a default 2 s capture of a 1 ms-step job fits (README)
