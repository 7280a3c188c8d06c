//! The mutating admission webhook, with two jobs:
//! - pods with Controller-class claims get the scheduling gate [`SCHEDULING_GATE`] so they wait
//!   until kerf-controller has allocated their claims (`failurePolicy: Ignore`: whenever it
//!   cannot answer, pods are admitted unchanged, as before the webhook existed);
//! - ResourceClaims and ResourceClaimTemplates being created with a config for kerf's driver
//!   are checked (invalid `GpuClaimParameters` are denied, naming field and value) and their
//!   parameters rewritten in the form kube-apiserver's later re-encodings keep byte for byte
//!   (`failurePolicy: Fail`, scoped by `matchConditions` to objects with a kerf config; see
//!   `deploy/helm/kerf/templates/webhook.yaml`);
//! - as the validating webhook `quota.gpu.kerf.dev` (path [`QUOTA_PATH`]), ResourceClaims
//!   being created are charged against their namespace's GpuQuotas and refused over quota
//!   (`failurePolicy: Ignore`: the controller's recount repairs the usage of claims admitted
//!   while no replica answered).
//!
//! - [`decide`](mod@decide): the pure pod decision and its JSONPatch;
//! - [`claims`]: the pure claim decision and its JSONPatch;
//! - [`quota`]: the GpuQuota check of a claim and the write of its charge;
//! - [`canonical`]: the JSON form kube-apiserver keeps;
//! - [`review`]: AdmissionReview v1 in, AdmissionReview v1 out, routed by resource;
//! - [`server`]: HTTPS (rustls, hyper) with a certificate swapped without a restart;
//! - [`tls`]: a self-made CA and serving certificate, or PEM files (cert-manager);
//! - [`ca_bundle`]: keeps this replica's CA in the webhook configurations;
//! - [`lookup`]: the watch caches the pod decisions read, on every replica (the claims,
//!   DeviceClasses, GpuClasses and GpuQuotas are the process's, shared with the leader's
//!   reconcilers).

pub mod ca_bundle;
pub mod canonical;
pub mod claims;
pub mod decide;
pub mod lookup;
pub mod outcome;
pub mod quota;
pub mod review;
pub mod server;
pub mod tls;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

pub use claims::decide_claim;
pub use decide::{ClaimLookup, decide};
pub use kerf_api::controller_claims::SCHEDULING_GATE;
pub use lookup::WebhookCaches;
pub use outcome::{ClaimDecision, ClaimResource, PodDecision, Skip};
pub use quota::{QUOTA_PATH, QuotaAdmission};
pub use tls::CertResolver;

use crate::cache::ProcessCaches;
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// How often the self-signed mode checks that its CA is still in the webhook configuration
/// (someone may have re-applied it), and the longest wait between two retries.
const BUNDLE_RECHECK: Duration = Duration::from_secs(60);
/// How often the cert-manager mode looks at the certificate files.
const FILE_POLL: Duration = Duration::from_secs(10);

/// Everything the webhook is configured with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookConfig {
    /// Where to listen for HTTPS.
    pub address: SocketAddr,
    /// The DRA driver whose classes count and whose claim configs are checked.
    pub driver_name: String,
    /// The field manager of the caBundle patch.
    pub field_manager: String,
    /// Where the serving certificate comes from.
    pub certificates: Certificates,
}

/// Where the serving certificate comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Certificates {
    /// Made by the controller, signed by a CA of its own, rotated before expiry; the CA goes
    /// into the `caBundle` of every webhook of the MutatingWebhookConfigurations.
    SelfSigned(SelfSigned),
    /// `tls.crt` and `tls.key` in a directory (a Secret cert-manager writes and whose CA its
    /// CA injector puts into the `caBundle`), read again when they change.
    Files {
        /// The directory.
        dir: PathBuf,
        /// How often to look for changes.
        poll: Duration,
    },
}

impl Certificates {
    /// Files in `dir`, polled every 10 s.
    pub fn files(dir: impl Into<PathBuf>) -> Self {
        Certificates::Files {
            dir: dir.into(),
            poll: FILE_POLL,
        }
    }
}

/// The self-signed mode's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelfSigned {
    /// The Service in front of the webhook: the certificate is for `<service>.<namespace>.svc`.
    pub service: String,
    /// The Service's namespace.
    pub namespace: String,
    /// The MutatingWebhookConfigurations whose `caBundle`s to keep (the pod webhook's and the
    /// claim webhooks').
    pub webhook_configurations: Vec<String>,
    /// The ValidatingWebhookConfigurations whose `caBundle`s to keep (the quota webhook's).
    pub validating_configurations: Vec<String>,
    /// How long each certificate is valid.
    pub validity: Duration,
    /// How long before expiry a new certificate replaces it.
    pub renew_before: Duration,
}

