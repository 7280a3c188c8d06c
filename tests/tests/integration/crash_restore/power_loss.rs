//! A power loss: the node boots again (a new boot ID) with whatever the disk kept of the
//! checkpoint, which is replaced without fsync — the last file whole, nothing, half of it, or
//! its length in zeros — and with a spec left truncated in a CDI directory on a disk. The
//! restarted plugin must read every one of them as "nothing prepared in this boot", never
//! fail or panic: before it serves, no spec of the older boot is left and the checkpoint
//! holds no claim. The kubelet then prepares the claims again (it keeps whether a claim is
//! prepared in memory only), and gets the same CDI IDs as before the power loss.

use std::path::Path;

use super::{Cluster, cdi_ids, defined_ids, prepare, register, spec_when_the_sockets_open};
use crate::common::uid;

/// What the disk kept of the checkpoint.
#[derive(Debug, Clone, Copy)]
enum Leftover {
    Whole,
    Empty,
    Torn,
    Zeros,
}

impl Leftover {
    fn apply(self, path: &Path) {
        let whole = std::fs::read(path).unwrap();
        let kept = match self {
            Leftover::Whole => whole,
            Leftover::Empty => Vec::new(),
            Leftover::Torn => whole[..whole.len() / 2].to_vec(),
            Leftover::Zeros => vec![0; whole.len()],
        };
        std::fs::write(path, kept).unwrap();
    }
}

async fn after_a_power_loss(leftover: Leftover) {
    let cluster = Cluster::new().await;
    let claims = [
        cluster.node.device_claim("power-a", &uid(1), "gpu-0"),
        cluster.node.device_claim("power-b", &uid(2), "gpu-1"),
    ];
    let mut first = cluster.spawn_plugin(1);
    let registered = register(&cluster, &first).await;
    let mut before = Vec::new();
    for claim in &claims {
        before.push(prepare(&registered, claim, &first).await);
    }
    first.kill();
    drop(registered);

    leftover.apply(&cluster.node.checkpoint_file());
    std::fs::OpenOptions::new()
        .write(true)
        .open(cluster.spec_path(&claims[0]))
        .unwrap()
        .set_len(0)
        .unwrap();
    std::fs::write(cluster.node.root.join("boot_id"), "boot-2\n").unwrap();

    let mut second = cluster.spawn_plugin(2);
    let spec = spec_when_the_sockets_open(&cluster, &mut second, &claims[0]).await;
    let log = second.log();
    assert_eq!(
        spec, None,
        "{leftover:?}: a spec of the older boot; log:\n{log}"
    );
    assert_eq!(
        cluster.node.cdi_files(),
        Vec::<String>::new(),
        "{leftover:?}: nothing of the older boot is left; log:\n{log}"
    );
    assert_eq!(
        cluster.node.checkpoint_claims(),
        Vec::<(String, String)>::new(),
        "{leftover:?}: nothing is prepared in this boot"
    );
    assert!(!log.contains("panicked"), "{leftover:?}: {log}");

    let registered = register(&cluster, &second).await;
    for (claim, devices) in claims.iter().zip(&before) {
        let again = prepare(&registered, claim, &second).await;
        assert_eq!(&again, devices, "{leftover:?}: the same devices and IDs");
        let spec = std::fs::read(cluster.spec_path(claim)).unwrap();
        assert_eq!(defined_ids(&spec), cdi_ids(&again));
    }
    let unprepared = registered.unprepare(&claims).await.unwrap();
    assert!(unprepared.values().all(Result::is_ok), "{unprepared:?}");
    assert_eq!(cluster.node.cdi_files(), Vec::<String>::new());
    assert!(cluster.node.checkpoint_claims().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_checkpoint_of_an_older_boot_holds_nothing_prepared() {
    after_a_power_loss(Leftover::Whole).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_checkpoint_after_a_power_loss_holds_nothing_prepared() {
    after_a_power_loss(Leftover::Empty).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_checkpoint_after_a_power_loss_holds_nothing_prepared() {
    after_a_power_loss(Leftover::Torn).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zeroed_checkpoint_after_a_power_loss_holds_nothing_prepared() {
    after_a_power_loss(Leftover::Zeros).await;
}
