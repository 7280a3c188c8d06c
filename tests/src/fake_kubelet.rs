//! A fake kubelet that behaves like the DRA manager of kubelet 1.34–1.37, built on the
//! kubelet-side client in [`kerf_proto::client`] (the project's own protos, nothing else).
//!
//! What it does, as the real one does (reference/dra-api.md §2 and §6):
//! - watches the plugin registry directory for `*-reg.sock` files (polling; the kubelet uses
//!   inotify) and registers every new socket: `GetInfo`, the first of the plugin's
//!   `supported_versions` it knows, `NotifyRegistrationStatus`. A socket that is replaced (a
//!   restarted plugin binds a new one) is registered again; one that disappears is
//!   deregistered;
//! - keeps every registered instance of a driver, as kubelet 1.33+ does for rolling updates
//!   (kubernetes `pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`: `DRAPluginManager.add`
//!   appends an instance per endpoint, `get` picks the most recently registered one,
//!   `remove` drops only the instance whose socket went away, so an old instance's
//!   deregistration leaves the driver with the newer one; 1.33's `plugins_store.go`
//!   `Store.add/get/remove` do the same). Before 1.33, `RegistrationHandler.DeRegisterPlugin`
//!   (`registration.go`) deleted the driver by name whatever instance left, which is why
//!   per-instance socket names need kubelet 1.33+. Upstream's `get` also prefers an instance
//!   whose gRPC connection is up (`monitoredPlugin.HandleConn`); the fake does not track
//!   connections: a plugin that stops removes its registration socket, and that deregisters
//!   it here;
//! - sends the `:authority` the kubelet sends: registration calls carry the registration
//!   socket's path (the plugin watcher's `dial` in kubernetes
//!   `pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go` dials the bare
//!   path with grpc-go and no `WithAuthority`), DRA calls `localhost` (the DRA plugin client
//!   in `pkg/kubelet/cm/dra/plugin` dials `unix:<endpoint>`);
//! - prepares a pod's claims with one batched `NodePrepareResources` call per driver,
//!   skipping claims already prepared for another pod, and unprepares a pod's claims with one
//!   batched `NodeUnprepareResources` call per driver once no other pod references them;
//! - applies the kubelet's rules to every answer: an RPC error voids the whole response,
//!   every claim must have an entry and no other claim may have one, and a per-claim error
//!   fails the pod. A failed pod is retried (the kubelet's next pod sync) with all of its
//!   claims that are not prepared yet, a bounded number of times with exponential backoff.
//!
//! Every call is logged ([`FakeKubelet::calls`]) so tests can check how often a claim was
//! sent.
//!
//! With its `ResourceHealthStatus` gate on ([`KubeletConfig::health_retry`] is `Some`), it
//! also watches each registered plugin's health as upstream kubelet does (module
//! [`health`](self::health)).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use kerf_proto::client::{
    Claim, ClientError, DraVersion, KNOWN_SERVICES, KubeletClient, PreparedDevice, RegisteredPlugin,
};

mod health;

pub use self::health::{DeviceHealthView, HealthCache};

/// Why the fake kubelet failed a pod or a wait.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    /// A call to a plugin failed by the kubelet's rules, or a claim was not prepared.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// No plugin of this driver is registered.
    #[error("driver {0} is not registered")]
    NotRegistered(String),
    /// Fewer registration decisions than awaited were made in time.
    #[error("no registration decision number {count} within {timeout:?}")]
    NoRegistration {
        /// The decision awaited (1-based).
        count: usize,
        /// How long it was awaited.
        timeout: Duration,
    },
}

/// How a failed pod is retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included; at least one is made.
    pub attempts: u32,
    /// Wait after the first failure; doubled after each further one.
    pub initial_backoff: Duration,
    /// Longest wait between two attempts.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    /// Ten attempts, 20 ms to 500 ms apart: a test's worth of the kubelet's pod sync retries.
    fn default() -> Self {
        RetryPolicy {
            attempts: 10,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(500),
        }
    }
}

impl RetryPolicy {
    /// The wait after failed attempt number `failed` (1 for the first).
    pub fn backoff(&self, failed: u32) -> Duration {
        let factor = 2u32.saturating_pow(failed.saturating_sub(1));
        self.initial_backoff
            .saturating_mul(factor)
            .min(self.max_backoff)
    }
}

