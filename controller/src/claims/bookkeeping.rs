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
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_core::alloc::{DeviceUse, Index};
use kube::runtime::reflector::{ObjectRef, Store};

use super::index::CapacityIndex;
use super::ownership::{DeviceOwnership, InputChanges};
use crate::cache::{Change, CompactResourceSlice};

/// A node the scheduler rejected for a pod.
#[derive(Debug, Clone, Copy)]
struct Rejection {
    /// Avoided until then.
    until: Instant,
    /// A rejection before then is a repeat.
    forget_at: Instant,
    /// Earlier rejections counted.
    repeats: u32,
}

/// The bookkeeping of one claim controller.
#[derive(Debug, Default)]
pub(crate) struct Bookkeeping {
    state: Mutex<State>,
    /// Bumped when what the ownership pass reads here changes: the allocations assumed for
    /// writes in flight, the claims waiting for capacity.
    changes: InputChanges,
    /// The claims changed since the capacity index last read the claim store. A lock of its
    /// own: the claim watch notes every change here and must not wait for a reconcile that
    /// holds the books.
    journal: Mutex<ClaimJournal>,
}

/// What the claim watch changed since the last sync ([`Bookkeeping::note_claim`]).
#[derive(Debug)]
struct ClaimJournal {
    /// Changed claims by UID.
    changed: HashMap<String, ObjectRef<ResourceClaim>>,
    /// Every claim must be read again: nothing was read yet, the watch relisted, or a claim
    /// was deleted (the deletion does not say which).
    walk_all: bool,
}

