//! SIGKILL as soon as a prepare returned, then the spec lost while the plugin was down (a
//! removal, or a file left empty): the restarted plugin must have the spec back, whole and
//! the same, before either of its sockets accepts a connection — the kubelet cannot call
//! before that, and a container started with the IDs the first prepare returned finds them
//! defined. A repeat prepare then returns the same IDs from the checkpoint, without a GET.

use std::path::Path;

use super::{Cluster, cdi_ids, defined_ids, prepare, register, spec_when_the_sockets_open};
use crate::common::cdi_spec_file;
use crate::common::uid;

/// What happened to the spec file while the plugin was down.
#[derive(Debug, Clone, Copy)]
enum Damage {
    /// Removed.
    Deleted,
    /// Left empty.
    Truncated,
}

impl Damage {
    fn apply(self, path: &Path) {
        match self {
            Damage::Deleted => std::fs::remove_file(path).unwrap(),
            Damage::Truncated => {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .unwrap()
                    .set_len(0)
                    .unwrap();
            }
        }
    }
}

async fn killed_after_a_prepare_and_restarted(damage: Damage) {
    let cluster = Cluster::new().await;
    let claim = cluster.node.device_claim("crash-restore", &uid(1), "gpu-0");
    let spec_path = cluster.spec_path(&claim);

    let mut first = cluster.spawn_plugin(1);
    let registered = register(&cluster, &first).await;
    let devices = prepare(&registered, &claim, &first).await;
    first.kill();
    drop(registered);

    let written = std::fs::read(&spec_path).unwrap();
    assert_eq!(
        defined_ids(&written),
        cdi_ids(&devices),
        "the spec defined the returned IDs when the prepare returned"
    );
    assert_eq!(
        cluster.node.checkpoint_claims(),
        [(claim.uid.clone(), "PrepareCompleted".to_owned())],
        "the checkpoint entry was written before the IDs were returned"
    );
    damage.apply(&spec_path);
    let gets_before_restart = cluster.claim_gets(&claim);

    let mut second = cluster.spawn_plugin(2);
    let restored = spec_when_the_sockets_open(&cluster, &mut second, &claim).await;
    assert_eq!(
        restored.as_deref(),
        Some(written.as_slice()),
        "{damage:?} spec restored before the sockets opened; plugin log:\n{}",
        second.log()
    );
    assert_eq!(
        cluster.node.cdi_files(),
        [cdi_spec_file(&claim.uid)],
        "no temporary or other files"
    );

    let registered = register(&cluster, &second).await;
    let again = prepare(&registered, &claim, &second).await;
    assert_eq!(
        again, devices,
        "a repeat prepare returns the same devices and IDs"
    );
    assert_eq!(
        cluster.claim_gets(&claim),
        gets_before_restart,
        "the repeat prepare was answered from the checkpoint"
    );
    assert_eq!(std::fs::read(&spec_path).unwrap(), written);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_deleted_after_a_kill_is_back_before_the_plugin_serves() {
    killed_after_a_prepare_and_restarted(Damage::Deleted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_truncated_after_a_kill_is_whole_again_before_the_plugin_serves() {
    killed_after_a_prepare_and_restarted(Damage::Truncated).await;
}
