//! GpuQuota enforced at admission, end to end: users create ResourceClaims in a FakeApi that
//! calls kerf's validating webhook `quota.gpu.kerf.dev` over HTTPS as kube-apiserver does
//! (`deploy/helm/kerf/templates/webhook.yaml`), served by kerf-controller's webhook as its ServiceAccount
//! (deploy/'s RBAC). Claims up to the quota are admitted and charged in its status, the next
//! is refused with ResourceQuota's message as kubectl shows it, concurrent creates never
//! exceed it, a conflicting write is evaluated again, and with the webhook down
//! (`failurePolicy: Ignore`) claims are admitted uncharged.

mod cluster;

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::common::controller::Watched;
use cluster::{Cluster, GI, other_claim, quota_admissions, slice_claim};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::gpuquota::{GpuAmount, GpuResources};
use kerf_controller::ControllerConfig;
use kerf_controller::quota::recount;
use kerf_controller::webhook::QuotaAdmission;
use kerf_core::rng::SeededRng;
use kerf_tests::fake_api::{Identity, KERF_NAMESPACE};
use kerf_tests::wait::eventually;
use kube::api::{DeleteParams, PostParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const TEAM: &str = "team-a";
/// What kubectl prints in front of the webhook's message (kube-apiserver's `ToStatusErr`).
const DENIED: &str = "admission webhook \"quota.gpu.kerf.dev\" denied the request: ";

/// What a create answered: `Ok(uid)` or the API error's code and message.
async fn create(
    cluster: &Cluster,
    namespace: &str,
    claim: &ResourceClaim,
) -> Result<String, (u16, String)> {
    match cluster
        .claims(namespace)
        .create(&PostParams::default(), claim)
        .await
    {
        Ok(created) => Ok(created.metadata.uid.unwrap()),
        Err(kube::Error::Api(status)) => Err((status.code, status.message)),
        Err(other) => panic!("create failed: {other}"),
    }
}

fn used(quota: &kerf_api::GpuQuota) -> GpuAmount {
    quota
        .status
        .as_ref()
        .and_then(|s| s.used.as_ref())
        .map_or(GpuAmount::ZERO, |u| u.amount("status.used").unwrap())
}

#[tokio::test]
async fn claims_up_to_the_quota_are_admitted_and_the_next_is_refused_in_resource_quotas_words() {
    let cluster = Cluster::start().await;
    let hard = json!({"memory": "40Gi", "compute": 100, "gpus": 2});
    cluster.quota(TEAM, TEAM, hard).await;
    let first = create(&cluster, TEAM, &slice_claim("a", 20, 50))
        .await
        .unwrap();
    let second = create(&cluster, TEAM, &slice_claim("b", 20, 50))
        .await
        .unwrap();
    let refused = create(&cluster, TEAM, &slice_claim("c", 20, 50)).await;
    assert_eq!(
        refused,
        Err((
            403,
            format!(
                "{DENIED}exceeded quota: team-a, requested: compute=50,memory=20Gi, used: \
                 compute=100,memory=40Gi, limited: compute=100,memory=40Gi"
            )
        ))
    );
    assert!(cluster.claims(TEAM).get_opt("c").await.unwrap().is_none());

    let quota = cluster.read_quota(TEAM, TEAM).await;
    let status = quota.status.unwrap();
    assert_eq!(
        status.used,
        Some(GpuResources::of(GpuAmount {
            memory_bytes: 40 * GI,
            compute: 100,
            gpus: 0
        }))
    );
    let admitted: Vec<(&str, &str)> = status
        .admitted
        .iter()
        .map(|a| (a.name.as_str(), a.uid.as_str()))
        .collect();
    assert_eq!(admitted, [("a", first.as_str()), ("b", second.as_str())]);
    let summary = status.summary.unwrap();
    assert_eq!(
        [summary.memory, summary.compute, summary.gpus],
        ["40Gi/40Gi", "100/100", "0/2"]
    );
    assert_eq!(quota_admissions(&cluster, "charged"), 2);
    assert_eq!(quota_admissions(&cluster, "denied"), 1);

    // A claim of another driver's class, and any claim of a namespace without a quota, is
    // charged nothing: both are admitted and the quota is not written.
    let before = cluster
        .read_quota(TEAM, TEAM)
        .await
        .metadata
        .resource_version;
    create(&cluster, TEAM, &other_claim("other")).await.unwrap();
    cluster::namespace(&cluster.fake, "team-b");
    create(&cluster, "team-b", &slice_claim("free", 80, 100))
        .await
        .unwrap();
    let after = cluster.read_quota(TEAM, TEAM).await;
    assert_eq!(after.metadata.resource_version, before);
    assert_eq!(quota_admissions(&cluster, "not_charged"), 2);
    cluster.stop.cancel();
}

/// Many users create claims of random sizes at once, for many seeds: the claims admitted
/// never hold more than the quota, the quota's `used` is exactly what they hold, and every
/// refused claim did not fit in what was admitted (usage only grows here, so a claim refused
/// at any moment does not fit at the end either).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_of_random_sizes_never_exceed_the_quota() {
    const CAP_GIB: u64 = 64;
    const CAP_COMPUTE: u64 = 150;
    const CLAIMS: usize = 16;
    // Two replicas: admissions of one replica take turns, those of two race for the
    // quota's resourceVersion.
    let cluster = Cluster::start_replicas(2).await;
    for seed in 1..=8_u64 {
        let namespace = format!("team-{seed}");
        let hard = json!({"memory": format!("{CAP_GIB}Gi"), "compute": CAP_COMPUTE});
        cluster.quota(&namespace, "gpu", hard).await;
        let mut rng = SeededRng::new(seed);
        let sizes: Vec<(u64, u64)> = (0..CLAIMS)
            .map(|_| (1 + rng.below(16) as u64, 1 + rng.below(30) as u64))
            .collect();
        let creates = sizes.iter().enumerate().map(|(i, &(gib, compute))| {
            let (cluster, namespace) = (&cluster, namespace.as_str());
            async move {
                let claim = slice_claim(&format!("c{i}"), gib, compute);
                (gib, compute, create(cluster, namespace, &claim).await)
            }
        });
        let results = futures::future::join_all(creates).await;
        let (mut gib_held, mut compute_held) = (0, 0);
        let mut uids = BTreeSet::new();
        for (gib, compute, result) in &results {
            if let Ok(uid) = result {
                gib_held += gib;
                compute_held += compute;
                uids.insert(uid.clone());
            }
        }
        assert!(
            gib_held <= CAP_GIB && compute_held <= CAP_COMPUTE,
            "seed {seed}: {gib_held}Gi, {compute_held} compute admitted"
        );
        for (gib, compute, result) in &results {
            let Err((code, message)) = result else {
                continue;
            };
            assert_eq!(*code, 403, "seed {seed}: {message}");
            let prefix = format!("{DENIED}exceeded quota: gpu, requested: ");
            assert!(message.starts_with(&prefix), "seed {seed}: {message}");
            assert!(
                gib_held + gib > CAP_GIB || compute_held + compute > CAP_COMPUTE,
                "seed {seed}: a claim of {gib}Gi/{compute} was refused with \
                 {gib_held}Gi/{compute_held} held: {message}"
            );
        }
        let quota = cluster.read_quota(&namespace, "gpu").await;
        assert_eq!(
            used(&quota),
            GpuAmount {
                memory_bytes: gib_held * GI,
                compute: compute_held,
                gpus: 0
            },
            "seed {seed}"
        );
        let recorded: BTreeSet<String> = quota
            .status
            .unwrap()
            .admitted
            .into_iter()
            .map(|a| a.uid)
            .collect();
        assert_eq!(recorded, uids, "seed {seed}");
    }
    cluster.stop.cancel();
}

