//! The fixture of `quota_admission.rs`: a FakeApi with kerf's webhook configurations
//! (`deploy/helm/kerf/templates/webhook.yaml`, called by the fake over HTTPS), kerf-controller's webhook
//! serving them as its ServiceAccount, a kerf Controller class whose claims are charged by
//! their `GpuClaimParameters`, and namespaces with GpuQuotas.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::GpuQuota;
use kerf_controller::Metrics;
use kerf_controller::cache::ProcessCaches;
use kerf_controller::webhook::{self, Certificates, SelfSigned, WebhookConfig};
use kerf_tests::fake_api::{FakeApi, Identity, KERF_NAMESPACE, KERF_WEBHOOK_MANIFEST};
use kerf_tests::fixtures::SliceClaim;
use kerf_tests::wait::until;
use kube::api::{Api, PostParams};
use kube::runtime::reflector::ObjectRef;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

pub use kerf_tests::fixtures::DRIVER;
/// The Controller class whose claims are charged their `GpuClaimParameters`.
pub const SLICE_CLASS: &str = "slice.gpu.kerf.dev";
/// A class of another driver: never charged.
pub const OTHER_CLASS: &str = "other.example.com";
pub const QUOTA_CONFIGURATION: &str = "kerf-gpu-quota";
pub const WAIT: Duration = Duration::from_secs(60);
pub const GI: u64 = 1 << 30;

/// A FakeApi with kerf's webhook served by kerf-controller replicas behind one Service.
pub struct Cluster {
    pub fake: FakeApi,
    /// Stops the webhooks (and the Service's forwarding).
    pub stop: CancellationToken,
    pub replicas: Vec<Replica>,
    /// Where the Service listens.
    pub port: u16,
}

/// One kerf-controller replica's webhook.
pub struct Replica {
    pub registry: Registry,
    /// The process caches the webhook reads.
    pub caches: ProcessCaches,
}

impl Cluster {
    /// The fake, its classes, and one replica serving with its CA in the configurations.
    pub async fn start() -> Self {
        Self::start_replicas(1).await
    }

    /// The fake, its classes, and `count` replicas, each with its own CA in the
    /// configurations; the Service sends each connection to the next replica in turn, as
    /// kube-proxy spreads connections over a Service's endpoints.
    pub async fn start_replicas(count: usize) -> Self {
        let fake = FakeApi::new();
        namespace(&fake, KERF_NAMESPACE);
        fake.install_webhook_configurations(KERF_WEBHOOK_MANIFEST, None);
        fake.insert(device_class(SLICE_CLASS, DRIVER, "Controller"));
        fake.insert(device_class(OTHER_CLASS, "other.example.com", "Scheduler"));
        let stop = CancellationToken::new();
        let mut replicas = Vec::new();
        let mut ports = Vec::new();
        for _ in 0..count {
            let port = free_port();
            replicas.push(start_replica(&fake, port, &stop).await);
            ports.push(port);
        }
        let port = if count == 1 {
            ports[0]
        } else {
            service(ports, &stop).await
        };
        fake.serve_webhook_service(
            KERF_NAMESPACE,
            "kerf-webhook",
            ([127, 0, 0, 1], port).into(),
        );
        until("every replica's CA in kerf-gpu-quota", WAIT, || {
            quota_ca_bundle(&fake).is_some_and(|b| b.matches("BEGIN CERTIFICATE").count() == count)
        })
        .await;
        Cluster {
            fake,
            stop,
            replicas,
            port,
        }
    }

    /// A namespace with the GpuQuota `name` capping `hard` (the webhook's cache has it once
    /// this returns).
    pub async fn quota(&self, namespace_name: &str, name: &str, hard: Value) {
        namespace(&self.fake, namespace_name);
        let quota: GpuQuota = serde_json::from_value(json!({
            "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuQuota",
            "metadata": {"name": name, "namespace": namespace_name},
            "spec": {"hard": hard},
        }))
        .unwrap();
        self.quotas(namespace_name)
            .create(&PostParams::default(), &quota)
            .await
            .unwrap();
        // The webhook charges against its cache: a claim created before the cache has the
        // quota would be admitted uncharged (as on a real cluster, until the recount).
        until("every webhook's cache has the quota", WAIT, || {
            let key = ObjectRef::new(name).within(namespace_name);
            self.replicas
                .iter()
                .all(|r| r.caches.gpu_quotas.get(&key).is_some())
        })
        .await;
    }

    /// GpuQuotas of `namespace_name`, as the cluster admin.
    pub fn quotas(&self, namespace_name: &str) -> Api<GpuQuota> {
        Api::namespaced(self.fake.client(), namespace_name)
    }

