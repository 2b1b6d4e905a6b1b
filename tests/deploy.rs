//! The deployment files (`deploy/`) against the binary they deploy. Nothing
//! here runs Docker or Kubernetes (neither is on the machines that run
//! this suite): every manifest is parsed, checked against `atmost serve
//! --help` and against each other, and its configuration is given to the
//! real binary, on a real redis-server, which must serve with it.
//!
//! - every `ATMOST_*` variable is one the binary reads, and every value
//!   parses: the binary starts with the ConfigMap's, the compose file's
//!   and the Dockerfile's environment (its metrics address moved to
//!   loopback), and serves health SERVING; with the ConfigMap's it answers
//!   the scrape the pod annotations describe;
//! - the ports agree, gRPC's and metrics' (container, Service, probes,
//!   listen addresses, pod annotations, PodMonitor, EXPOSE, compose's
//!   mappings, NetworkPolicy), and only Prometheus may reach metrics;
//! - every health probe asks for a service atmost reports, over TLS when
//!   atmost serves TLS;
//! - Kubernetes waits for the drain: terminationGracePeriodSeconds (and
//!   compose's stop_grace_period) cover --drain-delay + --shutdown-grace
//!   (+ any preStop sleep);
//! - the pod runs restricted, as the image's non-root user;
//! - the Service's, PDB's, HPA's and NetworkPolicy's selectors and target
//!   match the Deployment;
//! - every Secret and key the Deployment reads is in docs/deploy.md, and
//!   every file atmost is told to read is in a mounted volume;
//! - every metric the Prometheus alert rules (`deploy/prometheus/`) and the
//!   Grafana dashboard (`deploy/grafana/`) read is one a live server
//!   exports, and the rules cover UNCERTAIN age and count, store errors,
//!   shedding and a replica that cannot be scraped; and Prometheus scrapes
//!   the replicas as the job those rules read (the PodMonitor, and the
//!   scrape job docs/deploy.md gives).

use crate::support::*;
use saphyr::{LoadableYamlNode, ScalarOwned, YamlOwned};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The health service names atmost reports (src/server.rs, `set_all`);
/// each is also checked against the running server below.
const HEALTH_SERVICES: [&str; 3] = ["", "atmost.v1.Gate", "atmost.v1.Permits"];

/// Where the image puts the probe (deploy/Dockerfile's COPY).
const PROBE: &str = "/usr/local/bin/grpc-health-probe";

/// The one path atmost's metrics listener answers (anything else is 404:
/// src/telemetry/prometheus.rs); the Kubernetes test scrapes it.
const METRICS_PATH: &str = "/metrics";

/// deploy/kubernetes files outside kustomization.yaml's resources, each
/// for a cluster that has what it needs (a PodMonitor needs the
/// Prometheus Operator's kind). Parsed and checked like the others.
const NOT_IN_KUSTOMIZATION: [&str; 1] = ["podmonitor.yaml"];

// === reading the files ===

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every YAML document of a file, as JSON values.
fn yaml(path: &str) -> Vec<Value> {
    yaml_of(&read(path), path)
}

/// Every YAML document of `text` (from `path`), as JSON values.
fn yaml_of(text: &str, path: &str) -> Vec<Value> {
    YamlOwned::load_from_str(text)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .iter()
        .map(|doc| to_json(doc, path))
        .collect()
}

fn to_json(node: &YamlOwned, path: &str) -> Value {
    match node {
        YamlOwned::Value(scalar) => match scalar {
            ScalarOwned::Null => Value::Null,
            ScalarOwned::Boolean(b) => Value::Bool(*b),
            ScalarOwned::Integer(i) => Value::from(*i),
            ScalarOwned::FloatingPoint(f) => Value::from(f.into_inner()),
            ScalarOwned::String(s) => Value::String(s.clone()),
        },
        YamlOwned::Sequence(items) => {
            Value::Array(items.iter().map(|i| to_json(i, path)).collect())
        }
        YamlOwned::Mapping(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let key = match to_json(k, path) {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    (key, to_json(v, path))
                })
                .collect(),
        ),
        YamlOwned::Tagged(_, inner) => to_json(inner, path),
        other => panic!("{path}: a YAML node this test does not read: {other:?}"),
    }
}

/// A scalar as the text a program would read from it.
fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => panic!("not a scalar: {other}"),
    }
}

/// `v[pointer]`, which must be there.
#[track_caller]
fn at<'a>(v: &'a Value, pointer: &str) -> &'a Value {
    v.pointer(pointer)
        .unwrap_or_else(|| panic!("no {pointer} in {v}"))
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(text)
        .collect()
}

fn duration(value: &str) -> Duration {
    humantime::parse_duration(value).unwrap_or_else(|e| panic!("{value:?}: {e}"))
}

/// The port of `host:port`.
fn port_of(addr: &str) -> u16 {
    let addr: std::net::SocketAddr = addr.parse().unwrap_or_else(|e| panic!("{addr}: {e}"));
    addr.port()
}

// === the binary ===

/// One flag of `atmost serve --help`.
#[derive(Debug, Clone)]
struct Flag {
    name: String,
    default: Option<String>,
    /// `<FILE>`: a path the binary reads.
    file: bool,
}

/// The flags of `atmost serve`, by environment variable.
fn serve_flags() -> BTreeMap<String, Flag> {
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_atmost"))
        .args(["serve", "--help"])
        .output()
        .expect("atmost serve --help");
    let help = String::from_utf8(help.stdout).expect("utf-8 help");
    let mut flags = BTreeMap::new();
    for block in help.split("\n      --").skip(1) {
        let mut head = block.lines().next().expect("a line").split_whitespace();
        let name = format!("--{}", head.next().expect("a name"));
        if name == "--help" {
            continue;
        }
        let field = |label: &str| {
            block
                .lines()
                .find_map(|l| l.trim().strip_prefix(label))
                .map(|v| v.trim_end_matches(']').to_owned())
        };
        let env = field("[env: ")
            .and_then(|v| v.split('=').next().map(str::to_owned))
            .unwrap_or_else(|| panic!("{name} reads no variable"));
        let flag = Flag {
            name,
            default: field("[default: "),
            file: head.next() == Some("<FILE>"),
        };
        flags.insert(env, flag);
    }
    assert!(flags.len() >= 30, "read {} flags from --help", flags.len());
    flags
}

/// The value a configuration gives `var`: its own, or the flag's default.
fn effective(env: &BTreeMap<String, String>, flags: &BTreeMap<String, Flag>, var: &str) -> String {
    env.get(var).cloned().unwrap_or_else(|| {
        flags[var]
            .default
            .clone()
            .unwrap_or_else(|| panic!("{} ({var}) has no default", flags[var].name))
    })
}

#[track_caller]
fn assert_read_by_the_binary<'a>(
    source: &str,
    names: impl IntoIterator<Item = &'a String>,
    flags: &BTreeMap<String, Flag>,
) {
    for name in names {
        assert!(
            name.starts_with("ATMOST_") || name == "RUST_LOG",
            "{source}: {name} is no variable of atmost's"
        );
        if name.starts_with("ATMOST_") {
            assert!(
                flags.contains_key(name),
                "{source}: {name} is read by no flag of `atmost serve` (it would be ignored)"
            );
        }
    }
}