impl SelfSigned {
    /// Checks that the certificate is renewed before it expires.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when `renew_before` is not shorter than `validity`.
    pub fn validate(&self) -> Result<()> {
        if self.validity.is_zero() || self.renew_before >= self.validity {
            return Err(Error::Config(format!(
                "need 0 < --webhook-renew-before ({:?}) < --webhook-cert-validity ({:?})",
                self.renew_before, self.validity
            )));
        }
        Ok(())
    }
}

/// What the webhook runs with: one value for [`run`].
pub struct Webhook {
    /// Address, driver, field manager and certificates.
    pub config: WebhookConfig,
    /// The API server, for the caches and the `caBundle` patches.
    pub client: Client,
    /// The process's caches of claims and DeviceClasses, shared with the leader's
    /// reconcilers (filled by the caller); `None` starts the webhook's own.
    pub caches: Option<ProcessCaches>,
    /// Where the reviews are counted.
    pub metrics: Metrics,
    /// True while connections are accepted: the replica's readiness includes it, so that the
    /// Service never sends a review to a replica that cannot answer (claims with a kerf
    /// config would be refused there: `failurePolicy: Fail`).
    pub serving: Arc<AtomicBool>,
    /// Stops the webhook.
    pub shutdown: CancellationToken,
}

impl std::fmt::Debug for Webhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhook")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Serves the webhook until `webhook.shutdown` is cancelled: starts the caches it lacks,
/// makes or loads the certificate, binds `config.address` once the caches hold their first
/// lists, and keeps the certificate fresh.
///
/// # Errors
///
/// - [`Error::Config`] when the self-signed settings are inconsistent;
/// - [`Error::Tls`] / [`Error::CertFile`] when no first certificate can be had;
/// - [`Error::Webhook`] when the address cannot be bound or accepting fails for good;
/// - [`Error::ControllerStopped`] when the caches stop before their first list.
pub async fn run(webhook: Webhook) -> Result<()> {
    let (process, process_fill) = if let Some(process) = &webhook.caches {
        (process.clone(), None)
    } else {
        let (process, fill) = ProcessCaches::start(&webhook.client);
        (process, Some(tokio::spawn(fill)))
    };
    let (caches, fill) =
        WebhookCaches::start(&process, &webhook.client, &webhook.config.driver_name);
    let fill = tokio::spawn(fill);
    let quota = QuotaAdmission::new(
        webhook.client.clone(),
        process.clone(),
        &webhook.config.driver_name,
    );
    let result = serve_on(webhook, Arc::new(caches), Arc::new(quota)).await;
    fill.abort();
    if let Some(fill) = process_fill {
        fill.abort();
    }
    result
}

/// [`run`] once the caches are started: serves from `caches` and `quota` once the caches are
/// ready.
async fn serve_on(
    webhook: Webhook,
    caches: Arc<WebhookCaches>,
    quota: Arc<QuotaAdmission>,
) -> Result<()> {
    let Webhook {
        config,
        client,
        metrics,
        serving,
        shutdown,
        ..
    } = webhook;
    let address = config.address.to_string();
    metrics.set_webhook_serving(&address, false);
    let (resolver, keeper) = keep_certificate(&config, client, &shutdown)?;
    tokio::select! {
        () = shutdown.cancelled() => {
            keeper.abort();
            return Ok(());
        }
        ready = caches.wait_ready() => ready?,
    }
    let listener = tokio::net::TcpListener::bind(config.address)
        .await
        .map_err(Error::Webhook)?;
    let tls = tls::server_config(resolver)?;
    tracing::info!(address = %config.address, "admission webhook serving");
    serving.store(true, Ordering::Release);
    metrics.set_webhook_serving(&address, true);
    let reviewers = server::Reviewers {
        lookup: caches,
        driver: Arc::from(config.driver_name.as_str()),
        quota,
    };
    let result = server::serve(listener, tls, reviewers, metrics.clone(), shutdown).await;
    serving.store(false, Ordering::Release);
    metrics.set_webhook_serving(&address, false);
    keeper.abort();
    result
}

/// The first certificate, served by the returned resolver, and the task that keeps it fresh
/// as `config.certificates` says.
fn keep_certificate(
    config: &WebhookConfig,
    client: Client,
    shutdown: &CancellationToken,
) -> Result<(Arc<CertResolver>, tokio::task::JoinHandle<()>)> {
    match &config.certificates {
        Certificates::SelfSigned(settings) => {
            settings.validate()?;
            let names = tls::service_names(&settings.service, &settings.namespace);
            let issued = tls::issue(&names, settings.validity)?;
            let resolver = CertResolver::new(issued.key.clone());
            let keeper = keep_self_signed(
                client,
                settings.clone(),
                config.field_manager.clone(),
                resolver.clone(),
                issued,
                shutdown.clone(),
            );
            Ok((resolver, tokio::spawn(keeper)))
        }
        Certificates::Files { dir, poll } => {
            let (cert, key) = tls::file_paths(dir);
            let resolver = CertResolver::new(tls::load_files(&cert, &key)?);
            let keeper = keep_files(cert, key, *poll, resolver.clone(), shutdown.clone());
            Ok((resolver, tokio::spawn(keeper)))
        }
    }
}

