//! MPS slices in real containers: the plugin runs the fake `nvidia-cuda-mps-control` of
//! `kerf-fake-gpu-tools` (built here as `kerf-test-gpu-tools`) in a mock driver root, and
//! podman resolves the CDI devices it returns. Each container reports the pipe directory its
//! `CUDA_MPS_PIPE_DIRECTORY` names, what is in it (the daemon's `control` socket and PID
//! file), and its `/dev/shm`: slices of one GPU must reach the same daemon, slices of
//! another GPU another one, and every slice the node-wide shared-memory directory.
//!
//! Under `CI=true` a missing podman, runc or static busybox fails this test; elsewhere it is
//! skipped with the reason printed (the rules of `cdi_runtime.rs`).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt as _;
use std::time::Duration;

use crate::common;
use crate::common::mps::MpsNode;
use crate::common::{GIB, uid};
use kerf_core::mps::{CONTAINER_PIPE_ROOT, PID_FILE, SHM_DIRECTORY_NAME};
use kerf_proto::client::Claim;
use kerf_tests::fake_kubelet::{FakeKubelet, Pod, cdi_ids};
use kerf_tests::podman::{ContainerRun, Podman};

/// The file the host writes into the node-wide shared-memory directory.
const SHM_MARKER: &str = "kerf-host-marker";

/// podman, or `None` after printing why the test is skipped (a failure under `CI=true`).
fn podman_or_skip(test: &str) -> Option<Podman> {
    Podman::for_test(test, std::env::var("CI").is_ok_and(|v| v == "true"))
}

/// Runs in the container. Writes `/dev/shm/<name>` so that the host can see it arrived in
/// the node-wide directory, not in a container-private one.
fn mps_script(name: &str) -> String {
    format!(
        r#"set -e
d="$CUDA_MPS_PIPE_DIRECTORY"
echo "pipe=$d"
echo "inode=$(stat -c %i "$d")"
echo "entries=$(ls -A "$d" | sort | tr '\n' ' ')"
echo "control=$(stat -c %F "$d/control")"
echo "pid=$(cat "$d/{PID_FILE}")"
echo "marker=$(cat /dev/shm/{SHM_MARKER})"
echo "{name}" > /dev/shm/from-{name}
echo "end=1"
"#
    )
}

/// What one container printed, as `key=value` lines.
fn parse(output: &str) -> BTreeMap<String, String> {
    let seen: BTreeMap<String, String> = output
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect();
    assert!(
        seen.contains_key("end"),
        "the script did not finish: {output}"
    );
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_of_one_gpu_reach_one_daemon_from_their_containers() {
    let test = "slices_of_one_gpu_reach_one_daemon_from_their_containers";
    let Some(podman) = podman_or_skip(test) else {
        return;
    };
    let mps = MpsNode::with_profile("h100-sxm-80gb:2");
    let node = &mps.node;
    let (gpu0, gpu1) = (mps.gpu_uuid(0), mps.gpu_uuid(1));
    let claims: Vec<(Claim, &str)> = vec![
        (node.slice_claim("a", &uid(1), 0, 10 * GIB, 25), &gpu0),
        (node.slice_claim("b", &uid(2), 0, 20 * GIB, 50), &gpu0),
        (node.slice_claim("c", &uid(3), 1, 10 * GIB, 25), &gpu1),
    ];
    let plugin = mps.start().await;
    let kubelet = FakeKubelet::start(node.kubelet_config());
    kubelet
        .wait_for_registration(1, Duration::from_secs(10))
        .await
        .unwrap();
    // One pod per slice, as three workloads sharing the GPUs would be.
    let pods: Vec<Pod> = claims
        .iter()
        .map(|(claim, _)| {
            Pod::new(&format!("pod-{}", claim.name)).with_claim(common::DRIVER, claim.clone())
        })
        .collect();
    let mut ids = Vec::new();
    for pod in &pods {
        ids.push(cdi_ids(&kubelet.prepare_pod(pod).await.unwrap()));
    }
    let shm = mps.mps_root().join(SHM_DIRECTORY_NAME);
    std::fs::write(shm.join(SHM_MARKER), "from the host\n").unwrap();
    let rootfs = node.root.join("rootfs");
    podman.make_rootfs(&rootfs).unwrap();

    let mut seen = Vec::new();
    for ((claim, _), ids) in claims.iter().zip(ids) {
        assert_eq!(ids.len(), 1, "{ids:?}");
        let (podman, cdi_dir, rootfs) = (podman.clone(), node.cdi_dir(), rootfs.clone());
        let script = mps_script(&claim.name);
        let output = tokio::task::spawn_blocking(move || {
            podman.run(&ContainerRun {
                cdi_dir: &cdi_dir,
                devices: &ids,
                rootfs: &rootfs,
                script: &script,
                timeout: Duration::from_secs(30),
            })
        })
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{}: {e}", claim.name));
        seen.push(parse(&output));
    }

    for ((claim, gpu), seen) in claims.iter().zip(&seen) {
        assert_sees_its_daemon(&mps, &claim.name, gpu, seen);
    }
    // Both slices of GPU 0 share its daemon; the slice of GPU 1 has its own.
    let (a, b, c) = (&seen[0], &seen[1], &seen[2]);
    for key in ["pipe", "inode", "pid", "entries"] {
        assert_eq!(a[key], b[key], "{key}: {a:?} {b:?}");
    }
    for key in ["pipe", "inode", "pid"] {
        assert_ne!(a[key], c[key], "{key}: {a:?} {c:?}");
    }

    for pod in &pods {
        kubelet.unprepare_pod(pod).await.unwrap();
    }
    assert_eq!(mps.daemon_pid(&gpu0), None, "stopped after the last slice");
    assert_eq!(mps.daemon_pid(&gpu1), None, "stopped after the last slice");
    plugin.shutdown().await.unwrap();
}

/// What the container of slice `name` of `gpu` saw is that GPU's daemon on the host, and the
/// node-wide shared-memory directory.
fn assert_sees_its_daemon(mps: &MpsNode, name: &str, gpu: &str, seen: &BTreeMap<String, String>) {
    let pipe = mps.pipe(gpu);
    let shm = mps.mps_root().join(SHM_DIRECTORY_NAME);
    assert_eq!(
        seen["pipe"],
        format!("{CONTAINER_PIPE_ROOT}/{gpu}"),
        "{name}: {seen:?}"
    );
    // The very directory of the daemon on the host (bind mounts keep the inode), with the
    // daemon's socket and the PID of the daemon that runs.
    assert_eq!(
        seen["inode"],
        std::fs::metadata(&pipe).unwrap().ino().to_string(),
        "{name}: {seen:?}"
    );
    let entries: Vec<&str> = seen["entries"].split_whitespace().collect();
    assert!(
        entries.contains(&"control") && entries.contains(&PID_FILE),
        "{name}: {entries:?}"
    );
    assert_eq!(seen["control"], "socket", "{name}: {seen:?}");
    assert_eq!(
        seen["pid"],
        mps.daemon_pid(gpu).unwrap().to_string(),
        "{name}: {seen:?}"
    );
    assert_eq!(seen["marker"], "from the host", "{name}: {seen:?}");
    assert_eq!(
        std::fs::read_to_string(shm.join(format!("from-{name}"))).unwrap(),
        format!("{name}\n"),
        "what {name} wrote to /dev/shm is in the node-wide directory"
    );
}
