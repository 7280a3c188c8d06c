//! The kubelet wire contract: the plugin driven by a fake kubelet that behaves like kubelet
//! 1.34–1.37 (registry watch, version choice, one batched call per pod and driver, reference
//! counting of shared claims, retries by the kubelet's rules), with the plugin in-process and,
//! where it must be killed, as its own process talking to the API over HTTP.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common;
use crate::common::{DRIVER, GIB, NODE, TestNode, cdi_spec_file, uid};
use kerf_proto::client::{Claim, ClientError, DraVersion};
use kerf_proto::dra::v1;
use kerf_proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use kerf_proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use kerf_tests::api_server::ApiServer;
use kerf_tests::fake_api::Identity;
use kerf_tests::fake_kubelet::{
    Call, FakeKubelet, KubeletConfig, KubeletError, Method, Pod, PreparedPod, RetryPolicy, cdi_ids,
};
use kerf_tests::fixtures;
use kerf_tests::wait::until;
use serde_json::Value;

const REGISTERED_IN: Duration = Duration::from_secs(10);
const PLUGIN_BINARY: &str = env!("CARGO_BIN_EXE_kerf-test-plugin");

fn pod(uid: &str, claims: &[&Claim]) -> Pod {
    claims.iter().fold(Pod::new(uid), |pod, claim| {
        pod.with_claim(DRIVER, (*claim).clone())
    })
}

fn calls_of(calls: &[Call], method: Method) -> Vec<&Call> {
    calls.iter().filter(|c| c.method == method).collect()
}

async fn registered_kubelet(node: &TestNode, config: KubeletConfig) -> FakeKubelet {
    let kubelet = FakeKubelet::start(config);
    let registration = kubelet
        .wait_for_registration(1, REGISTERED_IN)
        .await
        .unwrap();
    assert_eq!(registration.driver, DRIVER);
    assert_eq!(
        registration.socket,
        node.registry_dir().join(format!("{DRIVER}-reg.sock"))
    );
    kubelet
}

/// The kind and names of every CDI device defined in the directory, with the file defining
/// it: a device defined twice would make a runtime refuse both.
fn cdi_devices(node: &TestNode) -> BTreeMap<String, Vec<String>> {
    let mut devices: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for file in node.cdi_files() {
        let spec: Value =
            serde_json::from_slice(&std::fs::read(node.cdi_dir().join(&file)).unwrap())
                .unwrap_or_else(|e| panic!("{file} is not a whole JSON spec: {e}"));
        for device in spec["devices"].as_array().unwrap() {
            let id = format!(
                "{}={}",
                spec["kind"].as_str().unwrap(),
                device["name"].as_str().unwrap()
            );
            devices.entry(id).or_default().push(file.clone());
        }
    }
    devices
}