/// Settings of a [`FakeKubelet`].
#[derive(Debug, Clone)]
pub struct KubeletConfig {
    /// Directory watched for registration sockets (`/var/lib/kubelet/plugins_registry`).
    pub registry_dir: PathBuf,
    /// DRA services this kubelet knows, e.g. [`KNOWN_SERVICES`].
    pub known_services: Vec<String>,
    /// How often the registry directory is scanned.
    pub poll_interval: Duration,
    /// Limit of one gRPC call (the kubelet's is 45 s for DRA calls).
    pub call_timeout: Duration,
    /// Retries of a failed pod.
    pub retry: RetryPolicy,
    /// Wait before opening a plugin's health stream again after it ended (the kubelet's 5 s),
    /// or `None` for a kubelet whose `ResourceHealthStatus` gate is off.
    pub health_retry: Option<Duration>,
}

impl KubeletConfig {
    /// The kubelet-side client of this configuration.
    fn client(&self) -> KubeletClient {
        KubeletClient::new()
            .knowing(&self.known_services)
            .call_timeout(Some(self.call_timeout))
    }

    /// A 1.34+ kubelet (v1 and v1beta1) watching `registry_dir` every 20 ms, with the
    /// kubelet's 45 s call timeout and the default retries.
    pub fn new(registry_dir: impl Into<PathBuf>) -> Self {
        KubeletConfig {
            registry_dir: registry_dir.into(),
            known_services: KNOWN_SERVICES.iter().map(|s| (*s).to_owned()).collect(),
            poll_interval: Duration::from_millis(20),
            call_timeout: kerf_proto::client::KUBELET_CALL_TIMEOUT,
            retry: RetryPolicy::default(),
            health_retry: Some(health::STREAM_RETRY),
        }
    }

    /// The same kubelet knowing only `services`, e.g. `["v1beta1.DRAPlugin"]`.
    #[must_use]
    pub fn knowing(mut self, services: &[&str]) -> Self {
        self.known_services = services.iter().map(|s| (*s).to_owned()).collect();
        self
    }
}

/// One of a pod's claims, with the driver its allocation names (the kubelet reads it from
/// the claim's `status.allocation`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodClaim {
    /// Driver that prepares the claim.
    pub driver: String,
    /// The claim.
    pub claim: Claim,
}

/// A pod as the kubelet's DRA manager sees it: a UID and claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    /// Pod UID.
    pub uid: String,
    /// Its resource claims.
    pub claims: Vec<PodClaim>,
}

impl Pod {
    /// A pod without claims.
    pub fn new(uid: &str) -> Self {
        Pod {
            uid: uid.to_owned(),
            claims: Vec::new(),
        }
    }

    /// Adds a claim prepared by `driver`.
    #[must_use]
    pub fn with_claim(mut self, driver: &str, claim: Claim) -> Self {
        self.claims.push(PodClaim {
            driver: driver.to_owned(),
            claim,
        });
        self
    }
}

/// The devices of a prepared pod, by claim UID.
pub type PreparedPod = BTreeMap<String, Vec<PreparedDevice>>;

/// The CDI device IDs of a prepared pod's claims, in claim UID order: what the kubelet
/// passes to the runtime in CRI's `CDIDevices`.
pub fn cdi_ids(prepared: &PreparedPod) -> Vec<String> {
    prepared
        .values()
        .flatten()
        .flat_map(|d| d.cdi_device_ids.iter().cloned())
        .collect()
}

/// A DRA call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `NodePrepareResources`.
    Prepare,
    /// `NodeUnprepareResources`.
    Unprepare,
}

/// One DRA call the kubelet made (or tried to make).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// Which RPC.
    pub method: Method,
    /// Driver called.
    pub driver: String,
    /// UIDs of the claims in the batch, in request order.
    pub claims: Vec<String>,
    /// `Err` with the kubelet's reason when the call failed by its rules.
    pub outcome: Result<(), String>,
}

/// One registration attempt that reached a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// Registration socket.
    pub socket: PathBuf,
    /// Driver name from `GetInfo` (empty when the call itself failed).
    pub driver: String,
    /// The chosen API version, or why registration was refused.
    pub result: Result<DraVersion, String>,
}

