//! The claim reconciler's bookkeeping, behind one lock: the capacity index with the
//! allocations it assumes, the claims a reconcile is writing, the claims whose missing
//! allocation is the controller's own doing, the nodes the scheduler rejected per pod, and
//! the claims waiting for capacity.
//!
//! Writes go through a [`WriteGuard`]: [`Books::begin`] marks claims as being written, and
//! dropping the guard ends that, so no path can leave a claim in flight. A claim whose write
//! sequence did not reach a consistent state (annotation and allocation agree again, see
//! [`WriteGuard::settled`]) stays marked as cleared by the controller, so that the next
//! reconcile does not read the half-finished write as a rejection by the scheduler.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kerf_core::alloc::{DeviceUse, Index};
use kube::runtime::reflector::ObjectRef;

use super::index::CapacityIndex;

/// The bookkeeping of one claim controller.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    capacity: CapacityIndex,
    /// Claims a reconcile is writing.
    in_flight: HashSet<String>,
    /// Claims whose missing allocation is ours although they carry the node annotation: a
    /// write sequence that stopped halfway, or a rejection already acted on.
    self_cleared: HashSet<String>,
    /// Nodes the scheduler rejected, per pod UID, until when.
    unsuitable: HashMap<String, HashMap<String, Instant>>,
    /// Claims that did not fit, to try again when the controller frees capacity.
    waiting: HashSet<ObjectRef<ResourceClaim>>,
}

impl Ledger {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The books stay meaningful whatever panicked while the lock was held.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The books, with the capacity index brought up to date with the stores.
    pub fn synced(
        &self,
        slices: &[Arc<ResourceSlice>],
        claims: &[Arc<ResourceClaim>],
        driver: &str,
    ) -> Books<'_> {
        let mut state = self.lock();
        state.capacity.sync(slices, claims, driver, Instant::now());
        Books {
            ledger: self,
            state,
        }
    }

    /// Marks `claims` as being written, or `None` when a reconcile is writing one of them.
    pub fn begin(&self, claims: Vec<String>) -> Option<WriteGuard<'_>> {
        Books {
            ledger: self,
            state: self.lock(),
        }
        .begin(claims)
    }

    /// For an annotated claim without allocation: true (once) when the missing allocation is
    /// not the controller's doing, i.e. someone else cleared it. From then on it counts as
    /// the controller's, so that the rejection is acted on once.
    pub fn take_rejection(&self, uid: &str) -> bool {
        let mut state = self.lock();
        !state.in_flight.contains(uid) && state.self_cleared.insert(uid.to_owned())
    }

    /// Marks `node` unsuitable for pod `pod_uid` until `until`; expired marks of every pod
    /// (deleted pods included) are dropped on the way.
    pub fn mark_unsuitable(&self, pod_uid: &str, node: &str, until: Instant) {
        let now = Instant::now();
        let mut state = self.lock();
        state.unsuitable.retain(|_, nodes| {
            nodes.retain(|_, until| *until > now);
            !nodes.is_empty()
        });
        state
            .unsuitable
            .entry(pod_uid.to_owned())
            .or_default()
            .insert(node.to_owned(), until);
    }

    /// Nodes currently unsuitable for pod `pod_uid`.
    pub fn unsuitable_nodes(&self, pod_uid: &str) -> Vec<String> {
        let now = Instant::now();
        let mut state = self.lock();
        let Some(nodes) = state.unsuitable.get_mut(pod_uid) else {
            return Vec::new();
        };
        nodes.retain(|_, until| *until > now);
        let out = nodes.keys().cloned().collect();
        if nodes.is_empty() {
            state.unsuitable.remove(pod_uid);
        }
        out
    }

    /// Remembers that `claim` waits for capacity.
    pub fn wait_for_capacity(&self, claim: ObjectRef<ResourceClaim>) {
        self.lock().waiting.insert(claim);
    }

    /// Every claim waiting for capacity, forgotten here.
    pub fn take_waiting(&self) -> Vec<ObjectRef<ResourceClaim>> {
        self.lock().waiting.drain().collect()
    }
}

/// The locked books: read the capacity index, place and begin writes under one lock.
pub(crate) struct Books<'a> {
    ledger: &'a Ledger,
    state: MutexGuard<'a, State>,
}

impl<'a> Books<'a> {
    /// The capacity index.
    pub fn index(&self) -> &Index {
        self.state.capacity.index()
    }

    /// True when a reconcile is writing claim `uid`.
    pub fn in_flight(&self, uid: &str) -> bool {
        self.state.in_flight.contains(uid)
    }

