//! FakeApi calls validating admission webhooks as kube-apiserver does (kubernetes/kubernetes
//! `staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/`): over HTTPS trusting only the
//! configuration's caBundle, with the AdmissionReview of `request/admissionreview.go`, denials
//! worded by `errors/statuserror.go` (`ToStatusErr`), failures by the failure policy, and
//! `ShouldCallHook`'s selectors and matchConditions. The webhook here is a tiny server of the
//! test's own (`server`).

pub(crate) mod server;

pub(crate) mod fixture;

use std::sync::Arc;

use fixture::{
    DEADLINE, HOST, NAMESPACE, SERVICE, api_error, claim, claims, cluster, configure, gpu_quota,
    gpu_quotas, namespace, webhook,
};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_tests::fake_api::{FakeApi, KERF_WEBHOOK_MANIFEST};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};
use server::{allowed, denied, handler};

#[tokio::test]
async fn an_allowed_claim_is_stored_as_the_webhook_saw_it() {
    let (fake, server) = cluster(
        "check.example.com",
        &["CREATE"],
        "Fail",
        handler(|_| allowed()),
    )
    .await;
    let stored = claims(&fake)
        .create(&PostParams::default(), &claim("first"))
        .await
        .unwrap();
    let reviews = server.reviews();
    assert_eq!(reviews.len(), 1, "one call: {reviews:#?}");
    let review = &reviews[0];
    assert_eq!(review["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(review["kind"], "AdmissionReview");
    let request = &review["request"];
    assert!(!request["uid"].as_str().unwrap().is_empty());
    let gvk = json!({"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"});
    let gvr = json!({"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"});
    assert_eq!(
        [
            &request["kind"],
            &request["requestKind"],
            &request["resource"],
            &request["requestResource"]
        ],
        [&gvk, &gvk, &gvr, &gvr]
    );
    assert_eq!(
        (
            &request["name"],
            &request["namespace"],
            &request["operation"]
        ),
        (&json!("first"), &json!("team-a"), &json!("CREATE"))
    );
    assert_eq!(request["userInfo"]["username"], "kubernetes-admin");
    assert_eq!(
        request["userInfo"]["groups"],
        json!(["system:masters", "system:authenticated"])
    );
    assert_eq!(request["dryRun"], false);
    assert_eq!(request["oldObject"], Value::Null);
    assert_eq!(request["options"]["kind"], "CreateOptions");
    assert!(request.get("subResource").is_none());
    // Validating admission runs after BeforeCreate: the object has its uid and timestamp,
    // and the store keeps the very same.
    let object = &request["object"];
    assert_eq!(
        object["metadata"]["uid"].as_str(),
        stored.metadata.uid.as_deref()
    );
    assert!(object["metadata"]["creationTimestamp"].is_string());
    assert!(object["metadata"].get("resourceVersion").is_none());
}

#[tokio::test]
async fn a_generated_name_is_in_the_review_and_stored() {
    let (fake, server) = cluster(
        "check.example.com",
        &["CREATE"],
        "Fail",
        handler(|_| allowed()),
    )
    .await;
    let mut generated = claim("");
    generated.metadata.name = None;
    generated.metadata.generate_name = Some("gpu-".to_owned());
    let stored = claims(&fake)
        .create(&PostParams::default(), &generated)
        .await
        .unwrap();
    let name = stored.metadata.name.unwrap();
    assert!(name.starts_with("gpu-") && name.len() == 9, "{name}");
    let request = server.reviews()[0]["request"].clone();
    assert_eq!(request["name"], json!(name));
    assert_eq!(request["object"]["metadata"]["name"], json!(name));
    assert_eq!(request["object"]["metadata"]["generateName"], "gpu-");
}

#[tokio::test]
async fn a_denial_reaches_the_client_as_kube_apiserver_words_it() {
    let answer = handler(|review| {
        match review["request"]["name"].as_str() {
            Some("forbidden") => denied(json!({
                "code": 403, "reason": "Forbidden",
                "message": "exceeded quota: team-a, requested: memory=20Gi, used: memory=40Gi, limited: memory=40Gi",
            })),
            // No code: ToStatusErr raises it to 400; no message: the reason is shown.
            Some("bare") => denied(json!({"reason": "NotWelcome"})),
            _ => denied(json!({})),
        }
    });
    let (fake, _server) = cluster("quota.gpu.kerf.dev", &["CREATE"], "Fail", answer).await;
    let status = api_error(
        claims(&fake)
            .create(&PostParams::default(), &claim("forbidden"))
            .await,
    );
    assert_eq!(
        (status.code, status.reason.as_str(), status.message.as_str()),
        (
            403,
            "Forbidden",
            "admission webhook \"quota.gpu.kerf.dev\" denied the request: exceeded quota: team-a, requested: memory=20Gi, used: memory=40Gi, limited: memory=40Gi"
        )
    );
    let status = api_error(
        claims(&fake)
            .create(&PostParams::default(), &claim("bare"))
            .await,
    );
    assert_eq!(
        (status.code, status.reason.as_str(), status.message.as_str()),
        (
            400,
            "NotWelcome",
            "admission webhook \"quota.gpu.kerf.dev\" denied the request: NotWelcome"
        )
    );
    let status = api_error(
        claims(&fake)
            .create(&PostParams::default(), &claim("silent"))
            .await,
    );
    assert_eq!(
        (status.code, status.message.as_str()),
        (
            400,
            "admission webhook \"quota.gpu.kerf.dev\" denied the request without explanation"
        )
    );
    assert!(
        claims(&fake)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
}

#[tokio::test]
async fn a_namespace_selector_that_does_not_match_skips_the_call() {
    let server = server::start(&[HOST], handler(|_| denied(json!({"code": 403})))).await;
    let fake = FakeApi::new();
    namespace(&fake, "team-a", json!({"quota": "enforced"}));
    namespace(&fake, "team-b", json!({}));
    let mut selective = webhook(
        "selective.example.com",
        &["CREATE"],
        "Fail",
        &server.ca_bundle(),
    );
    selective["namespaceSelector"] = json!({"matchLabels": {"quota": "enforced"}});
    configure(&fake, "selective", vec![selective]);
    fake.serve_webhook_service(NAMESPACE, SERVICE, server.address);
    Api::<ResourceClaim>::namespaced(fake.client(), "team-b")
        .create(&PostParams::default(), &claim("free"))
        .await
        .unwrap();
    assert!(server.reviews().is_empty());
    let status = api_error(
        claims(&fake)
            .create(&PostParams::default(), &claim("checked"))
            .await,
    );
    assert_eq!(status.code, 403);
    assert_eq!(server.reviews().len(), 1);
    // kube-apiserver's label on every namespace is matched too.
    let mut by_name = webhook(
        "by-name.example.com",
        &["CREATE"],
        "Fail",
        &server.ca_bundle(),
    );
    by_name["namespaceSelector"] = json!({"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["team-b"]},
    ]});
    configure(&fake, "selective", vec![by_name]);
    Api::<ResourceClaim>::namespaced(fake.client(), "team-b")
        .create(&PostParams::default(), &claim("free-too"))
        .await
        .unwrap();
    assert_eq!(server.reviews().len(), 1);
}

/// A fake whose webhook `conditional.example.com` (denying everything) has one
/// matchCondition, `expression`, under `failure_policy`.
async fn conditional(failure_policy: &str, expression: &str) -> (FakeApi, server::Webhook) {
    let server = server::start(&[HOST], handler(|_| denied(json!({"code": 403})))).await;
    let fake = FakeApi::new();
    namespace(&fake, "team-a", json!({}));
    let bundle = server.ca_bundle();
    let mut hook = webhook(
        "conditional.example.com",
        &["CREATE"],
        failure_policy,
        &bundle,
    );
    hook["matchConditions"] = json!([{"name": "only", "expression": expression}]);
    configure(&fake, "conditional", vec![hook]);
    fake.serve_webhook_service(NAMESPACE, SERVICE, server.address);
    (fake, server)
}

async fn create(fake: &FakeApi, name: &str) -> Result<ResourceClaim, kube::Error> {
    claims(fake)
        .create(&PostParams::default(), &claim(name))
        .await
}

#[tokio::test]
async fn a_false_match_condition_skips_the_call() {
    let (fake, server) = conditional("Fail", "object.metadata.name == 'checked'").await;
    create(&fake, "skipped").await.unwrap();
    assert!(server.reviews().is_empty());
    assert_eq!(api_error(create(&fake, "checked").await).code, 403);
    assert_eq!(server.reviews().len(), 1);
    // `request` is bound: the user's name is there.
    let (fake, server) = conditional("Fail", "request.userInfo.username == 'nobody'").await;
    create(&fake, "not-nobody").await.unwrap();
    assert!(server.reviews().is_empty());
}

#[tokio::test]
async fn a_match_condition_that_fails_to_evaluate_follows_the_failure_policy() {
    let broken = "object.spec.missing.field == 1";
    // Fail refuses without calling the webhook (`NewForbidden` with the evaluation error).
    let (fake, server) = conditional("Fail", broken).await;
    let status = api_error(create(&fake, "broken").await);
    assert_eq!((status.code, status.reason.as_str()), (403, "Forbidden"));
    let expected = format!(
        "resourceclaims.resource.k8s.io \"broken\" is forbidden: expression '{broken}' resulted in error: "
    );
    assert!(status.message.starts_with(&expected), "{}", status.message);
    assert!(server.reviews().is_empty());
    // Ignore skips the webhook.
    let (fake, server) = conditional("Ignore", broken).await;
    create(&fake, "ignored").await.unwrap();
    assert!(server.reviews().is_empty());
}

#[tokio::test]
async fn update_and_delete_reviews_carry_the_old_object() {
    let (fake, server) = cluster(
        "check.example.com",
        &["UPDATE", "DELETE"],
        "Fail",
        handler(|_| allowed()),
    )
    .await;
    let api = claims(&fake);
    let mut stored = api
        .create(&PostParams::default(), &claim("c"))
        .await
        .unwrap();
    assert!(server.reviews().is_empty(), "CREATE is not in the rules");
    stored.metadata.labels = Some([("team".to_owned(), "a".to_owned())].into());
    api.replace("c", &PostParams::default(), &stored)
        .await
        .unwrap();
    api.delete("c", &DeleteParams::default()).await.unwrap();
    let reviews = server.reviews();
    let [update, delete] = reviews.as_slice() else {
        panic!("two calls: {reviews:#?}");
    };
    let update = &update["request"];
    assert_eq!(update["operation"], "UPDATE");
    assert_eq!(update["options"]["kind"], "UpdateOptions");
    assert_eq!(update["object"]["metadata"]["labels"]["team"], "a");
    assert!(update["oldObject"]["metadata"].get("labels").is_none());
    let delete = &delete["request"];
    assert_eq!(delete["operation"], "DELETE");
    assert_eq!(delete["options"]["kind"], "DeleteOptions");
    assert_eq!(delete["object"], Value::Null);
    assert_eq!(delete["oldObject"]["metadata"]["labels"]["team"], "a");
    assert!(api.get_opt("c").await.unwrap().is_none());
}

#[tokio::test]
async fn a_webhook_writes_into_the_fake_while_it_is_called() {
    let fake_slot: Arc<std::sync::OnceLock<FakeApi>> = Arc::default();
    let slot = Arc::clone(&fake_slot);
    // As kerf's quota webhook does: a conditional status update of the GpuQuota, then allow.
    let answer: server::Handler = Arc::new(move |review| {
        let fake = slot.get().unwrap().clone();
        Box::pin(async move {
            let quotas = gpu_quotas(&fake);
            let mut quota = quotas.get("team-a").await.unwrap();
            let name = review["request"]["name"].as_str().unwrap().to_owned();
            quota.data["status"] = json!({"admitted": [name]});
            quotas
                .replace_status("team-a", &PostParams::default(), &quota)
                .await
                .unwrap();
            allowed()
        })
    });
    let (fake, _server) = cluster("quota.gpu.kerf.dev", &["CREATE"], "Fail", answer).await;
    fake_slot.set(fake.clone()).unwrap();
    gpu_quotas(&fake)
        .create(
            &PostParams::default(),
            &gpu_quota(json!({"hard": {"gpus": 2}}), json!({})),
        )
        .await
        .unwrap();
    tokio::time::timeout(
        DEADLINE,
        claims(&fake).create(&PostParams::default(), &claim("charged")),
    )
    .await
    .expect("the webhook's write waited for the store's lock")
    .unwrap();
    let quota = gpu_quotas(&fake).get("team-a").await.unwrap();
    assert_eq!(quota.data["status"], json!({"admitted": ["charged"]}));
}

#[tokio::test]
async fn concurrent_creates_reach_the_webhook_together() {
    // Each call waits until both are in the webhook: only a fake that calls webhooks without
    // its lock held lets both in.
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let answer: server::Handler = Arc::new(move |_| {
        let barrier = Arc::clone(&barrier);
        Box::pin(async move {
            barrier.wait().await;
            allowed()
        })
    });
    let (fake, server) = cluster("check.example.com", &["CREATE"], "Fail", answer).await;
    let api = claims(&fake);
    let params = PostParams::default();
    let (one, two) = (claim("one"), claim("two"));
    let both = async { tokio::join!(api.create(&params, &one), api.create(&params, &two)) };
    let (one, two) = tokio::time::timeout(DEADLINE, both)
        .await
        .expect("the second create never reached the webhook");
    one.unwrap();
    two.unwrap();
    assert_eq!(server.reviews().len(), 2);
}

#[tokio::test]
async fn kerfs_manifest_installs_with_a_ca_bundle() {
    let fake = FakeApi::new();
    let names = fake.install_webhook_configurations(KERF_WEBHOOK_MANIFEST, Some("PEM"));
    assert!(
        names.contains(&"kerf-claim-parameters".to_owned()),
        "{names:?}"
    );
    let bundles = fake
        .mutating_webhook_ca_bundles("kerf-claim-parameters")
        .unwrap();
    assert!(bundles.iter().all(|b| b == "PEM"), "{bundles:?}");
}
