//! Two plugin instances side by side, as a DaemonSet rolling update with `maxSurge: 1` runs
//! them: different pod UIDs (so different registration and DRA sockets), one plugin
//! directory, checkpoint, CDI directory and registry. The fake kubelet registers both and
//! sends its calls to the newest (kubelet 1.33+); the test also calls both instances
//! directly, in random interleavings, because upstream promises no more than that "it is not
//! predictable which instance the kubelet will use for which request"
//! (kubernetes `pkg/kubelet/pluginmanager/pluginwatcher/README.md`, "Seamless Upgrade").
//! Then the old instance shuts down cleanly. Afterwards the checkpoint holds exactly the
//! claims prepared and not unprepared, the CDI specs match, no call failed, and the node's
//! ResourceSlices existed throughout.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::Parser as _;
use futures::FutureExt as _;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kerf_kubelet_plugin::args::Args;
use kerf_kubelet_plugin::claim_reader::ApiClaimReader;
use kerf_kubelet_plugin::config::PluginConfig;
use kerf_kubelet_plugin::plugin::{self, Connections, RunningPlugin};
use kerf_proto::client::{Claim, KNOWN_SERVICES, KubeletClient, RegisteredPlugin};
use kerf_scheduler_standin::SeededRng;
use kerf_tests::fake_kubelet::{FakeKubelet, Pod};
use kerf_tests::wait::until;
use serde_json::json;

use crate::common;
use crate::common::{DRIVER, NODE, TestNode};

const WAIT: Duration = Duration::from_secs(20);
const OLD_UID: &str = "11111111-1111-4111-8111-111111111111";
const NEW_UID: &str = "22222222-2222-4222-8222-222222222222";
const GPUS: usize = 8;

/// The configuration `kerf-kubelet-plugin` builds from its flags in the pod `uid`, with
/// publishing on.
fn config_for(node: &TestNode, uid: &str) -> PluginConfig {
    let mut args = node.plugin_args();
    args.extend([
        format!("--pod-name=kerf-kubelet-plugin-{}", &uid[..8]),
        "--pod-namespace=kerf-system".to_owned(),
        format!("--pod-uid={uid}"),
    ]);
    let argv = std::iter::once("kerf-kubelet-plugin".to_owned()).chain(args);
    let mut config = Args::try_parse_from(argv).unwrap().into_config().unwrap();
    config.publish_resources = true;
    config
}

async fn start(node: &TestNode, config: &PluginConfig) -> RunningPlugin {
    let client = node.plugin_client();
    let connections = Connections {
        publisher: Some(client.clone()),
        ..Connections::reading(Arc::new(ApiClaimReader::new(client)))
    };
    plugin::start(config, node.inventory(), connections)
        .await
        .unwrap()
}

/// A client of one instance, as a kubelet that picked it would call it.
async fn direct(config: &PluginConfig) -> RegisteredPlugin {
    KubeletClient::new()
        .knowing(&KNOWN_SERVICES)
        .register(&config.registration_socket)
        .await
        .unwrap()
}

fn slices(node: &TestNode) -> usize {
    node.api.list_resources::<ResourceSlice>(None).len()
}

/// The pool generations of the node's slices.
fn generations(node: &TestNode) -> BTreeSet<i64> {
    node.api
        .list_resources::<ResourceSlice>(None)
        .iter()
        .map(|s| s.spec.pool.generation)
        .collect()
}

