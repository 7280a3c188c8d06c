//! The kubelet plugin enforcing slices on their GPUs, over the fake `nvidia-cuda-mps-control`
//! and `nvidia-smi` of `kerf-fake-gpu-tools` in a mock driver root: one MPS daemon per GPU
//! with MPS slices, started before the CDI IDs are returned and stopped after the last
//! unprepare; none for exclusive or MIG devices; a failed start leaves nothing; restarts adopt
//! running daemons and stop orphans; dead daemons are restarted and reported; time slices are
//! set and restored.

use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

use crate::common;
use crate::common::mps::{
    CONTROL, MpsNode, assert_restarts_counted, prepare, seen_through, unprepare,
};
use crate::common::{GIB, TestNode, uid};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_core::alloc::{ClaimPlacement, PlacedDevice, SliceSize};
use kerf_core::mps::TimeSliceInterval;
use kerf_core::rng::SeededRng;
use kerf_core::sharing::Sharing;
use kerf_fake_gpu_tools::{Call, fail_next_mps_start};
use kerf_proto::client::Claim;
use kerf_tests::api_server::ApiServer;
use kerf_tests::fake_api::Identity;
use kerf_tests::fake_kubelet::{FakeKubelet, Pod};
use kerf_tests::wait::until;

/// A time-sliced (or other non-MPS) slice allocated as the controller writes it.
fn shared_claim(
    on: &MpsNode,
    name: &str,
    claim_uid: &str,
    minor: u32,
    sharing: Sharing,
    interval: TimeSliceInterval,
) -> Claim {
    let inventory = on.node.inventory();
    let gpu = inventory.gpu_by_minor(minor).unwrap();
    let placement = ClaimPlacement {
        key: claim_uid.to_owned(),
        devices: vec![PlacedDevice {
            request: "gpu".to_owned(),
            device: gpu.device_name(),
            gpu_uuid: gpu.uuid.clone(),
            slice: Some(SliceSize {
                memory_bytes: 8 * GIB,
                compute_percent: 25,
            }),
            sharing,
            time_slice_interval: Some(interval),
            enforcement: kerf_core::enforcement::Enforcement::default(),
        }],
    };
    let allocation = kerf_api::allocation_status(
        &placement,
        common::NODE,
        common::DRIVER,
        Time(k8s_openapi::jiff::Timestamp::now()),
    )
    .unwrap();
    on.node.add_claim(common::allocated_claim(
        name,
        claim_uid,
        &serde_json::to_value(allocation).unwrap(),
    ))
}