/// Identity of a socket file: a plugin that restarts binds a new file at the same path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SocketId {
    inode: u64,
    ctime: i64,
    ctime_nsec: i64,
}

/// One registered instance of a driver: the socket it registered through, and its client.
type Instance = (PathBuf, Arc<RegisteredPlugin>);

struct ClaimInfo {
    claim: Claim,
    driver: String,
    pods: BTreeSet<String>,
    /// `Some` once prepared.
    devices: Option<Vec<PreparedDevice>>,
}

struct KubeletInner {
    config: KubeletConfig,
    client: KubeletClient,
    /// Registered instances by driver name, oldest first, with the socket each registered
    /// through.
    plugins: Mutex<HashMap<String, Vec<Instance>>>,
    registrations: Mutex<Vec<Registration>>,
    registration_count: watch::Sender<usize>,
    claims: Mutex<HashMap<String, ClaimInfo>>,
    calls: Mutex<Vec<Call>>,
    health: HealthCache,
    health_watchers: Mutex<Vec<JoinHandle<()>>>,
}

/// The fake kubelet. Dropping it stops the registry watcher.
pub struct FakeKubelet {
    inner: Arc<KubeletInner>,
    watcher: JoinHandle<()>,
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        self.watcher.abort();
        for watcher in lock(&self.inner.health_watchers).drain(..) {
            watcher.abort();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Only this file takes these locks, never across an await; a panic while holding one is a
    // failing test already.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl FakeKubelet {
    /// Starts watching the registry directory. Must be called inside a Tokio runtime.
    pub fn start(config: KubeletConfig) -> Self {
        let (registration_count, _) = watch::channel(0);
        let inner = Arc::new(KubeletInner {
            client: config.client(),
            config,
            plugins: Mutex::new(HashMap::new()),
            registrations: Mutex::new(Vec::new()),
            registration_count,
            claims: Mutex::new(HashMap::new()),
            calls: Mutex::new(Vec::new()),
            health: HealthCache::default(),
            health_watchers: Mutex::new(Vec::new()),
        });
        let watcher = tokio::spawn(watch_registry(Arc::clone(&inner)));
        FakeKubelet { inner, watcher }
    }

    /// Every registration decision so far, oldest first.
    pub fn registrations(&self) -> Vec<Registration> {
        lock(&self.inner.registrations).clone()
    }

    /// Waits until at least `count` registration decisions were made and returns the
    /// `count`-th (1-based).
    ///
    /// # Errors
    /// [`KubeletError::NoRegistration`] when that does not happen within `timeout`.
    pub async fn wait_for_registration(
        &self,
        count: usize,
        timeout: Duration,
    ) -> Result<Registration, KubeletError> {
        let missing = || KubeletError::NoRegistration { count, timeout };
        let mut rx = self.inner.registration_count.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|n| *n >= count))
            .await
            .map_err(|_| missing())?
            .map_err(|_| missing())?;
        let registrations = lock(&self.inner.registrations);
        registrations
            .get(count.saturating_sub(1))
            .cloned()
            .ok_or_else(missing)
    }

    /// The instance of `driver` that DRA calls go to: the most recently registered one.
    pub fn plugin(&self, driver: &str) -> Option<Arc<RegisteredPlugin>> {
        lock(&self.inner.plugins)
            .get(driver)
            .and_then(|instances| instances.last())
            .map(|(_, p)| Arc::clone(p))
    }

    /// The registration sockets of `driver`'s registered instances, oldest first.
    pub fn instances(&self, driver: &str) -> Vec<PathBuf> {
        lock(&self.inner.plugins)
            .get(driver)
            .map(|instances| instances.iter().map(|(s, _)| s.clone()).collect())
            .unwrap_or_default()
    }

    /// The health the kubelet knows of its plugins' devices.
    pub fn health(&self) -> &HealthCache {
        &self.inner.health
    }

    /// Every DRA call so far, oldest first.
    pub fn calls(&self) -> Vec<Call> {
        lock(&self.inner.calls).clone()
    }

    /// The calls of `method` whose batch contained `claim_uid`.
    pub fn calls_with(&self, method: Method, claim_uid: &str) -> Vec<Call> {
        lock(&self.inner.calls)
            .iter()
            .filter(|c| c.method == method && c.claims.iter().any(|u| u == claim_uid))
            .cloned()
            .collect()
    }

    /// Claims the kubelet holds, by UID, with the pods referencing them and whether they are
    /// prepared.
    pub fn claims(&self) -> BTreeMap<String, (BTreeSet<String>, bool)> {
        lock(&self.inner.claims)
            .iter()
            .map(|(uid, info)| (uid.clone(), (info.pods.clone(), info.devices.is_some())))
            .collect()
    }

    /// Prepares a pod's claims before its containers start. Claims already prepared (for
    /// another pod) are not sent again; the others go in one call per driver. A failure
    /// (RPC error, missing or unknown entry, per-claim error, unregistered driver, timeout)
    /// fails the attempt, and the pod is retried per [`KubeletConfig::retry`].
    ///
    /// # Errors
    /// The last attempt's failure.
    pub async fn prepare_pod(&self, pod: &Pod) -> Result<PreparedPod, KubeletError> {
        let retry = self.inner.config.retry;
        let mut failed = 0;
        loop {
            let batches = self.claims_to_prepare(pod);
            match self.prepare_batches(batches).await {
                Ok(prepared) => return Ok(self.record_prepared(pod, prepared)),
                Err(e) => {
                    failed += 1;
                    if failed >= retry.attempts {
                        return Err(e);
                    }
                    tokio::time::sleep(retry.backoff(failed)).await;
                }
            }
        }
    }

    /// Unprepares a pod's claims after it terminated: a claim other pods still reference only
    /// loses this pod's reference; the rest go in one call per driver and are forgotten once
    /// every call succeeded. Retried like [`FakeKubelet::prepare_pod`].
    ///
    /// # Errors
    /// The last attempt's failure.
    pub async fn unprepare_pod(&self, pod: &Pod) -> Result<(), KubeletError> {
        let retry = self.inner.config.retry;
        let mut failed = 0;
        loop {
            let batches = self.claims_to_unprepare(pod);
            match self.unprepare_batches(&batches).await {
                Ok(()) => {
                    let mut claims = lock(&self.inner.claims);
                    for claim in batches.values().flatten() {
                        claims.remove(&claim.uid);
                    }
                    return Ok(());
                }
                Err(e) => {
                    failed += 1;
                    if failed >= retry.attempts {
                        return Err(e);
                    }
                    tokio::time::sleep(retry.backoff(failed)).await;
                }
            }
        }
    }

    /// Adds the pod's references and returns its unprepared claims, batched by driver.
    fn claims_to_prepare(&self, pod: &Pod) -> BTreeMap<String, Vec<Claim>> {
        let mut claims = lock(&self.inner.claims);
        let mut batches: BTreeMap<String, Vec<Claim>> = BTreeMap::new();
        for pod_claim in &pod.claims {
            let info = claims
                .entry(pod_claim.claim.uid.clone())
                .or_insert_with(|| ClaimInfo {
                    claim: pod_claim.claim.clone(),
                    driver: pod_claim.driver.clone(),
                    pods: BTreeSet::new(),
                    devices: None,
                });
            info.pods.insert(pod.uid.clone());
            if info.devices.is_none() {
                let batch = batches.entry(info.driver.clone()).or_default();
                if !batch.contains(&info.claim) {
                    batch.push(info.claim.clone());
                }
            }
        }
        batches
    }

    /// Drops the pod's reference from shared claims and returns the claims only it holds,
    /// batched by driver.
    fn claims_to_unprepare(&self, pod: &Pod) -> BTreeMap<String, Vec<Claim>> {
        let mut claims = lock(&self.inner.claims);
        let mut batches: BTreeMap<String, Vec<Claim>> = BTreeMap::new();
        for pod_claim in &pod.claims {
            let Some(info) = claims.get_mut(&pod_claim.claim.uid) else {
                continue;
            };
            if !info.pods.contains(&pod.uid) {
                continue;
            }
            if info.pods.len() > 1 {
                info.pods.remove(&pod.uid);
                continue;
            }
            let batch = batches.entry(info.driver.clone()).or_default();
            if !batch.contains(&info.claim) {
                batch.push(info.claim.clone());
            }
        }
        batches
    }

    fn record_prepared(
        &self,
        pod: &Pod,
        prepared: HashMap<String, Vec<PreparedDevice>>,
    ) -> PreparedPod {
        let mut claims = lock(&self.inner.claims);
        for (uid, devices) in prepared {
            if let Some(info) = claims.get_mut(&uid) {
                info.devices = Some(devices);
            }
        }
        pod.claims
            .iter()
            .filter_map(|pc| {
                let devices = claims.get(&pc.claim.uid)?.devices.clone()?;
                Some((pc.claim.uid.clone(), devices))
            })
            .collect()
    }

    /// One `NodePrepareResources` per driver; aborts at the first failure, as the kubelet
    /// does, and then nothing of this attempt counts as prepared.
    async fn prepare_batches(
        &self,
        batches: BTreeMap<String, Vec<Claim>>,
    ) -> Result<HashMap<String, Vec<PreparedDevice>>, KubeletError> {
        let mut prepared = HashMap::new();
        for (driver, claims) in batches {
            let result = self.prepare_batch(&driver, &claims).await;
            self.log_call(
                Method::Prepare,
                &driver,
                &claims,
                result.as_ref().map(|_| ()),
            );
            prepared.extend(result?);
        }
        Ok(prepared)
    }

    async fn prepare_batch(
        &self,
        driver: &str,
        claims: &[Claim],
    ) -> Result<HashMap<String, Vec<PreparedDevice>>, KubeletError> {
        let plugin = self.registered(driver)?;
        let answer = plugin.prepare_response(claims).await?;
        Ok(answer.all_prepared()?)
    }

    async fn unprepare_batches(
        &self,
        batches: &BTreeMap<String, Vec<Claim>>,
    ) -> Result<(), KubeletError> {
        for (driver, claims) in batches {
            let result = self.unprepare_batch(driver, claims).await;
            self.log_call(Method::Unprepare, driver, claims, result.as_ref().copied());
            result?;
        }
        Ok(())
    }

    async fn unprepare_batch(&self, driver: &str, claims: &[Claim]) -> Result<(), KubeletError> {
        let plugin = self.registered(driver)?;
        let answer = plugin.unprepare_response(claims).await?;
        Ok(answer.all_unprepared()?)
    }

    fn registered(&self, driver: &str) -> Result<Arc<RegisteredPlugin>, KubeletError> {
        self.plugin(driver)
            .ok_or_else(|| KubeletError::NotRegistered(driver.to_owned()))
    }

    fn log_call(
        &self,
        method: Method,
        driver: &str,
        claims: &[Claim],
        outcome: Result<(), &KubeletError>,
    ) {
        lock(&self.inner.calls).push(Call {
            method,
            driver: driver.to_owned(),
            claims: claims.iter().map(|c| c.uid.clone()).collect(),
            outcome: outcome.map_err(ToString::to_string),
        });
    }
}

