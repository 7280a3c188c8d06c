//! The default GpuClasses (`--default-gpu-classes`), created by the leader so that one
//! `helm install` (or `kubectl apply -f deploy/kerf.yaml`) installs kerf: the chart renders no
//! GpuClass, which could only be applied once its CRD is established.
//!
//! Create only, never update: a class that exists is the admin's, whatever it says. Each
//! class the controller created (or found existing) is recorded in the ConfigMap
//! [`RECORD_CONFIGMAP`] next to the Lease, and a recorded class is never created again. So a
//! default class the admin deleted stays deleted, while a default that a newer kerf adds is
//! created on upgrade. Recreating deleted classes on every restart (addon-manager's
//! `EnsureExists`) would undo an admin's deliberate deletion at some unrelated later moment,
//! which is the more surprising of the two. Deleting the ConfigMap makes the controller
//! create every missing default again at its next leadership term.
//!
//! The controller waits for the GpuClass API to be served (the CRD established) by listing
//! GpuClasses until that works, which needs no read access to CRDs.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kerf_api::GpuClass;
use kube::api::{ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use crate::backoff::BackoffConfig;
use crate::error::{Error, Result};
use crate::run::ControllerTask;

/// Name of the task in logs.
pub(crate) const CONTROLLER: &str = "default-gpu-classes";

/// The ConfigMap (in [`DefaultClasses::record_namespace`]) whose data keys are the default
/// classes the controller created or found, each with the time it did.
pub const RECORD_CONFIGMAP: &str = "kerf-default-gpu-classes-created";

/// After this many failed attempts in a row, one warning says what keeps failing.
const WARN_AFTER_ATTEMPTS: u32 = 6;

/// The default classes and where to record them.
#[derive(Debug, Clone)]
pub struct DefaultClasses {
    /// The file they were read from, for logs.
    pub source: PathBuf,
    /// The classes, as written in the file.
    pub classes: Vec<GpuClass>,
    /// Namespace of [`RECORD_CONFIGMAP`] (the controller's own).
    pub record_namespace: String,
    /// Delays between attempts while the API server is not ready.
    pub retry: BackoffConfig,
}

impl DefaultClasses {
    /// Reads the classes from `path` (YAML, one GpuClass per document).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming `--default-gpu-classes`, the file and, for a bad class, the
    /// document and field (see [`kerf_api::crd::objects::parse_gpu_classes`]).
    pub fn load(path: &Path, record_namespace: &str) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Config(format!(
                "--default-gpu-classes: reading {}: {e}",
                path.display()
            ))
        })?;
        Self::parse(path, &text, record_namespace)
    }

    /// The classes of `text`, read from `source` (YAML, one GpuClass per document).
    ///
    /// # Errors
    ///
    /// As [`DefaultClasses::load`], but for reading the file.
    pub fn parse(source: &Path, text: &str, record_namespace: &str) -> Result<Self> {
        let origin = source.display().to_string();
        let classes = kerf_api::crd::objects::parse_gpu_classes(&origin, text)
            .map_err(|e| Error::Config(format!("--default-gpu-classes: {e}")))?;
        if record_namespace.is_empty() {
            return Err(Error::Config(
                "--lease-namespace (where the default classes are recorded) must not be empty"
                    .to_owned(),
            ));
        }
        Ok(Self {
            source: source.to_owned(),
            classes,
            record_namespace: record_namespace.to_owned(),
            retry: BackoffConfig {
                base: Duration::from_secs(1),
                max: Duration::from_secs(30),
            },
        })
    }
}

/// What [`ensure`] did with each default class.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Created now.
    pub created: Vec<String>,
    /// Existed already and had not been recorded: left as they are, now recorded.
    pub existing: Vec<String>,
    /// Recorded earlier: created before (and maybe deleted by the admin since); not touched.
    pub recorded: Vec<String>,
    /// Refused by the API server (e.g. invalid); tried again at the next leadership term.
    pub rejected: Vec<String>,
}

