//! kerf-controller's GpuQuota recount against the in-memory API server, as kerf-controller's
//! ServiceAccount (deploy/'s RBAC): usage summed from the claims (controller slices by their
//! parameters, scheduler whole GPUs by the class's largest device, per class), deletion
//! freeing, admitted charges kept until the claim is seen or the grace passes, a conflicting
//! admission never undone, an invalid spec and a refused write told on the quota.

use std::sync::Arc;
use std::time::Duration;

use crate::common::controller::{Watched, metrics_text};
use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kerf_api::gpuquota::{
    AdmittedClaim, ClassQuota, GpuAmount, GpuQuota, GpuQuotaSpec, GpuQuotaStatus, GpuResources,
};
use kerf_api::params::{Allocator, GpuSelector};
use kerf_api::quantity::bytes_quantity;
use kerf_api::{GpuClass, GpuClassSpec};
use kerf_controller::quota::{QuotaSettings, recount};
use kerf_controller::{Context, ControllerConfig, gpuclass};
use kerf_tests::fake_api::{FakeApi, Identity};
use kerf_tests::fixtures::SliceClaim;
use kerf_tests::wait::eventually;
use kube::Api;
use kube::api::{DeleteParams, ObjectMeta, PostParams};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use kerf_tests::fixtures::DRIVER;
const NS: &str = "team-a";
const H100: &str = "NVIDIA H100 80GB HBM3";
const GIB: u64 = 1 << 30;
/// NVML's memory of the mock H100.
const H100_BYTES: u64 = 81559 << 20;
const QUOTA_STATUS: &str = "/apis/gpu.kerf.dev/v1alpha1/namespaces/team-a/gpuquotas/team-a/status";
/// How long a test waits for the controller.
const DEADLINE: Duration = Duration::from_secs(20);

/// Publishes two mock H100s on `node-a` as the kubelet plugin would.
fn seed_node(fake: &FakeApi) {
    let inventory = kerf_core::mock::from_spec("h100-sxm-80gb:2").unwrap();
    let specs = kerf_api::resource_slices(&inventory, DRIVER, "node-a").unwrap();
    for (i, spec) in specs.into_iter().enumerate() {
        fake.insert_resource(&ResourceSlice {
            metadata: ObjectMeta {
                name: Some(kerf_api::slice_name("node-a", DRIVER, i)),
                ..ObjectMeta::default()
            },
            spec,
        });
    }
}

/// The whole-GPU Scheduler class `h100` and the Controller class `h100-slice`.
fn seed_classes(fake: &FakeApi) {
    let selector = GpuSelector {
        product_names: vec![H100.to_owned()],
        ..GpuSelector::default()
    };
    fake.insert_resource(&GpuClass::new(
        "h100",
        GpuClassSpec {
            selector: selector.clone(),
            ..GpuClassSpec::default()
        },
    ));
    fake.insert_resource(&GpuClass::new(
        "h100-slice",
        GpuClassSpec {
            allocator: Allocator::Controller,
            selector,
            ..GpuClassSpec::default()
        },
    ));
}

fn resources(memory: &str, compute: u64, gpus: u64) -> GpuResources {
    GpuResources {
        memory: Some(Quantity(memory.to_owned())),
        compute: Some(compute),
        gpus: Some(gpus),
    }
}

fn amount(memory_bytes: u64, compute: u64, gpus: u64) -> GpuAmount {
    GpuAmount {
        memory_bytes,
        compute,
        gpus,
    }
}

/// The quota `team-a`: 200Gi, 400 compute, 4 GPUs; per class 100Gi of slices and 2 H100s.
fn quota_spec() -> GpuQuotaSpec {
    GpuQuotaSpec {
        hard: resources("200Gi", 400, 4),
        classes: vec![
            ClassQuota {
                name: "h100-slice".to_owned(),
                hard: resources("100Gi", 400, 0),
            },
            ClassQuota {
                name: "h100".to_owned(),
                hard: resources("160Gi", 200, 2),
            },
        ],
    }
}

fn insert_quota(fake: &FakeApi, spec: GpuQuotaSpec) -> GpuQuota {
    let mut quota = GpuQuota::new(NS, spec);
    quota.metadata.namespace = Some(NS.to_owned());
    fake.insert_resource(&quota)
}

/// A claim in `namespace` for one `h100-slice` slice of `gib` GiB and `compute` percent.
fn slice_claim(name: &str, namespace: &str, gib: u64, compute: u64) -> Value {
    SliceClaim::new(name, "h100-slice", &format!("{gib}Gi"))
        .in_namespace(namespace)
        .compute(compute)
        .json()
}

