//! The atomic writer: content, overwrite, no temporary files left, failures clean up.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Test helpers may fail loudly.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use kerf_core::Error;
use kerf_core::fsutil::{
    fsync_dir, remove_durable, remove_if_exists, remove_stale_temp_files, write_atomic,
    write_replace,
};

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

fn io_op(e: Error) -> &'static str {
    match e {
        Error::Io { op, .. } => op,
        other => panic!("expected an Io error, got {other:?}"),
    }
}

#[test]
fn writes_and_overwrites_without_leftovers() {
    let dir = tempfile::tempdir().unwrap();
    write_atomic(dir.path(), "a.json", b"first").unwrap();
    assert_eq!(fs::read(dir.path().join("a.json")).unwrap(), b"first");
    write_atomic(dir.path(), "a.json", b"second, longer").unwrap();
    assert_eq!(
        fs::read(dir.path().join("a.json")).unwrap(),
        b"second, longer"
    );
    write_atomic(dir.path(), "a.json", b"").unwrap();
    assert_eq!(fs::read(dir.path().join("a.json")).unwrap(), b"");
    assert_eq!(names(dir.path()), ["a.json"]);
}

#[test]
fn missing_directory_fails_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    assert_eq!(
        io_op(write_atomic(&missing, "a.json", b"x").unwrap_err()),
        "create"
    );
    assert!(!missing.exists());
    assert!(names(dir.path()).is_empty());
}

#[test]
fn directory_that_is_a_file_fails() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    fs::write(&file, b"x").unwrap();
    assert_eq!(
        io_op(write_atomic(&file, "a.json", b"x").unwrap_err()),
        "create"
    );
}

#[test]
fn failed_rename_removes_the_temporary_file_and_keeps_the_target() {
    let dir = tempfile::tempdir().unwrap();
    // A non-empty directory where the target should go: the rename fails even for root.
    fs::create_dir(dir.path().join("a.json")).unwrap();
    fs::write(dir.path().join("a.json/keep"), b"k").unwrap();
    let err = write_atomic(dir.path(), "a.json", b"x").unwrap_err();
    assert_eq!(io_op(err), "rename");
    assert_eq!(
        names(dir.path()),
        ["a.json"],
        "temporary file must be removed"
    );
    assert_eq!(fs::read(dir.path().join("a.json/keep")).unwrap(), b"k");
}

