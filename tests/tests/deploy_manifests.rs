//! The deployment manifests: the Helm chart (`helm lint --strict`, the rendered objects
//! through `kubernetes-validate --strict`, the Prometheus operator objects checked against
//! the monitoring.coreos.com/v1 fields they use), the systemd units (`systemd-analyze
//! verify` on the text install.sh installs, in a staged root) and install.sh's staging.
//!
//! Tools: `KVX_HELM` and `KVX_KUBE_VALIDATE` (installed by `cargo xtask setup`),
//! `systemd-analyze` (Debian `systemd`). A missing tool fails the test.

#![allow(clippy::disallowed_methods)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use kvx_e2e::{kvx_bin, root};
use serde_json::Value;

/// The Kubernetes version the rendered objects are validated against.
const KUBE_VERSION: &str = "1.33";

/// Values files the chart is checked with: defaults, then every option on.
const VALUES: [Option<&str>; 3] =
    [None, Some("ci/all-on-values.yaml"), Some("ci/frontend-discovery-values.yaml")];

fn tool(var: &str) -> PathBuf {
    let Some(p) = std::env::var_os(var).map(PathBuf::from) else {
        panic!(
            "{var} is not set: run `cargo xtask setup` (it installs the deploy tools) or `cargo xtask test`"
        );
    };
    assert!(p.is_file(), "{var}={} does not exist: run `cargo xtask setup`", p.display());
    p
}

fn chart() -> PathBuf {
    root().join("deploy/helm/kvx")
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"))
}

fn run_ok(cmd: &mut Command) -> Output {
    let out = run(cmd);
    assert!(out.status.success(), "{cmd:?} failed:\n{}", text(&out));
    out
}

/// A fresh directory under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("kvx-deploy-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).expect("temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn helm_template(values: Option<&str>) -> String {
    let mut cmd = Command::new(tool("KVX_HELM"));
    cmd.args(["template", "kvx"]).arg(chart()).args(["--namespace", "kvx"]);
    if let Some(v) = values {
        cmd.arg("-f").arg(chart().join(v));
    }
    String::from_utf8(run_ok(&mut cmd).stdout).expect("utf-8")
}

/// kubernetes-validate --strict on a YAML stream: (success, output).
fn kube_validate(yaml: &str) -> (bool, String) {
    let mut child = Command::new(tool("KVX_KUBE_VALIDATE"))
        .args(["-k", KUBE_VERSION, "--strict", "--quiet", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning kubernetes-validate");
    std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), yaml.as_bytes())
        .expect("writing to kubernetes-validate");
    let out = child.wait_with_output().expect("kubernetes-validate");
    (out.status.success(), text(&out))
}

/// The objects of a YAML stream as JSON (PyYAML of kubernetes-validate's venv).
fn objects(yaml: &str) -> Vec<Value> {
    let python = tool("KVX_KUBE_VALIDATE").with_file_name("python");
    let mut child = Command::new(&python)
        .args([
            "-c",
            "import sys, json, yaml; \
             print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d]))",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawning the venv's python");
    std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), yaml.as_bytes())
        .expect("writing yaml");
    let out = child.wait_with_output().expect("python");
    assert!(out.status.success(), "the rendered chart is not YAML");
    serde_json::from_slice(&out.stdout).expect("json")
}

#[test]
fn helm_lint_strict_passes_with_default_and_full_values() {
    for values in VALUES {
        let mut cmd = Command::new(tool("KVX_HELM"));
        cmd.args(["lint", "--strict"]).arg(chart());
        if let Some(v) = values {
            cmd.arg("-f").arg(chart().join(v));
        }
        let out = run_ok(&mut cmd);
        assert!(text(&out).contains("0 chart(s) failed"), "{values:?}: {}", text(&out));
    }
}