// === Kubernetes ===

/// deploy/kubernetes: one object per file, by kind (the files outside the
/// kustomization's resources included).
fn kubernetes() -> BTreeMap<String, Value> {
    let kustomization = yaml("deploy/kubernetes/kustomization.yaml").remove(0);
    let listed: BTreeSet<String> = strings(at(&kustomization, "/resources"))
        .into_iter()
        .collect();
    let files: BTreeSet<String> = std::fs::read_dir(Path::new(ROOT).join("deploy/kubernetes"))
        .expect("deploy/kubernetes")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|f| f != "kustomization.yaml")
        .collect();
    let optional: BTreeSet<String> = NOT_IN_KUSTOMIZATION.map(String::from).into();
    assert!(
        listed.is_disjoint(&optional),
        "kustomization.yaml lists one of {optional:?}, which a cluster without its kind cannot apply"
    );
    assert_eq!(
        listed.union(&optional).cloned().collect::<BTreeSet<_>>(),
        files,
        "kustomization.yaml's resources (and {optional:?}) are not the files of deploy/kubernetes"
    );
    let mut objects = BTreeMap::new();
    for file in files {
        for object in yaml(&format!("deploy/kubernetes/{file}")) {
            let kind = text(at(&object, "/kind"));
            assert!(
                objects.insert(kind.clone(), object).is_none(),
                "two objects of kind {kind}"
            );
        }
    }
    for kind in [
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
        "PodMonitor",
    ] {
        assert!(objects.contains_key(kind), "no {kind} in deploy/kubernetes");
    }
    let image = text(at(&kustomization, "/images/0/name"));
    let container = atmost_container(&objects["Deployment"]);
    assert_eq!(
        text(at(container, "/image")),
        image,
        "kustomization.yaml sets the image of another container"
    );
    objects
}

fn atmost_container(deployment: &Value) -> &Value {
    let containers = at(deployment, "/spec/template/spec/containers")
        .as_array()
        .expect("containers");
    assert_eq!(containers.len(), 1, "one container: atmost");
    &containers[0]
}

/// The container's environment: the ConfigMaps of its envFrom, then its
/// own `env`. A value from a Secret is `None`.
fn pod_env(k8s: &BTreeMap<String, Value>) -> BTreeMap<String, Option<String>> {
    let container = atmost_container(&k8s["Deployment"]);
    let mut env = BTreeMap::new();
    for source in container
        .get("envFrom")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let name = text(
            source
                .pointer("/configMapRef/name")
                .expect("envFrom reads ConfigMaps only (the secrets are named one by one)"),
        );
        let map = &k8s["ConfigMap"];
        assert_eq!(
            text(at(map, "/metadata/name")),
            name,
            "envFrom names a ConfigMap deploy/kubernetes does not define"
        );
        for (k, v) in at(map, "/data").as_object().expect("data") {
            env.insert(k.clone(), Some(text(v)));
        }
    }
    for var in container
        .get("env")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let name = text(at(var, "/name"));
        env.insert(name, var.get("value").map(text));
    }
    env
}

/// What the pod mounts where: (mount path, the volume's object).
fn mounts(deployment: &Value) -> Vec<(String, Value)> {
    let volumes = at(deployment, "/spec/template/spec/volumes")
        .as_array()
        .expect("volumes");
    strings_of_mounts(atmost_container(deployment))
        .into_iter()
        .map(|(name, path)| {
            let volume = volumes
                .iter()
                .find(|v| text(at(v, "/name")) == name)
                .unwrap_or_else(|| panic!("volumeMount {name} names no volume"));
            (path, volume.clone())
        })
        .collect()
}

fn strings_of_mounts(container: &Value) -> Vec<(String, String)> {
    at(container, "/volumeMounts")
        .as_array()
        .expect("volumeMounts")
        .iter()
        .map(|m| {
            if let Some(sub) = m.get("subPath") {
                panic!(
                    "subPath {sub}: a Secret mounted by subPath never sees an update, \
                     and atmost re-reads its key files when they change"
                );
            }
            (text(at(m, "/name")), text(at(m, "/mountPath")))
        })
        .collect()
}

/// The Secret (name, key) a file path of the pod comes from; fails for a
/// path in no mounted Secret.
fn secret_file(deployment: &Value, path: &str) -> (String, String) {
    for (mount, volume) in mounts(deployment) {
        let Some(file) = path.strip_prefix(&format!("{mount}/")) else {
            continue;
        };
        let secret = volume
            .get("secret")
            .unwrap_or_else(|| panic!("{path}: in volume {volume}, which is no Secret"));
        let name = text(at(secret, "/secretName"));
        let key = match secret.get("items").and_then(Value::as_array) {
            // Only the listed keys are there, each at its path.
            Some(items) => items
                .iter()
                .find(|i| text(at(i, "/path")) == file)
                .map(|i| text(at(i, "/key")))
                .unwrap_or_else(|| panic!("{path}: {file} is not among the items of {name}")),
            None => file.to_owned(),
        };
        return (name, key);
    }
    panic!("{path} is in no volume the container mounts")
}

// === probes ===

/// A grpc-health-probe invocation.
#[derive(Debug)]
struct Probe {
    source: String,
    addr: String,
    service: String,
    tls: bool,
    ca: Option<String>,
}

fn probe(source: &str, command: &[String]) -> Probe {
    assert_eq!(
        command.first().map(String::as_str),
        Some(PROBE),
        "{source}: not the image's grpc-health-probe: {command:?}"
    );
    let mut p = Probe {
        source: source.to_owned(),
        addr: String::new(),
        service: String::new(),
        tls: false,
        ca: None,
    };
    for arg in &command[1..] {
        let (flag, value) = arg.split_once('=').unwrap_or((arg, ""));
        match flag {
            "-addr" => p.addr = value.to_owned(),
            "-service" => p.service = value.to_owned(),
            "-tls" => p.tls = true,
            "-tls-ca-cert" => p.ca = Some(value.to_owned()),
            "-tls-server-name" | "-connect-timeout" | "-rpc-timeout" => {}
            other => panic!("{source}: a probe flag this test does not know: {other}"),
        }
    }
    assert!(!p.addr.is_empty(), "{source}: no -addr");
    p
}

// === compose ===

fn compose() -> Value {
    yaml("deploy/compose.yaml").remove(0)
}

/// The atmost services of the compose file: the ones built from
/// deploy/Dockerfile.
fn compose_atmost(compose: &Value) -> Vec<(String, Value)> {
    let services: Vec<(String, Value)> = at(compose, "/services")
        .as_object()
        .expect("services")
        .iter()
        .filter(|(_, s)| s.get("build").is_some())
        .map(|(n, s)| (n.clone(), s.clone()))
        .collect();
    assert!(services.len() >= 2, "two atmost replicas in compose");
    for (name, service) in &services {
        assert_eq!(
            text(at(service, "/build/dockerfile")),
            "deploy/Dockerfile",
            "{name}"
        );
    }
    services
}

