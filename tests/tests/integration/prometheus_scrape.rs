//! The dashboard and the alerts against a real Prometheus scraping a running kerf: the
//! controller process (every controller, the webhook, `/metrics` on a free port) and a
//! kubelet plugin enforcing MPS with the fake GPU tools (`/metrics` on another) run against
//! the in-memory API server with four H100 nodes; a claim that fits, one that cannot, a
//! GpuClass, a GpuQuota, a refused write and a failed prepare give the metrics their series. Prometheus (Debian's `prometheus`, or
//! `$KERF_TEST_PROMETHEUS`) scrapes both every second.
//!
//! Every query of `deploy/helm/kerf/files/grafana-dashboard.json` and every alert expression
//! of `deploy/helm/kerf/files/prometheus-rules.yaml` must return series. An expression that is
//! empty while nothing is wrong (an alert's `> 0`, an error rate) passes when each of its
//! vector selectors returns series, matchers included. And every family the two processes
//! serve must be in `docs/metrics.md`.
//!
//! Under `CI=true` a missing `prometheus` fails the test; elsewhere it is skipped with a
//! message.

pub(crate) mod server;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kerf_controller::webhook::{Certificates, SelfSigned, WebhookConfig};
use kerf_controller::{BackoffConfig, Config, ControllerConfig, Process};
use kerf_kubelet_plugin::claim_reader::ApiClaimReader;
use kerf_kubelet_plugin::plugin::{self, Connections, RunningPlugin};
use kerf_tests::fake_api::{FakeApi, Identity};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::common::claim_cluster::{
    self, DRIVER, NODES, NS, PODS, SLICES, gated_pod, mirror_ownership_records,
};
use crate::common::mps::{MpsNode, prepare};
use kerf_proto::client::Claim;
use kerf_tests::fixtures::SliceClaim;
use server::{Prometheus, free_port, get, selectors};

/// How long the series may take to appear: the usage pass runs every 500 ms here, the
/// allocation takes milliseconds, Prometheus scrapes every second and a `rate` needs two.
const DEADLINE: Duration = Duration::from_secs(90);

fn repo(path: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `expr` of the dashboard's panels (rows' nested panels included).
fn dashboard_queries() -> Vec<String> {
    fn walk(panels: &Value, out: &mut Vec<String>) {
        for panel in panels.as_array().into_iter().flatten() {
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    out.push(expr.to_owned());
                }
            }
            walk(&panel["panels"], out);
        }
    }
    let dashboard: Value =
        serde_json::from_str(&repo("deploy/helm/kerf/files/grafana-dashboard.json")).unwrap();
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    assert!(!out.is_empty(), "the dashboard has queries");
    out
}

/// Every alert's `expr` of the rule file.
fn alert_expressions() -> Vec<String> {
    let rules: Value =
        serde_saphyr::from_str(&repo("deploy/helm/kerf/files/prometheus-rules.yaml")).unwrap();
    let out: Vec<String> = rules["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|group| group["rules"].as_array().cloned().unwrap_or_default())
        .filter_map(|rule| rule["expr"].as_str().map(str::to_owned))
        .collect();
    assert!(!out.is_empty(), "the rule file has alerts");
    out
}

/// Why `expr` does not pass yet, or `None` when it does (see the module documentation).
async fn unmet(prometheus: &Prometheus, expr: &str) -> Option<String> {
    match prometheus.query(expr).await {
        Err(error) => return Some(format!("{expr}: query failed: {error}")),
        Ok(series) if !series.is_empty() => return None,
        Ok(_) => {}
    }
    let mut missing = Vec::new();
    for selector in selectors(expr) {
        if prometheus
            .query(&selector)
            .await
            .is_ok_and(|s| !s.is_empty())
        {
            continue;
        }
        missing.push(selector);
    }
    (!missing.is_empty() || selectors(expr).is_empty())
        .then(|| format!("{expr}: no series, nor for {missing:?}"))
}

/// The cluster: four H100 nodes, the `slices` controller class and the `whole` scheduler
/// class (`claim_cluster`), the GpuClass `h100`, a GpuQuota, a claim that fits and one that
/// cannot, each used by a gated pod, and the gate removal of the first refused by RBAC.
pub(crate) fn cluster(fake: &FakeApi) {
    claim_cluster::gpu_nodes(fake, &NODES);
    claim_cluster::classes(fake);
    fake.insert(json!({
        "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClass", "metadata": {"name": "h100"},
        "spec": {"allocator": "Scheduler", "selector": {"productNames": ["NVIDIA H100 80GB HBM3"]}},
    }));
    fake.insert(json!({
        "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": "gpus", "namespace": NS},
        "spec": {"hard": {"memory": "100Gi", "compute": 400, "gpus": 4}},
    }));
    for (name, memory) in [("fits", "1Gi"), ("too-big", "500Gi")] {
        fake.insert(
            SliceClaim::new(name, SLICES, memory)
                .in_namespace(NS)
                .json(),
        );
    }
    fake.fail_next_with(
        "PATCH",
        &format!("{PODS}/pod-fits"),
        403,
        "Forbidden",
        r#"pods "pod-fits" is forbidden: User "system:serviceaccount:kerf-system:kerf-controller" cannot patch resource "pods" in API group "" in the namespace "default""#,
        usize::MAX,
    );
    gated_pod(fake, "pod-fits", "fits");
    gated_pod(fake, "pod-too-big", "too-big");
}