#[test]
fn the_chart_refuses_values_that_cannot_work() {
    let mut cmd = Command::new(tool("KVX_HELM"));
    cmd.args(["template", "kvx"]).arg(chart());
    cmd.args(["--set", "discovery.mode=frontend", "--set", "frontend.replicas=2"]);
    let out = run(&mut cmd);
    assert!(!out.status.success(), "two frontends without etcd rendered");
    assert!(text(&out).contains("one frontend replica"), "{}", text(&out));

    let mut cmd = Command::new(tool("KVX_HELM"));
    cmd.args(["template", "kvx"]).arg(chart()).args(["--set", "workers.podIPFamily=v6"]);
    let out = run(&mut cmd);
    assert!(!out.status.success(), "an unknown address family rendered");
    assert!(text(&out).contains("IPv4 or IPv6"), "{}", text(&out));

    // IPv6 pods: addresses are bracketed before their ports.
    let mut cmd = Command::new(tool("KVX_HELM"));
    cmd.args(["template", "kvx"]).arg(chart()).args(["--set", "workers.podIPFamily=IPv6"]);
    let out = run(&mut cmd);
    assert!(out.status.success(), "{}", text(&out));
    let yaml = String::from_utf8_lossy(&out.stdout);
    assert!(yaml.contains("\"[$(POD_IP)]:7300\"") && yaml.contains("\"[::]:7200\""), "{yaml}");

    // The workers' arithmetic: unset, the config map's (what `kvx configure` pinned) rules;
    // set, every worker gets it.
    let mut cmd = Command::new(tool("KVX_HELM"));
    cmd.args(["template", "kvx"]).arg(chart()).args(["--set", "config.KVX_ARITH=split"]);
    let out = run(&mut cmd);
    let yaml = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && !yaml.contains("name: KVX_ARITH"), "{yaml}");
    assert!(yaml.contains("KVX_ARITH: \"split\"") || yaml.contains("KVX_ARITH: split"), "{yaml}");
    let mut cmd = Command::new(tool("KVX_HELM"));
    cmd.args(["template", "kvx"]).arg(chart()).args(["--set", "workers.arith=exact"]);
    let out = run(&mut cmd);
    let yaml = String::from_utf8_lossy(&out.stdout);
    let workers = yaml.matches("args: [\"worker\"").count();
    assert!(workers > 0 && yaml.matches("name: KVX_ARITH").count() == workers, "{yaml}");
}

#[test]
fn rendered_objects_validate_strictly() {
    // Strict validation catches a field Kubernetes does not know.
    let broken = "apiVersion: v1\nkind: Service\nmetadata:\n  name: x\nspec:\n  portz: []\n";
    let (ok, out) = kube_validate(broken);
    assert!(!ok, "kubernetes-validate --strict accepted an unknown field:\n{out}");

    for values in VALUES {
        let yaml = helm_template(values);
        let (ok, out) = kube_validate(&yaml);
        assert!(ok, "{values:?}: kubernetes-validate --strict failed:\n{out}");
        // Warnings only for the operator's kinds, which have no built-in schema.
        for line in out.lines().filter(|l| l.starts_with("WARN")) {
            assert!(
                line.contains("monitoring.coreos.com/v1")
                    && (line.contains("ServiceMonitor") || line.contains("PodMonitor")),
                "{values:?}: unexpected warning: {line}"
            );
        }
        let objs = objects(&yaml);
        let kinds: Vec<&str> = objs.iter().filter_map(|o| o["kind"].as_str()).collect();
        for want in ["ConfigMap", "Deployment", "Service", "PodDisruptionBudget"] {
            assert!(kinds.contains(&want), "{values:?}: no {want} in {kinds:?}");
        }
        check_pods(&objs, values);
    }
}

/// Every kvx pod: non-root, read-only root, envFrom the ConfigMap; the frontend probes.
fn check_pods(objs: &[Value], values: Option<&str>) {
    for o in objs.iter().filter(|o| o["kind"] == "Deployment" || o["kind"] == "StatefulSet") {
        let name = o["metadata"]["name"].as_str().unwrap_or_default();
        let pod = &o["spec"]["template"]["spec"];
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{values:?} {name}");
        for c in pod["containers"].as_array().expect("containers") {
            assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true, "{name}");
            assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false, "{name}");
        }
        if name.ends_with("-frontend") {
            let c = &pod["containers"][0];
            assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/ready", "{name}");
            assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/health", "{name}");
            assert_eq!(c["envFrom"][0]["configMapRef"]["name"], "kvx-config", "{name}");
        }
    }
}