fn compose_env(service: &Value) -> BTreeMap<String, String> {
    match at(service, "/environment") {
        Value::Object(map) => map.iter().map(|(k, v)| (k.clone(), text(v))).collect(),
        Value::Array(list) => list
            .iter()
            .map(|entry| {
                let entry = text(entry);
                let (k, v) = entry.split_once('=').expect("NAME=value");
                (k.to_owned(), v.to_owned())
            })
            .collect(),
        other => panic!("environment: {other}"),
    }
}

/// The healthcheck's command, without its CMD.
fn compose_probe(name: &str, service: &Value) -> Probe {
    let test = strings(at(service, "/healthcheck/test"));
    assert_eq!(
        test[0], "CMD",
        "{name}: the image has no shell for CMD-SHELL"
    );
    probe(&format!("compose {name}"), &test[1..])
}

// === the Dockerfile ===

/// The Dockerfile's instructions: (INSTRUCTION, arguments), continuation
/// lines joined and comments dropped.
fn dockerfile() -> Vec<(String, String)> {
    let mut instructions = Vec::new();
    let mut current = String::new();
    for line in read("deploy/Dockerfile").lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                let (op, args) = current.split_once(' ').unwrap_or((&current, ""));
                instructions.push((op.to_uppercase(), args.trim().to_owned()));
                current.clear();
            }
        }
    }
    instructions
}

/// The final stage's instructions.
fn runtime_stage() -> Vec<(String, String)> {
    let all = dockerfile();
    let last = all.iter().rposition(|(op, _)| op == "FROM").expect("FROM");
    all[last..].to_vec()
}

fn dockerfile_env() -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for (op, args) in runtime_stage() {
        if op == "ENV" {
            for pair in args.split_whitespace() {
                let (k, v) = pair.split_once('=').expect("ENV NAME=value");
                env.insert(k.to_owned(), v.trim_matches('"').to_owned());
            }
        }
    }
    env
}

fn dockerfile_probe() -> Probe {
    let (_, args) = runtime_stage()
        .into_iter()
        .find(|(op, _)| op == "HEALTHCHECK")
        .expect("a HEALTHCHECK");
    let (_, cmd) = args.split_once("CMD ").expect("HEALTHCHECK ... CMD [...]");
    let cmd: Vec<String> = serde_json::from_str(cmd).expect("CMD in exec form (no shell)");
    probe("Dockerfile HEALTHCHECK", &cmd)
}

fn dockerfile_expose() -> Vec<u16> {
    runtime_stage()
        .into_iter()
        .filter(|(op, _)| op == "EXPOSE")
        .flat_map(|(_, args)| {
            args.split_whitespace()
                .map(|p| p.trim_end_matches("/tcp").parse::<u16>().expect("a port"))
                .collect::<Vec<_>>()
        })
        .collect()
}

// === the tests ===

#[test]
fn every_atmost_variable_in_deploy_is_one_the_binary_reads() {
    let flags = serve_flags();
    let k8s = kubernetes();
    assert_read_by_the_binary("kubernetes", pod_env(&k8s).keys(), &flags);
    assert_read_by_the_binary(
        "configmap.yaml",
        at(&k8s["ConfigMap"], "/data")
            .as_object()
            .expect("data")
            .keys(),
        &flags,
    );
    for (name, service) in compose_atmost(&compose()) {
        assert_read_by_the_binary(
            &format!("compose {name}"),
            compose_env(&service).keys(),
            &flags,
        );
    }
    assert_read_by_the_binary("Dockerfile", dockerfile_env().keys(), &flags);
    // The one way in: the image runs `atmost serve`, configured by its
    // environment.
    let entrypoint = runtime_stage()
        .into_iter()
        .find(|(op, _)| op == "ENTRYPOINT")
        .expect("ENTRYPOINT")
        .1;
    let entrypoint: Vec<String> = serde_json::from_str(&entrypoint).expect("exec form");
    assert_eq!(entrypoint, ["/usr/local/bin/atmost", "serve"]);
    let container = atmost_container(&k8s["Deployment"]);
    assert!(
        container.get("command").is_none() && container.get("args").is_none(),
        "the Deployment configures atmost through its environment only"
    );
}

/// The pod template's `prometheus.io/*` annotation `name`, which must be
/// there.
fn pod_annotation(deployment: &Value, name: &str) -> String {
    let annotations = at(deployment, "/spec/template/metadata/annotations");
    text(
        annotations
            .get(name)
            .unwrap_or_else(|| panic!("no pod annotation {name}: {annotations}")),
    )
}