/// Scans the registry directory forever, registering new sockets and deregistering removed
/// ones.
async fn watch_registry(inner: Arc<KubeletInner>) {
    let mut seen: HashMap<PathBuf, SocketId> = HashMap::new();
    let mut ticks = tokio::time::interval(inner.config.poll_interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let present = registration_sockets(&inner.config.registry_dir);
        seen.retain(|path, _| {
            let still_there = present.contains_key(path);
            if !still_there {
                inner.deregister(path);
            }
            still_there
        });
        for (path, id) in present {
            if seen.get(&path) == Some(&id) {
                continue;
            }
            if inner.register(&path).await {
                seen.insert(path, id);
            }
        }
    }
}

/// The `*-reg.sock` files in `dir` (none when it does not exist yet).
fn registration_sockets(dir: &Path) -> HashMap<PathBuf, SocketId> {
    use std::os::unix::fs::FileTypeExt as _;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return HashMap::new();
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with("-reg.sock"))
        .filter_map(|e| {
            let meta = std::fs::symlink_metadata(e.path()).ok()?;
            meta.file_type().is_socket().then(|| {
                let id = SocketId {
                    inode: meta.ino(),
                    ctime: meta.ctime(),
                    ctime_nsec: meta.ctime_nsec(),
                };
                (e.path(), id)
            })
        })
        .collect()
}

