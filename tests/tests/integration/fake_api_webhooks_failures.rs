//! FakeApi's webhook calls that fail, and what the failure policy makes of them
//! (kubernetes/kubernetes `staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/validating/dispatcher.go`,
//! `Dispatch`: `ErrCallingWebhook` fails the write with an internal error under
//! `failurePolicy: Fail` and is ignored under `Ignore`).

use crate::fake_api_webhooks::{fixture, server};

use std::sync::Arc;
use std::time::Duration;

use fixture::{
    HOST, NAMESPACE, SERVICE, api_error, claim, claims, cluster, configure, namespace, webhook,
};
use kerf_tests::fake_api::FakeApi;
use kube::api::PostParams;
use serde_json::json;
use server::{allowed, handler};

#[tokio::test]
async fn failure_policy_decides_while_the_webhook_is_down() {
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let fake = FakeApi::new();
    namespace(&fake, "team-a", json!({}));
    configure(
        &fake,
        "strict",
        vec![webhook("strict.example.com", &["CREATE"], "Fail", "")],
    );
    fake.serve_webhook_service(NAMESPACE, SERVICE, closed);
    let status = api_error(
        claims(&fake)
            .create(&PostParams::default(), &claim("refused"))
            .await,
    );
    assert_eq!(
        (status.code, status.reason.as_str()),
        (500, "InternalError")
    );
    let prefix = "Internal error occurred: failed calling webhook \"strict.example.com\": failed to call webhook: Post \"https://validator.webhooks.svc:443/validate?timeout=5s\": ";
    assert!(status.message.starts_with(prefix), "{}", status.message);

    let fake = FakeApi::new();
    namespace(&fake, "team-a", json!({}));
    configure(
        &fake,
        "lenient",
        vec![webhook("lenient.example.com", &["CREATE"], "Ignore", "")],
    );
    fake.serve_webhook_service(NAMESPACE, SERVICE, closed);
    claims(&fake)
        .create(&PostParams::default(), &claim("admitted"))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_certificate_the_ca_bundle_does_not_sign_fails_the_call() {
    let (fake, _server) = cluster(
        "check.example.com",
        &["CREATE"],
        "Fail",
        handler(|_| allowed()),
    )
    .await;
    let other = server::start(&[HOST], handler(|_| allowed())).await;
    // The configuration trusts `other`'s CA, but the Service still points at the first server.
    configure(
        &fake,
        "claims",
        vec![webhook(
            "check.example.com",
            &["CREATE"],
            "Fail",
            &other.ca_bundle(),
        )],
    );
    let status = api_error(
        claims(&fake)
            .create(&PostParams::default(), &claim("untrusted"))
            .await,
    );
    assert_eq!(status.code, 500, "{}", status.message);
    assert!(other.reviews().is_empty());
}

#[tokio::test]
async fn a_webhook_slower_than_its_timeout_fails_the_call() {
    let slow: server::Handler = Arc::new(|_| {
        Box::pin(async {
            tokio::time::sleep(Duration::from_secs(3)).await;
            allowed()
        })
    });
    let (fake, server) = cluster("slow.example.com", &["CREATE"], "Fail", slow).await;
    let mut hasty = webhook("slow.example.com", &["CREATE"], "Fail", &server.ca_bundle());
    hasty["timeoutSeconds"] = json!(1);
    configure(&fake, "claims", vec![hasty.clone()]);
    let status = api_error(
        claims(&fake)
            .create(&PostParams::default(), &claim("late"))
            .await,
    );
    assert_eq!(
        (status.code, status.message.as_str()),
        (
            500,
            "Internal error occurred: failed calling webhook \"slow.example.com\": failed to call webhook: Post \"https://validator.webhooks.svc:443/validate?timeout=1s\": context deadline exceeded"
        )
    );
    hasty["failurePolicy"] = json!("Ignore");
    configure(&fake, "claims", vec![hasty]);
    claims(&fake)
        .create(&PostParams::default(), &claim("late-but-admitted"))
        .await
        .unwrap();
}

#[tokio::test]
async fn an_answer_for_another_review_is_an_invalid_response() {
    let (fake, _server) = cluster(
        "confused.example.com",
        &["CREATE"],
        "Fail",
        handler(|_| json!({"allowed": true, "uid": "not-the-request"})),
    )
    .await;
    let status = api_error(
        claims(&fake)
            .create(&PostParams::default(), &claim("c"))
            .await,
    );
    assert_eq!(status.code, 500);
    let expected = "Internal error occurred: failed calling webhook \"confused.example.com\": received invalid webhook response: expected response.uid=";
    assert!(status.message.starts_with(expected), "{}", status.message);
}