/// A claim in `team-a` for `count` whole GPUs of `h100`.
fn whole_claim(name: &str, count: u32) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "h100", "allocationMode": "ExactCount", "count": count,
        }}]}},
    })
}

/// Creates `claim` as a user would.
async fn create_claim(fake: &FakeApi, claim: Value) -> String {
    let namespace = claim["metadata"]["namespace"].as_str().unwrap().to_owned();
    let api: Api<k8s_openapi::api::resource::v1::ResourceClaim> =
        Api::namespaced(fake.client(), &namespace);
    let claim = serde_json::from_value(claim).unwrap();
    let created = api.create(&PostParams::default(), &claim).await.unwrap();
    created.metadata.uid.unwrap()
}

/// kerf-controller's recount and GpuClass controller on caches of `fake`.
struct Controller {
    fake: FakeApi,
    ctx: Arc<Context>,
    registry: Registry,
    stop: CancellationToken,
}

impl Controller {
    /// A context over `fake`; the controllers run when `run` is true.
    async fn start(fake: &FakeApi, quota: QuotaSettings, run: bool) -> Self {
        let config = ControllerConfig {
            quota,
            ..ControllerConfig::new(DRIVER)
        };
        let Watched { context, registry } = Watched::start(fake, config).await;
        let ctx = Arc::new(context);
        let stop = CancellationToken::new();
        tokio::spawn(gpuclass::run(Arc::clone(&ctx), stop.clone()));
        if run {
            tokio::spawn(recount::run(Arc::clone(&ctx), stop.clone()));
        }
        let controller = Self {
            fake: fake.clone(),
            ctx,
            registry,
            stop,
        };
        controller.classes_sized().await;
        controller
    }

    /// Waits until both GpuClasses report their largest device (what whole GPUs are charged)
    /// and the process cache has them.
    async fn classes_sized(&self) {
        let gpu_classes = self.ctx.caches.process().gpu_classes.clone();
        eventually("the GpuClasses sized in the cache", DEADLINE, || {
            let sized = ["h100", "h100-slice"].iter().all(|name| {
                gpu_classes
                    .get(&kube::runtime::reflector::ObjectRef::new(name))
                    .and_then(|c| c.status.clone())
                    .and_then(|s| s.largest_device)
                    .is_some()
            });
            std::future::ready(sized.then_some(()))
        })
        .await;
    }

    fn quota(&self) -> GpuQuota {
        self.fake.get_resource(Some(NS), NS).unwrap()
    }