/// Self-signed mode: keeps `current`'s CA in the bundle and, `renew_before` ahead of its
/// expiry, issues a new CA and certificate, adds the CA to the bundle and only then serves
/// the new certificate (the API server must trust it first). If the bundle cannot be written
/// until the old certificate expires, the new one is served anyway.
async fn keep_self_signed(
    client: Client,
    settings: SelfSigned,
    field_manager: String,
    resolver: Arc<CertResolver>,
    mut current: tls::Issued,
    shutdown: CancellationToken,
) {
    let names = tls::service_names(&settings.service, &settings.namespace);
    let retry = (settings.validity / 10).clamp(Duration::from_millis(50), BUNDLE_RECHECK);
    let mut pending: Option<tls::Issued> = None;
    loop {
        let candidate = pending.as_ref().unwrap_or(&current);
        let bundle_ok = ensure_both(&client, &settings, &candidate.ca_pem, &field_manager).await;
        if let Some(next) = pending.take() {
            if bundle_ok || SystemTime::now() >= current.not_after {
                resolver.swap(next.key.clone());
                tracing::info!(not_after = ?next.not_after, "webhook: serving a new certificate");
                current = next;
            } else {
                pending = Some(next);
            }
        }
        let renew_at = current
            .not_after
            .checked_sub(settings.renew_before)
            .unwrap_or(current.not_after);
        let until_renewal = renew_at
            .duration_since(SystemTime::now())
            .unwrap_or_default();
        let wait = if bundle_ok && pending.is_none() {
            until_renewal.min(BUNDLE_RECHECK)
        } else {
            retry
        };
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
        if pending.is_none() && SystemTime::now() >= renew_at {
            match tls::issue(&names, settings.validity) {
                Ok(next) => pending = Some(next),
                Err(error) => tracing::error!(%error, "webhook: cannot issue a new certificate"),
            }
        }
    }
}

/// Puts `ca` into the `caBundle` of every webhook of the mutating and the validating
/// configurations of `settings`; true when each one trusts it now.
async fn ensure_both(
    client: &Client,
    settings: &SelfSigned,
    ca: &str,
    field_manager: &str,
) -> bool {
    let mutating = Api::<MutatingWebhookConfiguration>::all(client.clone());
    let validating = Api::<ValidatingWebhookConfiguration>::all(client.clone());
    let names = &settings.webhook_configurations;
    let mutating_ok = ensure_all(&mutating, names, ca, field_manager).await;
    let names = &settings.validating_configurations;
    let validating_ok = ensure_all(&validating, names, ca, field_manager).await;
    mutating_ok && validating_ok
}

/// Puts `ca` into the `caBundle` of every webhook of each configuration in `names`; true when
/// each one trusts it now. A configuration that does not exist counts as done (it has no
/// webhook that could call this replica; one created later gets the CA on the next round,
/// at most [`BUNDLE_RECHECK`] later), so a removed claim configuration cannot hold up the
/// rotation of the pod webhook's certificate; it is logged every round.
async fn ensure_all<K: ca_bundle::WebhookConfiguration>(
    api: &Api<K>,
    names: &[String],
    ca: &str,
    field_manager: &str,
) -> bool {
    let mut all = true;
    for name in names {
        match ca_bundle::ensure_ca(api, name, ca, field_manager).await {
            Ok(true) => tracing::info!(configuration = %name, "webhook: CA added to caBundle"),
            Ok(false) => {}
            Err(Error::Kube(kube::Error::Api(status))) if status.is_not_found() => {
                tracing::warn!(configuration = %name, "webhook: configuration not found; its webhooks cannot call this replica (empty the flag naming it if it is gone on purpose)");
            }
            Err(error) => {
                tracing::warn!(%error, configuration = %name, "webhook: cannot update caBundle");
                all = false;
            }
        }
    }
    all
}

/// Cert-manager mode: reloads the files when their modification time or size changes; a
/// reload that fails keeps the certificate served so far.
async fn keep_files(
    cert: PathBuf,
    key: PathBuf,
    poll: Duration,
    resolver: Arc<CertResolver>,
    shutdown: CancellationToken,
) {
    let stamp = |cert: &PathBuf, key: &PathBuf| {
        let one = |p: &PathBuf| {
            std::fs::metadata(p)
                .ok()
                .map(|m| (m.modified().ok(), m.len()))
        };
        (one(cert), one(key))
    };
    let mut seen = stamp(&cert, &key);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(poll) => {}
        }
        let now = stamp(&cert, &key);
        if now == seen {
            continue;
        }
        match tls::load_files(&cert, &key) {
            Ok(loaded) => {
                resolver.swap(loaded);
                seen = now;
                tracing::info!(path = %cert.display(), "webhook: certificate files reloaded");
            }
            Err(error) => {
                tracing::warn!(%error, "webhook: cannot reload the certificate files; keeping the old ones");
            }
        }
    }
}
