//! The kubelet plugin, driven exactly as the kubelet drives it: over its real Unix sockets,
//! registration first, then batched v1/v1beta1 prepare and unprepare calls. The API server
//! is an in-memory fake behind a real kube client.

#![allow(
    clippy::needless_pass_by_value,
    reason = "fixtures take JSON values as the tests write them inline"
)]

use std::collections::HashMap;
use std::sync::Arc;

use crate::plugin_node::*;
use kerf_kubelet_plugin::claim_reader::ApiClaimReader;
use kerf_kubelet_plugin::config::Discovery;
use kerf_kubelet_plugin::plugin::{self, Connections};
use kerf_proto::client::{Claim, ClaimResult, DraVersion, KNOWN_SERVICES};
use serde_json::json;

#[tokio::test]
async fn registers_like_a_kubelet_wants() {
    let node = Node::new();
    let plugin = node.start().await;
    let registered = node.kubelet(&KNOWN_SERVICES).await;
    assert_eq!(registered.info.r#type, "DRAPlugin");
    assert_eq!(registered.info.name, DRIVER);
    assert_eq!(
        registered.info.endpoint,
        node.config().dra_socket.to_string_lossy()
    );
    // The health service is listed last: a kubelet takes the first entry it knows as the
    // DRA service and skips the rest, so it can never be chosen.
    assert_eq!(
        registered.info.supported_versions,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth"
        ]
    );
    assert_eq!(registered.version, DraVersion::V1);
    assert!(
        plugin.ready_flags().is_ready(),
        "ready once serving and registered"
    );
    plugin.shutdown().await.unwrap();
    assert!(
        !node.config().dra_socket.exists(),
        "DRA socket removed on shutdown"
    );
    assert!(
        !node.config().registration_socket.exists(),
        "registration socket removed on shutdown"
    );
}

