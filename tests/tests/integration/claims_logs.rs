//! What kerf-controller leaves in `managedFields` and in its logs, against the in-memory API
//! server: every write names the field manager `kerf-controller`, and the conflicts and
//! NotFounds of optimistic concurrency are counted, not warned about, unless one object keeps
//! failing.

use crate::common::claim_cluster;
use crate::common::controller::{ClaimController, Watched, metric};

use std::sync::Arc;
use std::time::Duration;

use claim_cluster::{gpu_nodes, mirror_ownership_records};
use k8s_openapi::api::resource::v1::DeviceClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_api::params::{Allocator, ControllerPlacement, GpuSelector, PlacementPolicy};
use kerf_api::{GpuClass, GpuClassSpec, Slicing};
use kerf_controller::backoff::KEEPS_FAILING_AFTER;
use kerf_controller::claims;
use kerf_controller::{BackoffConfig, Config, Context, ControllerConfig, Process};
use kerf_tests::fake_api::{FakeApi, Identity};
use kerf_tests::fixtures::SliceClaim;
use kerf_tests::logs::CapturedLogs;
use kerf_tests::wait::eventually;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use kerf_tests::fixtures::DRIVER;
const NODES: [&str; 2] = ["node-0", "node-1"];
const SLICES: &str = "slices";
const CLAIMS: &str = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims";
const PODS: &str = "/api/v1/namespaces/default/pods";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/default/events";
const DEADLINE: Duration = Duration::from_secs(20);

// ---- fixtures ----

/// A BinPack controller class of 1Gi slices.
fn slices_class() -> GpuClass {
    let mut class = GpuClass::new(
        SLICES,
        GpuClassSpec {
            allocator: Allocator::Controller,
            selector: GpuSelector {
                product_names: vec!["NVIDIA H100 80GB HBM3".to_owned()],
                ..GpuSelector::default()
            },
            slicing: Some(Slicing {
                memory_granularity: Quantity("1Gi".to_owned()),
                max_slices_per_gpu: Some(7),
                default_compute: None,
            }),
            placement: Some(ControllerPlacement {
                policy: PlacementPolicy::BinPack,
            }),
            sharing: None,
            extended_resource_name: None,
        },
    );
    class.metadata.uid = Some(format!("uid-{SLICES}"));
    class
}

fn claim(fake: &FakeApi, name: &str, memory: &str) {
    fake.insert(
        SliceClaim::new(name, SLICES, memory)
            .in_namespace("default")
            .compute(10)
            .json(),
    );
}

/// An unscheduled pod using `claim`, behind kerf's scheduling gate.
fn pod(fake: &FakeApi, name: &str, claim: &str) {
    fake.insert(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "containers": [{"name": "main", "image": "busybox"}],
            "resourceClaims": [{"name": "c0", "resourceClaimName": claim}],
            "schedulingGates": [{"name": kerf_api::controller_claims::SCHEDULING_GATE}],
        },
        "status": {"phase": "Pending"},
    }));
}

fn settings() -> claims::ClaimSettings {
    claims::ClaimSettings {
        unplaceable_retry: Duration::from_millis(100),
        pending_retry: Duration::from_millis(50),
        ownership: claims::ownership::OwnershipTiming {
            settle: Duration::from_millis(50),
            linger: Duration::from_secs(1),
        },
        ownership_tick: Duration::from_millis(20),
        ..claims::ClaimSettings::default()
    }
}

fn config() -> ControllerConfig {
    ControllerConfig {
        backoff: BackoffConfig {
            base: Duration::from_millis(10),
            max: Duration::from_millis(100),
        },
        claims: settings(),
        ..ControllerConfig::new(DRIVER)
    }
}

fn allocated(fake: &FakeApi, name: &str) -> Option<Value> {
    fake.get(&format!("{CLAIMS}/{name}")).filter(|c| {
        c.pointer("/status/allocation")
            .is_some_and(|a| !a.is_null())
    })
}

// ---- field managers ----

/// The `fieldManager` query parameter of a request, if any.
fn field_manager(query: &str) -> Option<&str> {
    query
        .split('&')
        .find_map(|pair| pair.strip_prefix("fieldManager="))
}

