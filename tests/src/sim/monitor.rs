//! Every state the ResourceClaims pass through, checked: a watch of all claims that applies
//! each event to its own copy and checks the devices the changed claim holds (exclusive use,
//! slice over-commit; [`check::device_violation`]).
//!
//! A poll only sees the states that happen to exist when it looks; a double allocation that
//! one allocator undoes a few milliseconds later (kerf-controller yielding a device to the
//! scheduler) would slip between two polls. The API server sends a watcher every committed
//! change in order (upstream: the watch cache, `staging/src/k8s.io/apiserver/pkg/storage/
//! cacher`), and so does [`crate::fake_api::FakeApi`], so the monitor sees every state the
//! API held. Only a relist (after `410 Expired`) can skip states; the monitor counts them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures::StreamExt as _;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_core::alloc::UseKind;
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::check::{self, DeviceKey};
use super::cluster::DeviceInfo;

/// What the monitor found, shared with its task.
#[derive(Debug, Default)]
struct Found {
    violations: Mutex<Vec<String>>,
    events: AtomicU64,
    relists: AtomicU64,
}

/// Handle of a running claim monitor.
#[derive(Debug, Clone)]
pub struct ClaimMonitor(Arc<Found>);

impl ClaimMonitor {
    /// The violations found since the last call, each reported once.
    pub fn take_violations(&self) -> Vec<String> {
        std::mem::take(
            &mut *self
                .0
                .violations
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// Claim events checked so far.
    pub fn events(&self) -> u64 {
        self.0.events.load(Ordering::Relaxed)
    }

    /// Relists after the first list (each may have skipped states).
    pub fn relists(&self) -> u64 {
        self.0.relists.load(Ordering::Relaxed).saturating_sub(1)
    }
}

/// The monitor's copy of the claims and of what each holds.
struct State {
    driver: String,
    devices: HashMap<DeviceKey, DeviceInfo>,
    held: HashMap<String, Vec<(DeviceKey, UseKind)>>,
    holders: HashMap<DeviceKey, BTreeMap<String, UseKind>>,
    reported: HashSet<String>,
}

impl State {
    /// Applies the claim's new state (`None`: deleted); returns new violations.
    fn apply(&mut self, key: &str, claim: Option<&ResourceClaim>) -> Vec<String> {
        for (device, _) in self.held.remove(key).unwrap_or_default() {
            if let Some(holders) = self.holders.get_mut(&device) {
                holders.remove(key);
            }
        }
        let Some(claim) = claim else {
            return Vec::new();
        };
        let now: Vec<(DeviceKey, UseKind)> = kerf_api::device_uses(claim, &self.driver)
            .into_iter()
            .map(|u| ((u.node, u.device), u.kind))
            .collect();
        for (device, kind) in &now {
            self.holders
                .entry(device.clone())
                .or_default()
                .insert(key.to_owned(), *kind);
        }
        let mut found = Vec::new();
        for (device, _) in &now {
            let holders: Vec<(String, UseKind)> = self
                .holders
                .get(device)
                .into_iter()
                .flatten()
                .map(|(c, k)| (c.clone(), *k))
                .collect();
            let info = self.devices.get(device);
            if let Some(violation) = check::device_violation(&device.0, &device.1, &holders, info)
                && self.reported.insert(violation.clone())
            {
                found.push(violation);
            }
        }
        self.held.insert(key.to_owned(), now);
        found
    }

    fn clear(&mut self) {
        self.held.clear();
        self.holders.clear();
    }
}

/// Starts a monitor of every ResourceClaim of `driver`'s `devices`, until `shutdown`.
pub fn spawn(
    client: &Client,
    driver: &str,
    devices: &[DeviceInfo],
    shutdown: CancellationToken,
) -> (ClaimMonitor, JoinHandle<()>) {
    let found = Arc::new(Found::default());
    let mut state = State {
        driver: driver.to_owned(),
        devices: devices
            .iter()
            .map(|d| ((d.node.clone(), d.name.clone()), d.clone()))
            .collect(),
        held: HashMap::new(),
        holders: HashMap::new(),
        reported: HashSet::new(),
    };
    let claims = watcher(
        Api::<ResourceClaim>::all(client.clone()),
        watcher::Config::default(),
    );
    let shared = found.clone();
    let task = tokio::spawn(async move {
        let mut claims = std::pin::pin!(claims);
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return,
                event = claims.next() => event,
            };
            let violations = match event {
                None => return,
                Some(Err(_) | Ok(watcher::Event::InitDone)) => continue,
                Some(Ok(watcher::Event::Init)) => {
                    shared.relists.fetch_add(1, Ordering::Relaxed);
                    state.clear();
                    continue;
                }
                Some(Ok(watcher::Event::Apply(claim) | watcher::Event::InitApply(claim))) => {
                    state.apply(&check::claim_key(&claim), Some(&claim))
                }
                Some(Ok(watcher::Event::Delete(claim))) => {
                    state.apply(&check::claim_key(&claim), None)
                }
            };
            shared.events.fetch_add(1, Ordering::Relaxed);
            if !violations.is_empty() {
                shared
                    .violations
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .extend(violations);
            }
        }
    });
    (ClaimMonitor(found), task)
}
