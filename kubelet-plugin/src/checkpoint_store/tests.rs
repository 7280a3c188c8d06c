//! Tests of the checkpoint store: shared writes, boots, and two instances sharing one file.
#![allow(clippy::unwrap_used, clippy::panic)] // Test helpers may fail loudly.

use kerf_core::checkpoint::ClaimEntry;

use std::time::Duration;

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
async fn concurrent_updates_are_all_in_the_file_when_they_return() {
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

/// A checkpoint as the plugin leaves it in boot `boot_id`: two prepared claims and a GPU
/// with a time slice set.
async fn written_in(path: &Path, boot_id: &str) -> Vec<u8> {
    let (store, _) = CheckpointStore::open(path, boot_id).await.unwrap();
    store
        .update(|cp| {
            cp.claims.insert("a".into(), entry());
            cp.claims.insert("b".into(), entry());
            cp.gpu_sharing.insert(
                "GPU-0".into(),
                checkpoint::GpuSharingEntry {
                    time_slice: Some(kerf_core::mps::TimeSliceInterval::Long),
                    ..Default::default()
                },
            );
        })
        .await
        .unwrap();
    std::fs::read(path).unwrap()
}

#[tokio::test]
async fn a_checkpoint_from_an_older_boot_holds_nothing_prepared() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint.json");
    written_in(&path, "boot-1").await;
    let (store, opened) = CheckpointStore::open(&path, "boot-2").await.unwrap();
    assert_eq!(opened, Opened::Rebooted { forgotten: 2 });
    assert_eq!(store.read(|cp| cp.claims.len()), 0);
    assert_eq!(
        store.read(|cp| cp.gpu_sharing.len()),
        1,
        "what was set on a GPU stays recorded, so that start-up can undo it"
    );
    let cp = on_disk(&path);
    assert_eq!(cp.boot_id, "boot-2");
    assert!(cp.claims.is_empty());
}

#[tokio::test]
async fn the_same_boot_or_an_unknown_one_keeps_the_claims() {
    for (written, now) in [("boot-1", "boot-1"), ("boot-1", ""), ("", "boot-2")] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        written_in(&path, written).await;
        let (store, opened) = CheckpointStore::open(&path, now).await.unwrap();
        assert_eq!(
            opened,
            Opened::Loaded,
            "written in {written:?}, now {now:?}"
        );
        assert_eq!(store.read(|cp| cp.claims.len()), 2);
    }
}

/// What a power loss can leave of a checkpoint replaced without fsync: nothing, a prefix, or
/// its length in zeros. The node boots again after it, and every such file is read as
/// nothing prepared — moved aside when it does not decode — never as an error.
#[tokio::test]
async fn a_torn_or_empty_checkpoint_after_a_power_loss_holds_nothing_prepared() {
    let dir = tempfile::tempdir().unwrap();
    let whole = written_in(&dir.path().join("whole.json"), "boot-1").await;
    let len = whole.len();
    let mut leftovers: Vec<(String, Vec<u8>)> = [0, 1, len / 3, len / 2, len - 1]
        .into_iter()
        .map(|n| (format!("first {n} of {len} bytes"), whole[..n].to_vec()))
        .collect();
    leftovers.push(("zeros".into(), vec![0; len]));
    leftovers.push(("the whole file".into(), whole.clone()));
    for (what, bytes) in leftovers {
        let case = tempfile::tempdir().unwrap();
        let path = case.path().join("checkpoint.json");
        std::fs::write(&path, &bytes).unwrap();
        let (store, opened) = CheckpointStore::open(&path, "boot-2")
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(store.read(|cp| cp.claims.len()), 0, "{what}");
        match opened {
            Opened::MovedAside { moved_to, .. } => {
                assert_eq!(std::fs::read(&moved_to).unwrap(), bytes, "{what}");
            }
            Opened::Rebooted { forgotten } => assert_eq!(forgotten, 2, "{what}"),
            other => panic!("{what}: {other:?}"),
        }
        assert_eq!(on_disk(&path).boot_id, "boot-2", "{what}");
    }
}