/// The MPS mounts of a claim's spec (pipe directories and `/dev/shm`; not the device-metadata
/// files every claim gets), as `(host, container)`.
fn mounts(node: &TestNode, claim: &Claim) -> Vec<(String, String)> {
    let spec = node.cdi_spec(&claim.uid);
    spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|d| {
            d["containerEdits"]["mounts"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|m| {
            (
                m["hostPath"].as_str().unwrap().to_owned(),
                m["containerPath"].as_str().unwrap().to_owned(),
            )
        })
        .filter(|(_, container)| {
            container.starts_with(kerf_core::mps::CONTAINER_PIPE_ROOT) || container == "/dev/shm"
        })
        .collect()
}

fn device_env(node: &TestNode, claim: &Claim) -> Vec<String> {
    let spec = node.cdi_spec(&claim.uid);
    spec["devices"][0]["containerEdits"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap().to_owned())
        .collect()
}

fn assert_shm_is_for_every_user(sharing: &MpsNode) {
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(sharing.mps_root().join("shm"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o7777, 0o1777, "a /dev/shm for clients of any user");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_daemon_per_gpu_for_all_its_slices_stopped_after_the_last_unprepare() {
    let sharing = MpsNode::new();
    let node = &sharing.node;
    let plugin = sharing.start().await;
    let (gpu0, gpu1) = (sharing.gpu_uuid(0), sharing.gpu_uuid(1));
    let a = node.slice_claim("a", &uid(1), 0, 10 * GIB, 25);
    let b = node.slice_claim("b", &uid(2), 0, 20 * GIB, 50);
    let c = node.slice_claim("c", &uid(3), 1, 10 * GIB, 25);

    // Two slices of GPU 0 prepared concurrently, then one of GPU 1.
    let results = prepare(&plugin, &[&a, &b]).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert!(prepare(&plugin, &[&c]).await[0].is_ok());

    let starts = sharing.starts(&gpu0);
    assert_eq!(
        starts.len(),
        1,
        "one daemon for both slices: {:#?}",
        sharing.calls()
    );
    let env = &starts[0].env;
    assert_eq!(
        env["CUDA_MPS_PIPE_DIRECTORY"],
        sharing.pipe(&gpu0).to_string_lossy()
    );
    assert_eq!(
        env["CUDA_MPS_LOG_DIRECTORY"],
        sharing.mps_root().join(&gpu0).join("log").to_string_lossy()
    );
    assert_eq!(sharing.starts(&gpu1).len(), 1);
    let smi: Vec<Vec<String>> = sharing
        .calls()
        .into_iter()
        .filter(|c| c.tool == "nvidia-smi")
        .map(|c| c.args)
        .collect();
    assert!(
        smi.contains(&vec![
            "-i".into(),
            gpu0.clone(),
            "-c".into(),
            "EXCLUSIVE_PROCESS".into()
        ]),
        "{smi:?}"
    );
    let (pid0, pid1) = (sharing.daemon_pid(&gpu0), sharing.daemon_pid(&gpu1));
    assert!(pid0.is_some() && pid1.is_some() && pid0 != pid1);

    // Both slices of GPU 0 see its pipe directory; the slice of GPU 1 sees another.
    let pipe0 = format!("/run/kerf/mps/{gpu0}");
    for claim in [&a, &b] {
        assert!(
            mounts(node, claim)
                .contains(&(sharing.pipe(&gpu0).to_string_lossy().into(), pipe0.clone())),
            "{:?}",
            mounts(node, claim)
        );
        assert!(device_env(node, claim).contains(&format!("CUDA_MPS_PIPE_DIRECTORY={pipe0}")));
    }
    assert!(
        device_env(node, &c).contains(&format!("CUDA_MPS_PIPE_DIRECTORY=/run/kerf/mps/{gpu1}"))
    );
    assert!(device_env(node, &a).contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M".to_owned()));
    assert!(device_env(node, &b).contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50".to_owned()));
    assert_shm_is_for_every_user(&sharing);
    let checkpoint = node.checkpoint();
    assert!(
        checkpoint["gpuSharing"][&gpu0]["mpsRoot"].is_string(),
        "the daemon is recorded durably: {checkpoint}"
    );

    // The first unprepare keeps GPU 0's daemon for the other slice; the last one stops it.
    unprepare(&plugin, &a).await;
    assert_eq!(sharing.daemon_pid(&gpu0), pid0);
    unprepare(&plugin, &b).await;
    assert_eq!(sharing.daemon_pid(&gpu0), None);
    assert!(
        !sharing.mps_root().join(&gpu0).exists(),
        "its directories are gone"
    );
    let quits: Vec<Call> = sharing
        .calls()
        .into_iter()
        .filter(|c| c.tool == CONTROL && c.stdin.contains("quit"))
        .collect();
    assert_eq!(quits.len(), 1, "stopped with quit: {quits:#?}");
    assert_eq!(
        quits[0].env["CUDA_MPS_PIPE_DIRECTORY"],
        sharing.pipe(&gpu0).to_string_lossy()
    );
    let last_smi = sharing
        .calls()
        .into_iter()
        .rev()
        .find(|c| c.tool == "nvidia-smi" && c.args.contains(&gpu0))
        .unwrap();
    assert_eq!(last_smi.args, ["-i", gpu0.as_str(), "-c", "DEFAULT"]);
    assert!(
        sharing.daemon_pid(&gpu1).is_some(),
        "GPU 1 keeps its daemon"
    );
    plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusive_gpus_and_mig_devices_get_no_daemon_and_no_tool_call() {
    let sharing = MpsNode::new();
    let node = &sharing.node;
    let plugin = sharing.start().await;
    let whole = node.device_claim("whole", &uid(1), "gpu-2");
    let results = prepare(&plugin, &[&whole]).await;
    assert!(results[0].is_ok(), "{results:?}");
    assert!(mounts(node, &whole).is_empty());
    unprepare(&plugin, &whole).await;
    plugin.shutdown().await.unwrap();

    // A MIG device stays exclusive even when its class asks for MPS.
    let mig_node = MpsNode::with_profile("a100-40gb-mig");
    let plugin = mig_node.start().await;
    let (_, parent, mig) = mig_node.node.whole_gpu_and_mig();
    let claim = mig_node.node.add_claim(common::allocated_claim(
        "mig",
        &uid(2),
        &serde_json::json!({"devices": {
            "results": [{"request": "gpu", "driver": common::DRIVER, "pool": common::NODE, "device": mig.device_name(parent)}],
            "config": [{"source": "FromClass", "opaque": {"driver": common::DRIVER, "parameters": {
                "apiVersion": kerf_api::API_VERSION, "kind": "GpuClassParameters", "sharing": {"strategy": "MPS"}}}}]
        }}),
    ));
    assert!(prepare(&plugin, &[&claim]).await[0].is_ok());
    unprepare(&plugin, &claim).await;
    plugin.shutdown().await.unwrap();

    assert!(sharing.calls().is_empty(), "{:#?}", sharing.calls());
    assert!(mig_node.calls().is_empty(), "{:#?}", mig_node.calls());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_that_fails_to_start_fails_the_prepare_and_leaves_nothing() {
    let sharing = MpsNode::new();
    let node = &sharing.node;
    let plugin = sharing.start().await;
    let gpu = sharing.gpu_uuid(0);
    let claim = node.slice_claim("a", &uid(1), 0, 10 * GIB, 25);
    fail_next_mps_start(
        &sharing.tools_root(),
        "cannot open /dev/nvidia0: no such device",
    )
    .unwrap();

    let error = prepare(&plugin, &[&claim]).await.remove(0).unwrap_err();
    assert!(error.contains(&gpu), "names the GPU: {error}");
    assert!(
        error.contains("cannot open /dev/nvidia0"),
        "the daemon's own words: {error}"
    );
    assert!(
        node.cdi_files().is_empty(),
        "no spec: {:?}",
        node.cdi_files()
    );
    assert!(node.checkpoint_claims().is_empty());
    assert!(!sharing.mps_root().join(&gpu).exists(), "no MPS directory");
    assert_eq!(sharing.daemon_pid(&gpu), None);
    let last_smi = sharing
        .calls()
        .into_iter()
        .rev()
        .find(|c| c.tool == "nvidia-smi")
        .unwrap();
    assert_eq!(
        last_smi.args.last().map(String::as_str),
        Some("DEFAULT"),
        "compute mode restored"
    );

    // The kubelet retries; this time the daemon starts.
    assert!(prepare(&plugin, &[&claim]).await[0].is_ok());
    assert!(sharing.daemon_pid(&gpu).is_some());
    unprepare(&plugin, &claim).await;
    plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_daemon_is_restarted_counted_and_reported_on_its_claims() {
    let sharing = MpsNode::new();
    let node = &sharing.node;
    let plugin = sharing.start().await;
    let gpu = sharing.gpu_uuid(0);
    let claims = [
        node.slice_claim("a", &uid(1), 0, 10 * GIB, 25),
        node.slice_claim("b", &uid(2), 0, 10 * GIB, 25),
    ];
    let refs: Vec<&Claim> = claims.iter().collect();
    assert!(prepare(&plugin, &refs).await.iter().all(Result::is_ok));
    let first = sharing.daemon_pid(&gpu).unwrap();
    // As a running container's bind mount holds it.
    let mounted_pipe = std::fs::File::open(sharing.pipe(&gpu)).unwrap();

    Command::new("kill")
        .args(["-9", &first.to_string()])
        .status()
        .unwrap();
    until("the daemon restarted", Duration::from_secs(10), || {
        sharing.daemon_pid(&gpu).is_some_and(|pid| pid != first)
    })
    .await;
    until(
        "the new daemon's socket in the pipe directory containers have mounted",
        Duration::from_secs(10),
        || seen_through(&mounted_pipe).join("control").exists(),
    )
    .await;
    assert_eq!(sharing.starts(&gpu).len(), 2);
    until(
        "a Warning Event on each claim",
        Duration::from_secs(5),
        || sharing.events.warnings().len() >= 2,
    )
    .await;
    sharing.assert_restart_warned(&gpu, &["a", "b"]);
    assert_restarts_counted(&plugin, &gpu, 1);
    for claim in &claims {
        unprepare(&plugin, claim).await;
    }
    plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_slices_are_set_by_the_first_claim_and_restored_after_the_last() {
    let sharing = MpsNode::new();
    let plugin = sharing.start().await;
    let gpu = sharing.gpu_uuid(2);
    let a = shared_claim(
        &sharing,
        "a",
        &uid(1),
        2,
        Sharing::TimeSlicing,
        TimeSliceInterval::Long,
    );
    let b = shared_claim(
        &sharing,
        "b",
        &uid(2),
        2,
        Sharing::TimeSlicing,
        TimeSliceInterval::Short,
    );
    assert!(prepare(&plugin, &[&a]).await[0].is_ok());
    assert!(prepare(&plugin, &[&b]).await[0].is_ok());
    let policy = |sharing: &MpsNode| -> Vec<Vec<String>> {
        sharing
            .calls()
            .into_iter()
            .filter(|c| {
                c.tool == "nvidia-smi"
                    && c.args.first().map(String::as_str) == Some("compute-policy")
            })
            .map(|c| c.args)
            .collect()
    };
    let set = |n: &str| -> Vec<String> {
        ["compute-policy", "-i", gpu.as_str(), "--set-timeslice", n]
            .map(str::to_owned)
            .to_vec()
    };
    assert_eq!(policy(&sharing), [set("3")], "set once, by the first claim");
    assert!(
        mounts(&sharing.node, &a).is_empty(),
        "no MPS for time-slicing"
    );
    assert!(sharing.starts(&gpu).is_empty());

    unprepare(&plugin, &a).await;
    assert_eq!(
        policy(&sharing).len(),
        1,
        "kept while a time-sliced claim remains"
    );
    unprepare(&plugin, &b).await;
    assert_eq!(
        policy(&sharing),
        [set("3"), set("0")],
        "restored to the default"
    );
    plugin.shutdown().await.unwrap();
}

/// The plugin as its own process with the fake tools, so that it can be SIGKILLed.
fn spawn_plugin(sharing: &MpsNode, kubeconfig: &Path, generation: u32) -> Child {
    sharing
        .plugin_command(kubeconfig, &generation.to_string(), &[])
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_killed_with_daemons_running_adopts_them_and_stops_orphans() {
    let sharing = MpsNode::new();
    let node = &sharing.node;
    let server = ApiServer::start(node.api.clone()).await.unwrap();
    let kubeconfig = node.root.join("kubeconfig");
    server
        .write_kubeconfig_for(&kubeconfig, Identity::kerf_kubelet_plugin(common::NODE))
        .unwrap();
    let (gpu0, gpu1) = (sharing.gpu_uuid(0), sharing.gpu_uuid(1));
    let kept = node.slice_claim("kept", &uid(1), 0, 10 * GIB, 25);
    let gone = node.slice_claim("gone", &uid(2), 1, 10 * GIB, 25);

    let mut first = spawn_plugin(&sharing, &kubeconfig, 1);
    let kubelet = FakeKubelet::start(node.kubelet_config());
    kubelet
        .wait_for_registration(1, Duration::from_secs(10))
        .await
        .unwrap();
    let pod_kept = Pod::new("pod-kept").with_claim(common::DRIVER, kept.clone());
    let pod_gone = Pod::new("pod-gone").with_claim(common::DRIVER, gone.clone());
    kubelet.prepare_pod(&pod_kept).await.unwrap();
    kubelet.prepare_pod(&pod_gone).await.unwrap();
    let (pid0, pid1) = (
        sharing.daemon_pid(&gpu0).unwrap(),
        sharing.daemon_pid(&gpu1).unwrap(),
    );

    // SIGKILL, and meanwhile the claim of GPU 1 leaves the checkpoint (as if its unprepare
    // had finished just before the kill but the daemon stop had not).
    first.kill().unwrap();
    first.wait().unwrap();
    let mut checkpoint = node.checkpoint();
    checkpoint["claims"]
        .as_object_mut()
        .unwrap()
        .remove(&gone.uid);
    std::fs::write(
        node.checkpoint_file(),
        serde_json::to_vec(&checkpoint).unwrap(),
    )
    .unwrap();

    let mut second = spawn_plugin(&sharing, &kubeconfig, 2);
    kubelet
        .wait_for_registration(2, Duration::from_secs(10))
        .await
        .unwrap();
    until("the orphan stopped", Duration::from_secs(10), || {
        sharing.daemon_pid(&gpu1).is_none()
    })
    .await;
    assert_eq!(
        sharing.daemon_pid(&gpu0),
        Some(pid0),
        "adopted, not restarted"
    );
    assert_eq!(sharing.starts(&gpu0).len(), 1, "no duplicate daemon");
    assert!(!sharing.mps_root().join(&gpu1).exists());
    assert_ne!(pid0, pid1);

    kubelet.unprepare_pod(&pod_kept).await.unwrap();
    until(
        "the adopted daemon stopped",
        Duration::from_secs(10),
        || sharing.daemon_pid(&gpu0).is_none(),
    )
    .await;
    second.kill().unwrap();
    second.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slices_full_life_as_the_fake_tools_record_it() {
    let sharing = MpsNode::new();
    let plugin = sharing.start().await;
    let gpu = sharing.gpu_uuid(3);
    let claim = sharing.node.slice_claim("life", &uid(1), 3, 10 * GIB, 25);
    assert!(prepare(&plugin, &[&claim]).await[0].is_ok());
    unprepare(&plugin, &claim).await;
    plugin.shutdown().await.unwrap();

    let recorded = sharing.calls();
    for call in &recorded {
        println!(
            "{} {:?} env={:?} stdin={:?}",
            call.tool, call.args, call.env, call.stdin
        );
    }
    let steps: Vec<(&str, Vec<&str>, &str)> = recorded
        .iter()
        .map(|c| {
            (
                c.tool.as_str(),
                c.args.iter().map(String::as_str).collect(),
                c.stdin.as_str(),
            )
        })
        .collect();
    assert_eq!(
        steps,
        [
            (
                "nvidia-smi",
                vec!["-i", &gpu, "-c", "EXCLUSIVE_PROCESS"],
                ""
            ),
            (CONTROL, vec!["-d"], ""),
            ("mps-daemon", vec![], ""),
            // The server's limits: the slice's, read back.
            (
                CONTROL,
                vec![],
                "set_default_device_pinned_mem_limit 0 10240M\n\
                 set_default_active_thread_percentage 25\n\
                 get_server_list\n"
            ),
            (
                CONTROL,
                vec![],
                "get_default_device_pinned_mem_limit 0\n\
                 get_default_active_thread_percentage\n"
            ),
            (CONTROL, vec![], "quit\n"),
            ("nvidia-smi", vec!["-i", &gpu, "-c", "DEFAULT"], ""),
        ]
    );
    let pipe = sharing.pipe(&gpu).to_string_lossy().into_owned();
    for call in recorded.iter().filter(|c| c.tool != "nvidia-smi") {
        assert_eq!(call.env["CUDA_VISIBLE_DEVICES"], gpu, "{call:?}");
        assert_eq!(call.env["CUDA_MPS_PIPE_DIRECTORY"], pipe, "{call:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_prepares_and_unprepares_of_one_gpu_never_lose_or_duplicate_its_daemon() {
    let mut restarts_across_seeds = 0;
    for seed in 1..=4_u64 {
        let sharing = MpsNode::new();
        let plugin = Arc::new(sharing.start().await);
        let gpu = sharing.gpu_uuid(0);
        let claims: Vec<Claim> = (0..3)
            .map(|i| {
                sharing
                    .node
                    .slice_claim(&format!("c{i}"), &uid(i + 1), 0, 4 * GIB, 10)
            })
            .collect();
        // Seeded, so that a failing seed can be replayed.
        let mut rng = SeededRng::new(seed);
        // Each claim is prepared and unprepared a few times, all claims at once, with
        // random pauses: the last unprepare of one round races the first prepare of the next.
        let tasks = claims.iter().cloned().map(|claim| {
            let plugin = Arc::clone(&plugin);
            let pauses: Vec<u64> = (0..10).map(|_| rng.next_u64() % 8).collect();
            tokio::spawn(async move {
                for pair in pauses.chunks(2) {
                    tokio::time::sleep(Duration::from_millis(pair[0])).await;
                    let prepared = prepare(&plugin, &[&claim]).await.remove(0);
                    assert!(prepared.is_ok(), "{prepared:?}");
                    tokio::time::sleep(Duration::from_millis(pair[1])).await;
                    unprepare(&plugin, &claim).await;
                }
            })
        });
        for task in futures::future::join_all(tasks).await {
            task.unwrap();
        }
        assert_eq!(
            sharing.daemon_pid(&gpu),
            None,
            "seed {seed}: no claim left, no daemon"
        );
        let recorded = sharing.calls();
        let starts = recorded.iter().filter(|c| c.tool == "mps-daemon").count();
        let quits = recorded.iter().filter(|c| c.stdin.contains("quit")).count();
        assert!(starts >= 1, "seed {seed}");
        restarts_across_seeds += starts - 1;
        assert_eq!(
            starts, quits,
            "seed {seed}: every daemon started was stopped once"
        );

        // One more claim after the storm gets a daemon again.
        let last = sharing.node.slice_claim("last", &uid(99), 0, 4 * GIB, 10);
        assert!(prepare(&plugin, &[&last]).await[0].is_ok());
        assert!(sharing.daemon_pid(&gpu).is_some(), "seed {seed}");
        unprepare(&plugin, &last).await;
        Arc::try_unwrap(plugin)
            .ok()
            .unwrap()
            .shutdown()
            .await
            .unwrap();
    }
    assert!(
        restarts_across_seeds > 0,
        "no seed let the GPU run out of claims mid-storm; the race was not exercised"
    );
}