/// Keys the chart's ServiceMonitor / PodMonitor may use, each a field of the
/// monitoring.coreos.com/v1 CRDs (prometheus-operator), by path.
fn allowed_keys(path: &str) -> Option<&'static [&'static str]> {
    Some(match path {
        "" => &["apiVersion", "kind", "metadata", "spec"],
        "metadata" => &["name", "namespace", "labels", "annotations"],
        "spec" => &[
            "selector",
            "namespaceSelector",
            "endpoints",
            "podMetricsEndpoints",
            "jobLabel",
            "targetLabels",
            "podTargetLabels",
        ],
        "spec.selector" => &["matchLabels", "matchExpressions"],
        "spec.namespaceSelector" => &["any", "matchNames"],
        "spec.endpoints[]" | "spec.podMetricsEndpoints[]" => &[
            "port",
            "path",
            "scheme",
            "interval",
            "scrapeTimeout",
            "authorization",
            "honorLabels",
            "relabelings",
            "metricRelabelings",
        ],
        "spec.endpoints[].authorization" | "spec.podMetricsEndpoints[].authorization" => {
            &["type", "credentials"]
        }
        "spec.endpoints[].authorization.credentials"
        | "spec.podMetricsEndpoints[].authorization.credentials" => &["name", "key", "optional"],
        _ => return None,
    })
}

fn check_fields(v: &Value, path: &str, what: &str) {
    match v {
        Value::Object(m) => {
            if let Some(allowed) = allowed_keys(path) {
                for (k, child) in m {
                    assert!(allowed.contains(&k.as_str()), "{what}: unknown field {path}.{k}");
                    let sub = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                    check_fields(child, &sub, what);
                }
            }
        }
        Value::Array(a) => {
            for x in a {
                check_fields(x, &format!("{path}[]"), what);
            }
        }
        _ => {}
    }
}

fn is_duration(s: &str) -> bool {
    // The CRDs' Duration pattern: units y w d h m s ms in that order, digits before each.
    let mut rest = s;
    let mut any = false;
    for unit in ["y", "w", "d", "h", "ms", "m", "s"] {
        let digits = rest.chars().take_while(char::is_ascii_digit).count();
        if digits > 0 && rest[digits..].starts_with(unit) {
            let next = &rest[digits + unit.len()..];
            if unit == "m" && next.starts_with('s') {
                continue;
            }
            rest = next;
            any = true;
        }
    }
    any && rest.is_empty()
}

#[test]
fn every_kvx_container_serves_the_model_the_values_name() {
    let objs = objects(&helm_template(Some("ci/all-on-values.yaml")));
    let mut seen = 0;
    // The planner serves no model.
    let serving = |o: &&Value| {
        o["kind"] == "Deployment"
            && !o["metadata"]["name"].as_str().is_some_and(|n| n.ends_with("planner"))
    };
    for o in objs.iter().filter(serving) {
        for c in o["spec"]["template"]["spec"]["containers"].as_array().into_iter().flatten() {
            if !c["image"].as_str().is_some_and(|i| i.contains("kvx")) {
                continue;
            }
            let model =
                c["env"].as_array().into_iter().flatten().find(|e| e["name"] == "KVX_MODEL");
            assert_eq!(
                model.map(|e| &e["value"]),
                Some(&Value::from("smollm2-135m-instruct-q4_1")),
                "{} container {} does not get KVX_MODEL",
                o["metadata"]["name"],
                c["name"]
            );
            seen += 1;
        }
    }
    assert!(seen >= 2, "only {seen} kvx containers checked (frontend and workers)");
}

