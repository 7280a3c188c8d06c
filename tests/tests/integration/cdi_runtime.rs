//! A real CDI runtime: the CDI IDs that NodePrepareResources returns for each kind of claim
//! (whole GPU, slice, MIG device) are given to podman, which resolves them from the plugin's
//! spec files and starts a real container; the container reports what it sees.
//!
//! Under `CI=true` a missing podman, runc or static busybox fails these tests; elsewhere
//! they are skipped with the reason printed.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::common;
use crate::common::{DRIVER_FILES, GIB, TestNode, uid};
use kerf_core::cdi::env_key;
use kerf_kubelet_plugin::plugin::RunningPlugin;
use kerf_proto::client::Claim;
use kerf_tests::fake_kubelet::{FakeKubelet, Pod, PreparedPod};
use kerf_tests::podman::{ContainerRun, Podman};

/// podman, or `None` after printing why the test is skipped (a failure under `CI=true`).
fn podman_or_skip(test: &str) -> Option<Podman> {
    Podman::for_test(test, std::env::var("CI").is_ok_and(|v| v == "true"))
}

/// A node with one claim of each kind, prepared by the plugin for one pod through the fake
/// kubelet, and a busybox root file system.
struct Prepared {
    node: TestNode,
    plugin: RunningPlugin,
    podman: Podman,
    whole: (Claim, u32),
    slice: (Claim, u32),
    mig: (Claim, u32, u32, u32),
    devices: PreparedPod,
}

async fn prepare(test: &str) -> Option<Prepared> {
    let podman = podman_or_skip(test)?;
    let node = TestNode::new("a100-40gb-mig");
    let (whole_minor, mig_parent, mig) = node.whole_gpu_and_mig();
    let slice_minor = node.another_whole_gpu(whole_minor);
    let whole = node.device_claim("whole", &uid(1), &format!("gpu-{whole_minor}"));
    let slice = node.slice_claim("slice", &uid(2), slice_minor, 10 * GIB, 25);
    let mig_claim = node.device_claim("mig", &uid(3), &mig.device_name(mig_parent));
    let plugin = node.start_plugin().await;
    let kubelet = FakeKubelet::start(node.kubelet_config());
    kubelet
        .wait_for_registration(1, Duration::from_secs(10))
        .await
        .unwrap();
    let pod = [&whole, &slice, &mig_claim]
        .into_iter()
        .fold(Pod::new("pod-1"), |pod, c| {
            pod.with_claim(common::DRIVER, c.clone())
        });
    let devices = kubelet.prepare_pod(&pod).await.unwrap();
    podman.make_rootfs(&node.root.join("rootfs")).unwrap();
    Some(Prepared {
        node,
        plugin,
        podman,
        whole: (whole, whole_minor),
        slice: (slice, slice_minor),
        mig: (mig_claim, mig_parent, mig.gi_cap_minor, mig.ci_cap_minor),
        devices,
    })
}

/// What the container saw.
#[derive(Debug, Default)]
struct Report {
    env: BTreeMap<String, String>,
    /// Mount point → options, from /proc/mounts.
    mounts: BTreeMap<String, String>,
    /// Device node path → (type, major, minor) as `stat` prints them.
    nodes: BTreeMap<String, (String, String, String)>,
    /// Driver file path → (readonly|writable|missing, first line).
    files: BTreeMap<String, (String, String)>,
}

impl Report {
    fn assert_char_device(&self, path: &str) {
        let node = self
            .nodes
            .get(path)
            .unwrap_or_else(|| panic!("{path} missing in the container: {:?}", self.nodes));
        // Mock mode backs every node by /dev/null: character device 1:3.
        assert_eq!(
            node,
            &(
                "character special file".to_owned(),
                "1".to_owned(),
                "3".to_owned()
            ),
            "{path}"
        );
    }

    fn env(&self, name: &str) -> Option<&str> {
        self.env.get(name).map(String::as_str)
    }
}