/// Watches the node's slices every few milliseconds; `gone` is set if none are seen once.
fn watch_slices(node: &TestNode) -> (Arc<AtomicBool>, tokio::task::JoinHandle<()>) {
    let gone = Arc::new(AtomicBool::new(false));
    let api = node.api.clone();
    let flag = Arc::clone(&gone);
    let task = tokio::spawn(async move {
        loop {
            if api.list_resources::<ResourceSlice>(None).is_empty() {
                flag.store(true, Ordering::SeqCst);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    (gone, task)
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Prepare(usize),
    Unprepare(usize),
}

/// One call on one instance; a failure fails the test with the seed.
async fn apply(plugin: &RegisteredPlugin, op: Op, claims: &[Claim]) {
    match op {
        Op::Prepare(i) => {
            let answer = plugin.prepare_response(&claims[i..=i]).await.unwrap();
            answer.all_prepared().unwrap();
        }
        Op::Unprepare(i) => {
            let answer = plugin.unprepare_response(&claims[i..=i]).await.unwrap();
            answer.all_unprepared().unwrap();
        }
    }
}

/// A batch of calls on distinct claims, each sent to either instance while the old one runs,
/// all at once.
fn batch(rng: &mut SeededRng, both: bool) -> Vec<(bool, Op)> {
    let mut used = BTreeSet::new();
    let size = 1 + rng.below(4);
    let mut ops = Vec::new();
    for _ in 0..size {
        let claim = rng.below(GPUS);
        if !used.insert(claim) {
            continue;
        }
        let op = if rng.below(3) == 0 {
            Op::Unprepare(claim)
        } else {
            Op::Prepare(claim)
        };
        ops.push((both && rng.below(2) == 0, op));
    }
    ops
}

/// The node, its claims (one whole GPU each) and the two instances' configurations.
struct Setup {
    node: TestNode,
    claims: Vec<Claim>,
    old: PluginConfig,
    new: PluginConfig,
}

fn setup() -> Setup {
    let node = TestNode::new(&format!("h100-sxm-80gb:{GPUS}"));
    node.api
        .insert(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}));
    let claims = (0..GPUS)
        .map(|i| {
            let uid = common::uid(100 + u32::try_from(i).unwrap());
            node.device_claim(&format!("c{i}"), &uid, &format!("gpu-{i}"))
        })
        .collect();
    let old = config_for(&node, OLD_UID);
    let new = config_for(&node, NEW_UID);
    assert_ne!(old.registration_socket, new.registration_socket);
    assert_ne!(old.dra_socket, new.dra_socket);
    assert_eq!(old.checkpoint_file, new.checkpoint_file);
    Setup {
        node,
        claims,
        old,
        new,
    }
}

/// Rounds of concurrent calls on both instances; the old one shuts down cleanly after a
/// random round, and the kubelet then holds only the new one. Returns what is prepared.
async fn interleave(
    rng: &mut SeededRng,
    s: &Setup,
    kubelet: &FakeKubelet,
    old: RunningPlugin,
    mut prepared: BTreeSet<usize>,
) -> BTreeSet<usize> {
    let (old_client, new_client) = (direct(&s.old).await, direct(&s.new).await);
    let rounds = 6 + rng.below(6);
    let old_stops_after = rng.below(rounds);
    let mut old = Some(old);
    for round in 0..rounds {
        let ops = batch(rng, old.is_some());
        let calls = ops.iter().map(|(on_old, op)| {
            let client = if *on_old { &old_client } else { &new_client };
            apply(client, *op, &s.claims)
        });
        futures::future::join_all(calls).await;
        for (_, op) in ops {
            match op {
                Op::Prepare(i) => prepared.insert(i),
                Op::Unprepare(i) => prepared.remove(&i),
            };
        }
        if round == old_stops_after
            && let Some(old) = old.take()
        {
            old.shutdown().await.unwrap();
            until("the old instance deregistered", WAIT, || {
                kubelet.instances(DRIVER) == [s.new.registration_socket.clone()]
            })
            .await;
        }
    }
    prepared
}

/// The checkpoint holds exactly `prepared`, all completed, and the CDI specs match.
fn check_files(s: &Setup, prepared: &BTreeSet<usize>) {
    let expected: Vec<(String, String)> = prepared
        .iter()
        .map(|i| (s.claims[*i].uid.clone(), "PrepareCompleted".to_owned()))
        .collect();
    assert_eq!(s.node.checkpoint_claims(), expected, "checkpoint");
    let is_spec = |name: &String| {
        name.starts_with("k8s.")
            && std::path::Path::new(name)
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("json"))
    };
    let specs: Vec<String> = s.node.cdi_files().into_iter().filter(is_spec).collect();
    let expected_specs: Vec<String> = prepared
        .iter()
        .map(|i| common::cdi_spec_file(&s.claims[*i].uid))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(specs, expected_specs, "CDI specs");
}

async fn scenario(seed: u64) {
    let mut rng = SeededRng::new(seed);
    let s = setup();
    let old = start(&s.node, &s.old).await;
    let kubelet = FakeKubelet::start(s.node.kubelet_config());
    until("the old instance's slices", WAIT, || slices(&s.node) > 0).await;
    until("the old instance registered", WAIT, || {
        kubelet.instances(DRIVER).len() == 1
    })
    .await;
    let (gone, watcher) = watch_slices(&s.node);
    let published = generations(&s.node);
    // The new instance starts while the old one prepares: its start-up clean-up (orphan
    // specs, unfinished entries) must not take what the old one's prepares are making.
    let old_client = direct(&s.old).await;
    let early: BTreeSet<usize> = (0..=rng.below(4)).map(|_| rng.below(GPUS)).collect();
    let early_prepares = early
        .iter()
        .map(|claim| apply(&old_client, Op::Prepare(*claim), &s.claims));
    let (new, _) = tokio::join!(
        start(&s.node, &s.new),
        futures::future::join_all(early_prepares)
    );
    let prepared = early;

    // The kubelet serves through the newest.
    let both = [
        s.old.registration_socket.clone(),
        s.new.registration_socket.clone(),
    ];
    until("both instances registered", WAIT, || {
        kubelet.instances(DRIVER) == both
    })
    .await;
    let serving = kubelet.plugin(DRIVER).unwrap();
    assert_eq!(
        PathBuf::from(&serving.info.endpoint),
        s.new.dra_socket,
        "the newest instance serves"
    );
    let prepared = interleave(&mut rng, &s, &kubelet, old, prepared).await;

    // The kubelet still reaches the driver through the new instance.
    if !prepared.contains(&0) {
        let extra = s.node.device_claim("extra", &common::uid(999), "gpu-0");
        let pod = Pod::new("pod-extra").with_claim(DRIVER, extra);
        kubelet.prepare_pod(&pod).await.unwrap();
        kubelet.unprepare_pod(&pod).await.unwrap();
    }
    // Give a wrongly deleting publisher the time to show, then check.
    tokio::time::sleep(Duration::from_millis(200)).await;
    watcher.abort();
    assert!(
        !gone.load(Ordering::SeqCst),
        "the node had no ResourceSlices at some point"
    );
    // Both instances publish the same devices: neither rewrites what the other wrote.
    assert_eq!(generations(&s.node), published, "the publishers fought");
    check_files(&s, &prepared);
    new.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_share_the_node_through_a_rolling_update() {
    for seed in [1, 2, 3, 4, 5, 6, 0x5eed, 0xdead_beef] {
        if let Err(panic) = std::panic::AssertUnwindSafe(scenario(seed))
            .catch_unwind()
            .await
        {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            panic!("seed {seed:#x} failed: {message}");
        }
    }
}

/// Without a pod UID the sockets keep their fixed names, as before rolling updates.
#[test]
fn without_a_pod_uid_the_sockets_keep_their_names() {
    let node = TestNode::new("h100-sxm-80gb:1");
    let argv = std::iter::once("kerf-kubelet-plugin".to_owned()).chain(node.plugin_args());
    let config = Args::try_parse_from(argv).unwrap().into_config().unwrap();
    let legacy = node.config();
    assert_eq!(config.registration_socket, legacy.registration_socket);
    assert_eq!(config.dra_socket, legacy.dra_socket);
    let with_uid = config_for(&node, NEW_UID);
    assert_eq!(
        with_uid.registration_socket,
        node.registry_dir()
            .join(format!("{DRIVER}-{NEW_UID}-reg.sock"))
    );
    assert_eq!(
        with_uid.dra_socket,
        node.plugin_dir().join(format!("dra-{NEW_UID}.sock"))
    );
}

/// On a kubelet older than 1.33 the plugin falls back to the fixed socket names: such a
/// kubelet drops the driver when any instance deregisters.
#[tokio::test]
async fn an_old_kubelet_gets_the_fixed_socket_names() {
    use kerf_kubelet_plugin::grpc::kubelet_version::sockets_for_kubelet;
    for (kubelet, fixed) in [("v1.32.4", true), ("v1.33.0", false), ("v1.36.2", false)] {
        let node = TestNode::new("h100-sxm-80gb:1");
        node.api.insert(json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": NODE},
            "status": {"nodeInfo": {"kubeletVersion": kubelet}},
        }));
        let config = sockets_for_kubelet(config_for(&node, NEW_UID), &node.plugin_client()).await;
        let legacy = node.config();
        assert_eq!(
            config.registration_socket == legacy.registration_socket,
            fixed,
            "{kubelet}: {}",
            config.registration_socket.display()
        );
        assert_eq!(config.dra_socket == legacy.dra_socket, fixed, "{kubelet}");
    }
}