impl Default for ClaimJournal {
    fn default() -> Self {
        ClaimJournal {
            changed: HashMap::new(),
            walk_all: true,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    capacity: CapacityIndex,
    /// Claims a reconcile is writing.
    in_flight: HashSet<String>,
    /// Claims whose missing allocation is ours although they carry the node annotation: a
    /// write sequence that stopped halfway, or a rejection already acted on.
    self_cleared: HashSet<String>,
    /// Nodes the scheduler rejected, per pod UID.
    unsuitable: HashMap<String, HashMap<String, Rejection>>,
    /// Claims that did not fit, to try again when the controller frees capacity.
    waiting: HashSet<ObjectRef<ResourceClaim>>,
    /// The owner of every device and the controller's fences.
    ownership: DeviceOwnership,
}

impl Bookkeeping {
    /// An empty bookkeeping that bumps `changes` when an input of the ownership pass changes.
    pub(super) fn new(changes: InputChanges) -> Self {
        Bookkeeping {
            state: Mutex::default(),
            changes,
            journal: Mutex::default(),
        }
    }

    /// Notes a change of the claim store, after the store has it and before the reconcile it
    /// triggers is queued (`watch.rs`), so that reconcile's [`Bookkeeping::synced`] reads it.
    pub(super) fn note_claim(&self, change: &Change<ResourceClaim>) {
        let mut journal = self.journal.lock().unwrap_or_else(PoisonError::into_inner);
        match change {
            Change::Applied { object, .. } => {
                if let Some(uid) = object.metadata.uid.as_deref() {
                    journal
                        .changed
                        .insert(uid.to_owned(), ObjectRef::from_obj(object.as_ref()));
                }
            }
            Change::Deleted | Change::Listed => journal.walk_all = true,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The books stay meaningful whatever panicked while the lock was held.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The books, with the capacity index brought up to date with the stores.
    ///
    /// Only the claims noted since the last sync ([`Bookkeeping::note_claim`]) are read again,
    /// each from the store; every claim only after a relist or a deletion, or when an
    /// assumption expired. `claims` must be the store whose every write is noted here before
    /// the event that wrote it is passed on (`watch.rs`): a reconcile of a claim then always
    /// sees the claim's latest event in the index, and a reconcile during a burst of other
    /// objects' events (pods, nodes) or a quiet cluster's resync costs no walk of every claim.
    pub(super) fn synced(
        &self,
        slices: &Store<CompactResourceSlice>,
        claims: &Store<ResourceClaim>,
        driver: &str,
    ) -> Books<'_> {
        let slices = slices.state();
        let mut state = self.lock();
        // Taken under the books' lock, and the store read after it: two reconciles cannot
        // split a change between them, and a change noted after this is read by the next sync.
        let journal = std::mem::replace(
            &mut *self.journal.lock().unwrap_or_else(PoisonError::into_inner),
            ClaimJournal {
                changed: HashMap::new(),
                walk_all: false,
            },
        );
        let now = Instant::now();
        let State {
            capacity,
            ownership,
            ..
        } = &mut *state;
        capacity.sync_pools(&slices, driver, ownership);
        if journal.walk_all || capacity.expiry_due(now) {
            capacity.sync_claims(&claims.state(), driver, now);
        } else {
            let changed: Vec<_> = journal
                .changed
                .values()
                .filter_map(|r| claims.get(r))
                .collect();
            capacity.sync_changed_claims(&changed, driver, now);
        }
        Books {
            bookkeeping: self,
            state,
        }
    }

    /// Marks `claims` as being written, or `None` when a reconcile is writing one of them.
    pub(super) fn begin(&self, claims: Vec<String>) -> Option<WriteGuard<'_>> {
        Books {
            bookkeeping: self,
            state: self.lock(),
        }
        .begin(claims)
    }

    /// For an annotated claim without allocation: true (once) when the missing allocation is
    /// not the controller's doing, i.e. someone else cleared it. From then on it counts as
    /// the controller's, so that the rejection is acted on once.
    pub(super) fn take_rejection(&self, uid: &str) -> bool {
        let mut state = self.lock();
        !state.in_flight.contains(uid) && state.self_cleared.insert(uid.to_owned())
    }

    /// Marks `node` unsuitable for pod `pod_uid` from `now` for `period(repeats)`, where
    /// `repeats` counts the earlier rejections of the node for the pod still remembered.
    /// Marks are remembered for twice their period, so that a quick repeat counts; expired
    /// ones of every pod (deleted pods included) are dropped on the way.
    pub(super) fn mark_unsuitable(
        &self,
        pod_uid: &str,
        node: &str,
        now: Instant,
        period: impl Fn(u32) -> Duration,
    ) {
        let mut state = self.lock();
        state.unsuitable.retain(|_, nodes| {
            nodes.retain(|_, mark| mark.forget_at > now);
            !nodes.is_empty()
        });
        let nodes = state.unsuitable.entry(pod_uid.to_owned()).or_default();
        let repeats = nodes.get(node).map_or(0, |mark| mark.repeats + 1);
        let period = period(repeats);
        nodes.insert(
            node.to_owned(),
            Rejection {
                until: now + period,
                forget_at: now + period * 2,
                repeats,
            },
        );
    }

    /// Nodes currently unsuitable for pod `pod_uid`.
    pub(super) fn unsuitable_nodes(&self, pod_uid: &str) -> Vec<String> {
        let now = Instant::now();
        let state = self.lock();
        state
            .unsuitable
            .get(pod_uid)
            .into_iter()
            .flatten()
            .filter(|(_, mark)| mark.until > now)
            .map(|(node, _)| node.clone())
            .collect()
    }

    /// How many rejections of pod `pod_uid` are still remembered: each mark counts the
    /// rejections of its node (a repeat counts again).
    pub(super) fn rejections(&self, pod_uid: &str) -> u32 {
        let now = Instant::now();
        let state = self.lock();
        state
            .unsuitable
            .get(pod_uid)
            .into_iter()
            .flatten()
            .filter(|(_, mark)| mark.forget_at > now)
            .map(|(_, mark)| mark.repeats.saturating_add(1))
            .fold(0, u32::saturating_add)
    }

    /// True when devices taken over by the controller wait for their fence.
    pub(super) fn settling(&self) -> bool {
        self.lock().ownership.settling()
    }

    /// Remembers that `claim` waits for capacity.
    pub(super) fn wait_for_capacity(&self, claim: ObjectRef<ResourceClaim>) {
        if self.lock().waiting.insert(claim) {
            self.changes.bump();
        }
    }

    /// Every claim waiting for capacity, forgotten here.
    pub(super) fn take_waiting(&self) -> Vec<ObjectRef<ResourceClaim>> {
        let waiting: Vec<_> = self.lock().waiting.drain().collect();
        if !waiting.is_empty() {
            self.changes.bump();
        }
        waiting
    }
}

/// The locked books: read the capacity index, place and begin writes under one lock.
pub(crate) struct Books<'a> {
    bookkeeping: &'a Bookkeeping,
    state: MutexGuard<'a, State>,
}

impl<'a> Books<'a> {
    /// The capacity index.
    pub(crate) fn index(&self) -> &Index {
        self.state.capacity.index()
    }

