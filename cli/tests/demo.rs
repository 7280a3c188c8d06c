//! `kerf demo` end to end: the real plugin on its sockets, the real controller allocator,
//! the examples of the repository, MPS daemons of the `kerf` binary acting as the fake GPU
//! tools, and (with podman) real containers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use kerf_cli::demo::allocate::AllocatedBy;
use kerf_cli::demo::health::{FAULT_XID, Step};
use kerf_cli::demo::manifests::ManifestSource;
use kerf_cli::demo::{self, ClaimReport, DemoConfig, MpsReport, Summary};
use kerf_core::health::HealthStatus;

const GI: u64 = 1 << 30;

fn examples(folder: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("examples")
        .join(folder)
}

fn config(output: &Path) -> DemoConfig {
    DemoConfig {
        classes: ManifestSource::Dir(examples("admin")),
        claims: ManifestSource::Dir(examples("claims")),
        // The real binary: its main is the fake tools under their names, as `kerf demo` uses.
        gpu_tools: Some(PathBuf::from(env!("CARGO_BIN_EXE_kerf"))),
        ..DemoConfig::new(output)
    }
}

fn claim<'a>(summary: &'a Summary, name: &str) -> &'a ClaimReport {
    summary
        .claim("default", name)
        .unwrap_or_else(|| panic!("no claim {name} in {:#?}", summary.claims))
}

/// The env entries of a claim's CDI spec: spec-wide and per device.
fn spec_env(claim: &ClaimReport) -> Vec<String> {
    let spec = claim.cdi_spec.as_ref().expect("CDI spec snapshot");
    let mut env = Vec::new();
    let mut collect = |edits: &serde_json::Value| {
        for entry in edits["env"].as_array().into_iter().flatten() {
            env.push(entry.as_str().unwrap().to_owned());
        }
    };
    collect(&spec["containerEdits"]);
    for device in spec["devices"].as_array().unwrap() {
        collect(&device["containerEdits"]);
    }
    env
}

fn assert_clean(output: &Path) {
    let sockets: Vec<PathBuf> = [
        "plugins_registry/gpu.kerf.dev-reg.sock",
        "plugins/gpu.kerf.dev/dra.sock",
    ]
    .iter()
    .map(|p| output.join(p))
    .filter(|p| p.exists())
    .collect();
    assert!(sockets.is_empty(), "sockets left: {sockets:?}");
    let specs: Vec<_> = std::fs::read_dir(output.join("cdi")).unwrap().collect();
    assert!(specs.is_empty(), "CDI specs left: {specs:?}");
    // Every GPU's daemon directory went with its daemon; only the node-wide shm stays.
    let mps: Vec<String> = std::fs::read_dir(output.join("mps"))
        .into_iter()
        .flatten()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name != "shm")
        .collect();
    assert!(mps.is_empty(), "MPS directories left: {mps:?}");
    let faults: Vec<_> = ["mock-faults.yaml", "mock-faults.yaml.partial"]
        .iter()
        .map(|f| output.join(f))
        .filter(|p| p.exists())
        .collect();
    assert!(faults.is_empty(), "fault files left: {faults:?}");
}

/// Whether `pid` is still an MPS control daemon (its program name), not a reused PID.
fn is_mps_daemon(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|cmdline| String::from_utf8_lossy(&cmdline).contains("nvidia-cuda-mps-control"))
}