/// The planner's Kubernetes connector is pointed at what the chart renders: the worker
/// Deployments it scales exist, in the release's namespace, its frontend is the frontend
/// Service, and its Role may get and update their scale (all the connector does). In
/// aggregated mode (no pools to scale) the chart refuses the planner.
#[test]
fn the_planner_scales_the_deployments_the_chart_renders() {
    let objs = objects(&helm_template(Some("ci/frontend-discovery-values.yaml")));
    let named = |kind: &str, name: &str| {
        objs.iter().any(|o| o["kind"] == kind && o["metadata"]["name"] == name)
    };
    let planner = objs
        .iter()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "kvx-planner")
        .expect("the planner Deployment");
    let c = &planner["spec"]["template"]["spec"]["containers"][0];
    let env = |k: &str| -> String {
        c["env"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["name"] == k)
            .and_then(|e| e["value"].as_str())
            .unwrap_or_else(|| panic!("the planner has no {k}"))
            .to_string()
    };
    assert_eq!(env("KVX_PLANNER_CONNECTOR"), "kubernetes");
    for k in ["KVX_PLANNER_K8S_PREFILL", "KVX_PLANNER_K8S_DECODE"] {
        assert!(named("Deployment", &env(k)), "{k}={} is not rendered", env(k));
    }
    assert_eq!(env("KVX_PLANNER_K8S_NAMESPACE"), "kvx");
    let svc = env("KVX_PLANNER_FRONTEND");
    let host = svc.trim_start_matches("http://").split(':').next().unwrap_or_default();
    assert!(named("Service", host), "KVX_PLANNER_FRONTEND={svc}");
    assert_eq!(env("KVX_PLANNER_PROFILE"), "/etc/kvx/profile/profile.json");
    let role = objs
        .iter()
        .find(|o| o["kind"] == "Role" && o["metadata"]["name"] == "kvx-planner")
        .expect("the planner's Role");
    let scale = role["rules"].as_array().into_iter().flatten().any(|r| {
        let has = |k: &str, v: &str| r[k].as_array().is_some_and(|a| a.iter().any(|x| x == v));
        has("apiGroups", "apps")
            && has("resources", "deployments/scale")
            && has("verbs", "get")
            && has("verbs", "update")
    });
    assert!(scale, "the Role does not allow get and update on deployments/scale: {role}");

    let mut cmd = Command::new(tool("KVX_HELM"));
    cmd.args(["template", "kvx"]).arg(chart());
    cmd.args(["--set", "planner.enabled=true", "--set", "mode=agg"]);
    let out = run(&mut cmd);
    assert!(!out.status.success() && text(&out).contains("needs mode=disagg"), "{}", text(&out));
}

#[test]
fn monitors_match_the_operator_fields_and_select_the_frontend() {
    let objs = objects(&helm_template(Some("ci/all-on-values.yaml")));
    let find = |kind: &str| -> Vec<&Value> { objs.iter().filter(|o| o["kind"] == kind).collect() };
    let svc = find("Service")
        .into_iter()
        .find(|o| o["metadata"]["name"] == "kvx-frontend")
        .expect("frontend Service");
    let pods = find("Deployment")
        .into_iter()
        .find(|o| o["metadata"]["name"] == "kvx-frontend")
        .expect("frontend Deployment");
    for (kind, endpoints) in
        [("ServiceMonitor", "endpoints"), ("PodMonitor", "podMetricsEndpoints")]
    {
        let mons = find(kind);
        assert_eq!(mons.len(), 1, "one {kind}");
        let m = mons[0];
        assert_eq!(m["apiVersion"], "monitoring.coreos.com/v1", "{kind}");
        check_fields(m, "", kind);
        let sel = m["spec"]["selector"]["matchLabels"].as_object().expect("matchLabels");
        assert!(!sel.is_empty(), "{kind}: empty selector");
        let labels = if kind == "ServiceMonitor" {
            &svc["metadata"]["labels"]
        } else {
            &pods["spec"]["template"]["metadata"]["labels"]
        };
        for (k, v) in sel {
            assert_eq!(&labels[k], v, "{kind}: selector {k} does not select the frontend");
        }
        let eps = m["spec"][endpoints].as_array().expect("endpoints");
        assert!(!eps.is_empty(), "{kind}: no endpoints");
        for ep in eps {
            assert_eq!(ep["port"], "http", "{kind}: port");
            assert_eq!(ep["path"], "/metrics", "{kind}: path");
            let iv = ep["interval"].as_str().expect("interval");
            assert!(is_duration(iv), "{kind}: interval {iv} is not a Duration");
            assert_eq!(ep["authorization"]["type"], "Bearer", "{kind}");
            assert!(ep["authorization"]["credentials"]["name"].is_string(), "{kind}");
        }
        assert_eq!(m["spec"]["namespaceSelector"]["matchNames"][0], "kvx", "{kind}");
    }
    let port_names: Vec<&Value> =
        svc["spec"]["ports"].as_array().expect("ports").iter().map(|p| &p["name"]).collect();
    assert!(port_names.contains(&&Value::from("http")), "the Service has no `http` port");
    assert!(is_duration("15s") && is_duration("1m30s") && is_duration("500ms"));
    assert!(!is_duration("15") && !is_duration("s15") && !is_duration("1.5s"));
}