    /// True when a reconcile is writing claim `uid`.
    pub(crate) fn in_flight(&self, uid: &str) -> bool {
        self.state.in_flight.contains(uid)
    }

    /// See [`CapacityIndex::is_stale`].
    pub(crate) fn is_stale(&self, claim: &ResourceClaim) -> bool {
        self.state.capacity.is_stale(claim)
    }

    /// What the sync that made these books did.
    #[cfg(test)]
    fn sync_work(&self) -> super::index::SyncWork {
        self.state.capacity.last_work()
    }

    /// See [`CapacityIndex::holders`].
    pub(crate) fn holders(
        &self,
        node: &str,
        device: &str,
        except: &str,
    ) -> Vec<ObjectRef<ResourceClaim>> {
        self.state.capacity.holders(node, device, except)
    }

    /// The capacity index and the ownership book, to advance the book by a tick.
    pub(crate) fn ownership(&mut self) -> (&CapacityIndex, &mut DeviceOwnership) {
        let State {
            capacity,
            ownership,
            ..
        } = &mut *self.state;
        (capacity, ownership)
    }

    /// True when a controller claim waits for capacity.
    pub(crate) fn controller_waiting(&self) -> bool {
        !self.state.waiting.is_empty()
    }

    /// When the earliest assumed allocation expires (see [`CapacityIndex::next_expiry`]).
    pub(crate) fn next_expiry(&self) -> Option<Instant> {
        self.state.capacity.next_expiry(Instant::now())
    }

    /// Records allocations about to be written (see [`CapacityIndex::assume`]).
    pub(crate) fn assume(&mut self, uid: &str, uses: Vec<DeviceUse>) {
        self.state.capacity.assume(uid, uses, Instant::now());
        self.bookkeeping.changes.bump();
    }

