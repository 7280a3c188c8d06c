//! The limits each GPU's MPS server holds its clients to, as the fake tools of
//! `kerf-fake-gpu-tools` keep NVIDIA's documented rule (a client's `CUDA_MPS_*` environment can
//! only lower the server's limits): a process that clears its environment is still held to
//! its slice when every MPS slice of its GPU has one size, and only to the largest slice when
//! they differ; the limits follow the slices as they come and go.

use std::path::Path;
use std::process::Command;

use crate::common::mps::{MpsNode, prepare, unprepare};
use crate::common::{GIB, uid};

/// What the fake CUDA client reports for a client created now.
#[derive(Debug)]
struct ClientRun {
    /// The effective pinned memory limit, MiB, `None` for none.
    pinned_mib: Option<u64>,
    thread_percentage: f64,
    /// Whether an allocation of `alloc` fitted.
    allocated: bool,
}

/// Runs the fake CUDA client against `pipe` with only the given environment (a process that
/// cleared the rest), asking for `alloc` (e.g. `12G`).
fn client(sharing: &MpsNode, pipe: &Path, env: &[(&str, &str)], alloc: &str) -> ClientRun {
    try_client(sharing, pipe, env, alloc).unwrap_or_else(|why| panic!("{why}"))
}

/// [`client`], or why it gave no report (no daemon listens, say).
fn try_client(
    sharing: &MpsNode,
    pipe: &Path,
    env: &[(&str, &str)],
    alloc: &str,
) -> Result<ClientRun, String> {
    let output = Command::new(sharing.tools_root().join("usr/bin/kerf-fake-cuda-client"))
        .env_clear()
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .envs(env.iter().copied())
        .args(["--alloc", alloc])
        .output()
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&output.stdout);
    let report: serde_json::Value = serde_json::from_str(text.trim())
        .map_err(|e| format!("{e}: {text} / {}", String::from_utf8_lossy(&output.stderr)))?;
    Ok(ClientRun {
        pinned_mib: report["pinned_mem_limit_mib"].as_u64(),
        thread_percentage: report["thread_percentage"].as_f64().unwrap_or_default(),
        allocated: report["allocated"].as_bool() == Some(true) && output.status.success(),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_of_one_size_are_held_by_the_server_against_a_cleared_environment() {
    let sharing = MpsNode::new();
    let node = &sharing.node;
    let plugin = sharing.start().await;
    let gpu = sharing.gpu_uuid(0);
    let a = node.slice_claim("a", &uid(1), 0, 10 * GIB, 25);
    let b = node.slice_claim("b", &uid(2), 0, 10 * GIB, 25);
    let results = prepare(&plugin, &[&a, &b]).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");

    let pipe = sharing.pipe(&gpu);
    let cleared = client(&sharing, &pipe, &[], "12G");
    assert_eq!(cleared.pinned_mib, Some(10 * 1024), "{cleared:?}");
    assert!((cleared.thread_percentage - 25.0).abs() < f64::EPSILON);
    assert!(!cleared.allocated, "12 GiB is refused past a 10 GiB slice");
    assert!(client(&sharing, &pipe, &[], "8G").allocated);
    // Asking for more in the environment does not lift the server's limits either.
    let asks_more = client(
        &sharing,
        &pipe,
        &[
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=40G"),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"),
        ],
        "12G",
    );
    assert_eq!(asks_more.pinned_mib, Some(10 * 1024));
    assert!(!asks_more.allocated);
    let checkpoint = node.checkpoint();
    assert_eq!(
        checkpoint["gpuSharing"][&gpu]["mpsServerLimits"],
        serde_json::json!({"pinnedMib": 10240, "threadPercentage": 25}),
        "{checkpoint}"
    );
    plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_of_different_sizes_hold_the_smaller_only_by_its_environment() {
    let sharing = MpsNode::new();
    let node = &sharing.node;
    let plugin = sharing.start().await;
    let gpu = sharing.gpu_uuid(0);
    let pipe = sharing.pipe(&gpu);
    let small = node.slice_claim("small", &uid(1), 0, 10 * GIB, 25);
    let big = node.slice_claim("big", &uid(2), 0, 20 * GIB, 50);
    assert!(prepare(&plugin, &[&small]).await[0].is_ok());
    assert_eq!(
        client(&sharing, &pipe, &[], "1G").pinned_mib,
        Some(10 * 1024)
    );

    // The larger slice raises the server's ceiling for the clients created afterwards: a
    // process of the small slice that clears its environment gets up to the large one.
    assert!(prepare(&plugin, &[&big]).await[0].is_ok());
    let cleared = client(&sharing, &pipe, &[], "12G");
    assert_eq!(cleared.pinned_mib, Some(20 * 1024), "{cleared:?}");
    assert!(
        cleared.allocated,
        "only the environment held the small slice"
    );
    let kept = client(
        &sharing,
        &pipe,
        &[
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=10240M"),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25"),
        ],
        "12G",
    );
    assert_eq!(kept.pinned_mib, Some(10 * 1024));
    assert!(
        !kept.allocated,
        "a process that keeps its environment is held"
    );

    // With the large slice gone the ceiling comes down to the small one again.
    unprepare(&plugin, &big).await;
    let cleared = client(&sharing, &pipe, &[], "12G");
    assert_eq!(cleared.pinned_mib, Some(10 * 1024), "{cleared:?}");
    assert!(!cleared.allocated);
    plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_daemon_gets_the_server_limits_again() {
    let sharing = MpsNode::new();
    let node = &sharing.node;
    let plugin = sharing.start().await;
    let gpu = sharing.gpu_uuid(0);
    let pipe = sharing.pipe(&gpu);
    let a = node.slice_claim("a", &uid(1), 0, 10 * GIB, 25);
    assert!(prepare(&plugin, &[&a]).await[0].is_ok());
    let old = sharing.daemon_pid(&gpu).unwrap();
    crate::common::mps::kill_9(old);
    // The periodic check restarts the daemon; the new one starts without limits and is
    // given them again.
    kerf_tests::wait::until(
        "the daemon restarted",
        std::time::Duration::from_secs(20),
        || sharing.daemon_pid(&gpu).is_some_and(|pid| pid != old),
    )
    .await;
    kerf_tests::wait::until(
        "the new daemon holds the slice",
        std::time::Duration::from_secs(20),
        || {
            try_client(&sharing, &pipe, &[], "1G")
                .is_ok_and(|run| run.pinned_mib == Some(10 * 1024))
        },
    )
    .await;
    plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slice_that_requires_the_server_is_refused_where_it_would_not_hold() {
    let sharing = MpsNode::new();
    let node = &sharing.node;
    let plugin = sharing.start().await;
    // An allocation kerf-controller would not write: a server-held slice beside a larger one.
    let large = node.slice_claim("large", &uid(1), 0, 20 * GIB, 50);
    let held = node.server_held_slice_claim("held", &uid(2), 0, 10 * GIB, 25);
    assert!(prepare(&plugin, &[&large]).await[0].is_ok());
    let refused = prepare(&plugin, &[&held]).await.remove(0).unwrap_err();
    assert!(
        refused.contains("sharing.enforcement Server")
            && refused.contains("client environment")
            && refused.contains(&sharing.gpu_uuid(0)),
        "{refused}"
    );
    assert!(
        node.checkpoint()["claims"].get(uid(2)).is_none(),
        "nothing of the refused claim stays"
    );
    // Alone on its GPU it is held, and prepared.
    let alone = node.server_held_slice_claim("alone", &uid(3), 1, 10 * GIB, 25);
    assert!(prepare(&plugin, &[&alone]).await[0].is_ok());
    plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_gpu_tools_a_slice_that_requires_the_server_is_refused() {
    let node = crate::common::TestNode::new("h100-sxm-80gb:2");
    let plugin = node.start_plugin().await;
    let held = node.server_held_slice_claim("held", &uid(1), 0, 10 * GIB, 25);
    let refused = prepare(&plugin, &[&held]).await.remove(0).unwrap_err();
    assert!(refused.contains("enforces no MPS limits"), "{refused}");
    plugin.shutdown().await.unwrap();
}