/// The task that runs [`ensure`] once per leadership term, then idles until the term ends.
pub fn task(defaults: DefaultClasses) -> ControllerTask {
    ControllerTask::new(CONTROLLER, move |ctx, stop| async move {
        let field_manager = ctx.config.field_manager.clone();
        match ensure(&ctx.client, &defaults, &field_manager, &stop).await {
            Ok(report) => tracing::info!(
                source = %defaults.source.display(),
                created = ?report.created,
                existing = ?report.existing,
                recorded = ?report.recorded,
                rejected = ?report.rejected,
                "default GpuClasses ensured"
            ),
            Err(error) => {
                tracing::error!(%error, source = %defaults.source.display(), "cannot create the default GpuClasses");
            }
        }
        stop.cancelled().await;
        Ok(())
    })
}

/// Creates every default class that neither exists nor is recorded in [`RECORD_CONFIGMAP`],
/// with `field_manager`, once the GpuClass API is served; records what it created or found.
/// Transient failures (the CRD not established yet, server errors, lost connections) are
/// retried with back-off until `stop` is cancelled; then the report so far is returned.
///
/// # Errors
///
/// [`Error::Kube`] when reading or writing the record fails for a reason retrying does not
/// fix (e.g. Forbidden).
pub async fn ensure(
    client: &Client,
    defaults: &DefaultClasses,
    field_manager: &str,
    stop: &CancellationToken,
) -> Result<Report> {
    let mut report = Report::default();
    let classes: Api<GpuClass> = Api::all(client.clone());
    let records: Api<ConfigMap> = Api::namespaced(client.clone(), &defaults.record_namespace);
    let Some(mut recorded) = read_record(&classes, &records, defaults, stop).await? else {
        return Ok(report);
    };
    let before = recorded.len();
    let post = PostParams {
        field_manager: Some(field_manager.to_owned()),
        ..PostParams::default()
    };
    for class in &defaults.classes {
        let name = class.metadata.name.clone().unwrap_or_default();
        if recorded.contains_key(&name) {
            tracing::debug!(class = %name, "default GpuClass created before; not touching it");
            report.recorded.push(name);
            continue;
        }
        let object = default_object(class, &name);
        let what = format!("create default GpuClass {name}");
        let created = retry_create(&what, defaults.retry, stop, || {
            classes.create(&post, &object)
        })
        .await;
        match created {
            None => return Ok(report),
            Some(CreateOutcome::Created) => report.created.push(name.clone()),
            Some(CreateOutcome::Exists) => {
                tracing::debug!(class = %name, "default GpuClass exists already; leaving it as it is");
                report.existing.push(name.clone());
            }
            Some(CreateOutcome::Rejected(error)) => {
                tracing::error!(class = %name, %error, "the API server refused a default GpuClass");
                report.rejected.push(name);
                continue;
            }
        }
        recorded.insert(name, now());
    }
    if recorded.len() > before {
        write_record(&records, recorded, defaults, field_manager, stop).await?;
    }
    Ok(report)
}

/// Waits until the GpuClass API is served, then reads the record of default classes (class
/// name → when it was created or found); `None` when `stop` is cancelled first.
async fn read_record(
    classes: &Api<GpuClass>,
    records: &Api<ConfigMap>,
    defaults: &DefaultClasses,
    stop: &CancellationToken,
) -> Result<Option<std::collections::BTreeMap<String, String>>> {
    let list = ListParams::default().limit(1);
    let served = retry(
        "wait for the GpuClass API (CRD established)",
        defaults.retry,
        stop,
        || classes.list_metadata(&list),
    )
    .await?;
    if served.is_none() {
        return Ok(None);
    }
    let record = retry(
        "read the record of default classes",
        defaults.retry,
        stop,
        || records.get_opt(RECORD_CONFIGMAP),
    )
    .await?;
    Ok(record.map(|record| record.and_then(|r| r.data).unwrap_or_default()))
}