    /// Marks `claims` as being written, or `None` when a reconcile is writing one of them.
    /// The books are released first: the guard locks them again when it is dropped.
    pub(crate) fn begin(mut self, claims: Vec<String>) -> Option<WriteGuard<'a>> {
        if claims.iter().any(|uid| self.state.in_flight.contains(uid)) {
            return None;
        }
        self.state.in_flight.extend(claims.iter().cloned());
        Some(WriteGuard {
            bookkeeping: self.bookkeeping,
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
    bookkeeping: &'a Bookkeeping,
    claims: Vec<String>,
    settled: HashSet<String>,
}

impl WriteGuard<'_> {
    /// Claim `uid`'s annotation and allocation agree again (the allocation is written, or
    /// the annotation removed): a missing allocation of it is no longer the controller's
    /// doing.
    pub(crate) fn settled(&mut self, uid: &str) {
        self.settled.insert(uid.to_owned());
    }

    /// Claim `uid`'s annotation and allocation disagree from now on (its allocation is being
    /// cleared while the annotation stays), until [`WriteGuard::settled`] again.
    pub(crate) fn unsettled(&mut self, uid: &str) {
        self.settled.remove(uid);
    }

    /// The write of claim `uid` returned `version` (see [`CapacityIndex::confirm`]).
    pub(crate) fn confirm(&self, uid: &str, uses: Vec<DeviceUse>, version: &str) {
        self.bookkeeping
            .lock()
            .capacity
            .confirm(uid, uses, version, Instant::now());
        self.bookkeeping.changes.bump();
    }

    /// Drops what the index assumed about claim `uid` (after a rollback).
    pub(crate) fn forget(&self, uid: &str) {
        self.bookkeeping.lock().capacity.forget(uid);
        self.bookkeeping.changes.bump();
    }
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        let mut state = self.bookkeeping.lock();
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
    use k8s_openapi::api::resource::v1::ResourceSlice;
    use kube::runtime::reflector::{self, store::Writer};
    use kube::runtime::watcher;
    use serde_json::json;

    const DRIVER: &str = "gpu.kerf.dev";

    fn claim(name: &str, version: &str) -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "uid": name, "resourceVersion": version},
            "spec": {"devices": {"requests": []}},
        }))
        .unwrap()
    }

    fn slice(node: &str) -> CompactResourceSlice {
        serde_json::from_value::<ResourceSlice>(json!({
            "metadata": {"name": format!("{node}-slice"), "resourceVersion": "1"},
            "spec": {"driver": DRIVER, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}, "devices": []},
        }))
        .unwrap()
        .into()
    }

    fn apply<K>(writer: &mut Writer<K>, object: K)
    where
        K: reflector::Lookup<DynamicType = ()> + Clone,
    {
        writer.apply_watcher_event(&watcher::Event::Apply(object));
    }

    fn applied(claim: ResourceClaim) -> Change<ResourceClaim> {
        Change::Applied {
            object: std::sync::Arc::new(claim),
            listed: false,
        }
    }

    /// Fails when a sync walks every claim for a change of one (or of something else), or
    /// when a deletion or relist does not make it walk them all.
    #[test]
    fn a_sync_reads_only_the_claims_noted_and_rebuilds_only_changed_pools() {
        let bookkeeping = Bookkeeping::new(InputChanges::default());
        let (claims, mut claim_writer) = reflector::store::<ResourceClaim>();
        let (slices, mut slice_writer) = reflector::store::<CompactResourceSlice>();
        for i in 0..100 {
            apply(&mut claim_writer, claim(&format!("c{i}"), "1"));
        }
        for node in ["n1", "n2", "n3"] {
            apply(&mut slice_writer, slice(node));
        }
        let work = bookkeeping.synced(&slices, &claims, DRIVER).sync_work();
        assert_eq!((work.claims_examined, work.pools_rebuilt), (100, 3));
        let work = bookkeeping.synced(&slices, &claims, DRIVER).sync_work();
        assert_eq!(
            (work.claims_examined, work.pools_rebuilt),
            (0, 0),
            "nothing changed: no claim walked, no pool rebuilt"
        );
        apply(&mut claim_writer, claim("c7", "2"));
        bookkeeping.note_claim(&applied(claim("c7", "2")));
        apply(&mut slice_writer, slice("n2"));
        let work = bookkeeping.synced(&slices, &claims, DRIVER).sync_work();
        assert_eq!(
            (work.claims_examined, work.pools_rebuilt),
            (1, 1),
            "one claim changed: that claim read again"
        );
        drop(bookkeeping.begin(uids(&["c8"])));
        bookkeeping.wait_for_capacity(ObjectRef::new("c9").within("ns"));
        let work = bookkeeping.synced(&slices, &claims, DRIVER).sync_work();
        assert_eq!(
            work.claims_examined, 0,
            "the bookkeeping's own changes are in the books already"
        );
        for change in [Change::Deleted, Change::Listed] {
            bookkeeping.note_claim(&change);
            let work = bookkeeping.synced(&slices, &claims, DRIVER).sync_work();
            assert_eq!(work.claims_examined, 100, "{change:?}: every claim read");
        }
    }

    /// The index follows the store through noted changes alone: a claim allocated, then
    /// released, reads back as the store says after each sync.
    #[test]
    fn a_noted_claim_is_read_from_the_store_as_it_is_now() {
        let bookkeeping = Bookkeeping::new(InputChanges::default());
        let (claims, mut claim_writer) = reflector::store::<ResourceClaim>();
        let (slices, _) = reflector::store::<CompactResourceSlice>();
        drop(bookkeeping.synced(&slices, &claims, DRIVER));
        let allocated: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": "a", "namespace": "ns", "uid": "a", "resourceVersion": "5"},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": "n1", "device": "gpu-0"}
            ]}}},
        }))
        .unwrap();
        apply(&mut claim_writer, allocated.clone());
        bookkeeping.note_claim(&applied(claim("a", "4")));
        let books = bookkeeping.synced(&slices, &claims, DRIVER);
        assert_eq!(books.sync_work().claims_examined, 1);
        assert!(
            !books.index().gpu_usage("n1", "gpu-0").is_idle(),
            "the store's copy (version 5) counts, not the noted one"
        );
        drop(books);
        apply(&mut claim_writer, claim("a", "6"));
        bookkeeping.note_claim(&applied(claim("a", "6")));
        let books = bookkeeping.synced(&slices, &claims, DRIVER);
        assert!(books.index().gpu_usage("n1", "gpu-0").is_idle());
    }

    fn uids(names: &[&str]) -> Vec<String> {
        names.iter().map(|&n| n.to_owned()).collect()
    }

    #[test]
    fn a_claim_is_written_by_one_reconcile_at_a_time() {
        let bookkeeping = Bookkeeping::default();
        let first = bookkeeping.begin(uids(&["a", "b"])).unwrap();
        assert!(bookkeeping.begin(uids(&["b"])).is_none());
        assert!(bookkeeping.begin(uids(&["c"])).is_some());
        drop(first);
        assert!(bookkeeping.begin(uids(&["a", "b"])).is_some());
    }

    #[test]
    fn an_unsettled_write_is_not_a_rejection_and_a_settled_one_is_forgotten() {
        let bookkeeping = Bookkeeping::default();
        let mut guard = bookkeeping.begin(uids(&["halfway", "done"])).unwrap();
        assert!(
            !bookkeeping.take_rejection("done"),
            "in flight is never a rejection"
        );
        guard.settled("done");
        drop(guard);
        assert!(!bookkeeping.take_rejection("halfway"));
        assert!(bookkeeping.take_rejection("done"));
        assert!(
            !bookkeeping.take_rejection("done"),
            "a rejection is taken once"
        );
        let mut guard = bookkeeping.begin(uids(&["done"])).unwrap();
        guard.settled("done");
        drop(guard);
        assert!(bookkeeping.take_rejection("done"));
    }

    #[test]
    fn rejections_back_off_and_grow_on_repeats() {
        let bookkeeping = Bookkeeping::default();
        let now = Instant::now();
        let period = |repeats: u32| Duration::from_secs(5) * 2u32.pow(repeats);
        bookkeeping.mark_unsuitable("pod", "node1", now, period);
        bookkeeping.mark_unsuitable(
            "pod",
            "node2",
            now.checked_sub(Duration::from_secs(6)).unwrap(),
            period,
        );
        assert_eq!(
            bookkeeping.unsuitable_nodes("pod"),
            vec!["node1".to_owned()]
        );
        assert!(bookkeeping.unsuitable_nodes("other").is_empty());
        let state = bookkeeping.lock();
        let node2 = state.unsuitable["pod"]["node2"];
        assert_eq!(node2.repeats, 0);
        drop(state);
        bookkeeping.mark_unsuitable("pod", "node2", now, period);
        let state = bookkeeping.lock();
        let node2 = state.unsuitable["pod"]["node2"];
        assert_eq!(node2.repeats, 1, "a repeat within twice the period counts");
        assert_eq!(node2.until, now + Duration::from_secs(10));
    }
}
