//! Tests of the checkpoint store: group commit, and two instances sharing one file.
#![allow(clippy::unwrap_used, clippy::panic)] // Test helpers may fail loudly.

use kerf_core::checkpoint::ClaimEntry;

use super::*;

fn on_disk(path: &Path) -> Checkpoint {
    match checkpoint::load(path).unwrap() {
        LoadOutcome::Loaded(cp) => cp,
        other => panic!("expected a checkpoint, got {other:?}"),
    }
}

#[tokio::test]
async fn a_lazy_mutation_reaches_the_disk_with_the_next_awaited_write() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.json");
    let (store, opened) = CheckpointStore::open(&path, "boot-1").await.unwrap();
    assert_eq!(opened, Opened::Fresh);
    store.mutate_lazily(|cp| {
        cp.claims.insert("lazy".into(), ClaimEntry::default());
    });
    assert!(store.read(|cp| cp.claims.contains_key("lazy")));
    store
        .update(|cp| {
            cp.claims.insert("awaited".into(), ClaimEntry::default());
        })
        .await
        .unwrap();
    let cp = on_disk(&path);
    assert!(cp.claims.contains_key("lazy") && cp.claims.contains_key("awaited"));
    assert_eq!(cp.boot_id, "boot-1");
}

#[tokio::test]
async fn concurrent_updates_are_all_durable_when_they_return() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.json");
    let (store, _) = CheckpointStore::open(&path, "boot-1").await.unwrap();
    let updates = (0..32).map(|i| {
        let store = store.clone();
        async move {
            store
                .update(|cp| {
                    cp.claims
                        .insert(format!("claim-{i}"), ClaimEntry::default());
                })
                .await
        }
    });
    for result in futures::future::join_all(updates).await {
        result.unwrap();
    }
    assert_eq!(on_disk(&path).claims.len(), 32);
}

fn entry() -> ClaimEntry {
    ClaimEntry::default()
}

#[tokio::test]
async fn two_instances_keep_each_others_claims() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.json");
    let (old, _) = CheckpointStore::open(&path, "boot-1").await.unwrap();
    let (new, _) = CheckpointStore::open(&path, "boot-1").await.unwrap();
    old.update(|cp| cp.claims.insert("a".into(), entry()))
        .await
        .unwrap();
    new.update(|cp| cp.claims.insert("b".into(), entry()))
        .await
        .unwrap();
    // A lazy mutation of the old instance is kept through the new one's write.
    old.mutate_lazily(|cp| cp.claims.insert("c".into(), entry()));
    new.update(|cp| cp.remove_claim("a")).await.unwrap();
    assert!(
        !old.read(|cp| cp.claims.contains_key("a")),
        "the old instance sees the new one's unprepare"
    );
    old.update(|cp| cp.claims.insert("d".into(), entry()))
        .await
        .unwrap();
    let uids: Vec<String> = on_disk(&path).claims.into_keys().collect();
    assert_eq!(uids, ["b", "c", "d"]);
    assert_eq!(new.read(|cp| cp.claims.len()), 3);
}

#[tokio::test]
async fn an_unchanged_file_is_not_read_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.json");
    let (store, _) = CheckpointStore::open(&path, "boot-1").await.unwrap();
    for i in 0..20 {
        store
            .update(|cp| cp.claims.insert(format!("c{i}"), entry()))
            .await
            .unwrap();
        assert_eq!(store.read(|cp| cp.claims.len()), i + 1);
    }
    assert_eq!(store.reloads(), 0, "its own writes are not read back");
    let (other, _) = CheckpointStore::open(&path, "boot-1").await.unwrap();
    other.update(|cp| cp.remove_claim("c0")).await.unwrap();
    assert_eq!(store.read(|cp| cp.claims.len()), 19);
    assert_eq!(store.read(|cp| cp.claims.len()), 19);
    assert_eq!(store.reloads(), 1, "read once after the other's write");
}

#[tokio::test]
async fn start_up_waits_for_the_other_instances_operations() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.json");
    let (old, _) = CheckpointStore::open(&path, "boot-1").await.unwrap();
    let (new, _) = CheckpointStore::open(&path, "boot-1").await.unwrap();
    let first = old.operation().await.unwrap();
    let second = old.operation().await.unwrap();
    let start_up = tokio::spawn(async move { new.start_up_hold().await.unwrap() });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!start_up.is_finished(), "start-up ran beside an operation");
    drop(first);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!start_up.is_finished(), "one hold released the other");
    drop(second);
    let held = start_up.await.unwrap();
    let waiting = {
        let old = old.clone();
        tokio::spawn(async move { old.operation().await.unwrap() })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "an operation ran during start-up");
    drop(held);
    waiting.await.unwrap();
}

#[tokio::test]
async fn concurrent_writers_in_two_instances_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.json");
    let (a, _) = CheckpointStore::open(&path, "boot-1").await.unwrap();
    let (b, _) = CheckpointStore::open(&path, "boot-1").await.unwrap();
    let updates = (0..40).map(|i| {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        async move {
            store
                .update(|cp| cp.claims.insert(format!("claim-{i}"), entry()))
                .await
        }
    });
    for result in futures::future::join_all(updates).await {
        result.unwrap();
    }
    assert_eq!(on_disk(&path).claims.len(), 40);
    assert_eq!(a.read(|cp| cp.claims.len()), 40);
    assert_eq!(b.read(|cp| cp.claims.len()), 40);
}