/// kerf-controller's process with every controller and the webhook, `/metrics` on `port`.
pub(crate) fn start_controller(fake: &FakeApi, port: u16, shutdown: &CancellationToken) {
    let mut controller = ControllerConfig {
        backoff: BackoffConfig {
            base: Duration::from_millis(50),
            max: Duration::from_secs(1),
        },
        claims: claim_cluster::settings(),
        ..ControllerConfig::new(DRIVER)
    };
    controller.claims.fragmentation_interval = Duration::from_millis(500);
    let config = Config {
        controller,
        leader_election: None,
        metrics_address: Some(([127, 0, 0, 1], port).into()),
    };
    let webhook = WebhookConfig {
        address: ([127, 0, 0, 1], free_port()).into(),
        driver_name: DRIVER.to_owned(),
        field_manager: "kerf-controller".to_owned(),
        certificates: Certificates::SelfSigned(SelfSigned {
            service: "kerf-webhook".to_owned(),
            namespace: "kerf-system".to_owned(),
            webhook_configurations: Vec::new(),
            validating_configurations: Vec::new(),
            validity: Duration::from_secs(3600),
            renew_before: Duration::from_secs(600),
        }),
    };
    tokio::spawn(mirror_ownership_records(fake.clone(), shutdown.clone()));
    let client = fake.client_as(Identity::kerf_controller());
    let process = Process {
        webhook: Some(webhook),
        ..Process::new(config, client, shutdown.clone())
    };
    tokio::spawn(async move {
        if let Err(error) = process.run().await {
            eprintln!("kerf-controller stopped: {error}");
        }
    });
}

/// The kubelet plugin of an [`MpsNode`] (MPS enforced with the fake GPU tools, so that it
/// checks MPS daemons) with `/metrics` on `port`; a prepare of a claim that does not exist
/// fails, for the error series.
async fn start_plugin(node: &MpsNode, port: u16) -> RunningPlugin {
    let mut config = node.config();
    config.metrics_address = Some(([127, 0, 0, 1], port).into());
    let connections = Connections {
        mps_daemon_pods: None,
        device_status: None,
        claim_reader: Arc::new(ApiClaimReader::new(node.node.plugin_client())),
        publisher: None,
        events: Arc::clone(&node.events) as _,
    };
    let running = plugin::start(&config, node.node.inventory(), connections)
        .await
        .unwrap();
    let missing = Claim::new(NS, "missing", "11111111-1111-4111-8111-111111111111");
    let results = prepare(&running, &[&missing]).await;
    assert!(results[0].is_err(), "a claim that does not exist fails");
    running
}

/// The families `/metrics` on `port` serves, as Prometheus names their series.
async fn served(port: u16) -> Vec<String> {
    let (status, text) = get(port, "/metrics").await.expect("/metrics answers");
    assert_eq!(status, 200, "{text}");
    kerf_tests::metrics_reference::parse(&text)
        .into_iter()
        .map(|family| family.name)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_and_alert_expression_returns_series() {
    let Some(binary) = server::binary() else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "prometheus is not installed (apt-get install prometheus, or set KERF_TEST_PROMETHEUS)"
        );
        eprintln!("skipped: no prometheus on PATH and KERF_TEST_PROMETHEUS unset");
        return;
    };
    let node = MpsNode::new();
    let fake = &node.node.api;
    cluster(fake);
    let shutdown = CancellationToken::new();
    let (controller_port, plugin_port) = (free_port(), free_port());
    start_controller(fake, controller_port, &shutdown);
    let _plugin = start_plugin(&node, plugin_port).await;
    let prometheus = Prometheus::start(
        &binary,
        &[
            ("kerf-controller-metrics", controller_port),
            ("kerf-kubelet-plugin-metrics", plugin_port),
        ],
    )
    .await;

    let expressions: Vec<String> = dashboard_queries()
        .into_iter()
        .chain(alert_expressions())
        .collect();
    let deadline = Instant::now() + DEADLINE;
    loop {
        let mut failing = Vec::new();
        for expr in &expressions {
            failing.extend(unmet(&prometheus, expr).await);
        }
        if failing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after {DEADLINE:?}, {} of {} expressions return no series:\n{}\n\nprometheus log:\n{}",
            failing.len(),
            expressions.len(),
            failing.join("\n"),
            prometheus.log()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    let mut families = served(controller_port).await;
    families.extend(served(plugin_port).await);
    let reference = repo(kerf_tests::metrics_reference::PATH);
    let undocumented: Vec<&String> = families
        .iter()
        .filter(|name| !reference.contains(&format!("`{name}`")))
        .collect();
    assert!(
        undocumented.is_empty(),
        "served but not in docs/metrics.md: {undocumented:?}"
    );
    shutdown.cancel();
}