    /// Waits until the quota's status satisfies `check`, and returns it.
    async fn status_where(
        &self,
        what: &str,
        check: impl Fn(&GpuQuotaStatus) -> bool,
    ) -> GpuQuotaStatus {
        eventually(what, DEADLINE, || {
            let status = self.quota().status.filter(|s| check(s));
            std::future::ready(status)
        })
        .await
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn used(status: &GpuQuotaStatus) -> GpuAmount {
    status
        .used
        .as_ref()
        .map_or(GpuAmount::ZERO, |u| u.amount("used").unwrap())
}

fn class_used(status: &GpuQuotaStatus, class: &str) -> GpuAmount {
    status
        .classes
        .iter()
        .find(|c| c.name == class)
        .map(|c| c.used.amount("classes.used").unwrap())
        .unwrap()
}

fn settings(admitted_grace: Duration) -> QuotaSettings {
    QuotaSettings {
        admitted_grace,
        ..QuotaSettings::default()
    }
}

/// An admission as the webhook records it: `charge` raised into `used`, the entry listed.
fn admit(status: &mut GpuQuotaStatus, uid: &str, charge: GpuAmount, at: Timestamp) {
    let before = used(status);
    status.used = Some(GpuResources::of(before.plus(charge)));
    status.admitted.push(AdmittedClaim {
        name: format!("claim-{uid}"),
        uid: uid.to_owned(),
        time: Time(at),
        charge: GpuResources::of(charge),
        classes: Vec::new(),
    });
}

/// Writes `status` on the quota as the webhook does: a replace of `/status` by kerf-controller,
/// conditional on the resourceVersion of `quota`.
async fn write_as_webhook(fake: &FakeApi, mut quota: GpuQuota, status: GpuQuotaStatus) {
    quota.status = Some(status);
    let api: Api<GpuQuota> = Api::namespaced(fake.client_as(Identity::kerf_controller()), NS);
    api.replace_status(NS, &PostParams::default(), &quota)
        .await
        .unwrap();
}

#[tokio::test]
async fn usage_is_summed_from_the_claims_per_class_and_deletion_frees() {
    let fake = FakeApi::new();
    seed_node(&fake);
    seed_classes(&fake);
    let controller = Controller::start(&fake, QuotaSettings::default(), true).await;
    insert_quota(&fake, quota_spec());
    let empty = controller
        .status_where("the first recount", |s| s.used.is_some())
        .await;
    assert_eq!(used(&empty), GpuAmount::ZERO);

    create_claim(&fake, slice_claim("a", NS, 20, 50)).await;
    create_claim(&fake, slice_claim("b", NS, 20, 50)).await;
    create_claim(&fake, whole_claim("w", 1)).await;
    // Another namespace's claims are its own quota's business.
    create_claim(&fake, slice_claim("other", "team-b", 40, 100)).await;

    let slices = amount(40 * GIB, 100, 0);
    let whole = amount(H100_BYTES, 100, 1);
    let status = controller
        .status_where("both slices and the H100 counted", |s| {
            used(s) == slices.plus(whole)
        })
        .await;
    assert_eq!(class_used(&status, "h100-slice"), slices);
    assert_eq!(class_used(&status, "h100"), whole);
    assert_eq!(status.hard, Some(quota_spec().hard));
    let summary = status.summary.as_ref().unwrap();
    assert_eq!(
        (summary.compute.as_str(), summary.gpus.as_str()),
        ("200/400", "1/4")
    );
    let ready = &status.conditions[0];
    assert_eq!(
        (
            ready.type_.as_str(),
            ready.status.as_str(),
            ready.reason.as_str()
        ),
        ("Ready", "True", "Enforced")
    );
    assert!(status.admitted.is_empty());
    let metrics = metrics_text(&controller.registry);
    assert!(
        metrics.contains(r#"kerf_controller_quota_used_gpus{namespace="team-a",quota="team-a"} 1"#),
        "{metrics}"
    );

    let claims: Api<k8s_openapi::api::resource::v1::ResourceClaim> =
        Api::namespaced(fake.client(), NS);
    claims.delete("a", &DeleteParams::default()).await.unwrap();
    claims.delete("w", &DeleteParams::default()).await.unwrap();
    let freed = controller
        .status_where("the deleted claims freed", |s| {
            used(s) == amount(20 * GIB, 50, 0)
        })
        .await;
    assert_eq!(class_used(&freed, "h100"), GpuAmount::ZERO);
}

#[tokio::test]
async fn a_gpu_class_reports_its_largest_device() {
    let fake = FakeApi::new();
    seed_node(&fake);
    seed_classes(&fake);
    let _controller = Controller::start(&fake, QuotaSettings::default(), false).await;
    for name in ["h100", "h100-slice"] {
        let class: GpuClass = fake.get_resource(None, name).unwrap();
        let largest = class.status.unwrap().largest_device.unwrap();
        assert_eq!(largest.memory, bytes_quantity(H100_BYTES), "{name}");
        assert_eq!(largest.compute, 100, "{name}: a whole GPU");
    }
}

#[tokio::test]
async fn an_admitted_charge_counts_until_its_claim_is_seen() {
    let fake = FakeApi::new();
    seed_node(&fake);
    seed_classes(&fake);
    // A grace far longer than the test: only being seen in the cache drops an entry here.
    let controller = Controller::start(&fake, settings(Duration::from_secs(3600)), true).await;
    insert_quota(&fake, quota_spec());
    let first = controller
        .status_where("the first recount", |s| s.used.is_some())
        .await;

    // The webhook admitted "pending" (not created yet, or not in the cache yet) and "seen",
    // which exists.
    let seen_uid = create_claim(&fake, slice_claim("seen", NS, 10, 25)).await;
    let mut admitted = first.clone();
    admit(
        &mut admitted,
        "pending",
        amount(20 * GIB, 50, 0),
        Timestamp::now(),
    );
    admit(
        &mut admitted,
        &seen_uid,
        amount(10 * GIB, 25, 0),
        Timestamp::now(),
    );
    write_as_webhook(&fake, controller.quota(), admitted).await;

    let status = controller
        .status_where("the seen claim's entry dropped", |s| {
            s.admitted.len() == 1 && used(s) == amount(30 * GIB, 75, 0)
        })
        .await;
    assert_eq!(
        status.admitted[0].uid, "pending",
        "counted once, through the claim"
    );
}

#[tokio::test]
async fn an_admitted_charge_whose_claim_never_comes_expires_after_the_grace() {
    let fake = FakeApi::new();
    seed_node(&fake);
    seed_classes(&fake);
    let controller = Controller::start(&fake, settings(Duration::from_secs(1)), true).await;
    insert_quota(&fake, quota_spec());
    let first = controller
        .status_where("the first recount", |s| s.used.is_some())
        .await;
    let mut admitted = first.clone();
    admit(
        &mut admitted,
        "failed-create",
        amount(20 * GIB, 50, 0),
        Timestamp::now(),
    );
    write_as_webhook(&fake, controller.quota(), admitted).await;
    // Nothing else happens in the namespace: the recount comes back by itself when the entry
    // expires, not at the five-minute resync.
    let status = controller
        .status_where("the entry expired", |s| {
            s.admitted.is_empty() && used(s) == GpuAmount::ZERO && s.observed_generation.is_some()
        })
        .await;
    assert!(status.conditions.iter().all(|c| c.status == "True"));
}

#[tokio::test]
async fn a_recount_that_loses_to_an_admission_counts_again_and_keeps_it() {
    let fake = FakeApi::new();
    seed_node(&fake);
    seed_classes(&fake);
    // Only reconcile calls below: nothing else writes the quota.
    let controller = Controller::start(&fake, settings(Duration::from_secs(3600)), false).await;
    create_claim(&fake, slice_claim("existing", NS, 10, 25)).await;
    let stale = insert_quota(&fake, quota_spec());
    eventually("the claim in the cache", DEADLINE, || {
        std::future::ready((controller.ctx.caches.claims.len() == 1).then_some(()))
    })
    .await;

    // The webhook admits a claim between the recount's read and its write.
    let mut admitted = GpuQuotaStatus::default();
    admit(
        &mut admitted,
        "racing",
        amount(20 * GIB, 50, 0),
        Timestamp::now(),
    );
    write_as_webhook(&fake, stale.clone(), admitted).await;
    fake.clear_requests();

    recount::reconcile(Arc::new(stale), Arc::clone(&controller.ctx))
        .await
        .unwrap();
    let status = controller.quota().status.unwrap();
    assert_eq!(
        used(&status),
        amount(30 * GIB, 75, 0),
        "the claim and the admission"
    );
    assert_eq!(status.admitted.len(), 1);
    let writes: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| r.path == QUOTA_STATUS || r.path == QUOTA_STATUS.trim_end_matches("/status"))
        .map(|r| r.verb)
        .collect();
    assert_eq!(
        writes,
        ["update", "get", "update"],
        "a conflicting replace, a fresh read, a replace"
    );
}

#[tokio::test]
async fn an_invalid_spec_is_not_ready_and_warned_about_on_the_quota() {
    let fake = FakeApi::new();
    seed_node(&fake);
    seed_classes(&fake);
    let controller = Controller::start(&fake, QuotaSettings::default(), true).await;
    let mut spec = quota_spec();
    spec.classes[1].name = "h100-slice".to_owned();
    insert_quota(&fake, spec);
    let status = controller
        .status_where("the Ready condition", |s| !s.conditions.is_empty())
        .await;
    let ready = &status.conditions[0];
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "InvalidSpec")
    );
    assert!(ready.message.contains("listed twice"), "{}", ready.message);
    assert_eq!(status.hard, None, "an invalid quota enforces nothing");
    let events = eventually("the Warning Event", DEADLINE, || {
        let events = fake.warning_events("GpuQuota", NS);
        std::future::ready((!events.is_empty()).then_some(events))
    })
    .await;
    assert_eq!(events[0]["reason"], "InvalidSpec");
    assert_eq!(events[0]["regarding"]["namespace"], NS);
}

#[tokio::test]
async fn a_refused_status_write_is_told_on_the_quota() {
    let fake = FakeApi::new();
    seed_node(&fake);
    seed_classes(&fake);
    let controller = Controller::start(&fake, QuotaSettings::default(), true).await;
    let denied = r#"gpuquotas.gpu.kerf.dev "team-a" is forbidden: User "system:serviceaccount:kerf-system:kerf-controller" cannot update resource "gpuquotas/status" in API group "gpu.kerf.dev" in the namespace "team-a""#;
    fake.fail_next_with("update", QUOTA_STATUS, 403, "Forbidden", denied, 1);
    insert_quota(&fake, quota_spec());
    let events = eventually("the Warning Event", DEADLINE, || {
        let events = fake.warning_events("GpuQuota", NS);
        std::future::ready((!events.is_empty()).then_some(events))
    })
    .await;
    let note = events[0]["note"].as_str().unwrap();
    assert!(note.contains(denied), "{note}");
    // The retry after the back-off writes the status.
    controller
        .status_where("the status after the retry", |s| s.used.is_some())
        .await;
}