#[test]
fn the_ports_agree() {
    let k8s = kubernetes();
    let deployment = &k8s["Deployment"];
    let container = atmost_container(deployment);
    // The container's ports by name: gRPC's, and metrics'.
    let ports = at(container, "/ports").as_array().expect("ports");
    let named: BTreeMap<String, u16> = ports
        .iter()
        .map(|p| {
            (
                text(at(p, "/name")),
                at(p, "/containerPort").as_u64().expect("a number") as u16,
            )
        })
        .collect();
    assert_eq!(
        (
            ports.len(),
            named.keys().map(String::as_str).collect::<Vec<_>>()
        ),
        (2, vec!["grpc", "metrics"]),
        "two ports: grpc and metrics"
    );
    let (port, metrics) = (named["grpc"], named["metrics"]);
    assert_ne!(port, metrics, "gRPC and metrics on one port");
    // A port named or numbered, as Kubernetes resolves it.
    let resolve = |v: &Value| match v {
        Value::Number(n) => n.as_u64().expect("a port") as u16,
        Value::String(name) => *named
            .get(name)
            .unwrap_or_else(|| panic!("port {name} is not one of the container's: {named:?}")),
        other => panic!("port {other}"),
    };
    let env = pod_env(&k8s);
    for (var, port) in [("ATMOST_LISTEN", port), ("ATMOST_METRICS_LISTEN", metrics)] {
        let listen = env
            .get(var)
            .cloned()
            .flatten()
            .unwrap_or_else(|| panic!("{var} in the ConfigMap"));
        assert_eq!(port_of(&listen), port, "{var}");
        assert!(
            listen
                .parse::<std::net::SocketAddr>()
                .unwrap()
                .ip()
                .is_unspecified(),
            "{var}={listen}: the kubelet, the Service and Prometheus reach the pod's own address"
        );
    }
    // Prometheus, by annotation or by PodMonitor, scrapes the metrics port.
    assert_eq!(
        pod_annotation(deployment, "prometheus.io/scrape"),
        "true",
        "prometheus.io/scrape"
    );
    assert_eq!(
        pod_annotation(deployment, "prometheus.io/port")
            .parse::<u16>()
            .ok(),
        Some(metrics),
        "prometheus.io/port"
    );
    assert_eq!(
        pod_annotation(deployment, "prometheus.io/path"),
        METRICS_PATH,
        "prometheus.io/path"
    );
    let endpoints = at(&k8s["PodMonitor"], "/spec/podMetricsEndpoints")
        .as_array()
        .expect("podMetricsEndpoints");
    assert_eq!(endpoints.len(), 1, "PodMonitor: one endpoint");
    assert_eq!(
        resolve(at(&endpoints[0], "/port")),
        metrics,
        "PodMonitor port"
    );
    assert_eq!(
        endpoints[0].get("path").map_or("/metrics".into(), text),
        METRICS_PATH,
        "PodMonitor path"
    );
    // The Service carries gRPC only: metrics are scraped pod by pod.
    let service = &k8s["Service"];
    for p in at(service, "/spec/ports").as_array().expect("ports") {
        assert_eq!(resolve(at(p, "/targetPort")), port, "Service targetPort");
    }
    for kind in ["readinessProbe", "livenessProbe", "startupProbe"] {
        let Some(p) = container.get(kind) else {
            continue;
        };
        if let Some(command) = p.pointer("/exec/command") {
            let probe = probe(kind, &strings(command));
            assert_eq!(port_of(&probe.addr), port, "{kind} -addr");
        }
        for native in ["/tcpSocket/port", "/grpc/port", "/httpGet/port"] {
            if let Some(v) = p.pointer(native) {
                assert_eq!(resolve(v), port, "{kind} {native}");
            }
        }
    }
    // Ingress: callers to gRPC, and the monitoring namespace's Prometheus,
    // alone, to metrics.
    let policy = &k8s["NetworkPolicy"];
    let mut admitted = BTreeSet::new();
    for rule in at(policy, "/spec/ingress").as_array().expect("ingress") {
        let to: BTreeSet<u16> = at(rule, "/ports")
            .as_array()
            .expect("ports")
            .iter()
            .map(|p| resolve(at(p, "/port")))
            .collect();
        for p in &to {
            assert!(
                [port, metrics].contains(p),
                "NetworkPolicy ingress to {p}: atmost serves {port} and {metrics}"
            );
        }
        if to.contains(&metrics) {
            assert_eq!(
                to,
                [metrics].into(),
                "NetworkPolicy: metrics in a rule of its own (its callers are not Prometheus)"
            );
            let from = at(rule, "/from").as_array().expect("from");
            assert!(!from.is_empty(), "NetworkPolicy: metrics from anywhere");
            for peer in from {
                for selector in ["/namespaceSelector/matchLabels", "/podSelector/matchLabels"] {
                    assert!(
                        peer.pointer(selector)
                            .and_then(Value::as_object)
                            .is_some_and(|labels| !labels.is_empty()),
                        "NetworkPolicy: metrics from {peer}: only Prometheus's pods in the \
                         monitoring namespace, by label ({selector})"
                    );
                }
            }
        }
        admitted.extend(to);
    }
    assert_eq!(
        admitted,
        [port, metrics].into(),
        "NetworkPolicy ingress: gRPC for callers, metrics for Prometheus (or every replica \
         is AtmostScrapeDown)"
    );

    // The image: what it exposes, and where it listens.
    let mut exposed = dockerfile_expose();
    exposed.sort_unstable();
    let mut expected = [port, metrics];
    expected.sort_unstable();
    assert_eq!(exposed, expected, "Dockerfile EXPOSE: gRPC and metrics");
    let image_env = dockerfile_env();
    assert_eq!(
        port_of(&image_env["ATMOST_LISTEN"]),
        port,
        "Dockerfile ATMOST_LISTEN"
    );
    if let Some(listen) = image_env.get("ATMOST_METRICS_LISTEN") {
        assert_eq!(port_of(listen), metrics, "Dockerfile ATMOST_METRICS_LISTEN");
    }
    assert_eq!(
        port_of(&dockerfile_probe().addr),
        port,
        "Dockerfile HEALTHCHECK"
    );

    // Compose: the container's side of each mapping; every replica
    // publishes both ports, on loopback.
    let compose = compose();
    let mut host_ports = BTreeSet::new();
    for (name, service) in compose_atmost(&compose) {
        let env = compose_env(&service);
        assert_eq!(port_of(&env["ATMOST_LISTEN"]), port, "{name} ATMOST_LISTEN");
        let metrics_listen = env
            .get("ATMOST_METRICS_LISTEN")
            .unwrap_or_else(|| panic!("{name}: no ATMOST_METRICS_LISTEN"));
        assert_eq!(
            port_of(metrics_listen),
            metrics,
            "{name} ATMOST_METRICS_LISTEN"
        );
        assert_eq!(
            port_of(&compose_probe(&name, &service).addr),
            port,
            "{name} healthcheck"
        );
        let mut published = BTreeSet::new();
        for mapping in at(&service, "/ports").as_array().expect("ports") {
            let (host, container) = match mapping {
                Value::Object(m) => (text(&m["published"]), text(&m["target"])),
                other => {
                    let spec = text(other);
                    let mut parts: Vec<&str> = spec.rsplitn(3, ':').collect();
                    parts.reverse();
                    assert_eq!(parts.len(), 3, "{name}: publish on an address: {spec}");
                    assert_eq!(
                        parts[0], "127.0.0.1",
                        "{name}: dev keys and unauthenticated metrics, loopback only: {spec}"
                    );
                    (parts[1].to_owned(), parts[2].to_owned())
                }
            };
            let container = container
                .parse::<u16>()
                .unwrap_or_else(|e| panic!("{name}: {mapping}: {e}"));
            assert!(
                [port, metrics].contains(&container),
                "{name}: {mapping} publishes no port of atmost's ({port}, {metrics})"
            );
            assert!(
                published.insert(container),
                "{name}: {container} published twice"
            );
            assert!(
                host_ports.insert(host.clone()),
                "{name}: host port {host} taken twice"
            );
        }
        assert_eq!(
            published,
            [port, metrics].into(),
            "{name}: publishes gRPC and metrics"
        );
    }
}

#[test]
fn every_probe_asks_for_a_service_atmost_reports() {
    let k8s = kubernetes();
    let env = pod_env(&k8s);
    let deployment = &k8s["Deployment"];
    let container = atmost_container(deployment);
    let tls = env.contains_key("ATMOST_TLS_CERT");
    let mut probes = Vec::new();
    let mut readiness_on_health = false;
    for kind in ["readinessProbe", "livenessProbe", "startupProbe"] {
        let Some(p) = container.get(kind) else {
            continue;
        };
        assert!(
            p.get("grpc").is_none() || !tls,
            "{kind}: the kubelet's own gRPC probe speaks no TLS, and atmost serves TLS"
        );
        if let Some(service) = p.pointer("/grpc/service") {
            assert!(
                HEALTH_SERVICES.contains(&text(service).as_str()),
                "{kind}: {service}"
            );
        }
        if let Some(command) = p.pointer("/exec/command") {
            let probe = probe(&format!("kubernetes {kind}"), &strings(command));
            readiness_on_health |= kind == "readinessProbe";
            probes.push((probe, tls));
        }
    }
    assert!(readiness_on_health, "the readiness probe asks gRPC health");
    for (name, service) in compose_atmost(&compose()) {
        let env = compose_env(&service);
        probes.push((
            compose_probe(&name, &service),
            env.contains_key("ATMOST_TLS_CERT"),
        ));
    }
    probes.push((
        dockerfile_probe(),
        dockerfile_env().contains_key("ATMOST_TLS_CERT"),
    ));
    for (probe, tls) in probes {
        assert!(
            HEALTH_SERVICES.contains(&probe.service.as_str()),
            "{}: atmost reports no health for {:?}",
            probe.source,
            probe.service
        );
        assert_eq!(
            probe.tls,
            tls,
            "{}: -tls where atmost serves {}",
            probe.source,
            if tls { "TLS" } else { "plaintext" }
        );
        let host = probe
            .addr
            .parse::<std::net::SocketAddr>()
            .expect("-addr")
            .ip();
        assert!(
            host.is_loopback(),
            "{}: the probe runs in the container",
            probe.source
        );
        if let Some(ca) = &probe.ca {
            // In a mounted Secret, which docs/deploy.md lists (below).
            secret_file(deployment, ca);
        }
    }
}