fn systemd_analyze() -> PathBuf {
    let p = PathBuf::from("/usr/bin/systemd-analyze");
    assert!(
        p.is_file(),
        "systemd-analyze is missing (Debian package `systemd`): run `cargo xtask setup`"
    );
    p
}

/// install.sh into a staged root; the root.
fn install_staged(dir: &Path, extra: &[&str]) -> Output {
    run(Command::new("sh")
        .arg(root().join("deploy/systemd/install.sh"))
        .arg("--bin")
        .arg(kvx_bin())
        .args(extra)
        .env("DESTDIR", dir))
}

/// `systemd-analyze verify --root` of units in a staged root: clean means exit 0 and not a
/// word on stdout or stderr (unknown keys and bad values are only warnings).
fn verify(stage: &Path, units: &[&str]) -> Result<(), String> {
    let out = run(Command::new(systemd_analyze())
        .arg("verify")
        .arg(format!("--root={}", stage.display()))
        .args(units));
    let said = text(&out);
    if out.status.success() && said.trim().is_empty() { Ok(()) } else { Err(said) }
}

/// The host's own units (targets the kvx units name) and `kill` (ExecReload), in the
/// staged root, so that verify resolves them there.
fn add_system_units(stage: &Path) {
    let dst = stage.join("usr/lib/systemd");
    fs::create_dir_all(&dst).expect("mkdir");
    run_ok(Command::new("cp").arg("-a").arg("/lib/systemd/system").arg(&dst));
    fs::create_dir_all(stage.join("bin")).expect("mkdir");
    fs::copy("/bin/kill", stage.join("bin/kill")).expect("copying kill");
}