impl KubeletInner {
    /// Registers the plugin behind `socket`. Returns false when the socket did not answer
    /// (e.g. bound but not listening yet), so that the next scan tries again.
    async fn register(&self, socket: &Path) -> bool {
        let outcome = self.client.register(socket).await;
        let (driver, result) = match outcome {
            Ok(plugin) => {
                let driver = plugin.info.name.clone();
                let version = plugin.version;
                let plugin = Arc::new(plugin);
                let mut plugins = lock(&self.plugins);
                let instances = plugins.entry(driver.clone()).or_default();
                // A socket bound again (a restarted instance) replaces its old registration.
                instances.retain(|(registered_at, _)| registered_at != socket);
                instances.push((socket.to_owned(), Arc::clone(&plugin)));
                drop(plugins);
                if let Some(retry) = self.config.health_retry {
                    let watcher = tokio::spawn(health::watch(
                        plugin,
                        driver.clone(),
                        self.health.clone(),
                        retry,
                    ));
                    lock(&self.health_watchers).push(watcher);
                }
                (driver, Ok(version))
            }
            Err(ClientError::RegistrationRefused(reason)) => (String::new(), Err(reason)),
            Err(_) => return false,
        };
        lock(&self.registrations).push(Registration {
            socket: socket.to_owned(),
            driver,
            result,
        });
        self.registration_count.send_modify(|n| *n += 1);
        true
    }

