//! Cluster e2e of the node filters: kerf-controller places controller-class claims only on nodes where
//! the pod's CPU fits, so kube-scheduler binds every pod at its first try.
//!
//! The test makes kubelet-less Ready nodes (32 CPU, 128Gi, 110 pods; `tests/tests/e2e/fake_nodes.rs`)
//! with 8 mock H100 each, published as kerf's ResourceSlices and owned by kerf-controller, then
//! as many pods as nodes, each asking `cpu: 20` and one controller slice of 5Gi / 10 %: one
//! such pod fits a node. It asserts that all pods are bound within the bound and that no
//! claim got a `NodeRejected` Event (kube-scheduler refusing a node kerf chose), and prints
//! the time from the first pod's creation to the last binding. It deletes its pods (at once:
//! no kubelet stops them), nodes and slices.
//!
//! `#[ignore = "needs cluster"]`; run with
//! `KUBECONFIG=… cargo test -p kerf-tests --test e2e node_fit:: -- --ignored --nocapture`.
//! It needs kerf deployed from `deploy/` (the admission webhook gates the pods), kube-scheduler
//! and kube-controller-manager without a node lifecycle controller (or one slow enough: it
//! marks kubelet-less nodes NotReady after about 50 s; `../shared/cluster/up.sh
//! --no-node-lifecycle`). Environment:
//! - `KERF_E2E_FIT_NODES` (20), `KERF_E2E_FIT_PODS` (as many as nodes, at most that);
//! - `KERF_E2E_FIT_BIND_SECONDS` (20): the bound on creation → all bound;
//! - `KERF_E2E_FIT_SETTLE_SECONDS` (12): the wait after the GPUs are published as the
//!   controller's, for kerf-controller's ownership fence (`--ownership-settle-period`, 10 s).
//!
//! For the figures: `KERF_E2E_FIT_NODES=100 KERF_E2E_FIT_PODS=100
//! KERF_E2E_FIT_BIND_SECONDS=60`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, ensure};
use k8s_openapi::api::core::v1::{Event, Pod, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::ListParams;

use crate::cluster::{TestEnv, e2e};
use crate::fake_nodes;
use crate::fake_nodes::{FakeNodes, LABEL, Shape};
use crate::manifests;
use crate::manifests::{PodClaim, Script};
use crate::wait;
use crate::wait::Poll;

const TEST: &str = "node-fit";
/// The claim template every pod uses.
const TEMPLATE: &str = "slice";

/// What the environment asks of the run.
#[derive(Debug, Clone, Copy)]
struct Counts {
    nodes: usize,
    pods: usize,
    bind: Duration,
    settle: Duration,
}

fn env_number(name: &str, default: u64) -> Result<u64> {
    match std::env::var(name) {
        Ok(text) if !text.trim().is_empty() => text
            .trim()
            .parse()
            .with_context(|| format!("{name}={text:?}: expected a whole number")),
        _ => Ok(default),
    }
}

impl Counts {
    fn from_env() -> Result<Self> {
        let nodes = usize::try_from(env_number("KERF_E2E_FIT_NODES", 20)?)?;
        let pods = usize::try_from(env_number("KERF_E2E_FIT_PODS", nodes as u64)?)?;
        fake_nodes::check_counts(nodes, pods)?;
        Ok(Counts {
            nodes,
            pods,
            bind: Duration::from_secs(env_number("KERF_E2E_FIT_BIND_SECONDS", 20)?),
            settle: Duration::from_secs(env_number("KERF_E2E_FIT_SETTLE_SECONDS", 12)?),
        })
    }
}

/// A pod asking `cpu: 20` and one slice from [`TEMPLATE`], for the fake nodes only.
fn cpu_heavy_pod(env: &TestEnv, name: &str) -> Pod {
    let mut spec = manifests::pod_spec(
        &env.settings,
        PodClaim::Template(TEMPLATE),
        Script::ReportAndSleep,
        "Never",
    );
    spec.node_selector = Some(BTreeMap::from([(LABEL.to_owned(), "true".to_owned())]));
    spec.tolerations.get_or_insert_default().push(Toleration {
        key: Some(LABEL.to_owned()),
        operator: Some("Exists".to_owned()),
        effect: Some("NoSchedule".to_owned()),
        ..Toleration::default()
    });
    for container in &mut spec.containers {
        let resources = container
            .resources
            .get_or_insert_with(ResourceRequirements::default);
        resources.requests = Some(BTreeMap::from([(
            "cpu".to_owned(),
            Quantity("20".to_owned()),
        )]));
    }
    manifests::pod(name, spec, false)
}

/// Waits until every pod of the namespace is bound; returns pod → node.
async fn all_bound(
    env: &TestEnv,
    pods: usize,
    bound: Duration,
) -> Result<BTreeMap<String, String>> {
    wait::poll_until(format_args!("{pods} pods bound"), bound, || async {
        let listed = env.api::<Pod>().list(&ListParams::default()).await?.items;
        let nodes: BTreeMap<String, String> = listed
            .iter()
            .filter_map(|p| {
                let node = p.spec.as_ref()?.node_name.clone()?;
                Some((p.metadata.name.clone()?, node))
            })
            .collect();
        Ok(if nodes.len() >= pods {
            Poll::Ready(nodes)
        } else {
            Poll::Pending(format!("{} of {pods} bound", nodes.len()))
        })
    })
    .await
}

/// The `NodeRejected` Events of the namespace, one line each.
async fn rejections(env: &TestEnv) -> Result<Vec<String>> {
    let params = ListParams::default().fields("reason=NodeRejected");
    Ok(env
        .api::<Event>()
        .list(&params)
        .await?
        .items
        .iter()
        .map(|e| {
            format!(
                "{}: {}",
                e.involved_object.name.as_deref().unwrap_or_default(),
                e.message.as_deref().unwrap_or_default()
            )
        })
        .collect())
}

/// Publishes the GPUs, creates the class, the template and the pods, and checks the outcome.
async fn measure(env: &TestEnv, fake: &FakeNodes, counts: Counts) -> Result<()> {
    let driver = env.settings.driver.clone();
    fake_nodes::publish_controller_gpus(&env.client, &driver, fake, env.settings.timeout).await?;
    tokio::time::sleep(counts.settle).await;
    let class = env
        .gpu_class(TEST, manifests::controller_class_spec(None))
        .await?;
    let parameters = manifests::slice_parameters("5Gi", 10)?;
    let template = manifests::claim_spec(&class, &driver, Some(parameters), &[]);
    env.create(&manifests::claim_template(TEMPLATE, template))
        .await?;
    let started = Instant::now();
    for i in 0..counts.pods {
        env.create(&cpu_heavy_pod(env, &format!("cpu-heavy-{i:04}")))
            .await?;
    }
    let bound = all_bound(env, counts.pods, counts.bind).await;
    let elapsed = started.elapsed();
    let rejected = rejections(env).await?;
    eprintln!(
        "[{TEST}] {} pods on {} nodes: {}, {} NodeRejected Events",
        counts.pods,
        counts.nodes,
        match &bound {
            Ok(_) => format!(
                "all bound {:.1} s after the first creation",
                elapsed.as_secs_f64()
            ),
            Err(_) => format!("not all bound after {:.1} s", elapsed.as_secs_f64()),
        },
        rejected.len()
    );
    let bound = bound?;
    ensure!(
        rejected.is_empty(),
        "kube-scheduler rejected kerf's nodes: {rejected:?}"
    );
    let mut per_node: BTreeMap<&str, usize> = BTreeMap::new();
    for node in bound.values() {
        *per_node.entry(node.as_str()).or_default() += 1;
    }
    ensure!(
        per_node.values().all(|pods| *pods == 1),
        "a node of 32 CPUs holds one pod of 20: {per_node:?}"
    );
    Ok(())
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn cpu_heavy_controller_pods_bind_at_the_first_try() -> Result<()> {
    e2e(TEST, |env| async move {
        let counts = Counts::from_env()?;
        let shape = Shape {
            cpu: "32".to_owned(),
            memory: "128Gi".to_owned(),
            pods: "110".to_owned(),
        };
        let prefix = format!("{}-n", env.namespace);
        let driver = env.settings.driver.clone();
        let fake = fake_nodes::create(&env.client, &driver, &prefix, counts.nodes, &shape).await?;
        let outcome = measure(&env, &fake, counts).await;
        let cleanup = fake_nodes::delete(&env.client, &driver, &fake).await;
        outcome?;
        cleanup
    })
    .await
}