/// The MPS daemon of the first device of claim `name`.
fn mps_of<'a>(summary: &'a Summary, name: &str) -> &'a MpsReport {
    let claim = claim(summary, name);
    claim.devices[0]
        .mps
        .as_ref()
        .unwrap_or_else(|| panic!("{name} has no MPS daemon: {claim:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_examples_on_a_mock_h100_node() {
    let output = tempfile::tempdir().unwrap();
    let summary = demo::run(&config(output.path())).await.unwrap();
    println!("{}", demo::report::render_table(&summary));
    println!("{}", demo::report::render_health(&summary));

    // The summary on disk is the one returned.
    let written: Summary =
        serde_json::from_slice(&std::fs::read(output.path().join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(written, summary);
    assert_clean(output.path());
    assert_eq!(summary.devices.len(), 8, "{:?}", summary.devices);
    assert!(
        summary.classes.iter().all(|c| c.error.is_none()),
        "{:?}",
        summary.classes
    );

    whole_gpu_by_the_scheduler(&summary);
    scheduler_slices_on_the_nvl_node(output.path(), &summary);
    slice_with_limits_in_its_cdi_spec(output.path(), &summary);
    invalid_claim_names_the_field(&summary);
    nvlink_pair(&summary);
    dynamic_mig_placement_created_and_destroyed(output.path(), &summary);
    deployment_claims_are_packed(&summary);
    mps_slices_share_their_gpus_daemon(output.path(), &summary);
    a_prepared_device_flips_unhealthy_and_back(output.path(), &summary);
}

/// The kubelet's health stream showed one device a prepared claim holds Healthy, then
/// Unhealthy with the XID in its message once the fault file declared it, then Healthy
/// again once the file was removed; the printed section says so in that order.
fn a_prepared_device_flips_unhealthy_and_back(output: &Path, summary: &Summary) {
    let health = summary.device_health.as_ref().expect("a health report");
    assert_eq!(health.error, None, "{health:#?}");
    assert_eq!(health.fault_file, output.join("mock-faults.yaml"));
    let device = health.device.as_deref().expect("a flipped device");
    assert!(!health.claims.is_empty(), "{health:#?}");
    for name in &health.claims {
        let (_, name) = name.split_once('/').unwrap();
        let holder = claim(summary, name);
        assert!(holder.prepared, "{holder:#?}");
        assert!(
            holder.devices.iter().any(|d| d.device == device),
            "{name} does not hold {device}: {holder:#?}"
        );
    }
    let seen: Vec<(Step, HealthStatus)> = health
        .observations
        .iter()
        .map(|o| (o.step, o.status))
        .collect();
    assert_eq!(
        seen,
        [
            (Step::Opened, HealthStatus::Healthy),
            (Step::FaultDeclared, HealthStatus::Unhealthy),
            (Step::FaultRemoved, HealthStatus::Healthy),
        ],
        "{health:#?}"
    );
    assert_eq!(health.observations[1].message, format!("XID {FAULT_XID}"));
    assert_eq!(health.observations[2].message, "");

    let text = demo::report::render_health(summary);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("Device health"), "{text}");
    assert!(lines[1].trim_start().starts_with(device), "{text}");
    let unhealthy = lines
        .iter()
        .position(|l| l.contains(&format!("Unhealthy \"XID {FAULT_XID}\"")))
        .unwrap_or_else(|| panic!("no Unhealthy line: {text}"));
    let recovered = lines
        .iter()
        .position(|l| l.contains("fault file removed") && l.contains("Healthy"))
        .unwrap_or_else(|| panic!("no Healthy line after the fault: {text}"));
    assert!(unhealthy < recovered, "{text}");
}

/// The MPS slices of one GPU name one daemon and pipe directory, those of another GPU
/// another; whole GPUs none; and no daemon outlives the run.
fn mps_slices_share_their_gpus_daemon(output: &Path, summary: &Summary) {
    assert_eq!(
        summary.gpu_tools_root.as_deref(),
        Some(output.join("mock-driver").as_path())
    );
    let slice = mps_of(summary, "slice-10gi");
    let shared = mps_of(summary, "shared-slice");
    assert_eq!(
        claim(summary, "slice-10gi").devices[0].device,
        claim(summary, "shared-slice").devices[0].device
    );
    assert_eq!(slice, shared, "one daemon per GPU");
    assert!(
        slice.pipe_directory.starts_with(output.join("mps")),
        "{slice:?}"
    );
    assert!(slice.pipe_directory.ends_with("pipe"), "{slice:?}");
    assert!(
        slice
            .container_pipe_directory
            .starts_with("/run/kerf/mps/GPU-"),
        "{slice:?}"
    );
    let spec_env = spec_env(claim(summary, "slice-10gi"));
    let pipe_env = format!("CUDA_MPS_PIPE_DIRECTORY={}", slice.container_pipe_directory);
    assert!(spec_env.contains(&pipe_env), "{spec_env:?}");
    let daemons: BTreeSet<u32> = summary
        .claims
        .iter()
        .filter(|c| c.node.as_deref() == Some("demo-node"))
        .flat_map(|c| &c.devices)
        .filter_map(|d| d.mps.as_ref())
        .map(|m| {
            m.daemon_pid
                .expect("the daemon ran while its slices were prepared")
        })
        .collect();
    // The main node's slices are on two GPUs (see deployment_claims_are_packed): two daemons.
    assert_eq!(daemons.len(), 2, "{daemons:?}");
    assert!(claim(summary, "whole-gpu").devices[0].mps.is_none());
    for pid in daemons {
        assert!(!is_mps_daemon(pid), "daemon {pid} outlived the demo");
    }
}

/// A whole GPU, placed by the scheduler stand-in on an SXM H100 of the main node (the sliced
/// class selects the H100 NVL, so the main node's GPUs stay whole for the class gpu.kerf.dev),
/// prepared with one CDI device.
fn whole_gpu_by_the_scheduler(summary: &Summary) {
    let whole = claim(summary, "whole-gpu");
    assert_eq!(
        whole.allocated_by,
        Some(AllocatedBy::Scheduler),
        "{whole:#?}"
    );
    assert_eq!(whole.node.as_deref(), Some("demo-node"), "{whole:#?}");
    assert_eq!(whole.devices[0].share_id, None, "{whole:#?}");
    assert!(
        summary.devices.iter().all(|d| !d.contains("shareable")),
        "{:?}",
        summary.devices
    );
    assert!(whole.prepared, "{whole:#?}");
    assert_eq!(whole.devices.len(), 1);
    assert_eq!(whole.devices[0].memory_bytes, None);
    assert_eq!(whole.devices[0].slice_text(), "whole GPU");
    let uid = whole.uid.as_deref().unwrap();
    assert_eq!(
        whole.devices[0].cdi_device_ids,
        [format!(
            "k8s.gpu.kerf.dev/gpu={uid}-{}",
            whole.devices[0].device
        )]
    );
    assert!(!spec_env(whole).iter().any(|e| e.starts_with("CUDA_MPS_")));
}

/// The scheduler-slice claims: kube-scheduler's allocator (the stand-in) cuts shares from the
/// H100 NVLs of demo-nvl-node, which are published shareable with the sliced class's slicing,
/// and writes a shareID per share; that node's plugin prepares each share as an MPS client of
/// its GPU's daemon, with the share's limits in the CDI spec.
fn scheduler_slices_on_the_nvl_node(output: &Path, summary: &Summary) {
    let node = summary.shareable_node.as_ref().expect("the shareable node");
    assert_eq!(node.node, "demo-nvl-node");
    assert_eq!(node.devices.len(), 2, "{node:#?}");
    for device in &node.devices {
        assert!(
            device.contains("NVIDIA H100 NVL")
                && device.contains(
                    "shareable: memory in 1Gi steps, compute 25% unless asked, at most 7 shares"
                ),
            "{device}"
        );
    }
    assert!(
        summary.published_whole.is_empty(),
        "{:?}",
        summary.published_whole
    );

    let single = claim(summary, "scheduler-slice-gpu");
    let pair = claim(summary, "scheduler-slice-pair");
    for share in [single, pair] {
        assert_eq!(
            share.allocated_by,
            Some(AllocatedBy::Scheduler),
            "{share:#?}"
        );
        assert_eq!(share.node.as_deref(), Some("demo-nvl-node"), "{share:#?}");
        assert!(share.prepared, "{share:#?}");
        assert!(
            share
                .cdi_spec_file
                .as_ref()
                .unwrap()
                .starts_with(output.join("demo-nvl-node").join("cdi")),
            "{share:#?}"
        );
        for device in &share.devices {
            assert!(device.share_id.is_some(), "{device:#?}");
            assert_eq!(device.sharing, "MPS", "{device:#?}");
            let mps = device.mps.as_ref().expect("an MPS daemon for the share");
            assert!(
                mps.pipe_directory
                    .starts_with(output.join("demo-nvl-node").join("mps")),
                "{mps:?}"
            );
            let pid = mps
                .daemon_pid
                .expect("the daemon ran while the share was prepared");
            assert!(!is_mps_daemon(pid), "daemon {pid} outlived the demo");
        }
    }
    assert_eq!(single.devices.len(), 1);
    assert_eq!(single.devices[0].memory_bytes, Some(10 * GI));
    assert_eq!(single.devices[0].compute_percent, Some(30));
    let env = spec_env(single);
    assert!(
        env.contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30".to_owned()),
        "{env:?}"
    );
    assert!(
        env.contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M".to_owned()),
        "{env:?}"
    );
    // distinctAttribute on the GPU UUID: the pair's shares are on both GPUs.
    assert_eq!(pair.devices.len(), 2);
    assert_ne!(pair.devices[0].device, pair.devices[1].device);
    assert!(
        pair.devices
            .iter()
            .all(|d| d.memory_bytes == Some(20 * GI) && d.compute_percent == Some(40)),
        "{pair:#?}"
    );
    assert_clean(&output.join("demo-nvl-node"));
    let table = demo::report::render_table(summary);
    let share_id = single.devices[0].share_id.as_deref().unwrap();
    assert!(
        table.contains(&format!("share {share_id} of the shareable GPU")),
        "{table}"
    );
}

/// A 10Gi / 25% slice by the controller, with its limits in its CDI spec.
fn slice_with_limits_in_its_cdi_spec(output: &Path, summary: &Summary) {
    let slice = claim(summary, "slice-10gi");
    assert_eq!(
        slice.allocated_by,
        Some(AllocatedBy::Controller),
        "{slice:#?}"
    );
    assert!(slice.prepared, "{slice:#?}");
    assert_eq!(slice.devices[0].memory_bytes, Some(10 * GI));
    assert_eq!(slice.devices[0].compute_percent, Some(25));
    let env = spec_env(slice);
    assert!(
        env.contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25".to_owned()),
        "{env:?}"
    );
    assert!(
        env.contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M".to_owned()),
        "{env:?}"
    );
    assert!(
        env.contains(&format!("KERF_SLICE_MEMORY_BYTES={}", 10 * GI)),
        "{env:?}"
    );
    assert!(
        slice
            .cdi_spec_file
            .as_ref()
            .unwrap()
            .starts_with(output.join("cdi"))
    );
}

/// The invalid claim: not allocated, and the message names the misspelt field.
fn invalid_claim_names_the_field(summary: &Summary) {
    let invalid = claim(summary, "invalid-memroy");
    assert_eq!(invalid.allocated_by, None);
    assert!(!invalid.prepared);
    assert!(invalid.devices.is_empty());
    let error = invalid.error.as_deref().unwrap();
    assert!(
        error.contains("spec.devices.config[0].opaque.parameters.memroy"),
        "{error}"
    );
    let pod = summary
        .pods
        .iter()
        .find(|p| p.name == "invalid-memroy")
        .unwrap();
    assert!(!pod.scheduled);
}

/// Two whole GPUs for the NVLink pair.
fn nvlink_pair(summary: &Summary) {
    let pair = claim(summary, "nvlink-pair");
    assert_eq!(
        pair.allocated_by,
        Some(AllocatedBy::Controller),
        "{pair:#?}"
    );
    assert_eq!(pair.devices.len(), 2);
    assert_ne!(pair.devices[0].device, pair.devices[1].device);
    assert!(
        pair.devices
            .iter()
            .all(|d| d.memory_bytes.is_none() && d.cdi_device_ids.len() == 1)
    );
}

/// The 1g.5gb claim, which no H100 of the main node serves, goes to the dynamic-MIG node:
/// the scheduler stand-in takes the first placement device that fits its GPU's counters,
/// that node's plugin creates the MIG instance at prepare (its UUID in the claim's CDI
/// spec) and destroys it at unprepare; the node's slices carry the counter sets.
fn dynamic_mig_placement_created_and_destroyed(output: &Path, summary: &Summary) {
    let mig = claim(summary, "mig-1g-5gb");
    assert_eq!(mig.allocated_by, Some(AllocatedBy::Scheduler), "{mig:#?}");
    assert_eq!(mig.node.as_deref(), Some("demo-mig-node"));
    assert!(mig.prepared, "{mig:#?}");
    let device = &mig.devices[0];
    assert_eq!(device.device, "gpu-0-mig-1g-5gb-0");
    assert_eq!(device.device_type, "mig");
    assert_eq!(device.mig_profile.as_deref(), Some("1g.5gb"));
    let instance = device
        .mig_instance
        .as_ref()
        .expect("the created MIG instance");
    assert_eq!(
        (
            instance.gpu_minor,
            instance.placement_start,
            instance.placement_size
        ),
        (0, 0, 1),
        "{instance:#?}"
    );
    assert!(instance.ci_id.is_some(), "{instance:#?}");
    let uuid = instance.mig_uuid.as_deref().expect("a MIG UUID");
    assert!(uuid.starts_with("MIG-"), "{uuid}");
    let spec_file = mig.cdi_spec_file.as_ref().unwrap();
    assert!(
        spec_file.starts_with(output.join("demo-mig-node").join("cdi")),
        "{}",
        spec_file.display()
    );
    let env = spec_env(mig);
    assert!(
        env.iter().any(|e| e.ends_with(&format!("={uuid}"))),
        "the MIG UUID in the CDI spec: {env:?}"
    );

    let node = summary.mig_node.as_ref().expect("the dynamic-MIG node");
    assert_eq!(node.node, "demo-mig-node");
    assert_eq!(node.gpus.len(), 4, "{node:#?}");
    assert!(
        node.gpus
            .iter()
            .all(|g| g.contains("counter set gpu-") && g.contains("25 MIG placements")),
        "{node:#?}"
    );
    assert_eq!(node.counter_slices, 1, "{node:#?}");
    assert_eq!(node.instances_prepared, vec![instance.clone()]);
    assert!(node.instances_left.is_empty(), "{node:#?}");
    // Read again now: the emulated driver state has no instance on any GPU.
    let state = demo::mig::live_instances(&node.mig_state_root).unwrap();
    assert!(state.is_empty(), "{state:#?}");
    assert_clean(&output.join("demo-mig-node"));
    let printed = demo::print::render_summary(summary, false);
    assert!(
        printed.contains(&format!(
            "MIG instance created at prepare: GPU 0 GI {} CI {}",
            instance.gi_id,
            instance.ci_id.unwrap()
        )) && printed.contains("after unprepare: no MIG instance left"),
        "{printed}"
    );
}

/// The Deployment: three pods, three generated claims, all prepared, packed by BinPack onto
/// GPUs that already carry slices rather than onto idle ones; no GPU is both whole and
/// sliced, or whole twice.
fn deployment_claims_are_packed(summary: &Summary) {
    let generated: Vec<&ClaimReport> = summary
        .claims
        .iter()
        .filter(|c| c.template.as_deref() == Some("inference-slice"))
        .collect();
    assert_eq!(generated.len(), 3);
    assert!(generated.iter().all(|c| c.prepared && c.pods.len() == 1));
    // Device names repeat across nodes: the main node's claims only.
    let main_node: Vec<&ClaimReport> = summary
        .claims
        .iter()
        .filter(|c| c.node.as_deref() == Some("demo-node"))
        .collect();
    let slice_gpus: BTreeSet<&str> = main_node
        .iter()
        .filter(|c| c.devices.iter().any(|d| d.memory_bytes.is_some()))
        .flat_map(|c| c.devices.iter().map(|d| d.device.as_str()))
        .collect();
    // 20Gi/50% + 10Gi/25% + 3 × 8Gi/15% = 120% of compute: two GPUs, not five.
    assert_eq!(slice_gpus.len(), 2, "{slice_gpus:?}");
    let whole_gpus: Vec<&str> = main_node
        .iter()
        .flat_map(|c| &c.devices)
        .filter(|d| d.memory_bytes.is_none())
        .map(|d| d.device.as_str())
        .collect();
    let distinct: BTreeSet<&&str> = whole_gpus.iter().collect();
    assert_eq!(distinct.len(), whole_gpus.len(), "{whole_gpus:?}");
    assert!(whole_gpus.iter().all(|g| !slice_gpus.contains(g)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployment_alone_is_packed_onto_one_gpu() {
    let claims = tempfile::tempdir().unwrap();
    std::fs::copy(
        examples("claims").join("template-deployment.yaml"),
        claims.path().join("deployment.yaml"),
    )
    .unwrap();
    let output = tempfile::tempdir().unwrap();
    let config = DemoConfig {
        claims: ManifestSource::Dir(claims.path().to_owned()),
        ..config(output.path())
    };
    let summary = demo::run(&config).await.unwrap();
    assert_clean(output.path());
    assert_eq!(summary.pods.len(), 3);
    assert_eq!(summary.claims.len(), 3);
    let gpus: BTreeSet<&str> = summary
        .claims
        .iter()
        .inspect(|c| assert!(c.prepared, "{c:#?}"))
        .flat_map(|c| c.devices.iter().map(|d| d.device.as_str()))
        .collect();
    assert_eq!(
        gpus.len(),
        1,
        "BinPack puts 3 × 8Gi/15% on one GPU: {gpus:?}"
    );
    let names: Vec<&str> = summary.claims.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        ["inference-0-gpu", "inference-1-gpu", "inference-2-gpu"]
    );
}

/// Two sliced Scheduler classes that select the H100 NVL with different slicing: as
/// kerf-controller decides, the GPUs are published whole, the report says why, and the
/// scheduler-slice claims find no shareable GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_sliced_classes_leave_the_gpus_whole() {
    let classes = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(examples("admin")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, classes.path().join(path.file_name().unwrap())).unwrap();
    }
    let original =
        std::fs::read_to_string(examples("admin").join("scheduler-slices.yaml")).unwrap();
    let other = original
        .replace("name: h100-scheduler-slice", "name: h100-scheduler-slice-3")
        .replace("maxSlicesPerGpu: 7", "maxSlicesPerGpu: 3");
    assert_ne!(other, original);
    std::fs::write(classes.path().join("scheduler-slices-3.yaml"), other).unwrap();
    let output = tempfile::tempdir().unwrap();
    let config = DemoConfig {
        classes: ManifestSource::Dir(classes.path().to_owned()),
        ..config(output.path())
    };
    let summary = demo::run(&config).await.unwrap();
    assert_clean(output.path());
    assert_eq!(
        summary.published_whole.len(),
        2,
        "{:?}",
        summary.published_whole
    );
    for (line, gpu) in summary.published_whole.iter().zip(["gpu-0", "gpu-1"]) {
        assert!(
            line.starts_with(&format!("demo-nvl-node/{gpu}: published whole"))
                && line.contains("h100-scheduler-slice, h100-scheduler-slice-3"),
            "{line}"
        );
    }
    let node = summary.shareable_node.as_ref().unwrap();
    assert!(
        node.devices.iter().all(|d| !d.contains("shareable")),
        "{node:#?}"
    );
    let single = claim(&summary, "scheduler-slice-gpu");
    assert_eq!(single.allocated_by, None, "{single:#?}");
    assert!(
        single
            .error
            .as_deref()
            .unwrap()
            .contains("h100-scheduler-slice"),
        "{single:#?}"
    );
    assert!(claim(&summary, "whole-gpu").prepared);
    let printed = demo::print::render_summary(&summary, false);
    assert!(
        printed.contains("not shareable: demo-nvl-node/gpu-0: published whole"),
        "{printed}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_claims_on_an_a100_mig_node() {
    let output = tempfile::tempdir().unwrap();
    let config = DemoConfig {
        discovery: kerf_kubelet_plugin::config::Discovery::MockProfile("a100-40gb-mig".into()),
        ..config(output.path())
    };
    let summary = demo::run(&config).await.unwrap();
    assert_clean(output.path());
    let mig = claim(&summary, "mig-1g-5gb");
    assert_eq!(mig.allocated_by, Some(AllocatedBy::Scheduler), "{mig:#?}");
    assert!(mig.prepared, "{mig:#?}");
    assert_eq!(mig.devices[0].device_type, "mig");
    assert_eq!(mig.devices[0].mig_profile.as_deref(), Some("1g.5gb"));
    // No GPU is published whole here (the A100s are in MIG mode, the H100 NVLs shareable):
    // the whole-GPU class selects nothing, and says so.
    let whole = claim(&summary, "whole-gpu");
    assert_eq!(whole.allocated_by, None);
    assert!(
        whole
            .error
            .as_deref()
            .unwrap()
            .contains("class \"gpu.kerf.dev\""),
        "{whole:#?}"
    );
}

/// With podman present, each prepared claim runs in a busybox container that sees its CDI
/// devices. Under CI (CI=true) a missing podman is a failure; elsewhere the test is skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn containers_see_their_cdi_devices() {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    let available = demo::containers::find_runtime(None);
    if let Err(e) = &available {
        assert!(!ci, "CI=true but the container runtime is unusable: {e}");
        println!("skipped: {e}");
        return;
    }
    let output = tempfile::tempdir().unwrap();
    let config = DemoConfig {
        run_containers: true,
        ..config(output.path())
    };
    let summary = demo::run(&config).await.unwrap();
    assert_eq!(summary.containers_error, None);
    assert_clean(output.path());
    print!("{}", demo::report::render_containers(&summary));
    // Containers run on the main node only; the dynamic-MIG node's claim has none.
    let prepared: Vec<&ClaimReport> = summary
        .claims
        .iter()
        .filter(|c| c.prepared && c.node.as_deref() == Some("demo-node"))
        .collect();
    assert!(prepared.len() >= 5);
    assert!(claim(&summary, "mig-1g-5gb").container.is_none());
    for claim in prepared {
        let run = claim
            .container
            .as_ref()
            .unwrap_or_else(|| panic!("{claim:#?}"));
        assert_eq!(run.exit_code, Some(0), "{}: {}", claim.name, run.output);
        let uid = claim.uid.as_deref().unwrap();
        assert!(
            run.output.contains(&format!("KERF_CLAIM_UID={uid}")),
            "{}",
            run.output
        );
        for device in &claim.devices {
            let node = format!("/dev/nvidia{}", device.device.trim_start_matches("gpu-"));
            assert!(
                run.output.contains(&node),
                "{} lacks {node}: {}",
                claim.name,
                run.output
            );
        }
    }
    let slice = claim(&summary, "slice-10gi").container.as_ref().unwrap();
    assert!(
        slice
            .output
            .contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"),
        "{}",
        slice.output
    );
    // The container reaches its GPU's daemon: the pipe directory it is told about holds the
    // daemon's socket and PID file.
    let pipe = &mps_of(&summary, "slice-10gi").container_pipe_directory;
    for expected in [
        format!("CUDA_MPS_PIPE_DIRECTORY={pipe}"),
        format!("ls -l {pipe}:"),
        " control".to_owned(),
        " nvidia-cuda-mps-control.pid".to_owned(),
    ] {
        assert!(
            slice.output.contains(&expected),
            "{expected}: {}",
            slice.output
        );
    }
    assert!(
        slice
            .output
            .lines()
            .any(|l| l.starts_with('s') && l.ends_with(" control")),
        "control is a socket: {}",
        slice.output
    );
}
