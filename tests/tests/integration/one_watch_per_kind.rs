//! kerf-controller as `main` runs it (the controllers and the admission webhook) lists and
//! watches each kind once: the webhook and the leader's reconcilers read the same caches of
//! ResourceClaims and DeviceClasses (`kerf_controller::cache::ProcessCaches`), where they
//! used to hold three and two copies.

use std::time::Duration;

use kerf_controller::webhook::{Certificates, SelfSigned, WebhookConfig};
use kerf_controller::{Config, ControllerConfig, Process};
use kerf_tests::fake_api::{FakeApi, Identity, RequestCounts};
use kerf_tests::wait::eventually;
use tokio_util::sync::CancellationToken;

use kerf_tests::fixtures::DRIVER;
const WAIT: Duration = Duration::from_secs(20);

fn webhook() -> WebhookConfig {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    WebhookConfig {
        address: ([127, 0, 0, 1], port).into(),
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
    }
}

#[tokio::test]
async fn the_webhook_and_the_reconcilers_list_each_kind_once() {
    let fake = FakeApi::new();
    let config = Config {
        controller: ControllerConfig::new(DRIVER),
        leader_election: None,
        metrics_address: None,
    };
    let stop = CancellationToken::new();
    let client = fake.client_as(Identity::kerf_controller());
    let process = Process {
        webhook: Some(webhook()),
        ..Process::new(config, client, stop.clone())
    };
    let run = tokio::spawn(process.run());
    let user = Identity::kerf_controller().username;
    let lists = |resource: &str| RequestCounts::of(&fake.requests()).get(&user, "list", resource);
    // Every watch has started once these have: the webhook's templates, the term's slices and
    // the claim controller's pods and nodes, which start after the shared caches.
    let started = [
        "resource.k8s.io/resourceclaimtemplates",
        "resource.k8s.io/resourceslices",
        "pods",
        "nodes",
    ];
    eventually("every watch listed", WAIT, || {
        let all = started.iter().all(|resource| lists(resource) > 0);
        std::future::ready(all.then_some(()))
    })
    .await;
    for resource in [
        "resource.k8s.io/resourceclaims",
        "resource.k8s.io/deviceclasses",
    ]
    .into_iter()
    .chain(started)
    {
        assert_eq!(lists(resource), 1, "lists of {resource}");
    }
    stop.cancel();
    run.await.unwrap().unwrap();
}