/// Runs in the container; sections are parsed by [`parse_report`].
fn report_script() -> String {
    let files = DRIVER_FILES.map(|f| format!("/{f}")).join(" ");
    format!(
        r#"echo '== env'; env
echo '== mounts'; cat /proc/mounts
echo '== nodes'
for f in /dev/nvidia* /dev/nvidia-caps/*; do
  [ -e "$f" ] && stat -c '%n|%F|%t|%T' "$f"
done
echo '== files'
for f in {files}; do
  if [ ! -f "$f" ]; then echo "$f|missing|"; continue; fi
  if touch "$f" 2>/dev/null; then w=writable; else w=readonly; fi
  echo "$f|$w|$(head -n 1 "$f")"
done
echo '== end'
"#
    )
}

fn parse_report(output: &str) -> Report {
    let mut report = Report::default();
    let mut section = "";
    for line in output.lines() {
        if let Some(name) = line.strip_prefix("== ") {
            section = match name {
                "env" => "env",
                "mounts" => "mounts",
                "nodes" => "nodes",
                "files" => "files",
                _ => "",
            };
            continue;
        }
        match section {
            "env" => {
                if let Some((k, v)) = line.split_once('=') {
                    report.env.insert(k.to_owned(), v.to_owned());
                }
            }
            "mounts" => {
                let fields: Vec<&str> = line.split_whitespace().collect();
                if fields.len() >= 4 {
                    report
                        .mounts
                        .insert(fields[1].to_owned(), fields[3].to_owned());
                }
            }
            "nodes" => {
                let parts: Vec<&str> = line.split('|').collect();
                if let [path, kind, major, minor] = parts[..] {
                    report.nodes.insert(
                        path.to_owned(),
                        (kind.to_owned(), major.to_owned(), minor.to_owned()),
                    );
                }
            }
            "files" => {
                let parts: Vec<&str> = line.splitn(3, '|').collect();
                if let [path, state, first] = parts[..] {
                    report
                        .files
                        .insert(path.to_owned(), (state.to_owned(), first.to_owned()));
                }
            }
            _ => {}
        }
    }
    assert!(
        output.contains("== end"),
        "the script did not finish: {output}"
    );
    report
}

impl Prepared {
    fn ids(&self, claim: &Claim) -> Vec<String> {
        self.devices[&claim.uid]
            .iter()
            .flat_map(|d| d.cdi_device_ids.clone())
            .collect()
    }

    /// Starts a container with `ids` and returns its report.
    async fn run(&self, ids: Vec<String>) -> Report {
        parse_report(&self.run_script(ids, report_script()).await)
    }

    /// Starts a container with `ids` that runs `script`, and returns its output.
    async fn run_script(&self, ids: Vec<String>, script: String) -> String {
        let podman = self.podman.clone();
        let cdi_dir = self.node.cdi_dir();
        let rootfs = self.node.root.join("rootfs");
        tokio::task::spawn_blocking(move || {
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
        .unwrap_or_else(|e| panic!("{e}"))
    }

    async fn finish(self) {
        self.plugin.shutdown().await.unwrap();
    }
}

/// The prefix of the per-device variables of `device` of `claim`.
fn device_env_key(claim: &Claim, device: &str) -> String {
    format!(
        "KERF_DEVICE_{}",
        env_key(&kerf_core::cdi::claim_device_name(&claim.uid, device))
    )
}

/// The control nodes, the read-only driver files and the claim-level env every kerf
/// container gets.
fn assert_common(report: &Report) {
    for path in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"] {
        report.assert_char_device(path);
    }
    assert_eq!(report.env("NVIDIA_VISIBLE_DEVICES"), Some("void"));
    for file in DRIVER_FILES {
        let path = format!("/{file}");
        let (state, _) = report
            .files
            .get(&path)
            .unwrap_or_else(|| panic!("{path} not reported: {report:?}"));
        assert_eq!(state, "readonly", "{path} must be mounted read-only");
        let options = report
            .mounts
            .get(&path)
            .unwrap_or_else(|| panic!("{path} is not a mount point: {:?}", report.mounts));
        assert!(
            options.split(',').any(|o| o == "ro"),
            "{path} mounted {options}"
        );
    }
    // The symlink libcuda.so.1 is mounted as the file it points to.
    assert_eq!(
        report.files["/usr/lib/x86_64-linux-gnu/libcuda.so.1"].1,
        "libcuda"
    );
    assert_eq!(report.files["/usr/bin/nvidia-smi"].1, "#!/bin/sh");
}

fn assert_claim_env(report: &Report, claim: &Claim) {
    assert_eq!(report.env("KERF_CLAIM_UID"), Some(claim.uid.as_str()));
    assert_eq!(report.env("KERF_CLAIM_NAME"), Some(claim.name.as_str()));
    assert_eq!(
        report.env("KERF_CLAIM_NAMESPACE"),
        Some(claim.namespace.as_str())
    );
}

/// `/dev/nvidia<N>` nodes the container has.
fn gpu_nodes(report: &Report) -> Vec<String> {
    report
        .nodes
        .keys()
        .filter(|p| {
            p.strip_prefix("/dev/nvidia")
                .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
        })
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_gpu_in_a_real_container() {
    let Some(prepared) = prepare("a_whole_gpu_in_a_real_container").await else {
        return;
    };
    let (claim, minor) = prepared.whole.clone();
    let report = prepared.run(prepared.ids(&claim)).await;
    assert_common(&report);
    assert_claim_env(&report, &claim);
    assert_eq!(gpu_nodes(&report), [format!("/dev/nvidia{minor}")]);
    report.assert_char_device(&format!("/dev/nvidia{minor}"));
    let device = format!("gpu-{minor}");
    assert_eq!(report.env("KERF_DEVICES"), Some(device.as_str()));
    let key = device_env_key(&claim, &device);
    assert_eq!(report.env(&format!("{key}_NAME")), Some(device.as_str()));
    assert_eq!(report.env(&format!("{key}_SHARING")), Some("Exclusive"));
    let uuid = prepared
        .node
        .inventory()
        .gpu_by_minor(minor)
        .unwrap()
        .uuid
        .clone();
    assert_eq!(report.env("KERF_DEVICE_UUIDS"), Some(uuid.as_str()));
    assert!(
        report.env.keys().all(|k| !k.starts_with("CUDA_MPS")),
        "a whole GPU has no MPS limits: {:?}",
        report.env
    );
    prepared.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slice_in_a_real_container_carries_its_limits() {
    let Some(prepared) = prepare("a_slice_in_a_real_container_carries_its_limits").await else {
        return;
    };
    let (claim, minor) = prepared.slice.clone();
    let report = prepared.run(prepared.ids(&claim)).await;
    assert_common(&report);
    assert_claim_env(&report, &claim);
    assert_eq!(gpu_nodes(&report), [format!("/dev/nvidia{minor}")]);
    assert_eq!(report.env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), Some("25"));
    assert_eq!(
        report.env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        Some("0=10240M")
    );
    assert_eq!(report.env("KERF_SHARING"), Some("MPS"));
    let bytes = (10 * GIB).to_string();
    assert_eq!(report.env("KERF_SLICE_MEMORY_BYTES"), Some(bytes.as_str()));
    assert_eq!(report.env("KERF_SLICE_COMPUTE_PERCENT"), Some("25"));
    let key = device_env_key(&claim, &format!("gpu-{minor}"));
    assert_eq!(
        report.env(&format!("{key}_MEMORY_BYTES")),
        Some(bytes.as_str())
    );
    assert_eq!(report.env(&format!("{key}_COMPUTE_PERCENT")), Some("25"));
    prepared.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_device_in_a_real_container_gets_its_capability_nodes() {
    let Some(prepared) =
        prepare("a_mig_device_in_a_real_container_gets_its_capability_nodes").await
    else {
        return;
    };
    let (claim, parent, gi, ci) = prepared.mig.clone();
    let report = prepared.run(prepared.ids(&claim)).await;
    assert_common(&report);
    assert_claim_env(&report, &claim);
    assert_eq!(gpu_nodes(&report), [format!("/dev/nvidia{parent}")]);
    for path in [
        format!("/dev/nvidia{parent}"),
        format!("/dev/nvidia-caps/nvidia-cap{gi}"),
        format!("/dev/nvidia-caps/nvidia-cap{ci}"),
    ] {
        report.assert_char_device(&path);
    }
    let device = &prepared.devices[&claim.uid][0].device_name;
    assert_eq!(report.env("KERF_DEVICES"), Some(device.as_str()));
    prepared.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_of_several_claims_go_into_one_container() {
    let Some(prepared) = prepare("devices_of_several_claims_go_into_one_container").await else {
        return;
    };
    let (whole, whole_minor) = prepared.whole.clone();
    let (slice, slice_minor) = prepared.slice.clone();
    let (mig, parent, gi, ci) = prepared.mig.clone();
    let ids: Vec<String> = [&whole, &slice, &mig]
        .into_iter()
        .flat_map(|c| prepared.ids(c))
        .collect();
    assert_eq!(ids.len(), 3);
    let report = prepared.run(ids).await;
    assert_common(&report);
    let mut expected = vec![
        format!("/dev/nvidia{whole_minor}"),
        format!("/dev/nvidia{slice_minor}"),
        format!("/dev/nvidia{parent}"),
    ];
    expected.sort();
    assert_eq!(gpu_nodes(&report), expected);
    report.assert_char_device(&format!("/dev/nvidia-caps/nvidia-cap{gi}"));
    report.assert_char_device(&format!("/dev/nvidia-caps/nvidia-cap{ci}"));
    // Per-device variables are keyed by claim and device, so all three survive together.
    for (claim, device) in [
        (&whole, format!("gpu-{whole_minor}")),
        (&slice, format!("gpu-{slice_minor}")),
        (&mig, prepared.devices[&mig.uid][0].device_name.clone()),
    ] {
        let key = device_env_key(claim, &device);
        assert_eq!(
            report.env(&format!("{key}_NAME")),
            Some(device.as_str()),
            "{claim:?}"
        );
    }
    prepared.finish().await;
}

#[test]
fn the_report_parser_reads_every_section() {
    let output = "== env\nA=1\nB=x=y\n== mounts\n/dev/vda /usr/bin/nvidia-smi ext4 ro,nosuid 0 0\n\
                  == nodes\n/dev/nvidia0|character special file|1|3\n\
                  == files\n/usr/bin/nvidia-smi|readonly|#!/bin/sh\n== end\n";
    let report = parse_report(output);
    assert_eq!(report.env("B"), Some("x=y"));
    assert_eq!(report.mounts["/usr/bin/nvidia-smi"], "ro,nosuid");
    report.assert_char_device("/dev/nvidia0");
    assert_eq!(report.files["/usr/bin/nvidia-smi"].0, "readonly");
}

/// The per-request variables and the claim's metadata files, seen from inside a container
/// given one claim: `KERF_GPU_*` and `KERF_<CLAIM>_GPU_*`, the KEP-5304 file of the request
/// and kerf's claim-wide file, both read-only and holding the claim's `DeviceMetadata`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_env_and_metadata_files_in_a_real_container() {
    let Some(prepared) = prepare("request_env_and_metadata_files_in_a_real_container").await else {
        return;
    };
    let (claim, minor) = prepared.slice.clone();
    let kep = format!(
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/{}/gpu/{}-metadata.json",
        claim.name,
        common::DRIVER
    );
    let kerf = format!("/var/run/kerf/claims/{}.json", claim.name);
    let script = format!(
        r#"env | grep '^KERF_' | sort
for f in {kep} {kerf}; do
  if touch "$f" 2>/dev/null; then echo "== $f writable"; else echo "== $f readonly"; fi
  tr -d '\n ' < "$f"; echo
done
"#
    );
    let output = prepared.run_script(prepared.ids(&claim), script).await;
    let uuid = prepared
        .node
        .inventory()
        .gpu_by_minor(minor)
        .unwrap()
        .uuid
        .clone();
    let claim_key = kerf_core::cdi::workload_env_name(&claim.name);
    for line in [
        format!("KERF_GPU_UUIDS={uuid}"),
        "KERF_GPU_COUNT=1".to_owned(),
        format!("KERF_GPU_MEMORY_BYTES={}", 10 * GIB),
        "KERF_GPU_COMPUTE_PERCENT=25".to_owned(),
        format!("KERF_{claim_key}_GPU_UUIDS={uuid}"),
    ] {
        assert!(
            output.lines().any(|l| l == line),
            "{line} missing: {output}"
        );
    }
    let mut lines = output.lines().skip_while(|l| !l.starts_with("== "));
    for path in [&kep, &kerf] {
        assert_eq!(
            lines.next(),
            Some(format!("== {path} readonly").as_str()),
            "{output}"
        );
        let doc: serde_json::Value = serde_json::from_str(lines.next().unwrap())
            .unwrap_or_else(|e| panic!("{path}: {e}: {output}"));
        assert_eq!(doc["kind"], "DeviceMetadata", "{path}");
        assert_eq!(doc["metadata"]["uid"], claim.uid.as_str(), "{path}");
        assert_eq!(doc["requests"][0]["name"], "gpu", "{path}");
        assert_eq!(
            doc["requests"][0]["devices"][0]["attributes"]["uuid"]["string"],
            uuid.as_str(),
            "{path}"
        );
    }
    prepared.finish().await;
}