#[test]
fn install_sh_stages_units_user_and_settings() {
    let dir = TempDir::new("install");
    let stage = &dir.0;
    let out = install_staged(stage, &["--roles", "prefill,decode", "--local-etcd"]);
    assert!(out.status.success(), "install.sh failed:\n{}", text(&out));
    let etc = stage.join("etc/systemd/system");
    let bin = stage.join("usr/local/bin/kvx");
    assert!(bin.is_file(), "no binary at {}", bin.display());
    for u in ["kvx-frontend.service", "kvx-worker@.service", "kvx-planner.service"] {
        let unit = fs::read_to_string(etc.join(u)).expect(u);
        assert!(unit.contains("ExecStart=/usr/local/bin/kvx "), "{u}");
        assert!(unit.contains("EnvironmentFile=/etc/kvx/kvx.env"), "{u}");
        assert!(unit.contains("User=kvx"), "{u}");
    }
    for wanted in
        ["kvx-frontend.service", "kvx-worker@prefill.service", "kvx-worker@decode.service"]
    {
        let link = etc.join("multi-user.target.wants").join(wanted);
        assert!(link.is_symlink(), "{wanted} is not enabled");
    }
    assert!(!etc.join("multi-user.target.wants/kvx-planner.service").exists(), "planner enabled");
    for d in ["kvx-frontend.service.d", "kvx-worker@.service.d"] {
        let conf = fs::read_to_string(etc.join(d).join("discovery-etcd.conf")).expect(d);
        assert!(conf.contains("Wants=etcd.service") && conf.contains("After=etcd.service"));
    }
    let passwd = fs::read_to_string(stage.join("etc/passwd")).expect("staged passwd");
    assert!(passwd.lines().any(|l| l.starts_with("kvx:")), "no kvx user:\n{passwd}");
    let env = fs::read_to_string(stage.join("etc/kvx/kvx.env")).expect("kvx.env");
    assert!(env.lines().any(|l| l.starts_with("KVX_")), "kvx.env has no KVX_ line:\n{env}");
    let mut cpus = Vec::new();
    for r in ["prefill", "decode"] {
        let f = stage.join(format!("etc/kvx/worker-{r}.env"));
        assert!(f.is_file(), "no {}", f.display());
        // Every worker has a way to its frontend (the shared file or its own).
        let own = fs::read_to_string(&f).expect("worker env");
        let joins = |t: &str| {
            t.lines().any(|l| l.starts_with("KVX_FRONTEND=") || l == "KVX_DISCOVERY=etcd")
        };
        assert!(joins(&env) || joins(&own), "worker {r} cannot find its frontend:\n{env}\n{own}");
        // Two workers on one host get disjoint cores (a worker pins shard i to its i-th core).
        let d = etc.join(format!("kvx-worker@{r}.service.d/cpus.conf"));
        if let Ok(c) = fs::read_to_string(&d) {
            let range =
                c.lines().find_map(|l| l.strip_prefix("CPUAffinity=")).expect("CPUAffinity");
            cpus.push(range.to_string());
        }
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores >= 2 {
        assert_eq!(cpus.len(), 2, "no per-worker CPUAffinity drop-ins");
        assert_ne!(cpus[0], cpus[1], "both workers pinned to {}", cpus[0]);
    }

    // A second run keeps the settings an operator edited.
    fs::write(stage.join("etc/kvx/kvx.env"), "KVX_PORT=9000\n").expect("edit");
    let out = install_staged(stage, &["--roles", "agg"]);
    assert!(out.status.success(), "second install.sh failed:\n{}", text(&out));
    let env = fs::read_to_string(stage.join("etc/kvx/kvx.env")).expect("kvx.env");
    assert_eq!(env, "KVX_PORT=9000\n", "install.sh rewrote an existing kvx.env");

    let out = install_staged(stage, &["--roles", "prefil"]);
    assert!(!out.status.success(), "install.sh accepted an unknown role");

    // The staged units as installed, verified in the staged root.
    add_system_units(stage);
    let units = [
        "kvx-frontend.service",
        "kvx-worker@prefill.service",
        "kvx-worker@decode.service",
        "kvx-worker@agg.service",
        "kvx-planner.service",
    ];
    if let Err(e) = verify(stage, &units) {
        panic!("systemd-analyze verify on the installed units:\n{e}");
    }

    // The same check fails on broken units: a binary that is not there, a misspelled key.
    let worker = fs::read_to_string(etc.join("kvx-worker@.service")).expect("worker unit");
    let missing =
        worker.replace("ExecStart=/usr/local/bin/kvx ", "ExecStart=/usr/local/bin/kvx-gone ");
    fs::write(etc.join("kvx-broken1@.service"), missing).expect("write");
    let e = verify(stage, &["kvx-broken1@prefill.service"]).expect_err("a missing binary passed");
    assert!(e.contains("kvx-gone"), "{e}");
    let typo = worker.replace("LimitMEMLOCK=", "LimitMEMLOK=");
    fs::write(etc.join("kvx-broken2@.service"), typo).expect("write");
    let e = verify(stage, &["kvx-broken2@prefill.service"]).expect_err("a misspelled key passed");
    assert!(e.contains("LimitMEMLOK"), "{e}");
}