    /// Drops the instance registered through `socket`; the driver stays registered while
    /// another instance is (`DRAPluginManager.remove`).
    fn deregister(&self, socket: &Path) {
        let mut plugins = lock(&self.plugins);
        for instances in plugins.values_mut() {
            instances.retain(|(registered_at, _)| registered_at != socket);
        }
        plugins.retain(|_, instances| !instances.is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_limit() {
        let retry = RetryPolicy {
            attempts: 5,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
        };
        let waits: Vec<u128> = (1..=5).map(|n| retry.backoff(n).as_millis()).collect();
        assert_eq!(waits, [10, 20, 40, 50, 50]);
        assert_eq!(retry.backoff(200), Duration::from_millis(50));
    }

    fn pod(uid: &str, claims: &[(&str, &str)]) -> Pod {
        claims.iter().fold(Pod::new(uid), |pod, (driver, claim)| {
            pod.with_claim(driver, Claim::new("ns", claim, &format!("uid-{claim}")))
        })
    }

    #[tokio::test]
    async fn batches_per_driver_and_counts_references() {
        let kubelet = FakeKubelet::start(KubeletConfig::new("/nonexistent"));
        let a = pod("a", &[("d1", "shared"), ("d1", "own-a"), ("d2", "other")]);
        let batches = kubelet.claims_to_prepare(&a);
        assert_eq!(batches.len(), 2);
        assert_eq!(batches["d1"].len(), 2);
        kubelet.record_prepared(
            &a,
            ["uid-shared", "uid-own-a", "uid-other"]
                .into_iter()
                .map(|u| (u.to_owned(), Vec::new()))
                .collect(),
        );
        let b = pod("b", &[("d1", "shared"), ("d1", "own-b")]);
        let batches = kubelet.claims_to_prepare(&b);
        assert_eq!(batches["d1"], [Claim::new("ns", "own-b", "uid-own-b")]);

        let batches = kubelet.claims_to_unprepare(&a);
        let uids: Vec<&str> = batches.values().flatten().map(|c| c.uid.as_str()).collect();
        assert_eq!(uids, ["uid-own-a", "uid-other"], "shared stays for pod b");
        assert_eq!(
            kubelet.claims()["uid-shared"].0,
            BTreeSet::from(["b".to_owned()])
        );
        let batches = kubelet.claims_to_unprepare(&b);
        let uids: Vec<&str> = batches.values().flatten().map(|c| c.uid.as_str()).collect();
        assert_eq!(uids, ["uid-shared", "uid-own-b"]);
    }

    #[tokio::test]
    async fn an_unregistered_driver_fails_after_the_retries() {
        let mut config = KubeletConfig::new("/nonexistent");
        config.retry.attempts = 3;
        config.retry.initial_backoff = Duration::from_millis(1);
        let kubelet = FakeKubelet::start(config);
        let error = kubelet
            .prepare_pod(&pod("a", &[("d1", "c")]))
            .await
            .unwrap_err();
        assert!(matches!(error, KubeletError::NotRegistered(d) if d == "d1"));
        assert_eq!(kubelet.calls().len(), 3);
        assert!(!kubelet.claims()["uid-c"].1, "not prepared");
    }
}