/// A write by someone else (another replica, the recount) since the webhook last read the
/// quota makes its status write conflict: it reads the quota again and decides on the newer
/// usage.
#[tokio::test]
async fn a_conflicting_write_is_decided_again_on_the_newer_usage() {
    let cluster = Cluster::start().await;
    cluster.quota(TEAM, TEAM, json!({"memory": "40Gi"})).await;
    create(&cluster, TEAM, &slice_claim("a", 10, 10))
        .await
        .unwrap();
    // The recount finds more in use than the webhook wrote (claims admitted while it was
    // down): its write makes the webhook's copy stale.
    let quotas = cluster.quotas(TEAM);
    let mut quota = quotas.get_status(TEAM).await.unwrap();
    let status = quota.status.as_mut().unwrap();
    status.used = Some(GpuResources::of(GpuAmount {
        memory_bytes: 35 * GI,
        compute: 0,
        gpus: 0,
    }));
    quotas
        .replace_status(TEAM, &PostParams::default(), &quota)
        .await
        .unwrap();
    let refused = create(&cluster, TEAM, &slice_claim("b", 10, 10)).await;
    assert_eq!(
        refused,
        Err((
            403,
            format!(
                "{DENIED}exceeded quota: team-a, requested: memory=10Gi, used: memory=35Gi, \
                 limited: memory=40Gi"
            )
        ))
    );
    create(&cluster, TEAM, &slice_claim("c", 5, 10))
        .await
        .unwrap();
    assert_eq!(
        used(&cluster.read_quota(TEAM, TEAM).await).memory_bytes,
        40 * GI
    );
    cluster.stop.cancel();
}