    /// ResourceClaims of `namespace_name`, as a user.
    pub fn claims(&self, namespace_name: &str) -> Api<ResourceClaim> {
        Api::namespaced(self.fake.client(), namespace_name)
    }

    /// Quota `name` as stored.
    pub async fn read_quota(&self, namespace_name: &str, name: &str) -> GpuQuota {
        self.quotas(namespace_name).get(name).await.unwrap()
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A replica's webhook on `port`, as kerf-controller's ServiceAccount, serving once this
/// returns.
async fn start_replica(fake: &FakeApi, port: u16, stop: &CancellationToken) -> Replica {
    let mut registry = Registry::default();
    let serving = Arc::new(AtomicBool::new(false));
    let client = fake.client_as(Identity::kerf_controller());
    let (caches, fill) = ProcessCaches::start(&client);
    let fill = tokio::spawn(fill);
    let filling = stop.clone();
    tokio::spawn(async move {
        filling.cancelled().await;
        fill.abort();
    });
    tokio::spawn(webhook::run(webhook::Webhook {
        config: config(port),
        client,
        caches: Some(caches.clone()),
        metrics: Metrics::new(&mut registry),
        serving: Arc::clone(&serving),
        shutdown: stop.clone(),
    }));
    until("the replica serves", WAIT, || {
        serving.load(Ordering::Acquire)
    })
    .await;
    Replica { registry, caches }
}

/// A Service in front of the replicas at `ports`: each connection goes to the next one in
/// turn (TLS passes through; the configurations' caBundle trusts every replica's CA).
async fn service(ports: Vec<u16>, stop: &CancellationToken) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let stop = stop.clone();
    tokio::spawn(async move {
        for next in (0..).map(|i| ports[i % ports.len()]) {
            let accepted = tokio::select! {
                () = stop.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            let Ok((mut inbound, _)) = accepted else {
                continue;
            };
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(("127.0.0.1", next)).await
                {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    port
}

/// The webhook as kerf-controller's self-signed mode runs it on `port`.
fn config(port: u16) -> WebhookConfig {
    WebhookConfig {
        address: ([127, 0, 0, 1], port).into(),
        driver_name: DRIVER.to_owned(),
        field_manager: "kerf-controller".to_owned(),
        certificates: Certificates::SelfSigned(SelfSigned {
            service: "kerf-webhook".to_owned(),
            namespace: KERF_NAMESPACE.to_owned(),
            webhook_configurations: Vec::new(),
            validating_configurations: vec![QUOTA_CONFIGURATION.to_owned()],
            validity: Duration::from_secs(3600),
            renew_before: Duration::from_secs(600),
        }),
    }
}

/// The caBundle of the quota webhook (PEM), once the controller has set it.
fn quota_ca_bundle(fake: &FakeApi) -> Option<String> {
    use base64::Engine as _;
    let path = format!(
        "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{QUOTA_CONFIGURATION}"
    );
    let encoded = fake.get(&path)?["webhooks"][0]["clientConfig"]["caBundle"]
        .as_str()?
        .to_owned();
    let pem = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .ok()?;
    String::from_utf8(pem).ok()
}

/// A namespace object: the webhook's namespaceSelector reads its labels.
pub fn namespace(fake: &FakeApi, name: &str) {
    fake.insert(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name}},
    }));
}

/// A DeviceClass of `driver` with kerf's class parameters for `allocator`.
fn device_class(name: &str, driver: &str, allocator: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"config": [{"opaque": {"driver": driver, "parameters": {
            "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClassParameters",
            "allocator": allocator, "slicing": {"memoryGranularity": "1Gi"},
        }}}]},
    })
}

/// A claim of a slice of the Controller class: `memory_gib` GiB and `compute` percent.
pub fn slice_claim(name: &str, memory_gib: u64, compute: u64) -> ResourceClaim {
    SliceClaim::new(name, SLICE_CLASS, &format!("{memory_gib}Gi"))
        .compute(compute)
        .resource()
        .unwrap()
}

/// A claim of another driver's class.
pub fn other_claim(name: &str) -> ResourceClaim {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": OTHER_CLASS}}]}},
    }))
    .unwrap()
}

/// `kerf_controller_quota_admissions_total{outcome}`, summed over the replicas.
pub fn quota_admissions(cluster: &Cluster, outcome: &str) -> i64 {
    cluster
        .replicas
        .iter()
        .map(|r| replica_admissions(&r.registry, outcome))
        .sum()
}

fn replica_admissions(registry: &Registry, outcome: &str) -> i64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    let series = format!("kerf_controller_quota_admissions_total{{outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&series))
        .map_or(0, |n| n.trim().parse().unwrap())
}