#[tokio::test]
async fn a_pod_with_a_whole_gpu_a_slice_and_a_mig_device() {
    let node = TestNode::new("a100-40gb-mig");
    let (whole_minor, mig_parent, mig) = node.whole_gpu_and_mig();
    let slice_minor = node.another_whole_gpu(whole_minor);
    let mig_name = mig.device_name(mig_parent);
    let whole = node.device_claim("whole", &uid(1), &format!("gpu-{whole_minor}"));
    let slice = node.slice_claim("slice", &uid(2), slice_minor, 10 * GIB, 25);
    let mig_claim = node.device_claim("mig", &uid(3), &mig_name);
    let plugin = node.start_plugin().await;
    let kubelet = registered_kubelet(&node, node.kubelet_config()).await;
    assert_eq!(kubelet.registrations()[0].result, Ok(DraVersion::V1));

    let pod = pod("pod-1", &[&whole, &slice, &mig_claim]);
    let prepared = kubelet.prepare_pod(&pod).await.unwrap();

    let calls = kubelet.calls();
    assert_eq!(calls.len(), 1, "one batched call for the pod: {calls:?}");
    assert_eq!(calls[0].claims, [uid(1), uid(2), uid(3)]);
    let device = |claim: &Claim| {
        let devices = &prepared[&claim.uid];
        assert_eq!(devices.len(), 1, "{devices:?}");
        devices[0].clone()
    };
    for (claim, name) in [
        (&whole, format!("gpu-{whole_minor}")),
        (&slice, format!("gpu-{slice_minor}")),
        (&mig_claim, mig_name.clone()),
    ] {
        let device = device(claim);
        assert_eq!(device.device_name, name);
        assert_eq!(device.pool_name, NODE);
        assert_eq!(device.request_names, ["gpu"]);
        assert_eq!(
            device.cdi_device_ids,
            [format!("k8s.{DRIVER}/gpu={}-{name}", claim.uid)]
        );
    }

    let whole_spec = node.cdi_spec(&whole.uid).to_string();
    assert!(
        whole_spec.contains(&format!("\"/dev/nvidia{whole_minor}\"")),
        "{whole_spec}"
    );
    assert!(!whole_spec.contains("CUDA_MPS"), "{whole_spec}");
    let slice_spec = node.cdi_spec(&slice.uid).to_string();
    for needle in [
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M",
        "KERF_SHARING=MPS",
    ] {
        assert!(slice_spec.contains(needle), "{needle} in {slice_spec}");
    }
    let mig_spec = node.cdi_spec(&mig_claim.uid).to_string();
    for path in [
        format!("/dev/nvidia{mig_parent}"),
        format!("/dev/nvidia-caps/nvidia-cap{}", mig.gi_cap_minor),
        format!("/dev/nvidia-caps/nvidia-cap{}", mig.ci_cap_minor),
    ] {
        assert!(mig_spec.contains(&path), "{path} in {mig_spec}");
    }
    assert_eq!(
        node.checkpoint_claims(),
        [1, 2, 3]
            .map(|n| (uid(n), "PrepareCompleted".to_owned()))
            .to_vec()
    );

    kubelet.unprepare_pod(&pod).await.unwrap();
    let unprepares = calls_of(&kubelet.calls(), Method::Unprepare).len();
    assert_eq!(unprepares, 1, "one batched unprepare");
    assert!(node.cdi_files().is_empty(), "{:?}", node.cdi_files());
    assert!(node.checkpoint_claims().is_empty());
    assert!(kubelet.claims().is_empty(), "the kubelet forgot the claims");
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn two_pods_sharing_a_claim_prepare_it_once_and_unprepare_it_once() {
    let node = TestNode::new("h100-sxm-80gb");
    let shared = node.slice_claim("shared", &uid(1), 0, 8 * GIB, 20);
    let own_a = node.device_claim("own-a", &uid(2), "gpu-1");
    let own_b = node.device_claim("own-b", &uid(3), "gpu-2");
    let plugin = node.start_plugin().await;
    let kubelet = registered_kubelet(&node, node.kubelet_config()).await;
    let pod_a = pod("pod-a", &[&shared, &own_a]);
    let pod_b = pod("pod-b", &[&shared, &own_b]);

    let prepared_a = kubelet.prepare_pod(&pod_a).await.unwrap();
    let prepared_b = kubelet.prepare_pod(&pod_b).await.unwrap();
    assert_eq!(
        prepared_a[&shared.uid], prepared_b[&shared.uid],
        "same devices for both pods"
    );
    let prepares = calls_of(&kubelet.calls(), Method::Prepare)
        .into_iter()
        .map(|c| c.claims.clone())
        .collect::<Vec<_>>();
    assert_eq!(prepares, [vec![uid(1), uid(2)], vec![uid(3)]]);
    assert_eq!(
        kubelet.claims()[&shared.uid].0,
        BTreeSet::from(["pod-a".to_owned(), "pod-b".to_owned()])
    );

    kubelet.unprepare_pod(&pod_a).await.unwrap();
    assert!(
        kubelet
            .calls_with(Method::Unprepare, &shared.uid)
            .is_empty(),
        "pod b still uses the shared claim"
    );
    assert_eq!(
        node.cdi_files(),
        [cdi_spec_file(&shared.uid), cdi_spec_file(&own_b.uid)],
    );
    kubelet.unprepare_pod(&pod_b).await.unwrap();
    for claim in [&shared, &own_a, &own_b] {
        assert_eq!(
            kubelet.calls_with(Method::Prepare, &claim.uid).len(),
            1,
            "{}",
            claim.name
        );
        assert_eq!(
            kubelet.calls_with(Method::Unprepare, &claim.uid).len(),
            1,
            "{}",
            claim.name
        );
    }
    assert!(node.cdi_files().is_empty(), "{:?}", node.cdi_files());
    assert!(node.checkpoint_claims().is_empty());
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_v1beta1_only_kubelet_prepares_every_kind_of_claim() {
    let node = TestNode::new("a100-40gb-mig");
    let (whole_minor, mig_parent, mig) = node.whole_gpu_and_mig();
    let whole = node.device_claim("whole", &uid(1), &format!("gpu-{whole_minor}"));
    let slice = node.slice_claim("slice", &uid(2), whole_minor + 1, 4 * GIB, 10);
    let mig_claim = node.device_claim("mig", &uid(3), &mig.device_name(mig_parent));
    let plugin = node.start_plugin().await;
    let kubelet =
        registered_kubelet(&node, node.kubelet_config().knowing(&["v1beta1.DRAPlugin"])).await;
    let registration = &kubelet.registrations()[0];
    assert_eq!(registration.result, Ok(DraVersion::V1beta1));
    let info = &kubelet.plugin(DRIVER).unwrap().info;
    assert_eq!(
        info.supported_versions[0], "v1.DRAPlugin",
        "the plugin offers v1 first; this kubelet takes the first it knows"
    );

    let pod = pod("pod-1", &[&whole, &slice, &mig_claim]);
    let prepared = kubelet.prepare_pod(&pod).await.unwrap();
    assert_eq!(prepared.len(), 3);
    assert!(prepared.values().flatten().all(|d| d.share_id.is_none()));
    assert_eq!(cdi_ids(&prepared).len(), 3);
    assert_eq!(node.cdi_files().len(), 3);
    kubelet.unprepare_pod(&pod).await.unwrap();
    assert!(node.cdi_files().is_empty());
    assert!(node.checkpoint_claims().is_empty());
    plugin.shutdown().await.unwrap();
}

/// 100 slices over the 8 GPUs of the node.
fn hundred_slices(node: &TestNode) -> Vec<Claim> {
    (0..100)
        .map(|i| node.slice_claim(&format!("c{i}"), &uid(i + 1), i % 8, GIB, 5))
        .collect()
}

fn assert_hundred_prepared(node: &TestNode, claims: &[Claim]) {
    let expected: Vec<String> = {
        let mut files: Vec<String> = claims.iter().map(|c| cdi_spec_file(&c.uid)).collect();
        files.sort();
        files
    };
    assert_eq!(node.cdi_files(), expected);
    let checkpoint = node.checkpoint_claims();
    assert_eq!(checkpoint.len(), 100);
    assert!(
        checkpoint
            .iter()
            .all(|(_, state)| state == "PrepareCompleted")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_claims_in_one_batch() {
    let node = TestNode::new("h100-sxm-80gb");
    let claims = hundred_slices(&node);
    let plugin = node.start_plugin().await;
    let kubelet = registered_kubelet(&node, node.kubelet_config()).await;
    let refs: Vec<&Claim> = claims.iter().collect();
    let pod = pod("big-pod", &refs);

    let prepared = kubelet.prepare_pod(&pod).await.unwrap();
    assert_eq!(prepared.len(), 100);
    assert_eq!(kubelet.calls().len(), 1, "one call for the pod");
    assert_hundred_prepared(&node, &claims);

    kubelet.unprepare_pod(&pod).await.unwrap();
    assert_eq!(kubelet.calls().len(), 2, "one unprepare call for the pod");
    assert!(node.cdi_files().is_empty());
    assert!(node.checkpoint_claims().is_empty());
    plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_claims_in_a_hundred_concurrent_calls() {
    let node = TestNode::new("h100-sxm-80gb");
    let claims = hundred_slices(&node);
    let plugin = node.start_plugin().await;
    let kubelet = Arc::new(registered_kubelet(&node, node.kubelet_config()).await);
    let pods: Vec<Pod> = claims
        .iter()
        .enumerate()
        .map(|(i, claim)| pod(&format!("pod-{i}"), &[claim]))
        .collect();

    let prepares = pods.iter().cloned().map(|pod| {
        let kubelet = Arc::clone(&kubelet);
        tokio::spawn(async move { kubelet.prepare_pod(&pod).await })
    });
    for prepared in futures::future::join_all(prepares).await {
        assert_eq!(prepared.unwrap().unwrap().len(), 1);
    }
    assert_eq!(calls_of(&kubelet.calls(), Method::Prepare).len(), 100);
    assert!(
        kubelet.calls().iter().all(|c| c.outcome.is_ok()),
        "no call needed a retry"
    );
    assert_hundred_prepared(&node, &claims);

    let unprepares = pods.into_iter().map(|pod| {
        let kubelet = Arc::clone(&kubelet);
        tokio::spawn(async move { kubelet.unprepare_pod(&pod).await })
    });
    for unprepared in futures::future::join_all(unprepares).await {
        unprepared.unwrap().unwrap();
    }
    assert_eq!(calls_of(&kubelet.calls(), Method::Unprepare).len(), 100);
    assert!(node.cdi_files().is_empty());
    assert!(node.checkpoint_claims().is_empty());
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_per_claim_error_is_retried_until_the_claim_can_be_prepared() {
    let node = TestNode::new("h100-sxm-80gb");
    let good = node.device_claim("good", &uid(1), "gpu-0");
    // The allocation is not there yet: the plugin answers this claim with an error.
    let late = Claim::new(common::NAMESPACE, "late", &uid(2));
    let plugin = node.start_plugin().await;
    let kubelet = Arc::new(registered_kubelet(&node, node.kubelet_config()).await);
    let pod = pod("pod-1", &[&good, &late]);
    let preparing = {
        let (kubelet, pod) = (Arc::clone(&kubelet), pod.clone());
        tokio::spawn(async move { kubelet.prepare_pod(&pod).await })
    };
    until("two failed attempts", Duration::from_secs(10), || {
        kubelet
            .calls()
            .iter()
            .filter(|c| c.outcome.is_err())
            .count()
            >= 2
    })
    .await;
    node.device_claim("late", &uid(2), "gpu-1");
    let prepared = preparing.await.unwrap().unwrap();
    assert_eq!(prepared.len(), 2);

    let calls = kubelet.calls();
    let (last, failed) = calls.split_last().unwrap();
    assert!(last.outcome.is_ok());
    for call in failed {
        assert_eq!(
            call.claims,
            [uid(1), uid(2)],
            "every retry resends the unprepared claims"
        );
        let error = call.outcome.as_ref().unwrap_err();
        assert!(
            error.contains(&uid(2)) && error.contains("not found"),
            "{error}"
        );
    }
    assert_eq!(
        kubelet.calls_with(Method::Prepare, &uid(1)).len(),
        calls.len(),
        "the good claim was resent too: a failed pod is retried as a whole"
    );
    assert_eq!(
        node.cdi_files().len(),
        2,
        "repeats of the good claim left one spec"
    );
    kubelet.unprepare_pod(&pod).await.unwrap();
    assert!(node.cdi_files().is_empty());
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_claim_that_keeps_failing_fails_the_pod_after_bounded_retries() {
    let node = TestNode::new("h100-sxm-80gb");
    let good = node.device_claim("good", &uid(1), "gpu-0");
    let bad = node.device_claim("bad", &uid(2), "gpu-99");
    let plugin = node.start_plugin().await;
    let mut config = node.kubelet_config();
    config.retry = RetryPolicy {
        attempts: 3,
        initial_backoff: Duration::from_millis(5),
        max_backoff: Duration::from_millis(5),
    };
    let kubelet = registered_kubelet(&node, config).await;
    let pod = pod("pod-1", &[&good, &bad]);
    let error = kubelet.prepare_pod(&pod).await.unwrap_err();
    assert!(
        matches!(&error, KubeletError::Client(ClientError::ClaimFailed { uid, error }) if *uid == bad.uid && error.contains("gpu-99")),
        "{error}"
    );
    assert_eq!(kubelet.calls().len(), 3);
    assert!(
        !kubelet.claims()[&good.uid].1,
        "nothing of a failed pod counts as prepared"
    );
    // The pod is deleted: the kubelet unprepares every claim it sent, prepared by the plugin
    // or not.
    kubelet.unprepare_pod(&pod).await.unwrap();
    assert_eq!(
        calls_of(&kubelet.calls(), Method::Unprepare)[0].claims,
        [uid(1), uid(2)]
    );
    assert!(node.cdi_files().is_empty());
    assert!(node.checkpoint_claims().is_empty());
    plugin.shutdown().await.unwrap();
}

#[tokio::test]
async fn after_a_clean_restart_the_kubelet_registers_again_and_unprepares() {
    let node = TestNode::new("h100-sxm-80gb");
    let claim = node.device_claim("a", &uid(1), "gpu-4");
    let plugin = node.start_plugin().await;
    let kubelet = registered_kubelet(&node, node.kubelet_config()).await;
    let pod = pod("pod-1", &[&claim]);
    kubelet.prepare_pod(&pod).await.unwrap();
    plugin.shutdown().await.unwrap();
    until("deregistration", Duration::from_secs(5), || {
        kubelet.plugin(DRIVER).is_none()
    })
    .await;

    // Meanwhile the claim was deleted from the API: unprepare needs only the checkpoint.
    node.api
        .remove("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/a");
    let plugin = node.start_plugin().await;
    kubelet
        .wait_for_registration(2, REGISTERED_IN)
        .await
        .unwrap();
    kubelet.unprepare_pod(&pod).await.unwrap();
    assert!(node.cdi_files().is_empty());
    assert!(node.checkpoint_claims().is_empty());
    plugin.shutdown().await.unwrap();
}

/// Checkpoint entries with their state, or nothing while the file cannot be read.
fn checkpoint_states(node: &TestNode) -> Vec<(String, String)> {
    std::fs::read(node.checkpoint_file())
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .and_then(|v| {
            v["claims"].as_object().map(|m| {
                m.iter()
                    .map(|(uid, e)| (uid.clone(), e["state"].as_str().unwrap_or("").to_owned()))
                    .collect()
            })
        })
        .unwrap_or_default()
}

/// Waits until the plugin finished every claim but `slow`, whose GET hangs, then SIGKILLs it
/// and checks what the crash left and what the kubelet saw.
async fn kill_while_the_slow_claim_is_in_flight(
    node: &TestNode,
    kubelet: &FakeKubelet,
    plugin: &mut common::PluginProcess,
    claims: &[Claim],
) {
    until(
        "three claims prepared and the fourth one's GET in flight",
        Duration::from_secs(10),
        || {
            node.api
                .count("GET", &fixtures::claim_path("default", "slow"))
                == 1
                && checkpoint_states(node)
                    .iter()
                    .filter(|(_, s)| s == "PrepareCompleted")
                    .count()
                    == 3
        },
    )
    .await;
    assert!(plugin.is_running());
    plugin.kill();

    // What the crash left: the finished claims, nothing of the one in flight.
    let finished: Vec<String> = claims[..3].iter().map(|c| cdi_spec_file(&c.uid)).collect();
    assert_eq!(node.cdi_files(), finished);
    until(
        "the kubelet saw the call fail",
        Duration::from_secs(10),
        || kubelet.calls().iter().any(|c| c.outcome.is_err()),
    )
    .await;
    let failed = kubelet.calls()[0].clone();
    assert_eq!(failed.claims.len(), 4);
    assert!(
        failed.outcome.as_ref().unwrap_err().contains("RPC failed"),
        "an RPC error voids the whole response: {failed:?}"
    );
}

/// One spec file per claim defining its device once, every returned CDI ID defined, and
/// every claim complete in the checkpoint.
fn assert_each_claim_prepared_once(node: &TestNode, claims: &[Claim], prepared: &PreparedPod) {
    let mut expected: Vec<String> = claims.iter().map(|c| cdi_spec_file(&c.uid)).collect();
    expected.sort();
    assert_eq!(node.cdi_files(), expected, "no leaked or temporary files");
    let defined = cdi_devices(node);
    assert_eq!(defined.len(), claims.len());
    assert!(
        defined.values().all(|files| files.len() == 1),
        "{defined:?}"
    );
    for id in cdi_ids(prepared) {
        assert!(defined.contains_key(&id), "{id} is defined by a spec");
    }
    assert_eq!(
        node.checkpoint_claims(),
        claims
            .iter()
            .map(|c| (c.uid.clone(), "PrepareCompleted".to_owned()))
            .collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_killed_in_the_middle_of_a_batch_restarts_and_the_kubelet_retries() {
    let node = TestNode::new("h100-sxm-80gb");
    let server = ApiServer::start(node.api.clone()).await.unwrap();
    let kubeconfig = node.root.join("kubeconfig");
    server
        .write_kubeconfig_for(&kubeconfig, Identity::kerf_kubelet_plugin(NODE))
        .unwrap();
    let mut claims: Vec<Claim> = (0..3)
        .map(|i| node.device_claim(&format!("c{i}"), &uid(i + 1), &format!("gpu-{i}")))
        .collect();
    claims.push(node.slice_claim("slow", &uid(4), 5, 16 * GIB, 30));
    // The plugin's read of this claim hangs, so the batch is in flight when the kill comes.
    node.api.delay_next(
        "GET",
        &fixtures::claim_path("default", "slow"),
        Duration::from_secs(30),
        1,
    );

    let mut first = common::PluginProcess::spawn(PLUGIN_BINARY, &node, &kubeconfig, 1);
    let kubelet = Arc::new(FakeKubelet::start(node.kubelet_config()));
    let registered = kubelet.wait_for_registration(1, REGISTERED_IN).await;
    assert!(
        registered.is_ok(),
        "{registered:?}; plugin log:\n{}",
        first.log()
    );
    let refs: Vec<&Claim> = claims.iter().collect();
    let pod = pod("pod-1", &refs);
    let preparing = {
        let (kubelet, pod) = (Arc::clone(&kubelet), pod.clone());
        tokio::spawn(async move { kubelet.prepare_pod(&pod).await })
    };
    kill_while_the_slow_claim_is_in_flight(&node, &kubelet, &mut first, &claims).await;

    let mut second = common::PluginProcess::spawn(PLUGIN_BINARY, &node, &kubeconfig, 2);
    let prepared: PreparedPod = tokio::time::timeout(Duration::from_secs(20), preparing)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "kubelet retry did not finish; plugin log:\n{}",
                second.log()
            )
        })
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}; plugin log:\n{}", second.log()));
    assert_eq!(prepared.len(), 4);
    kubelet
        .wait_for_registration(2, REGISTERED_IN)
        .await
        .unwrap();
    assert_eq!(
        node.api
            .count("GET", &fixtures::claim_path("default", "c0")),
        1,
        "the restarted plugin answered the finished claims from its checkpoint"
    );

    assert_each_claim_prepared_once(&node, &claims, &prepared);

    // Killed again, restarted again: the pod goes away and its claims are unprepared by the
    // third process, which learns them only from the checkpoint.
    second.kill();
    let third = common::PluginProcess::spawn(PLUGIN_BINARY, &node, &kubeconfig, 3);
    kubelet
        .wait_for_registration(3, REGISTERED_IN)
        .await
        .unwrap();
    let gets_before = node.api.count("GET", "/apis/resource.k8s.io");
    kubelet
        .unprepare_pod(&pod)
        .await
        .unwrap_or_else(|e| panic!("{e}; plugin log:\n{}", third.log()));
    assert_eq!(node.api.count("GET", "/apis/resource.k8s.io"), gets_before);
    assert!(node.cdi_files().is_empty(), "{:?}", node.cdi_files());
    assert!(node.checkpoint_claims().is_empty());
    drop(server);
}

/// A plugin that answers by script, to show the fake kubelet applies the kubelet's rules.
mod scripted {
    use super::*;
    use kerf_h2_authority::{AuthorityLog, LenientAuthority};
    use std::path::Path;
    use tokio::net::{UnixListener, UnixStream};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Answer {
        RpcError,
        LeaveOutAClaim,
        AddAnUnknownClaim,
        ClaimError,
        Fine,
    }

    #[derive(Clone)]
    pub struct Plugin {
        pub versions: Vec<String>,
        pub endpoint: PathBuf,
        pub answers: Arc<Mutex<VecDeque<Answer>>>,
        pub statuses: Arc<Mutex<Vec<RegistrationStatus>>>,
        /// The `:authority` forms the registration socket saw.
        pub registration_log: Arc<AuthorityLog>,
        /// The `:authority` forms the DRA socket saw.
        pub dra_log: Arc<AuthorityLog>,
    }

    #[tonic::async_trait]
    impl Registration for Plugin {
        async fn get_info(
            &self,
            _: tonic::Request<InfoRequest>,
        ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
            Ok(tonic::Response::new(PluginInfo {
                r#type: "DRAPlugin".into(),
                name: "scripted.example.com".into(),
                endpoint: self.endpoint.to_string_lossy().into_owned(),
                supported_versions: self.versions.clone(),
            }))
        }

        async fn notify_registration_status(
            &self,
            request: tonic::Request<RegistrationStatus>,
        ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
            self.statuses.lock().unwrap().push(request.into_inner());
            Ok(tonic::Response::new(RegistrationStatusResponse {}))
        }
    }

    fn answer(
        claims: &[v1::Claim],
        script: Answer,
    ) -> Result<v1::NodePrepareResourcesResponse, tonic::Status> {
        let ok = || v1::NodePrepareResourceResponse {
            devices: vec![v1::Device {
                request_names: vec!["gpu".into()],
                pool_name: "pool".into(),
                device_name: "dev".into(),
                cdi_device_ids: vec!["example.com/dev=x".into()],
                share_id: None,
            }],
            error: String::new(),
        };
        let mut map: std::collections::HashMap<String, v1::NodePrepareResourceResponse> =
            claims.iter().map(|c| (c.uid.clone(), ok())).collect();
        match script {
            Answer::RpcError => return Err(tonic::Status::internal("scripted failure")),
            Answer::LeaveOutAClaim => {
                map.remove(&claims[0].uid);
            }
            Answer::AddAnUnknownClaim => {
                map.insert("not-asked-for".into(), ok());
            }
            Answer::ClaimError => {
                let first = map.get_mut(&claims[0].uid).unwrap();
                first.error = "scripted claim error".into();
            }
            Answer::Fine => {}
        }
        Ok(v1::NodePrepareResourcesResponse { claims: map })
    }

    #[tonic::async_trait]
    impl v1::dra_plugin_server::DraPlugin for Plugin {
        async fn node_prepare_resources(
            &self,
            request: tonic::Request<v1::NodePrepareResourcesRequest>,
        ) -> Result<tonic::Response<v1::NodePrepareResourcesResponse>, tonic::Status> {
            let script = self
                .answers
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or(Answer::Fine);
            answer(&request.into_inner().claims, script).map(tonic::Response::new)
        }

        async fn node_unprepare_resources(
            &self,
            request: tonic::Request<v1::NodeUnprepareResourcesRequest>,
        ) -> Result<tonic::Response<v1::NodeUnprepareResourcesResponse>, tonic::Status> {
            let claims = request
                .into_inner()
                .claims
                .into_iter()
                .map(|c| {
                    (
                        c.uid,
                        v1::NodeUnprepareResourceResponse {
                            error: String::new(),
                        },
                    )
                })
                .collect();
            Ok(tonic::Response::new(v1::NodeUnprepareResourcesResponse {
                claims,
            }))
        }
    }

    /// The connections to the socket at `path`, answered whatever `:authority` the client
    /// sends, as a plugin written in Go answers them (the kubelet sends the registration
    /// socket's path, which h2 alone refuses).
    fn incoming(
        path: &Path,
        log: &Arc<AuthorityLog>,
    ) -> impl futures::Stream<Item = std::io::Result<LenientAuthority<UnixStream>>> + use<> {
        let listener = UnixListener::bind(path).unwrap();
        let log = Arc::clone(log);
        futures::stream::unfold(listener, move |listener| {
            let log = Arc::clone(&log);
            async move {
                let accepted = listener.accept().await;
                let lenient = accepted.map(|(stream, _)| LenientAuthority::new(stream, log));
                Some((lenient, listener))
            }
        })
    }

    /// Serves the plugin: DRA socket first, then the registration socket the kubelet sees.
    pub fn serve(plugin: &Plugin, registry_dir: &Path) {
        let dra = incoming(&plugin.endpoint, &plugin.dra_log);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(v1::dra_plugin_server::DraPluginServer::new(plugin.clone()))
                .serve_with_incoming(dra),
        );
        std::fs::create_dir_all(registry_dir).unwrap();
        let registration = incoming(
            &registry_dir.join("scripted.example.com-reg.sock"),
            &plugin.registration_log,
        );
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(plugin.clone()))
                .serve_with_incoming(registration),
        );
    }
}

fn scripted_plugin(
    dir: &std::path::Path,
    versions: &[&str],
    answers: &[scripted::Answer],
) -> scripted::Plugin {
    let plugin = scripted::Plugin {
        versions: versions.iter().map(|s| (*s).to_owned()).collect(),
        endpoint: dir.join("dra.sock"),
        answers: Arc::new(Mutex::new(answers.iter().copied().collect())),
        statuses: Arc::new(Mutex::new(Vec::new())),
        registration_log: kerf_h2_authority::AuthorityLog::new("registration"),
        dra_log: kerf_h2_authority::AuthorityLog::new("dra"),
    };
    scripted::serve(&plugin, &dir.join("registry"));
    plugin
}

#[tokio::test]
async fn the_kubelet_rules_void_bad_answers_and_retry_them() {
    use scripted::Answer::{AddAnUnknownClaim, ClaimError, LeaveOutAClaim, RpcError};
    let dir = tempfile::tempdir().unwrap();
    let plugin = scripted_plugin(
        dir.path(),
        &["v1.DRAPlugin"],
        &[RpcError, LeaveOutAClaim, AddAnUnknownClaim, ClaimError],
    );
    let mut config = KubeletConfig::new(dir.path().join("registry"));
    config.retry.initial_backoff = Duration::from_millis(1);
    let kubelet = FakeKubelet::start(config);
    kubelet
        .wait_for_registration(1, REGISTERED_IN)
        .await
        .unwrap();
    let statuses = plugin.statuses.lock().unwrap().clone();
    assert_eq!(statuses.len(), 1);
    assert!(statuses[0].plugin_registered);
    // As the real kubelet: the registration socket's path as :authority there, and
    // (checked below, after the first prepare) `localhost` on the DRA socket.
    let forms = |log: &kerf_h2_authority::AuthorityLog| {
        use kerf_h2_authority::AuthorityForm::{Host, SocketPath};
        (log.has_seen(SocketPath), log.has_seen(Host))
    };
    assert_eq!(forms(&plugin.registration_log), (true, false));

    let pod = Pod::new("pod-1")
        .with_claim("scripted.example.com", Claim::new("ns", "a", "uid-a"))
        .with_claim("scripted.example.com", Claim::new("ns", "b", "uid-b"));
    let prepared = kubelet.prepare_pod(&pod).await.unwrap();
    assert_eq!(prepared.len(), 2);
    assert_eq!(forms(&plugin.dra_log), (false, true));
    let outcomes: Vec<String> = kubelet
        .calls()
        .iter()
        .map(|c| match &c.outcome {
            Ok(()) => "ok".to_owned(),
            Err(e) => e.clone(),
        })
        .collect();
    assert_eq!(outcomes.len(), 5, "{outcomes:?}");
    assert!(outcomes[0].contains("RPC failed"), "{outcomes:?}");
    assert!(
        outcomes[1].contains("no entry for claim uid-a"),
        "{outcomes:?}"
    );
    assert!(outcomes[2].contains("not-asked-for"), "{outcomes:?}");
    assert!(outcomes[3].contains("scripted claim error"), "{outcomes:?}");
    assert_eq!(outcomes[4], "ok");
    assert!(plugin.answers.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_plugin_without_a_known_version_is_refused_and_told_so() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = scripted_plugin(dir.path(), &["v2.DRAPlugin"], &[]);
    let kubelet = FakeKubelet::start(KubeletConfig::new(dir.path().join("registry")));
    let registration = kubelet
        .wait_for_registration(1, REGISTERED_IN)
        .await
        .unwrap();
    let reason = registration.result.unwrap_err();
    assert!(reason.contains("v2.DRAPlugin"), "{reason}");
    assert!(kubelet.plugin("scripted.example.com").is_none());
    let statuses = plugin.statuses.lock().unwrap().clone();
    assert_eq!(statuses.len(), 1);
    assert!(!statuses[0].plugin_registered);
    assert!(statuses[0].error.contains("v2.DRAPlugin"));
}

/// The plugin answers the kubelet-side client whatever `:authority` it sends on either
/// socket: every form of [`Authority::all_forms`] on the registration socket, with every
/// form on the DRA socket, registers and prepares.
#[tokio::test]
async fn the_plugin_answers_every_authority_form_on_both_sockets() {
    use kerf_proto::client::KubeletClient;
    use kerf_proto::dial::Authority;

    let node = TestNode::new("h100-sxm-80gb");
    let plugin = node.start_plugin().await;
    let socket = node.config().registration_socket;
    let mut n = 0;
    for registration in Authority::all_forms() {
        for dra in Authority::all_forms() {
            n += 1;
            let forms = format!("registration {registration:?}, DRA {dra:?}");
            let claim = node.device_claim(&format!("authority-{n}"), &uid(n), "gpu-0");
            let kubelet = KubeletClient::new()
                .registration_authority(registration.clone())
                .dra_authority(dra)
                .register(&socket)
                .await
                .unwrap_or_else(|e| panic!("{forms}: {e}"));
            assert_eq!(kubelet.version, DraVersion::V1, "{forms}");
            let claims = std::slice::from_ref(&claim);
            let prepared = kubelet
                .prepare_response(claims)
                .await
                .unwrap_or_else(|e| panic!("{forms}: {e}"))
                .all_prepared()
                .unwrap_or_else(|e| panic!("{forms}: {e}"));
            assert_eq!(prepared[&claim.uid][0].device_name, "gpu-0", "{forms}");
            kubelet
                .unprepare_response(claims)
                .await
                .and_then(|answer| answer.all_unprepared())
                .unwrap_or_else(|e| panic!("{forms}: {e}"));
        }
    }
    assert_eq!(n, 25);
    assert!(node.cdi_files().is_empty(), "{:?}", node.cdi_files());
    plugin.shutdown().await.unwrap();
}