/// `failurePolicy: Ignore`: while no replica answers, claims are admitted and not charged
/// (the recount adds them to `used`).
#[tokio::test]
async fn with_the_webhook_down_claims_are_admitted_uncharged() {
    let cluster = Cluster::start().await;
    cluster.quota(TEAM, TEAM, json!({"memory": "10Gi"})).await;
    cluster.stop.cancel();
    kerf_tests::wait::until("the webhook stopped", cluster::WAIT, || {
        std::net::TcpStream::connect(("127.0.0.1", cluster.port)).is_err()
    })
    .await;
    create(&cluster, TEAM, &slice_claim("big", 20, 10))
        .await
        .unwrap();
    assert_eq!(used(&cluster.read_quota(TEAM, TEAM).await), GpuAmount::ZERO);
}

/// An AdmissionReview of the CREATE of `claim` in `namespace`, as kube-apiserver sends it.
fn review(namespace: &str, claim: &ResourceClaim, dry_run: bool) -> Vec<u8> {
    let mut object = serde_json::to_value(claim).unwrap();
    object["metadata"]["namespace"] = json!(namespace);
    object["metadata"]["uid"] = json!(format!("uid-{}", claim.metadata.name.as_ref().unwrap()));
    let gvr = json!({"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"});
    let gvk = json!({"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"});
    json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "review-1", "kind": gvk, "resource": gvr, "requestKind": gvk,
            "requestResource": gvr, "name": claim.metadata.name, "namespace": namespace,
            "operation": "CREATE", "userInfo": {"username": "alice"}, "object": object,
            "oldObject": null, "dryRun": dry_run, "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"},
        },
    })
    .to_string()
    .into_bytes()
}

