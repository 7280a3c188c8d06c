//! The admission webhook over real HTTPS, against the in-memory API server.
//!
//! The test client checks the answer the way the API server does, as read upstream in
//! kubernetes/kubernetes:
//! - `VerifyAdmissionResponse` in
//!   `staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/request/admissionreview.go`:
//!   the answer is an `admission.k8s.io/v1` `AdmissionReview` whose `response.uid` is the
//!   request's, and `patch` and `patchType` come together;
//! - `callAttrMutatingHook` in
//!   `staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/mutating/dispatcher.go`: a
//!   non-empty patch is decoded as an RFC 6902 JSONPatch (`jsonpatch.DecodePatch`) and, for
//!   `patchType: JSONPatch`, applied to the JSON of the object;
//! - `AdmissionResponse.Patch` is a `[]byte` in `staging/src/k8s.io/api/admission/v1/types.go`,
//!   so the JSON carries it base64-encoded.
//!
//! The fake API server (`kerf_tests::fake_api::FakeApi`) has no admission chain of its own;
//! the test posts AdmissionReviews itself, as the dispatcher would.

use crate::common::claim_cluster::device_class;
use crate::common::webhook_server;

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use kerf_api::controller_claims::SCHEDULING_GATE;
use kerf_api::params::{Allocator, PlacementPolicy};
use kerf_tests::fake_api::FakeApi;
use kerf_tests::wait::eventually;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use webhook_server::{bundles, configuration};

const CONFIGURATION: &str = "kerf-scheduling-gate";
const DEADLINE: Duration = Duration::from_secs(15);

fn devices(class: &str) -> Value {
    json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": class}}]})
}

fn cluster() -> FakeApi {
    let fake = FakeApi::new();
    device_class(
        &fake,
        "slices",
        Allocator::Controller,
        PlacementPolicy::BinPack,
    );
    device_class(
        &fake,
        "whole",
        Allocator::Scheduler,
        PlacementPolicy::BinPack,
    );
    for (name, class) in [("slice-claim", "slices"), ("whole-claim", "whole")] {
        fake.insert(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": devices(class)},
        }));
        fake.insert(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": format!("{name}-template"), "namespace": "default"},
            "spec": {"spec": {"devices": devices(class)}},
        }));
    }
    fake.insert(configuration(
        CONFIGURATION,
        &["scheduling-gate.gpu.kerf.dev"],
        "Ignore",
    ));
    fake
}

/// The caBundle of the configuration's webhook, decoded, if set.
fn ca_bundle(fake: &FakeApi) -> Option<String> {
    bundles(fake, CONFIGURATION)?.into_iter().next()
}

/// POSTs `body` to the webhook; returns the HTTP status, the JSON answer and the certificate
/// the server presented.
async fn post(
    port: u16,
    bundle: &str,
    body: &Value,
) -> Result<(u16, Value, CertificateDer<'static>), String> {
    let answer = webhook_server::post(port, bundle, body.to_string()).await?;
    Ok((answer.status, answer.body, answer.certificate))
}

#[allow(clippy::needless_pass_by_value)] // callers pass json!() literals
fn review(uid: &str, spec: Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "p", "namespace": "default", "operation": "CREATE",
            "userInfo": {"username": "tester"},
            "object": {"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": "p", "namespace": "default"}, "spec": spec},
            "oldObject": null, "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    })
}

/// Checks the answer as `VerifyAdmissionResponse` does and applies its patch as
/// `callAttrMutatingHook` does; returns the pod spec after admission.
fn admitted_spec(request: &Value, answer: &Value) -> Value {
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1", "{answer}");
    assert_eq!(answer["kind"], "AdmissionReview", "{answer}");
    let response = &answer["response"];
    assert_eq!(response["uid"], request["request"]["uid"], "{answer}");
    assert_eq!(response["allowed"], true, "{answer}");
    let mut pod = request["request"]["object"].clone();
    match (response.get("patch"), response.get("patchType")) {
        (None, None) => {}
        (Some(patch), Some(kind)) => {
            assert_eq!(kind, "JSONPatch");
            let bytes = STANDARD
                .decode(patch.as_str().expect("patch is a base64 string"))
                .unwrap();
            let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
            json_patch::patch(&mut pod, &patch).unwrap();
        }
        _ => panic!("patch and patchType must come together: {answer}"),
    }
    pod["spec"].take()
}