#[test]
fn read_only_directory_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let ro = dir.path().join("ro");
    fs::create_dir(&ro).unwrap();
    fs::write(ro.join("a.json"), b"old").unwrap();
    fs::set_permissions(&ro, fs::Permissions::from_mode(0o555)).unwrap();
    // Root ignores directory permissions; the failure case only exists for other users.
    let probe = fs::write(ro.join("probe"), b"");
    if probe.is_ok() {
        fs::remove_file(ro.join("probe")).unwrap();
        fs::set_permissions(&ro, fs::Permissions::from_mode(0o755)).unwrap();
        eprintln!("running as root: read-only directory case not exercised");
        return;
    }
    assert_eq!(
        io_op(write_atomic(&ro, "a.json", b"new").unwrap_err()),
        "create"
    );
    assert_eq!(fs::read(ro.join("a.json")).unwrap(), b"old");
    assert_eq!(names(&ro), ["a.json"]);
    fs::set_permissions(&ro, fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn concurrent_writers_of_one_target_leave_one_whole_version() {
    let dir = tempfile::tempdir().unwrap();
    let contents: Vec<Vec<u8>> = (0..8u8)
        .map(|i| vec![b'a' + i; 4096 * usize::from(i + 1)])
        .collect();
    std::thread::scope(|s| {
        for c in &contents {
            let d = dir.path();
            s.spawn(move || {
                for _ in 0..5 {
                    write_atomic(d, "t.json", c).unwrap();
                }
            });
        }
    });
    let got = fs::read(dir.path().join("t.json")).unwrap();
    assert!(
        contents.contains(&got),
        "torn or mixed content of {} bytes",
        got.len()
    );
    assert_eq!(names(dir.path()), ["t.json"]);
}

#[test]
fn remove_durable_reports_presence() {
    let dir = tempfile::tempdir().unwrap();
    write_atomic(dir.path(), "a.json", b"x").unwrap();
    assert!(remove_durable(dir.path(), "a.json").unwrap());
    assert!(!remove_durable(dir.path(), "a.json").unwrap());
    assert!(names(dir.path()).is_empty());
    // Removing a directory entry that is a directory is an error, not "absent".
    fs::create_dir(dir.path().join("d")).unwrap();
    assert_eq!(
        io_op(remove_durable(dir.path(), "d").unwrap_err()),
        "remove"
    );
}

#[test]
fn fsync_dir_of_missing_directory_fails() {
    let dir = tempfile::tempdir().unwrap();
    fsync_dir(dir.path()).unwrap();
    assert_eq!(
        io_op(fsync_dir(&dir.path().join("missing")).unwrap_err()),
        "open dir"
    );
}

#[test]
fn stale_temporary_files_of_our_targets_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        ".k8s.gpu.kerf.dev-gpu_u1.json.tmp-123-0",
        ".k8s.gpu.kerf.dev-gpu_u2.json.tmp-9-77",
        ".nvidia.com-gpu_x.json.tmp-1-1",
        "k8s.gpu.kerf.dev-gpu_u3.json",
        ".hidden",
    ] {
        fs::write(dir.path().join(name), b"x").unwrap();
    }
    let removed = remove_stale_temp_files(dir.path(), "k8s.gpu.kerf.dev-gpu_").unwrap();
    assert_eq!(removed.len(), 2, "{removed:?}");
    assert_eq!(
        names(dir.path()),
        [
            ".hidden",
            ".nvidia.com-gpu_x.json.tmp-1-1",
            "k8s.gpu.kerf.dev-gpu_u3.json"
        ]
    );
    assert!(
        remove_stale_temp_files(&dir.path().join("missing"), "")
            .unwrap()
            .is_empty()
    );
}

#[test]
fn commit_applies_a_group_of_writes_and_removals_in_order() {
    use kerf_core::fsutil::{FileChange, commit};
    let dir = tempfile::tempdir().unwrap();
    write_atomic(dir.path(), "old.json", b"old").unwrap();
    let changes = [
        FileChange::Write {
            name: "a.json",
            contents: b"a",
        },
        FileChange::Write {
            name: "b.json",
            contents: b"b",
        },
        FileChange::Remove { name: "old.json" },
        FileChange::Remove {
            name: "never-there.json",
        },
        // A later change to the same file wins, as if applied one by one.
        FileChange::Write {
            name: "a.json",
            contents: b"a2",
        },
    ];
    let results: Vec<bool> = commit(dir.path(), &changes)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(results, [true, true, true, false, true]);
    assert_eq!(names(dir.path()), ["a.json", "b.json"]);
    assert_eq!(fs::read(dir.path().join("a.json")).unwrap(), b"a2");
    assert_eq!(fs::read(dir.path().join("b.json")).unwrap(), b"b");
}

#[test]
fn commit_fails_only_the_change_that_cannot_be_made() {
    use kerf_core::fsutil::{FileChange, commit};
    let dir = tempfile::tempdir().unwrap();
    // A directory where a file should go: its rename fails, the others land.
    fs::create_dir(dir.path().join("blocked.json")).unwrap();
    fs::write(dir.path().join("blocked.json").join("inside"), b"x").unwrap();
    let changes = [
        FileChange::Write {
            name: "ok-1.json",
            contents: b"1",
        },
        FileChange::Write {
            name: "blocked.json",
            contents: b"2",
        },
        FileChange::Write {
            name: "ok-3.json",
            contents: b"3",
        },
    ];
    let results = commit(dir.path(), &changes);
    assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
    let Err(e) = &results[1] else {
        panic!("expected the blocked write to fail: {results:?}")
    };
    assert!(e.to_string().contains("blocked.json"), "{e}");
    assert_eq!(
        names(dir.path()),
        ["blocked.json", "ok-1.json", "ok-3.json"]
    );
}