#[test]
fn the_drain_fits_in_the_termination_grace() {
    let flags = serve_flags();
    let k8s = kubernetes();
    let env: BTreeMap<String, String> = pod_env(&k8s)
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k, v)))
        .collect();
    let delay = duration(&effective(&env, &flags, "ATMOST_DRAIN_DELAY"));
    let grace = duration(&effective(&env, &flags, "ATMOST_SHUTDOWN_GRACE"));
    assert!(
        delay >= Duration::from_secs(2),
        "a drain delay of {delay:?}: too short for endpoints to see the pod go"
    );
    let spec = at(&k8s["Deployment"], "/spec/template/spec");
    let container = atmost_container(&k8s["Deployment"]);
    let pre_stop = match container.pointer("/lifecycle/preStop") {
        None => Duration::ZERO,
        Some(hook) => match hook.pointer("/sleep/seconds") {
            Some(s) => Duration::from_secs(s.as_u64().expect("seconds")),
            None => panic!("a preStop hook this test cannot time: {hook}"),
        },
    };
    let period = Duration::from_secs(
        at(spec, "/terminationGracePeriodSeconds")
            .as_u64()
            .expect("seconds"),
    );
    assert!(
        period >= pre_stop + delay + grace,
        "terminationGracePeriodSeconds {period:?} < preStop {pre_stop:?} + drain delay {delay:?} \
         + shutdown grace {grace:?}: the kubelet kills atmost mid-drain"
    );
    // The readiness probe sees NOT_SERVING within the delay.
    let readiness = at(container, "/readinessProbe");
    let seen = Duration::from_secs(
        at(readiness, "/periodSeconds").as_u64().unwrap_or(10)
            * readiness
                .get("failureThreshold")
                .and_then(Value::as_u64)
                .unwrap_or(3),
    );
    assert!(
        seen <= delay,
        "readiness needs {seen:?} to see NOT_SERVING, longer than the drain delay {delay:?}"
    );

    for (name, service) in compose_atmost(&compose()) {
        let env = compose_env(&service);
        let delay = duration(&effective(&env, &flags, "ATMOST_DRAIN_DELAY"));
        let grace = duration(&effective(&env, &flags, "ATMOST_SHUTDOWN_GRACE"));
        let stop = service
            .get("stop_grace_period")
            .map_or(Duration::from_secs(10), |v| duration(&text(v)));
        assert!(
            stop >= delay + grace,
            "{name}: stop_grace_period {stop:?} < {delay:?} + {grace:?}"
        );
    }
}

#[test]
fn the_pod_runs_restricted_as_the_images_user() {
    let k8s = kubernetes();
    let spec = at(&k8s["Deployment"], "/spec/template/spec");
    let pod = at(spec, "/securityContext");
    assert_eq!(
        pod.get("runAsNonRoot"),
        Some(&Value::Bool(true)),
        "pod runAsNonRoot"
    );
    assert_eq!(
        pod.pointer("/seccompProfile/type").map(text).as_deref(),
        Some("RuntimeDefault"),
        "pod seccompProfile"
    );
    for host in ["hostNetwork", "hostPID", "hostIPC"] {
        assert_ne!(spec.get(host), Some(&Value::Bool(true)), "{host}");
    }
    let container = atmost_container(&k8s["Deployment"]);
    let ctx = at(container, "/securityContext");
    assert_eq!(
        ctx.get("allowPrivilegeEscalation"),
        Some(&Value::Bool(false))
    );
    assert_eq!(ctx.get("readOnlyRootFilesystem"), Some(&Value::Bool(true)));
    assert_ne!(ctx.get("privileged"), Some(&Value::Bool(true)));
    assert_eq!(strings(at(ctx, "/capabilities/drop")), ["ALL"]);
    assert!(
        ctx.pointer("/capabilities/add").is_none(),
        "no capability added"
    );
    if let Some(seccomp) = ctx.pointer("/seccompProfile/type") {
        assert_eq!(text(seccomp), "RuntimeDefault");
    }
    let user = ctx
        .get("runAsUser")
        .or_else(|| pod.get("runAsUser"))
        .map(|u| u.as_u64().expect("a uid"));
    // The image's own user, not root.
    let (_, image_user) = runtime_stage()
        .into_iter()
        .rev()
        .find(|(op, _)| op == "USER")
        .expect("USER in the final stage");
    let image_uid: u64 = image_user
        .split(':')
        .next()
        .unwrap()
        .parse()
        .expect("a numeric USER (runAsNonRoot checks numbers)");
    assert_ne!(image_uid, 0, "the image runs as root");
    if let Some(user) = user {
        assert_eq!(user, image_uid, "runAsUser is not the image's user");
    }
    assert!(
        at(container, "/resources/requests").get("cpu").is_some()
            && at(container, "/resources/requests").get("memory").is_some()
            && at(container, "/resources/limits").get("memory").is_some(),
        "CPU and memory requests, a memory limit"
    );
    assert_eq!(
        spec.get("automountServiceAccountToken"),
        Some(&Value::Bool(false)),
        "atmost calls no Kubernetes API"
    );
}