/// `sideEffects: NoneOnDryRun`: a dry-run create is checked (a claim over the quota is still
/// refused) and never written. kube-apiserver sends dry-run requests only to such webhooks;
/// FakeApi sends them none, so the review is posted by hand.
#[tokio::test]
async fn a_dry_run_is_checked_and_never_charged() {
    let cluster = Cluster::start().await;
    cluster.quota(TEAM, TEAM, json!({"memory": "40Gi"})).await;
    let before = cluster
        .read_quota(TEAM, TEAM)
        .await
        .metadata
        .resource_version;
    let client = cluster.fake.client_as(Identity::kerf_controller());
    let caches = cluster.replicas[0].caches.clone();
    let admission = QuotaAdmission::new(client, caches, cluster::DRIVER);
    let answer = |body: Vec<u8>| {
        let admission = &admission;
        async move {
            let answer = admission.handle(&body).await;
            assert_eq!(answer.status, 200);
            serde_json::from_slice::<serde_json::Value>(&answer.body).unwrap()["response"].clone()
        }
    };
    let fits = answer(review(TEAM, &slice_claim("fits", 20, 10), true)).await;
    assert_eq!(fits["allowed"], json!(true), "{fits}");
    let over = answer(review(TEAM, &slice_claim("over", 41, 10), true)).await;
    assert_eq!(over["allowed"], json!(false), "{over}");
    assert_eq!(over["status"]["code"], json!(403));
    assert_eq!(over["status"]["reason"], json!("Forbidden"));
    assert_eq!(
        over["status"]["message"],
        json!(
            "exceeded quota: team-a, requested: memory=41Gi, used: memory=0, limited: \
             memory=40Gi"
        )
    );
    let after = cluster.read_quota(TEAM, TEAM).await;
    assert_eq!(after.metadata.resource_version, before, "nothing written");

    // The same review without dryRun is charged.
    let charged = answer(review(TEAM, &slice_claim("fits", 20, 10), false)).await;
    assert_eq!(charged["allowed"], json!(true), "{charged}");
    assert_eq!(
        used(&cluster.read_quota(TEAM, TEAM).await).memory_bytes,
        20 * GI
    );
    cluster.stop.cancel();
}

/// While the webhook cannot be reached (`failurePolicy: Ignore`) claims are admitted
/// uncharged; kerf-controller's recount (the leader's, another process than the webhook's
/// replica here) adds them to `used`, after which the webhook refuses what no longer fits, and
/// a deleted claim frees its share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_repaired_by_the_recount_after_a_webhook_outage() {
    let cluster = Cluster::start().await;
    cluster.quota(TEAM, TEAM, json!({"memory": "40Gi"})).await;
    let leader = Watched::start(&cluster.fake, ControllerConfig::new(cluster::DRIVER)).await;
    let stop = CancellationToken::new();
    tokio::spawn(recount::run(Arc::new(leader.context), stop.clone()));

    // Nothing listens on the Service's address: every call fails and is ignored.
    let nowhere = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    cluster
        .fake
        .serve_webhook_service(KERF_NAMESPACE, "kerf-webhook", nowhere);
    create(&cluster, TEAM, &slice_claim("a", 20, 10))
        .await
        .unwrap();
    create(&cluster, TEAM, &slice_claim("b", 30, 10))
        .await
        .unwrap();
    let used_memory = |gib: u64| {
        let cluster = &cluster;
        move || async move {
            let quota = cluster.read_quota(TEAM, TEAM).await;
            (used(&quota).memory_bytes == gib * GI).then_some(())
        }
    };
    eventually(
        "the recount counts the uncharged claims",
        cluster::WAIT,
        used_memory(50),
    )
    .await;

    let service = ([127, 0, 0, 1], cluster.port).into();
    cluster
        .fake
        .serve_webhook_service(KERF_NAMESPACE, "kerf-webhook", service);
    assert_eq!(
        create(&cluster, TEAM, &slice_claim("c", 1, 10)).await,
        Err((
            403,
            format!(
                "{DENIED}exceeded quota: team-a, requested: memory=1Gi, used: memory=50Gi, \
                 limited: memory=40Gi"
            )
        ))
    );
    cluster
        .claims(TEAM)
        .delete("b", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        "the recount frees the deleted claim",
        cluster::WAIT,
        used_memory(20),
    )
    .await;
    if let Err(refused) = create(&cluster, TEAM, &slice_claim("c", 1, 10)).await {
        let stored = cluster.read_quota(TEAM, TEAM).await.status;
        panic!("c refused after the deletion: {refused:?}; the quota's status: {stored:?}");
    }
    eventually("c charged", cluster::WAIT, used_memory(21)).await;
    stop.cancel();
    cluster.stop.cancel();
}