/// The GpuClass to create for the default `class` named `name`: its name, labels,
/// annotations and spec, nothing of the file's other metadata.
fn default_object(class: &GpuClass, name: &str) -> GpuClass {
    GpuClass {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: class.metadata.labels.clone(),
            annotations: class.metadata.annotations.clone(),
            ..ObjectMeta::default()
        },
        spec: class.spec.clone(),
        status: None,
    }
}

/// Applies the record of default classes, `recorded` (class name → when), to
/// [`RECORD_CONFIGMAP`], retrying transient failures until `stop`.
async fn write_record(
    records: &Api<ConfigMap>,
    recorded: std::collections::BTreeMap<String, String>,
    defaults: &DefaultClasses,
    field_manager: &str,
    stop: &CancellationToken,
) -> Result<()> {
    let body = ConfigMap {
        metadata: ObjectMeta {
            name: Some(RECORD_CONFIGMAP.to_owned()),
            namespace: Some(defaults.record_namespace.clone()),
            ..ObjectMeta::default()
        },
        data: Some(recorded),
        ..ConfigMap::default()
    };
    let params = PatchParams::apply(field_manager).force();
    let patch = Patch::Apply(&body);
    retry("record the default classes", defaults.retry, stop, || {
        records.patch(RECORD_CONFIGMAP, &params, &patch)
    })
    .await?;
    Ok(())
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// Whether an error goes away by itself: the resource not served yet (404 while the CRD is
/// being established), conflicts, throttling, server errors, transport failures.
fn is_transient(error: &kube::Error) -> bool {
    match error {
        kube::Error::Api(status) => {
            status.is_not_found() || status.code == 409 || status.code == 429 || status.code >= 500
        }
        _ => true,
    }
}

/// Runs `attempt` until it succeeds, fails for good (the error) or `stop` is cancelled
/// (`Ok(None)`). Failures are debug logs, with one warning once they have lasted
/// [`WARN_AFTER_ATTEMPTS`] attempts and one info line when it then succeeds.
async fn retry<T, F, Fut>(
    what: &str,
    backoff: BackoffConfig,
    stop: &CancellationToken,
    mut attempt: F,
) -> Result<Option<T>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = kube::Result<T>>,
{
    let mut failures = 0u32;
    loop {
        match attempt().await {
            Ok(value) => {
                if failures >= WARN_AFTER_ATTEMPTS {
                    tracing::info!(what, attempts = failures + 1, "succeeded after retries");
                }
                return Ok(Some(value));
            }
            Err(error) if is_transient(&error) => {
                failures += 1;
                if failures == WARN_AFTER_ATTEMPTS {
                    tracing::warn!(what, %error, attempts = failures, "still failing; retrying with back-off");
                } else {
                    tracing::debug!(what, %error, attempts = failures, "failed; retrying");
                }
            }
            Err(error) => return Err(error.into()),
        }
        tokio::select! {
            () = stop.cancelled() => return Ok(None),
            () = tokio::time::sleep(backoff.delay(failures)) => {}
        }
    }
}

enum CreateOutcome {
    Created,
    Exists,
    Rejected(kube::Error),
}

/// [`retry`] for a create: AlreadyExists is an answer, not a failure, and a permanent error
/// only rejects this class.
async fn retry_create<F, Fut>(
    what: &str,
    backoff: BackoffConfig,
    stop: &CancellationToken,
    mut attempt: F,
) -> Option<CreateOutcome>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = kube::Result<GpuClass>>,
{
    let outcome = retry(what, backoff, stop, || {
        let created = attempt();
        async move {
            match created.await {
                Ok(_) => Ok(CreateOutcome::Created),
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(CreateOutcome::Exists),
                Err(error) if is_transient(&error) => Err(error),
                Err(error) => Ok(CreateOutcome::Rejected(error)),
            }
        }
    })
    .await;
    // The closure turns every permanent error into Rejected, so retry cannot fail.
    outcome.ok().flatten()
}