#[test]
fn selectors_and_targets_match_the_deployment() {
    let k8s = kubernetes();
    let deployment = &k8s["Deployment"];
    let name = text(at(deployment, "/metadata/name"));
    let labels = at(deployment, "/spec/template/metadata/labels")
        .as_object()
        .expect("labels")
        .clone();
    let matches = |what: &str, selector: &Value| {
        let selector = selector.as_object().expect("a label map");
        assert!(
            !selector.is_empty(),
            "{what}: an empty selector selects every pod"
        );
        for (k, v) in selector {
            assert_eq!(
                labels.get(k),
                Some(v),
                "{what}: {k}={v} is not the pods' label"
            );
        }
    };
    matches("Deployment", at(deployment, "/spec/selector/matchLabels"));
    matches("Service", at(&k8s["Service"], "/spec/selector"));
    matches(
        "PodDisruptionBudget",
        at(&k8s["PodDisruptionBudget"], "/spec/selector/matchLabels"),
    );
    matches(
        "NetworkPolicy",
        at(&k8s["NetworkPolicy"], "/spec/podSelector/matchLabels"),
    );
    matches(
        "PodMonitor",
        at(&k8s["PodMonitor"], "/spec/selector/matchLabels"),
    );
    for c in at(deployment, "/spec/template/spec/topologySpreadConstraints")
        .as_array()
        .into_iter()
        .flatten()
    {
        matches(
            "topologySpreadConstraints",
            at(c, "/labelSelector/matchLabels"),
        );
    }

    let hpa = &k8s["HorizontalPodAutoscaler"];
    assert_eq!(text(at(hpa, "/apiVersion")), "autoscaling/v2");
    assert_eq!(text(at(hpa, "/spec/scaleTargetRef/kind")), "Deployment");
    assert_eq!(text(at(hpa, "/spec/scaleTargetRef/name")), name);
    assert!(
        at(hpa, "/spec/metrics")
            .as_array()
            .expect("metrics")
            .iter()
            .any(|m| m.pointer("/resource/name").map(text).as_deref() == Some("cpu")),
        "the HPA scales on CPU"
    );
    let min = at(hpa, "/spec/minReplicas").as_u64().expect("minReplicas");
    let max = at(hpa, "/spec/maxReplicas").as_u64().expect("maxReplicas");
    assert!(
        min >= 2 && max >= min,
        "minReplicas {min}, maxReplicas {max}"
    );
    // The budget lets a drain proceed, and never takes every replica.
    let pdb = at(&k8s["PodDisruptionBudget"], "/spec");
    match (pdb.get("maxUnavailable"), pdb.get("minAvailable")) {
        (Some(n), None) => {
            let n = n.as_u64().expect("a number");
            assert!(n >= 1 && n < min, "maxUnavailable {n} with {min} replicas");
        }
        (None, Some(n)) => {
            let n = n.as_u64().expect("a number");
            assert!(
                n < min,
                "minAvailable {n} blocks every drain at {min} replicas"
            );
        }
        other => panic!("the PDB sets one of maxUnavailable, minAvailable: {other:?}"),
    }

    // The NetworkPolicy lets atmost reach DNS and Redis, nothing more.
    let policy = at(&k8s["NetworkPolicy"], "/spec");
    assert_eq!(strings(at(policy, "/policyTypes")), ["Ingress", "Egress"]);
    let egress_ports: BTreeSet<(u64, String)> = at(policy, "/egress")
        .as_array()
        .expect("egress")
        .iter()
        .flat_map(|rule| at(rule, "/ports").as_array().expect("ports").clone())
        .map(|p| {
            (
                at(&p, "/port").as_u64().expect("a numbered port"),
                p.get("protocol").map_or("TCP".into(), text),
            )
        })
        .collect();
    assert!(
        egress_ports.contains(&(53, "UDP".into())),
        "DNS over UDP: {egress_ports:?}"
    );
    assert!(
        egress_ports.contains(&(53, "TCP".into())),
        "DNS over TCP: {egress_ports:?}"
    );
    assert_eq!(
        egress_ports.len(),
        3,
        "DNS and Redis only: {egress_ports:?}"
    );
}

#[test]
fn every_secret_and_config_map_is_documented_and_mounted() {
    let flags = serve_flags();
    let k8s = kubernetes();
    let deployment = &k8s["Deployment"];
    let docs = read("docs/deploy.md");
    let section = docs
        .split("\n## Secrets")
        .nth(1)
        .expect("docs/deploy.md has a \"## Secrets\" section")
        .split("\n## ")
        .next()
        .expect("the section");
    // Every (Secret, key) the pod reads.
    let mut needed: BTreeSet<(String, String)> = BTreeSet::new();
    let container = atmost_container(deployment);
    for var in container
        .get("env")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(secret) = var.pointer("/valueFrom/secretKeyRef") {
            needed.insert((text(at(secret, "/name")), text(at(secret, "/key"))));
        }
    }
    for (_, volume) in mounts(deployment) {
        if let Some(secret) = volume.get("secret") {
            let name = text(at(secret, "/secretName"));
            for item in secret
                .get("items")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                needed.insert((name.clone(), text(at(item, "/key"))));
            }
        }
    }
    // Every file a flag names is in a mounted Secret.
    for (var, value) in pod_env(&k8s) {
        let (Some(flag), Some(path)) = (flags.get(&var), value) else {
            continue;
        };
        if flag.file {
            needed.insert(secret_file(deployment, &path));
        }
    }
    if let Some(command) = container.pointer("/readinessProbe/exec/command")
        && let Some(ca) = probe("readiness", &strings(command)).ca
    {
        needed.insert(secret_file(deployment, &ca));
    }
    let secrets: BTreeSet<&String> = needed.iter().map(|(s, _)| s).collect();
    assert!(secrets.len() >= 3, "read {secrets:?}");
    for (secret, key) in &needed {
        let row = section
            .lines()
            .find(|l| l.starts_with(&format!("| `{secret}`")))
            .unwrap_or_else(|| panic!("Secret {secret} has no row in docs/deploy.md, \"Secrets\""));
        let keys = row.split(" | ").nth(1).expect("| Secret | keys | what |");
        assert!(
            keys.split(", ").any(|k| k == format!("`{key}`")),
            "Secret {secret}: key {key} is not in its keys in docs/deploy.md: {row}"
        );
    }
    // No Secret documented that nothing reads (a renamed one).
    for line in section.lines().filter(|l| l.starts_with("| `")) {
        let name = line[3..].split('`').next().expect("a name");
        assert!(
            secrets.contains(&name.to_owned()),
            "docs/deploy.md documents Secret {name}, which the Deployment does not read"
        );
    }
    let config = text(at(&k8s["ConfigMap"], "/metadata/name"));
    assert!(
        docs.contains(&format!("`{config}`")),
        "docs/deploy.md names {config}"
    );
}

/// Starts the binary with a configuration's environment, on loopback:
/// AtmostProcess's `--listen 127.0.0.1:0` wins over ATMOST_LISTEN, and
/// [`on_loopback`] moves the metrics.
fn start_with(env: &BTreeMap<String, String>) -> AtmostProcess {
    let env = on_loopback(env);
    let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    spawn_atmost_with_env::<&str>(&[], &pairs)
}

/// `env` with its ATMOST_METRICS_LISTEN, if it sets one (the pod's own
/// address, on a fixed port), moved to `127.0.0.1:0`: no test binds a
/// fixed port or an address but loopback. atmost announces the port it
/// got ("atmost metrics on ADDR": [`AtmostProcess::metrics_addr`]).
fn on_loopback(env: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut env = env.clone();
    if let Some(metrics) = env.get_mut("ATMOST_METRICS_LISTEN") {
        *metrics = "127.0.0.1:0".into();
    }
    env
}

/// Every health service the probes ask for is SERVING.
async fn assert_serving(client: &Client) {
    for service in HEALTH_SERVICES {
        assert_eq!(
            health(client, service).await.expect("health"),
            ServingStatus::Serving,
            "{service:?}"
        );
    }
}

/// The ConfigMap's values, given to the binary on a real Redis: every one
/// parses (a value out of range or misspelt stops atmost at start-up), and
/// it answers the scrape the pod annotations describe. The files only the
/// pod has (keys, certificates) are left out; the test above checks each
/// is in a mounted Secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_with_the_kubernetes_configuration() {
    let _machine = shared().await;
    let flags = serve_flags();
    let k8s = kubernetes();
    let redis = Redis::start_owned();
    let mut env: BTreeMap<String, String> = pod_env(&k8s)
        .into_iter()
        .filter_map(|(k, v)| Some((k, v?)))
        .filter(|(k, _)| !flags.get(k).is_some_and(|f| f.file))
        .collect();
    assert_eq!(env.get("ATMOST_STORE").map(String::as_str), Some("redis"));
    // The atmost-redis Secret's URL, here.
    env.insert("ATMOST_REDIS_URL".into(), redis.url.clone());
    let process = start_with(&env);
    assert_serving(&process.client().await).await;

    // Prometheus's scrape: the annotations' path, on the metrics listener
    // the ConfigMap turns on.
    let metrics = process
        .metrics_addr()
        .expect("the ConfigMap's ATMOST_METRICS_LISTEN: atmost announced no metrics address");
    let path = pod_annotation(&k8s["Deployment"], "prometheus.io/path");
    let answer = crate::telemetry::get(metrics, &path).await;
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "GET {path}: {head}"
    );
    let build_info = format!(
        "atmost_build_info{{version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    assert!(
        body.lines().any(|l| l == build_info),
        "GET {path}: no {build_info}:\n{body}"
    );
}