    /// See [`CapacityIndex::is_stale`].
    pub fn is_stale(&self, claim: &ResourceClaim) -> bool {
        self.state.capacity.is_stale(claim)
    }

    /// See [`CapacityIndex::holders`].
    pub fn holders(&self, node: &str, device: &str, except: &str) -> Vec<ObjectRef<ResourceClaim>> {
        self.state.capacity.holders(node, device, except)
    }

    /// Records allocations about to be written (see [`CapacityIndex::assume`]).
    pub fn assume(&mut self, uid: &str, uses: Vec<DeviceUse>) {
        self.state.capacity.assume(uid, uses, Instant::now());
    }

    /// Marks `claims` as being written, or `None` when a reconcile is writing one of them.
    /// The books are released first: the guard locks them again when it is dropped.
    pub fn begin(mut self, claims: Vec<String>) -> Option<WriteGuard<'a>> {
        if claims.iter().any(|uid| self.state.in_flight.contains(uid)) {
            return None;
        }
        self.state.in_flight.extend(claims.iter().cloned());
        Some(WriteGuard {
            ledger: self.ledger,
            claims,
            settled: HashSet::new(),
        })
    }
}

/// Claims one reconcile is writing. Dropping it ends the write: the claims are no longer in
/// flight, and those not [settled](WriteGuard::settled) stay marked as cleared by the
/// controller.
#[derive(Debug)]
pub(crate) struct WriteGuard<'a> {
    ledger: &'a Ledger,
    claims: Vec<String>,
    settled: HashSet<String>,
}

impl WriteGuard<'_> {
    /// Claim `uid`'s annotation and allocation agree again (the allocation is written, or
    /// the annotation removed): a missing allocation of it is no longer the controller's
    /// doing.
    pub fn settled(&mut self, uid: &str) {
        self.settled.insert(uid.to_owned());
    }

    /// Claim `uid`'s annotation and allocation disagree from now on (its allocation is being
    /// cleared while the annotation stays), until [`WriteGuard::settled`] again.
    pub fn unsettled(&mut self, uid: &str) {
        self.settled.remove(uid);
    }

    /// The write of claim `uid` returned `version` (see [`CapacityIndex::confirm`]).
    pub fn confirm(&self, uid: &str, uses: Vec<DeviceUse>, version: &str) {
        self.ledger
            .lock()
            .capacity
            .confirm(uid, uses, version, Instant::now());
    }

    /// Drops what the index assumed about claim `uid` (after a rollback).
    pub fn forget(&self, uid: &str) {
        self.ledger.lock().capacity.forget(uid);
    }
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        let mut state = self.ledger.lock();
        for uid in &self.claims {
            state.in_flight.remove(uid);
            if self.settled.contains(uid) {
                state.self_cleared.remove(uid);
            } else {
                state.self_cleared.insert(uid.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uids(names: &[&str]) -> Vec<String> {
        names.iter().map(|&n| n.to_owned()).collect()
    }

    #[test]
    fn a_claim_is_written_by_one_reconcile_at_a_time() {
        let ledger = Ledger::default();
        let first = ledger.begin(uids(&["a", "b"])).unwrap();
        assert!(ledger.begin(uids(&["b"])).is_none());
        assert!(ledger.begin(uids(&["c"])).is_some());
        drop(first);
        assert!(ledger.begin(uids(&["a", "b"])).is_some());
    }

    #[test]
    fn an_unsettled_write_is_not_a_rejection_and_a_settled_one_is_forgotten() {
        let ledger = Ledger::default();
        let mut guard = ledger.begin(uids(&["halfway", "done"])).unwrap();
        assert!(
            !ledger.take_rejection("done"),
            "in flight is never a rejection"
        );
        guard.settled("done");
        drop(guard);
        assert!(!ledger.take_rejection("halfway"));
        assert!(ledger.take_rejection("done"));
        assert!(!ledger.take_rejection("done"), "a rejection is taken once");
        let mut guard = ledger.begin(uids(&["done"])).unwrap();
        guard.settled("done");
        drop(guard);
        assert!(ledger.take_rejection("done"));
    }

    #[test]
    fn unsuitable_marks_expire() {
        let ledger = Ledger::default();
        let now = Instant::now();
        ledger.mark_unsuitable("pod", "node1", now + std::time::Duration::from_secs(60));
        ledger.mark_unsuitable("pod", "node2", now);
        assert_eq!(ledger.unsuitable_nodes("pod"), vec!["node1".to_owned()]);
        assert!(ledger.unsuitable_nodes("other").is_empty());
    }
}