#[test]
fn commit_into_a_missing_directory_fails_every_write() {
    use kerf_core::fsutil::{FileChange, commit};
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let changes = [
        FileChange::Write {
            name: "a.json",
            contents: b"a",
        },
        FileChange::Write {
            name: "b.json",
            contents: b"b",
        },
    ];
    for result in commit(&missing, &changes) {
        assert_eq!(io_op(result.unwrap_err()), "create");
    }
}

#[test]
fn write_replace_creates_and_overwrites_without_leftovers() {
    let dir = tempfile::tempdir().unwrap();
    write_replace(dir.path(), "a.json", b"first, longer").unwrap();
    assert_eq!(
        fs::read(dir.path().join("a.json")).unwrap(),
        b"first, longer"
    );
    write_replace(dir.path(), "a.json", b"second").unwrap();
    assert_eq!(fs::read(dir.path().join("a.json")).unwrap(), b"second");
    write_replace(dir.path(), "a.json", b"").unwrap();
    assert_eq!(fs::read(dir.path().join("a.json")).unwrap(), b"");
    assert_eq!(names(dir.path()), ["a.json"]);
}

#[test]
fn write_replace_into_a_missing_directory_fails_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let err = write_replace(&missing, "a.json", b"x").unwrap_err();
    let message = err.to_string();
    assert!(message.contains("missing"), "names the path: {message}");
    assert_eq!(io_op(err), "create");
    assert!(!missing.exists());
}

#[test]
fn a_failed_write_replace_keeps_the_target_and_removes_its_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    // A non-empty directory where the target should go: the rename fails even for root.
    fs::create_dir(dir.path().join("a.json")).unwrap();
    fs::write(dir.path().join("a.json/keep"), b"k").unwrap();
    let err = write_replace(dir.path(), "a.json", b"x").unwrap_err();
    assert_eq!(io_op(err), "rename");
    assert_eq!(names(dir.path()), ["a.json"]);
    assert_eq!(fs::read(dir.path().join("a.json/keep")).unwrap(), b"k");
}

/// The point of the rename: a reader polling the file while it is replaced again and
/// again (as a CDI runtime rescanning its directory would) only ever sees whole versions.
/// Writing the target in place would show it empty or half-written.
#[test]
fn a_reader_never_sees_a_torn_or_empty_file_during_write_replace() {
    let dir = tempfile::tempdir().unwrap();
    let versions: Vec<Vec<u8>> = (0..2u8).map(|i| vec![b'a' + i; 256 * 1024]).collect();
    write_replace(dir.path(), "t.json", &versions[0]).unwrap();
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..200 {
                write_replace(dir.path(), "t.json", &versions[i % 2]).unwrap();
            }
            done.store(true, std::sync::atomic::Ordering::Release);
        });
        let mut reads = 0;
        while !done.load(std::sync::atomic::Ordering::Acquire) || reads == 0 {
            let got = fs::read(dir.path().join("t.json")).unwrap();
            assert!(
                versions.contains(&got),
                "read {} bytes that are neither version",
                got.len()
            );
            reads += 1;
        }
    });
    assert_eq!(names(dir.path()), ["t.json"]);
}

#[test]
fn remove_if_exists_reports_presence_and_refuses_directories() {
    let dir = tempfile::tempdir().unwrap();
    write_replace(dir.path(), "a.json", b"x").unwrap();
    assert!(remove_if_exists(dir.path(), "a.json").unwrap());
    assert!(!remove_if_exists(dir.path(), "a.json").unwrap());
    assert!(names(dir.path()).is_empty());
    // A directory under the name is an error, not "absent".
    fs::create_dir(dir.path().join("d")).unwrap();
    assert_eq!(
        io_op(remove_if_exists(dir.path(), "d").unwrap_err()),
        "remove"
    );
    assert_eq!(names(dir.path()), ["d"]);
}