#[tokio::test]
async fn every_write_of_a_controller_run_names_the_kerf_controller_field_manager() {
    let fake = FakeApi::new();
    gpu_nodes(&fake, &NODES);
    fake.insert_resource(&slices_class());
    let shutdown = CancellationToken::new();
    tokio::spawn(mirror_ownership_records(fake.clone(), shutdown.clone()));
    let config = Config {
        controller: config(),
        leader_election: None,
        metrics_address: None,
    };
    let client = fake.client_as(Identity::kerf_controller());
    let run = tokio::spawn(Process::new(config, client, shutdown.clone()).run());

    // Claims come after their class, as in a cluster: a claim's class decides whose it is.
    eventually("the DeviceClass applied", DEADLINE, || async {
        (!fake.list_resources::<DeviceClass>(None).is_empty()).then_some(())
    })
    .await;
    claim(&fake, "fits", "10Gi");
    pod(&fake, "p", "fits");
    claim(&fake, "too-big", "500Gi");
    pod(&fake, "q", "too-big");
    eventually("the fitting claim allocated", DEADLINE, || async {
        allocated(&fake, "fits")
    })
    .await;
    let written = |method: &'static str, path: String| {
        let fake = fake.clone();
        async move {
            fake.requests()
                .iter()
                .any(|r| r.matches(method, &path))
                .then_some(())
        }
    };
    eventually("the gate removed", DEADLINE, || {
        written("PATCH", format!("{PODS}/p"))
    })
    .await;
    eventually("the Unplaceable condition", DEADLINE, || {
        written("PATCH", format!("{PODS}/q/status"))
    })
    .await;
    eventually("an Event created", DEADLINE, || {
        written("POST", EVENTS.to_owned())
    })
    .await;
    eventually("a repeated Event's series", DEADLINE, || {
        written("PATCH", EVENTS.to_owned())
    })
    .await;
    eventually("the GpuClass status", DEADLINE, || {
        written(
            "PATCH",
            format!("/apis/gpu.kerf.dev/v1alpha1/gpuclasses/{SLICES}/status"),
        )
    })
    .await;
    // Deallocation: the pod goes, kube-controller-manager's resourceclaim controller drops its
    // reservation (`pkg/controller/resourceclaim/controller.go`, `Controller.syncClaim`), and
    // the claim's allocation and finalizer follow.
    fake.remove(&format!("{PODS}/p"));
    let mut unreserved = fake.get(&format!("{CLAIMS}/fits")).unwrap();
    if let Some(status) = unreserved["status"].as_object_mut() {
        status.remove("reservedFor");
    }
    fake.insert(unreserved);
    eventually("the claim deallocated", DEADLINE, || async {
        let claim = fake.get(&format!("{CLAIMS}/fits"))?;
        claim["metadata"]["finalizers"]
            .as_array()
            .is_none_or(Vec::is_empty)
            .then_some(())
    })
    .await;
    shutdown.cancel();
    tokio::time::timeout(DEADLINE, run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();

    let writes: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| matches!(r.verb, "create" | "update" | "patch"))
        .collect();
    for kind in [
        "/resourceclaims/fits",
        "/resourceclaims/fits/status",
        "/deviceclasses/",
        "/events",
    ] {
        assert!(
            writes.iter().any(|r| r.path.contains(kind)),
            "no write of {kind}: {writes:#?}"
        );
    }
    let unnamed: Vec<_> = writes
        .iter()
        .filter(|r| field_manager(&r.query) != Some("kerf-controller"))
        .collect();
    assert!(
        unnamed.is_empty(),
        "writes without fieldManager=kerf-controller: {unnamed:#?}"
    );
}

// ---- logs and metrics of failed reconciles ----

/// The claim controller on its own context, whose metrics and back-off the test reads.
struct Harness {
    ctx: Arc<Context>,
    registry: Registry,
    controller: ClaimController,
}

impl Harness {
    async fn start(fake: &FakeApi) -> Self {
        let dc = kerf_controller::deviceclass::device_class(
            &slices_class(),
            DRIVER,
            "kerf-controller",
            true,
        )
        .unwrap();
        fake.insert_resource::<DeviceClass>(&dc);
        let Watched { context, registry } = Watched::start(fake, config()).await;
        let ctx = Arc::new(context);
        let controller = ClaimController::start(fake, Arc::clone(&ctx));
        Self {
            ctx,
            registry,
            controller,
        }
    }

    /// Failed reconciles of the claim controller with `reason`.
    fn errors(&self, reason: &str) -> u64 {
        let series = format!(
            r#"kerf_controller_reconcile_total{{controller="resourceclaim",result="error",reason="{reason}"}}"#
        );
        metric(&self.registry, &series).unwrap_or(0)
    }

    async fn stop(self) {
        self.controller.stop().await;
    }
}

#[tokio::test]
async fn a_conflict_and_a_not_found_under_a_reconcile_are_counted_without_a_warning() {
    let logs = CapturedLogs::default();
    let _guard = logs.capture(tracing::Level::WARN);
    let fake = FakeApi::new();
    gpu_nodes(&fake, &NODES);
    claim(&fake, "c", "10Gi");
    pod(&fake, "p", "c");
    // The first two writes of the claim (marking it for allocation) fail as if it had
    // changed, then as if it had been deleted, under the reconcile.
    fake.fail_next("PATCH", &format!("{CLAIMS}/c"), 409, 1);
    fake.fail_next("PATCH", &format!("{CLAIMS}/c"), 404, 1);
    let harness = Harness::start(&fake).await;

    eventually("the claim allocated", DEADLINE, || async {
        allocated(&fake, "c")
    })
    .await;
    assert_eq!(harness.errors("kube_conflict"), 1);
    assert_eq!(harness.errors("kube_not_found"), 1);
    assert_eq!(harness.ctx.backoff.failures("resourceclaim/default/c"), 0);
    harness.stop().await;
    assert_eq!(
        logs.count("WARN"),
        0,
        "{:#?}",
        logs.lines_containing("WARN")
    );
}

#[tokio::test]
async fn a_claim_that_keeps_failing_warns_once_past_the_threshold() {
    let logs = CapturedLogs::default();
    let _guard = logs.capture(tracing::Level::WARN);
    let fake = FakeApi::new();
    gpu_nodes(&fake, &NODES);
    claim(&fake, "c", "10Gi");
    pod(&fake, "p", "c");
    let failures = usize::try_from(KEEPS_FAILING_AFTER).unwrap() + 2;
    fake.fail_next("PATCH", &format!("{CLAIMS}/c"), 409, failures);
    let harness = Harness::start(&fake).await;

    eventually("the claim allocated", DEADLINE, || async {
        allocated(&fake, "c")
    })
    .await;
    assert_eq!(
        harness.errors("kube_conflict"),
        u64::try_from(failures).unwrap()
    );
    let warnings = logs.lines_containing("WARN");
    assert_eq!(
        logs.count("reconcile keeps failing"),
        1,
        "one warning at the threshold: {warnings:#?}"
    );
    assert!(
        warnings[0].contains("resourceclaim/default/c") && warnings[0].contains("kube_conflict"),
        "{warnings:#?}"
    );
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    assert_eq!(
        harness.ctx.backoff.failures("resourceclaim/default/c"),
        0,
        "success resets the count"
    );
    harness.stop().await;
}