#[tokio::test]
async fn prepares_and_unprepares_over_v1() {
    let node = Node::new();
    node.add_claim(whole_gpu_claim("a", UID_A, "gpu-3"));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;

    let answers = kubelet.prepare(&[claim("a", UID_A)]).await.unwrap();
    let devices = answers[UID_A].clone().unwrap();
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].pool_name, NODE);
    assert_eq!(devices[0].device_name, "gpu-3");
    assert_eq!(devices[0].request_names, ["gpu"]);
    assert_eq!(
        devices[0].cdi_device_ids,
        [format!("k8s.{DRIVER}/gpu={UID_A}-gpu-3")]
    );

    let spec = node.cdi_spec(UID_A);
    assert_eq!(spec["kind"], format!("k8s.{DRIVER}/gpu"));
    let text = spec.to_string();
    assert!(text.contains("/dev/nvidia3"), "{text}");
    assert!(text.contains(&format!("KERF_CLAIM_UID={UID_A}")), "{text}");
    assert!(text.contains("NVIDIA_VISIBLE_DEVICES=void"), "{text}");
    assert!(
        text.contains("/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
        "driver libraries mounted: {text}"
    );
    assert!(
        text.contains("/usr/bin/nvidia-smi"),
        "driver binaries mounted: {text}"
    );
    assert_eq!(
        spec["cdiVersion"], "0.5.0",
        "hostPath in mock mode needs 0.5.0 and nothing more"
    );
    assert_eq!(
        node.checkpoint()["claims"][UID_A]["state"],
        "PrepareCompleted"
    );

    let answers = kubelet.unprepare(&[claim("a", UID_A)]).await.unwrap();
    assert_eq!(answers[UID_A], Ok(()));
    assert!(node.cdi_files().is_empty(), "{:?}", node.cdi_files());
    assert!(node.checkpoint()["claims"].get(UID_A).is_none());
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_v1beta1_only_kubelet_is_served_too() {
    let node = Node::new();
    node.add_claim(whole_gpu_claim("a", UID_A, "gpu-0"));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&["v1beta1.DRAPlugin"]).await;
    assert_eq!(kubelet.version, DraVersion::V1beta1);
    let answers = kubelet.prepare(&[claim("a", UID_A)]).await.unwrap();
    assert_eq!(answers[UID_A].clone().unwrap()[0].device_name, "gpu-0");
    assert_eq!(
        kubelet.unprepare(&[claim("a", UID_A)]).await.unwrap()[UID_A],
        Ok(())
    );
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn repeat_prepare_is_idempotent_and_rewrites_the_spec() {
    let node = Node::new();
    node.add_claim(whole_gpu_claim("a", UID_A, "gpu-1"));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let first = kubelet.prepare(&[claim("a", UID_A)]).await.unwrap();
    // A reboot empties /var/run/cdi while the kubelet keeps the IDs.
    for file in node.cdi_files() {
        std::fs::remove_file(node.root.join("cdi").join(file)).unwrap();
    }
    let second = kubelet.prepare(&[claim("a", UID_A)]).await.unwrap();
    assert_eq!(first, second);
    assert_eq!(node.cdi_files().len(), 1);
    plugin.shutdown().await.unwrap();
}

/// The spec and the checkpoint entry are written at the same time, so the entry can be
/// durable before the spec write fails. The prepare must still fail with the spec's path and
/// leave nothing behind (no entry, no device metadata files), and the kubelet's retry works
/// once the directory is back.
#[tokio::test]
async fn a_spec_that_cannot_be_written_fails_the_prepare_and_leaves_nothing() {
    let node = Node::new();
    node.add_claim(whole_gpu_claim("a", UID_A, "gpu-1"));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let cdi_dir = node.root.join("cdi");
    std::fs::remove_dir(&cdi_dir).unwrap();

    let answers = kubelet.prepare(&[claim("a", UID_A)]).await.unwrap();
    let error = answers[UID_A].clone().unwrap_err();
    assert!(error.contains(&*cdi_dir.to_string_lossy()), "{error}");
    let claims = &node.checkpoint()["claims"];
    assert!(
        claims.as_object().is_some_and(serde_json::Map::is_empty),
        "the failed prepare left an entry: {claims}"
    );
    let metadata = node
        .root
        .join("plugins")
        .join(DRIVER)
        .join(kerf_core::cdi::METADATA_HOST_SUBDIR)
        .join(UID_A);
    assert!(!metadata.exists(), "{} was left behind", metadata.display());

    std::fs::create_dir(&cdi_dir).unwrap();
    let retried = kubelet.prepare(&[claim("a", UID_A)]).await.unwrap();
    assert!(retried[UID_A].is_ok(), "{:?}", retried[UID_A]);
    assert_eq!(node.cdi_files().len(), 1);
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn one_bad_claim_does_not_fail_the_others() {
    let node = Node::new();
    node.add_claim(whole_gpu_claim("good", UID_A, "gpu-0"));
    node.add_claim(whole_gpu_claim(
        "wrong-uid",
        "99999999-9999-4999-8999-999999999999",
        "gpu-1",
    ));
    node.add_claim(allocated_claim(
        "other-driver",
        UID_C,
        &[("gpu", "gpu.nvidia.com", NODE, "gpu-2")],
        json!([]),
    ));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;

    let answers = kubelet
        .prepare(&[
            claim("good", UID_A),
            claim("wrong-uid", UID_B),
            claim("other-driver", UID_C),
        ])
        .await
        .unwrap();
    assert_eq!(answers.len(), 3);
    assert!(answers[UID_A].is_ok(), "{:?}", answers[UID_A]);
    let wrong_uid = answers[UID_B].clone().unwrap_err();
    assert!(
        wrong_uid.contains("claim.uid") && wrong_uid.contains(UID_B),
        "{wrong_uid}"
    );
    let other = answers[UID_C].clone().unwrap_err();
    assert!(other.contains("gpu.nvidia.com"), "{other}");
    assert_eq!(
        node.cdi_files().len(),
        1,
        "only the good claim has a spec: {:?}",
        node.cdi_files()
    );
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn bad_input_gets_a_clear_per_claim_error_and_changes_nothing() {
    let node = Node::new();
    let unallocated = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "unallocated", "namespace": "default", "uid": UID_A},
        "spec": {"devices": {"requests": []}}
    });
    node.add_claim(unallocated);
    node.add_claim(whole_gpu_claim("no-such-device", UID_B, "gpu-42"));
    node.add_claim(allocated_claim(
        "other-pool",
        UID_C,
        &[("gpu", DRIVER, "node-2", "gpu-0")],
        json!([]),
    ));
    let bad_config = allocated_claim(
        "bad-config",
        "44444444-4444-4444-8444-444444444444",
        &[("gpu", DRIVER, NODE, "gpu-0")],
        json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClaimParameters", "memroy": "10Gi"}}}]),
    );
    node.add_claim(bad_config);
    let bad_kind = allocated_claim(
        "bad-kind",
        "55555555-5555-4555-8555-555555555555",
        &[("gpu", DRIVER, NODE, "gpu-0")],
        json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuWishes"}}}]),
    );
    node.add_claim(bad_kind);
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;

    let cases: Vec<(Claim, &[&str])> = vec![
        (claim("unallocated", UID_A), &["not allocated"]),
        (claim("no-such-device", UID_B), &["gpu-42"]),
        (claim("other-pool", UID_C), &["node-2"]),
        (
            claim("bad-config", "44444444-4444-4444-8444-444444444444"),
            &["memroy"],
        ),
        (
            claim("bad-kind", "55555555-5555-4555-8555-555555555555"),
            &["GpuWishes"],
        ),
        (
            claim("missing", "66666666-6666-4666-8666-666666666666"),
            &["not found"],
        ),
        (
            Claim::new("default", "x", "../../etc/passwd"),
            &["claim.uid"],
        ),
        (
            Claim::new("default", "a/b", "77777777-7777-4777-8777-777777777777"),
            &["claim.name"],
        ),
        (
            Claim::new("..", "x", "88888888-8888-4888-8888-888888888888"),
            &["claim.namespace"],
        ),
    ];
    let claims: Vec<Claim> = cases.iter().map(|(c, _)| c.clone()).collect();
    let answers = kubelet.prepare(&claims).await.unwrap();
    for (claim, needles) in &cases {
        let error = answers[&claim.uid].clone().expect_err(&claim.name);
        for needle in *needles {
            assert!(
                error.contains(needle),
                "{}: {error:?} lacks {needle:?}",
                claim.name
            );
        }
    }
    assert!(node.cdi_files().is_empty(), "{:?}", node.cdi_files());
    assert_eq!(node.checkpoint()["claims"], json!({}));
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_whole_gpu_is_not_handed_to_two_claims() {
    let node = Node::new();
    node.add_claim(whole_gpu_claim("a", UID_A, "gpu-5"));
    node.add_claim(whole_gpu_claim("b", UID_B, "gpu-5"));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    assert!(kubelet.prepare(&[claim("a", UID_A)]).await.unwrap()[UID_A].is_ok());
    let error = kubelet.prepare(&[claim("b", UID_B)]).await.unwrap()[UID_B]
        .clone()
        .unwrap_err();
    assert!(
        error.contains("gpu-5") && error.contains("default/a"),
        "{error}"
    );
    assert_eq!(node.cdi_files().len(), 1);
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn unprepare_of_an_unknown_claim_succeeds() {
    let node = Node::new();
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let answers = kubelet
        .unprepare(&[claim("never-seen", UID_A)])
        .await
        .unwrap();
    assert_eq!(answers[UID_A], Ok(()));
    plugin.shutdown().await.unwrap();
}

/// A node whose plugin prepared claims a and b and stopped, with the devices it returned.
async fn two_claims_prepared_then_stopped() -> (Node, HashMap<String, ClaimResult>) {
    let node = Node::new();
    node.add_claim(whole_gpu_claim("a", UID_A, "gpu-2"));
    node.add_claim(whole_gpu_claim("b", UID_B, "gpu-4"));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let before = kubelet
        .prepare(&[claim("a", UID_A), claim("b", UID_B)])
        .await
        .unwrap();
    plugin.shutdown().await.unwrap();
    (node, before)
}

#[tokio::test]
async fn restart_keeps_prepared_claims_without_asking_the_api_again() {
    let (node, before) = two_claims_prepared_then_stopped().await;

    // The plugin restarts in the same boot, its specs lost meanwhile, and claim b is deleted.
    for file in node.cdi_files() {
        std::fs::remove_file(node.root.join("cdi").join(file)).unwrap();
    }
    node.api
        .remove("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/b");
    let plugin = node.start().await;
    assert_eq!(
        node.cdi_files().len(),
        2,
        "specs of prepared claims are restored at start-up"
    );
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let gets_before = node.api.requests().len();
    let after = kubelet.prepare(&[claim("a", UID_A)]).await.unwrap();
    assert_eq!(before[UID_A], after[UID_A]);
    assert_eq!(
        node.api.requests().len(),
        gets_before,
        "a prepared claim needs no API call"
    );
    // Unprepare of a claim deleted from the API works from the checkpoint alone.
    assert_eq!(
        kubelet.unprepare(&[claim("b", UID_B)]).await.unwrap()[UID_B],
        Ok(())
    );
    assert_eq!(node.cdi_files().len(), 1);
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn after_a_reboot_nothing_is_prepared_and_the_kubelet_prepares_again() {
    let (node, before) = two_claims_prepared_then_stopped().await;

    // The node reboots: a new boot ID, and claim b is deleted meanwhile. The CDI directory is
    // left as it was, as a directory on a disk would be.
    std::fs::write(node.root.join("boot_id"), "boot-2\n").unwrap();
    node.api
        .remove("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/b");
    let plugin = node.start().await;
    assert_eq!(
        node.cdi_files(),
        Vec::<String>::new(),
        "no spec of the older boot is left"
    );
    assert_eq!(node.checkpoint()["bootId"], "boot-2");
    assert_eq!(node.checkpoint()["claims"], serde_json::json!({}));
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let gets_before = node.api.requests().len();
    let after = kubelet.prepare(&[claim("a", UID_A)]).await.unwrap();
    assert_eq!(before[UID_A], after[UID_A], "the same devices and IDs");
    assert!(
        node.api.requests().len() > gets_before,
        "the claim is read again: nothing was prepared in this boot"
    );
    // The kubelet unprepares the older boot's claim of a pod deleted meanwhile: unknown, done.
    assert_eq!(
        kubelet.unprepare(&[claim("b", UID_B)]).await.unwrap()[UID_B],
        Ok(())
    );
    assert_eq!(node.cdi_files().len(), 1);
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_corrupt_checkpoint_is_moved_aside_not_a_crash_loop() {
    let node = Node::new();
    let config = node.config();
    std::fs::create_dir_all(config.checkpoint_file.parent().unwrap()).unwrap();
    std::fs::write(
        &config.checkpoint_file,
        b"{\"version\": 1, \"claims\": {tru",
    )
    .unwrap();
    // A spec left behind for a claim nobody knows about any more.
    std::fs::create_dir_all(&config.cdi_dir).unwrap();
    std::fs::write(
        config
            .cdi_dir
            .join(format!("k8s.{DRIVER}-gpu_{UID_C}.json")),
        format!(r#"{{"cdiVersion":"0.5.0","kind":"k8s.{DRIVER}/gpu","devices":[]}}"#),
    )
    .unwrap();
    let plugin = node.start().await;
    let aside: Vec<_> = std::fs::read_dir(config.checkpoint_file.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("corrupt"))
        .collect();
    assert_eq!(aside.len(), 1, "corrupt checkpoint kept for inspection");
    assert!(
        node.cdi_files().is_empty(),
        "orphaned spec removed: {:?}",
        node.cdi_files()
    );
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn concurrent_prepares_of_many_claims() {
    let node = Node::new();
    let uids: Vec<String> = (0..8)
        .map(|i| format!("{i:08}-0000-4000-8000-000000000000"))
        .collect();
    for (i, uid) in uids.iter().enumerate() {
        node.add_claim(whole_gpu_claim(&format!("c{i}"), uid, &format!("gpu-{i}")));
    }
    let plugin = node.start().await;
    let kubelet = Arc::new(node.kubelet(&KNOWN_SERVICES).await);
    let calls = uids.iter().enumerate().map(|(i, uid)| {
        let kubelet = Arc::clone(&kubelet);
        let claim = claim(&format!("c{i}"), uid);
        let uid = uid.clone();
        tokio::spawn(async move { (uid, kubelet.prepare(&[claim]).await.unwrap()) })
    });
    for answer in futures::future::join_all(calls).await {
        let (uid, answer) = answer.unwrap();
        // An empty answer would pass an all-Ok check, so the claim's own entry is required.
        assert_eq!(
            answer.keys().collect::<Vec<_>>(),
            [&uid],
            "one answer, for the claim asked about"
        );
        let devices = answer[&uid].as_ref().unwrap();
        assert_eq!(devices.len(), 1, "claim {uid}: {devices:?}");
    }
    assert_eq!(node.cdi_files().len(), 8);
    let checkpoint = node.checkpoint();
    assert_eq!(checkpoint["claims"].as_object().unwrap().len(), 8);
    plugin.shutdown().await.unwrap();
}

/// The UUID the mock profile gives a GPU, read from the plugin's own inventory.

#[tokio::test]
async fn slices_of_one_gpu_carry_their_limits() {
    let node = Node::new();
    let uuid = mock_uuid(&node, 0);
    let ten_gib = 10 * 1024 * 1024 * 1024;
    node.add_claim(allocated_claim(
        "small",
        UID_A,
        &[("gpu", DRIVER, NODE, "gpu-0")],
        slice_allocation("gpu-0", &uuid, ten_gib, 25),
    ));
    node.add_claim(allocated_claim(
        "large",
        UID_B,
        &[("gpu", DRIVER, NODE, "gpu-0")],
        slice_allocation("gpu-0", &uuid, 4 * ten_gib, 50),
    ));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let answers = kubelet
        .prepare(&[claim("small", UID_A), claim("large", UID_B)])
        .await
        .unwrap();
    assert!(
        answers.values().all(Result::is_ok),
        "two slices share one GPU: {answers:?}"
    );

    let small = node.cdi_spec(UID_A).to_string();
    assert!(
        small.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"),
        "{small}"
    );
    assert!(
        small.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M"),
        "{small}"
    );
    assert!(small.contains("KERF_SHARING=MPS"), "{small}");
    let large = node.cdi_spec(UID_B).to_string();
    assert!(
        large.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50"),
        "{large}"
    );
    assert!(
        large.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40960M"),
        "{large}"
    );

    // A whole-GPU claim cannot take a GPU that slices are using.
    node.add_claim(whole_gpu_claim("whole", UID_C, "gpu-0"));
    let error = kubelet.prepare(&[claim("whole", UID_C)]).await.unwrap()[UID_C]
        .clone()
        .unwrap_err();
    assert!(error.contains("gpu-0"), "{error}");
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn claim_parameters_become_slice_limits() {
    let node = Node::new();
    let config = json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClaimParameters",
        "memory": "20Gi", "compute": 30, "sharing": "MPS"}}}]);
    node.add_claim(allocated_claim(
        "params",
        UID_A,
        &[("gpu", DRIVER, NODE, "gpu-6")],
        config,
    ));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let answers = kubelet.prepare(&[claim("params", UID_A)]).await.unwrap();
    assert!(answers[UID_A].is_ok(), "{answers:?}");
    let spec = node.cdi_spec(UID_A).to_string();
    assert!(
        spec.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30"),
        "{spec}"
    );
    assert!(
        spec.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M"),
        "{spec}"
    );
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_slice_placed_on_another_gpu_is_refused() {
    let node = Node::new();
    node.add_claim(allocated_claim(
        "moved",
        UID_A,
        &[("gpu", DRIVER, NODE, "gpu-1")],
        slice_allocation(
            "gpu-1",
            "GPU-00000000-0000-0000-0000-000000000000",
            1 << 30,
            10,
        ),
    ));
    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let error = kubelet.prepare(&[claim("moved", UID_A)]).await.unwrap()[UID_A]
        .clone()
        .unwrap_err();
    assert!(
        error.contains("GPU-00000000-0000-0000-0000-000000000000"),
        "{error}"
    );
    assert!(node.cdi_files().is_empty());
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn mig_devices_get_their_capability_nodes() {
    let node = Node::new();
    let mut config = node.config();
    config.discovery = Discovery::MockProfile("a100-40gb-mig".into());
    let inventory = plugin::discover(&config).unwrap();
    let (parent, mig) = inventory
        .gpus
        .iter()
        .find_map(|g| g.mig_devices.first().map(|m| (g.minor, m.clone())))
        .unwrap();
    let device = mig.device_name(parent);
    node.add_claim(whole_gpu_claim("mig", UID_A, &device));
    let connections = Connections::reading(Arc::new(ApiClaimReader::new(node.plugin_client())));
    let plugin = plugin::start(&config, inventory, connections)
        .await
        .unwrap();
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let devices = kubelet.prepare(&[claim("mig", UID_A)]).await.unwrap()[UID_A]
        .clone()
        .unwrap();
    assert_eq!(devices[0].device_name, device);
    let spec = node.cdi_spec(UID_A).to_string();
    assert!(
        spec.contains(&format!("/dev/nvidia-caps/nvidia-cap{}", mig.gi_cap_minor)),
        "{spec}"
    );
    assert!(
        spec.contains(&format!("/dev/nvidia-caps/nvidia-cap{}", mig.ci_cap_minor)),
        "{spec}"
    );
    assert!(spec.contains(&format!("/dev/nvidia{parent}")), "{spec}");
    plugin.shutdown().await.unwrap();
}

/// What the controller writes (`kerf_api::allocation_status` for a placement of the real
/// allocator) is what the plugin prepares: the slice's limits end up in the CDI spec.
#[tokio::test]
async fn prepares_a_slice_the_controller_allocated() {
    use kerf_core::alloc::{self, DeviceRequest, Index, NodeGpus, PodRequest, SliceSize};

    let node = Node::new();
    let inventory = plugin::discover(&node.config()).unwrap();
    let mut index = Index::new();
    index.upsert_node(NodeGpus::from_inventory(NODE, &inventory));
    let mut request = DeviceRequest::slices(
        "gpu",
        1,
        SliceSize {
            memory_bytes: 12 << 30,
            compute_percent: 40,
        },
    );
    request.sharing = kerf_core::sharing::Sharing::Mps;
    let pod = PodRequest {
        claims: vec![alloc::ClaimRequest {
            key: UID_A.into(),
            requests: vec![request],
        }],
    };
    let placement = alloc::place(&index, &pod, &[NODE]).unwrap();
    let now =
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
    let allocation =
        kerf_api::allocation_status(&placement.claims[0], &placement.node, DRIVER, now).unwrap();
    let mut api_claim = allocated_claim("controller-slice", UID_A, &[], json!([]));
    api_claim["status"]["allocation"] = serde_json::to_value(&allocation).unwrap();
    node.add_claim(api_claim);

    let plugin = node.start().await;
    let kubelet = node.kubelet(&KNOWN_SERVICES).await;
    let devices = kubelet
        .prepare(&[claim("controller-slice", UID_A)])
        .await
        .unwrap()[UID_A]
        .clone()
        .unwrap();
    assert_eq!(devices.len(), 1);
    assert_eq!(
        devices[0].device_name,
        placement.claims[0].devices[0].device
    );
    let spec = node.cdi_spec(UID_A).to_string();
    assert!(
        spec.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40"),
        "{spec}"
    );
    assert!(
        spec.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=12288M"),
        "{spec}"
    );
    assert!(
        spec.contains(&format!("KERF_SLICE_MEMORY_BYTES={}", 12u64 << 30)),
        "{spec}"
    );
    assert!(spec.contains("KERF_SHARING=MPS"), "{spec}");
    plugin.shutdown().await.unwrap();
}