/// compose.yaml's environment and key file, on a redis-server started with
/// compose's Redis command (atmost refuses an evicting Redis): it serves,
/// and the development keys docs/deploy.md gives are the file's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_with_the_compose_configuration() {
    use sha2::Digest;
    let _machine = shared().await;
    let compose = compose();
    let command = strings(at(&compose, "/services/redis/command"));
    assert_eq!(command[0], "redis-server");
    let settings: BTreeMap<&str, &str> = command[1..]
        .chunks(2)
        .map(|pair| (pair[0].as_str(), pair[1].as_str()))
        .collect();
    assert_eq!(settings.get("--appendonly"), Some(&"yes"));
    assert_eq!(settings.get("--appendfsync"), Some(&"everysec"));
    assert_eq!(settings.get("--maxmemory-policy"), Some(&"noeviction"));
    // Its append-only file in a directory of its own.
    let dir =
        std::env::temp_dir().join(format!("atmost-compose-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).expect("a data directory");
    let dir_arg = dir.to_string_lossy().into_owned();
    let mut args: Vec<&str> = command[1..].iter().map(String::as_str).collect();
    args.extend(["--dir", &dir_arg]);
    let redis = Redis::start_owned_with(&args);

    let (name, service) = compose_atmost(&compose).remove(0);
    let mut env = compose_env(&service);
    assert_eq!(env.get("ATMOST_STORE").map(String::as_str), Some("redis"));
    env.insert("ATMOST_REDIS_URL".into(), redis.url.clone());
    // The files compose mounts, from deploy/ here.
    let volumes = strings(at(&service, "/volumes"));
    for value in env.values_mut() {
        if !value.starts_with('/') {
            continue;
        }
        let host = volumes
            .iter()
            .find_map(|v| {
                let mut parts = v.split(':');
                let (host, inside) = (parts.next()?, parts.next()?);
                (inside == value.as_str()).then(|| Path::new(ROOT).join("deploy").join(host))
            })
            .unwrap_or_else(|| panic!("{name}: {value} is in no volume"));
        *value = host.to_string_lossy().into_owned();
    }
    let keys_file = PathBuf::from(env.get("ATMOST_AUTH_KEYS").expect("compose runs with keys"));
    let process = start_with(&env);
    let client = process.client().await;
    assert_serving(&client).await;
    assert!(
        process.metrics_addr().is_some(),
        "{name}: serves no metrics"
    );

    // Each key of the file: its comment's plaintext hashes to its digest,
    // docs/deploy.md gives it, and it works.
    let file = std::fs::read_to_string(&keys_file).expect("the key file");
    let docs = read("docs/deploy.md");
    let mut keys = BTreeMap::new();
    let mut plaintext = None;
    for line in file.lines() {
        if let Some(rest) = line.strip_prefix("# printf %s ") {
            plaintext = rest.split_whitespace().next().map(str::to_owned);
        }
        if let Some(digest) = line.strip_prefix("sha256 = ") {
            let key = plaintext.take().expect("each digest follows its plaintext");
            assert_eq!(
                hex(&sha2::Sha256::digest(key.as_bytes())),
                digest.trim_matches('"'),
                "{key}"
            );
            assert!(
                docs.contains(&format!("`{key}`")),
                "docs/deploy.md gives {key}"
            );
            keys.insert(
                key.clone(),
                client.clone().with_api_key(&key).expect("a key"),
            );
        }
    }
    let admin = &keys["atmost-dev-admin-key"];
    let agent = &keys["atmost-dev-agent-key"];
    let permit = admin
        .create_permit(NewPermit::new(["t"]).subject("compose").build())
        .await
        .expect("CreatePermit with the dev admin key")
        .permit_id;
    let answer = authorize_new_key(agent, permit).await;
    assert_eq!(answer.decision(), pb::Decision::Dispatch);
    drop(process);
    drop(redis);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The image's own environment starts the binary (dev mode here: on a
/// non-loopback address atmost wants keys, which the image leaves to its
/// deployment).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_with_the_images_environment() {
    let _machine = shared().await;
    let env = dockerfile_env();
    assert!(
        port_of(&env["ATMOST_LISTEN"]) > 0
            && env["ATMOST_LISTEN"]
                .parse::<std::net::SocketAddr>()
                .unwrap()
                .ip()
                .is_unspecified(),
        "the image listens on every interface of its container"
    );
    let process = start_with(&env);
    assert_serving(&process.client().await).await;
    // The same environment on its real address, without keys: refused.
    let mut on_all = on_loopback(&env);
    on_all.insert("ATMOST_LISTEN".into(), "0.0.0.0:0".into());
    let (status, stderr) = run_to_exit_with_env(&[], &on_all);
    assert!(!status.success(), "served without keys on 0.0.0.0");
    assert!(stderr.contains("without authentication"), "{stderr}");
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

// === the alert rules and the dashboard ===

/// The metric names a PromQL expression reads: every identifier that is
/// not a function (followed by `(`), an aggregation or keyword, or inside
/// label matchers (`{...}`), a range (`[...]`), a string, or a
/// `by`/`without`/`on`/`ignoring`/`group_*` label list.
fn promql_metrics(expr: &str) -> BTreeSet<String> {
    // Binary operators, modifiers, and the aggregations (which may be
    // followed by `by (...)` rather than by their parenthesis).
    const KEYWORDS: [&str; 21] = [
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "group_left",
        "group_right",
        "sum",
        "min",
        "max",
        "avg",
        "count",
        "stddev",
        "stdvar",
        "topk",
        "bottomk",
        "quantile",
        "count_values",
        "group",
        "limitk",
        "limit_ratio",
    ];
    const LABEL_LISTS: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    let skip_to = |from: usize, close: char| -> usize {
        let mut j = from;
        let mut quoted = None;
        while j < chars.len() {
            match (quoted, chars[j]) {
                (Some(q), c) if c == q => quoted = None,
                (Some(_), '\\') => j += 1,
                (None, '"' | '\'' | '`') => quoted = Some(chars[j]),
                (None, c) if c == close => return j + 1,
                _ => {}
            }
            j += 1;
        }
        j
    };
    while i < chars.len() {
        let c = chars[i];
        match c {
            '{' => i = skip_to(i + 1, '}'),
            '[' => i = skip_to(i + 1, ']'),
            '"' | '\'' | '`' => i = skip_to(i + 1, c),
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let mut next = i;
                while next < chars.len() && chars[next].is_whitespace() {
                    next += 1;
                }
                let called = chars.get(next) == Some(&'(');
                if called && LABEL_LISTS.contains(&word.as_str()) {
                    i = skip_to(next + 1, ')');
                } else if !called && !KEYWORDS.contains(&word.as_str()) {
                    names.insert(word);
                }
            }
            // A number (with its exponent or unit letters) is not a name.
            c if c.is_ascii_digit() || c == '.' => {
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    names
}

#[test]
fn promql_names_are_read_from_expressions() {
    assert_eq!(
        promql_metrics(
            r#"histogram_quantile(0.99, sum by (le, rpc_method) (rate(x_bucket{a="b{c}"}[5m]))) / on (i) group_left y > 1e3 and z"#
        ),
        ["x_bucket", "y", "z"].map(String::from).into()
    );
}

/// Every PromQL expression of the alert rules (with the alert's name) and
/// of the dashboard.
fn rule_and_dashboard_exprs() -> Vec<(String, String)> {
    let mut exprs = Vec::new();
    for doc in yaml("deploy/prometheus/alerts.yaml") {
        for group in at(&doc, "/groups").as_array().expect("groups") {
            for rule in at(group, "/rules").as_array().expect("rules") {
                exprs.push((text(at(rule, "/alert")), text(at(rule, "/expr"))));
            }
        }
    }
    fn walk(v: &Value, out: &mut Vec<(String, String)>) {
        match v {
            Value::Object(map) => {
                if let Some(Value::String(expr)) = map.get("expr") {
                    out.push(("dashboard".into(), expr.clone()));
                }
                map.values().for_each(|v| walk(v, out));
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let dashboard: Value =
        serde_json::from_str(&read("deploy/grafana/atmost.json")).expect("dashboard JSON");
    walk(&dashboard, &mut exprs);
    exprs
}

/// Every metric the alert rules and the dashboard read is one a live
/// server exports (`up` is Prometheus's own), and the rules cover what an
/// operator must hear of: UNCERTAIN age and count, store errors, shedding,
/// a replica that cannot be scraped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_and_the_dashboard_read_is_exported() {
    let _machine = shared().await;
    let exported = crate::telemetry::exported_metric_names().await;
    let exprs = rule_and_dashboard_exprs();
    let mut read = BTreeSet::new();
    let mut unknown = Vec::new();
    for (source, expr) in &exprs {
        for name in promql_metrics(expr) {
            if name != "up" && !exported.contains(&name) {
                unknown.push(format!("{source}: {name}"));
            }
            read.insert(name);
        }
    }
    assert!(
        unknown.is_empty(),
        "not exported: {unknown:#?}\nexported: {exported:#?}"
    );
    let alert = |name: &str| -> &str {
        exprs
            .iter()
            .find(|(source, _)| source == name)
            .map(|(_, expr)| expr.as_str())
            .unwrap_or_else(|| panic!("no alert {name}"))
    };
    for (name, needs) in [
        (
            "AtmostUncertainAttemptOld",
            "atmost_uncertain_oldest_age_seconds",
        ),
        ("AtmostUncertainAttemptsPiling", "atmost_uncertain_attempts"),
        (
            "AtmostUncertainCensusStale",
            "atmost_uncertain_census_age_seconds",
        ),
        ("AtmostStoreUnavailable", "STORE_UNAVAILABLE"),
        ("AtmostShedding", "atmost_admission_shed_total"),
        ("AtmostScrapeDown", "up{"),
    ] {
        assert!(alert(name).contains(needs), "{name}: {}", alert(name));
    }
    // The dashboard shows the signals that matter.
    for name in [
        "atmost_uncertain_attempts",
        "atmost_decisions_total",
        "atmost_errors_total",
        "rpc_server_call_duration_seconds_bucket",
        "atmost_store_duration_seconds_bucket",
        "atmost_admission_shed_total",
    ] {
        assert!(read.contains(name), "nothing reads {name}");
    }
}

/// The `job` the alert rules and the dashboard read (`up{job="..."}`):
/// one name, wherever it is written.
fn rules_job() -> String {
    let mut jobs = BTreeSet::new();
    for (source, expr) in rule_and_dashboard_exprs() {
        for part in expr.split("job=\"").skip(1) {
            let job = part.split('"').next().expect("a quoted job");
            jobs.insert(job.to_owned());
            assert!(!job.is_empty(), "{source}: an empty job in {expr}");
        }
    }
    assert_eq!(
        jobs.len(),
        1,
        "the rules and the dashboard read jobs {jobs:?}"
    );
    jobs.pop_first().expect("a job")
}

/// Prometheus scrapes every replica as the job the rules read, so
/// AtmostScrapeDown watches them: the PodMonitor takes its job from a pod
/// label of that value, and the scrape job docs/deploy.md gives (for a
/// Prometheus without the Operator) has that name and keeps atmost's pods
/// and their metrics port.
#[test]
fn prometheus_scrapes_the_replicas_as_the_job_the_rules_read() {
    let job = rules_job();
    let k8s = kubernetes();
    let labels = at(&k8s["Deployment"], "/spec/template/metadata/labels");
    let label = text(at(&k8s["PodMonitor"], "/spec/jobLabel"));
    assert_eq!(
        labels.get(&label).map(text),
        Some(job.clone()),
        "PodMonitor jobLabel {label}: the pods' {label} is not the rules' job {job:?}"
    );

    let docs = read("docs/deploy.md");
    let section = docs
        .split("\n## Metrics")
        .nth(1)
        .expect("docs/deploy.md has a \"## Metrics\" section")
        .split("\n## ")
        .next()
        .expect("the section");
    let block = section
        .split("```yaml\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("docs/deploy.md, \"Metrics\": a yaml block, the scrape job");
    let config = yaml_of(block, "docs/deploy.md, \"Metrics\"").remove(0);
    let scrape = at(&config, "/scrape_configs/0");
    assert_eq!(text(at(scrape, "/job_name")), job, "the scrape job's name");
    assert_eq!(
        text(at(scrape, "/kubernetes_sd_configs/0/role")),
        "pod",
        "the scrape job discovers pods"
    );
    assert_eq!(
        scrape.get("metrics_path").map_or("/metrics".into(), text),
        METRICS_PATH
    );
    // Its `keep` rules: (source labels, regex).
    let keeps: Vec<(Vec<String>, String)> = at(scrape, "/relabel_configs")
        .as_array()
        .expect("relabel_configs")
        .iter()
        .filter(|r| r.get("action").map(text).as_deref() == Some("keep"))
        .map(|r| (strings(at(r, "/source_labels")), text(at(r, "/regex"))))
        .collect();
    let kept = |source: &str, value: &str| {
        keeps
            .iter()
            .any(|(sources, regex)| sources == &[source] && regex == value)
    };
    let name = text(at(labels, "/app.kubernetes.io~1name"));
    assert!(
        kept("__meta_kubernetes_pod_label_app_kubernetes_io_name", &name),
        "the scrape job keeps the pods labelled app.kubernetes.io/name={name}: {keeps:?}"
    );
    assert!(
        kept("__meta_kubernetes_pod_container_port_name", "metrics"),
        "the scrape job keeps the container port `metrics`: {keeps:?}"
    );
}
