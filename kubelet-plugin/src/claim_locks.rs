//! Per-claim locks: two calls for the same claim serialise, independent claims never wait
//! on each other (the lesson of a node-wide prepare lock with a 10 s timeout).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

/// A set of async locks keyed by claim UID, dropped from the map when nobody holds them.
#[derive(Default)]
pub(crate) struct ClaimLocks {
    locks: Mutex<HashMap<String, Arc<AsyncMutex<()>>>>,
}

/// Holds one claim's lock; releases it (and forgets an unused entry) on drop.
pub(crate) struct ClaimGuard<'a> {
    owner: &'a ClaimLocks,
    key: String,
    guard: Option<OwnedMutexGuard<()>>,
}

impl ClaimLocks {
    /// Waits for and takes the lock of `key`.
    pub(crate) async fn lock(&self, key: &str) -> ClaimGuard<'_> {
        let lock = {
            let mut map = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
            Arc::clone(map.entry(key.to_owned()).or_default())
        };
        let guard = lock.lock_owned().await;
        ClaimGuard {
            owner: self,
            key: key.to_owned(),
            guard: Some(guard),
        }
    }

    /// Number of claims with a lock entry (held or awaited).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.locks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// True when no lock is held or awaited.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for ClaimGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut map = self
            .owner
            .locks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Only the map itself still refers to the lock: no holder, no waiter.
        if map
            .get(&self.key)
            .is_some_and(|lock| Arc::strong_count(lock) == 1)
        {
            map.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn same_key_serialises_and_entries_are_forgotten() {
        let locks = Arc::new(ClaimLocks::default());
        let first = locks.lock("a").await;
        let other = locks.lock("b").await;
        let waiter = {
            let locks = Arc::clone(&locks);
            tokio::spawn(async move {
                let _g = locks.lock("a").await;
            })
        };
        tokio::task::yield_now().await;
        assert!(
            !waiter.is_finished(),
            "second lock of the same key must wait"
        );
        drop(first);
        waiter.await.unwrap();
        drop(other);
        assert!(locks.is_empty());
    }
}