fn has_gate(spec: &Value) -> bool {
    spec["schedulingGates"]
        .as_array()
        .is_some_and(|g| g.iter().any(|g| g["name"] == SCHEDULING_GATE))
}

#[allow(clippy::needless_pass_by_value)] // callers pass json!() literals
fn claims(refs: Value) -> Value {
    json!({"containers": [{"name": "c", "image": "busybox"}], "resourceClaims": refs})
}

#[tokio::test]
async fn reviews_over_https_gate_only_pods_with_controller_claims() {
    let fake = cluster();
    let stop = CancellationToken::new();
    let webhook_server::Started { port, registry, .. } = webhook_server::start(
        &fake,
        &[CONFIGURATION],
        Duration::from_secs(3600),
        Duration::from_secs(600),
        &stop,
    );
    let bundle = eventually("the caBundle", DEADLINE, || {
        std::future::ready(ca_bundle(&fake))
    })
    .await;
    let patches = fake.requests();
    let patch = patches
        .iter()
        .find(|r| r.verb == "patch" && r.path.ends_with(CONFIGURATION))
        .expect("a caBundle patch");
    assert!(
        patch.query.contains("fieldManager=kerf-controller"),
        "{patch:?}"
    );

    let cases = [
        (
            "controller claim",
            claims(json!([{"name": "g", "resourceClaimName": "slice-claim"}])),
            true,
        ),
        (
            "controller template",
            claims(json!([{"name": "g", "resourceClaimTemplateName": "slice-claim-template"}])),
            true,
        ),
        (
            "scheduler claim",
            claims(json!([{"name": "g", "resourceClaimName": "whole-claim"}])),
            false,
        ),
        (
            "scheduler template",
            claims(json!([{"name": "g", "resourceClaimTemplateName": "whole-claim-template"}])),
            false,
        ),
        (
            "missing claim",
            claims(json!([{"name": "g", "resourceClaimName": "nope"}])),
            false,
        ),
        (
            "no claims",
            json!({"containers": [{"name": "c", "image": "busybox"}]}),
            false,
        ),
    ];
    for (i, (what, spec, gated)) in cases.into_iter().enumerate() {
        let request = review(&format!("uid-{i}"), spec);
        // The caches fill in the background: the server answers once they are ready.
        let (status, answer, _) = eventually("the webhook to answer", DEADLINE, || async {
            post(port, &bundle, &request).await.ok()
        })
        .await;
        assert_eq!(status, 200, "{what}: {answer}");
        let spec = admitted_spec(&request, &answer);
        assert_eq!(has_gate(&spec), gated, "{what}: {spec}");
    }

    // A pod with other gates gets kerf's appended; one with kerf's gate or a node is left alone.
    let mut spec = claims(json!([{"name": "g", "resourceClaimName": "slice-claim"}]));
    spec["schedulingGates"] = json!([{"name": "other"}]);
    let request = review("uid-append", spec);
    let (_, answer, _) = post(port, &bundle, &request).await.unwrap();
    assert_eq!(
        admitted_spec(&request, &answer)["schedulingGates"],
        json!([{"name": "other"}, {"name": SCHEDULING_GATE}])
    );
    for (field, value) in [
        ("schedulingGates", json!([{"name": SCHEDULING_GATE}])),
        ("nodeName", json!("node-1")),
    ] {
        let mut spec = claims(json!([{"name": "g", "resourceClaimName": "slice-claim"}]));
        spec[field] = value;
        let request = review("uid-left-alone", spec.clone());
        let (_, answer, _) = post(port, &bundle, &request).await.unwrap();
        assert!(
            answer["response"].get("patch").is_none(),
            "{field}: {answer}"
        );
        assert_eq!(admitted_spec(&request, &answer), spec);
    }

    // A body that is not a review gets 400 and a Status, never a dropped connection.
    let (status, answer, _) = post(port, &bundle, &json!({"kind": "Pod"})).await.unwrap();
    assert_eq!(status, 400);
    assert_eq!(answer["kind"], "Status");

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains(r#"kerf_controller_admissions_total{outcome="gated"} 3"#),
        "{text}"
    );
    assert!(
        text.contains(r#"kerf_controller_admissions_total{outcome="error"} 1"#),
        "{text}"
    );
    stop.cancel();
}

#[tokio::test]
async fn the_certificate_is_rotated_into_the_ca_bundle_without_a_restart() {
    let fake = cluster();
    let stop = CancellationToken::new();
    // Renewed 1.5 s after issue.
    let webhook_server::Started { port, .. } = webhook_server::start(
        &fake,
        &[CONFIGURATION],
        Duration::from_secs(4),
        Duration::from_millis(2500),
        &stop,
    );
    let first_bundle = eventually("the caBundle", DEADLINE, || {
        std::future::ready(ca_bundle(&fake))
    })
    .await;
    let request = review(
        "uid-rotation",
        claims(json!([{"name": "g", "resourceClaimName": "slice-claim"}])),
    );
    let (_, _, first_cert) = eventually("the webhook to answer", DEADLINE, || async {
        post(port, &first_bundle, &request).await.ok()
    })
    .await;

    // A new CA joins the bundle (first), the old one stays, and the new certificate is served.
    let (bundle, answer, served) = eventually("a rotated certificate", DEADLINE, || async {
        let bundle = ca_bundle(&fake)?;
        let (_, answer, served) = post(port, &bundle, &request).await.ok()?;
        (served != first_cert).then_some((bundle, answer, served))
    })
    .await;
    assert!(has_gate(&admitted_spec(&request, &answer)));
    let cas: Vec<_> = CertificateDer::pem_slice_iter(bundle.as_bytes()).collect();
    assert!(cas.len() >= 2, "{bundle}");
    assert!(
        bundle.ends_with(&first_bundle) || bundle.contains(first_bundle.trim()),
        "{bundle}"
    );
    // Only the new CA verifies the new certificate: a client with the old bundle alone fails.
    let new_ca = CertificateDer::pem_slice_iter(bundle.as_bytes())
        .next()
        .unwrap()
        .unwrap();
    assert_ne!(new_ca.as_ref(), first_cert.as_ref());
    let old_only = post(port, &first_bundle, &request).await;
    assert!(
        old_only.is_err(),
        "the old CA must not verify the new certificate"
    );
    let _ = served;
    stop.cancel();
}

/// Replicas of a rollout write their CAs into one bundle at once: each write tests the
/// resourceVersion it read, so all but one lose; the losers read again and write at once, so
/// that every replica is trusted right away (not a recheck later, while the API server's calls
/// to it fail TLS verification). Randomized: seeded pauses before each replica's write.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_writing_their_cas_at_once_are_all_trusted_at_once() {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    use kerf_controller::webhook::{ca_bundle, tls};
    use kerf_core::rng::SeededRng;

    for seed in 0..6_u64 {
        let mut rng = SeededRng::new(seed);
        let fake = FakeApi::new();
        fake.insert(configuration(
            CONFIGURATION,
            &["a.gpu.kerf.dev", "b.gpu.kerf.dev"],
            "Fail",
        ));
        let api = kube::Api::<MutatingWebhookConfiguration>::all(fake.client());
        let names = vec!["kerf-webhook.kerf-system.svc".to_owned()];
        let cas: Vec<String> = (0..4)
            .map(|_| {
                tls::issue(&names, Duration::from_secs(3600))
                    .unwrap()
                    .ca_pem
            })
            .collect();
        // Each replica starts after its own random pause, as pods of a rollout do.
        let writes = cas.iter().map(|ca| {
            let api = api.clone();
            let pause = Duration::from_millis(rng.next_u64() % 5);
            async move {
                tokio::time::sleep(pause).await;
                ca_bundle::ensure_ca(&api, CONFIGURATION, ca, "kerf-controller").await
            }
        });
        for (at, outcome) in futures::future::join_all(writes)
            .await
            .into_iter()
            .enumerate()
        {
            assert!(outcome.is_ok(), "seed {seed} replica {at}: {outcome:?}");
        }
        for bundle in bundles(&fake, CONFIGURATION).unwrap() {
            let present = ca_bundle::pem_blocks(&bundle);
            for ca in &cas {
                assert!(
                    ca_bundle::pem_blocks(ca)
                        .iter()
                        .all(|b| present.contains(b)),
                    "seed {seed}: a replica's CA is missing"
                );
            }
        }
    }
}
