//! A node for the prepare benchmarks: the real kubelet plugin on its real Unix sockets, with
//! a mock H100 inventory, a fake driver root, claims served from memory (no API latency),
//! and the kubelet-side client of [`kerf_proto::client`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kerf_core::alloc::{ClaimPlacement, PlacedDevice, SliceSize};
use kerf_core::enforcement::Enforcement;
use kerf_core::inventory::Inventory;
use kerf_core::sharing::Sharing;
use kerf_kubelet_plugin::claim_reader::{ClaimReader, MemoryClaimReader};
use kerf_kubelet_plugin::config::{Discovery, PluginConfig};
use kerf_kubelet_plugin::plugin::{self, Connections, RunningPlugin};
use kerf_kubelet_plugin::preparer::PreparerConfig;
use kerf_proto::client::{Claim, KubeletClient, RegisteredPlugin};

use crate::gpu_tools::FakeGpuTools;
use crate::{Error, Result};

/// The DRA driver name the benchmark plugin runs as.
pub(crate) use kerf_tests::fixtures::DRIVER;
/// The benchmark node's name.
pub(crate) const NODE: &str = "bench-node";
/// Namespace of the benchmark claims.
pub(crate) const NAMESPACE: &str = "bench";
/// The mock inventory: 8 × H100 SXM 80GB in one NVLink domain.
pub(crate) const PROFILE: &str = "h100-sxm-80gb";

const GI: u64 = 1 << 30;

/// The plugin's files and sockets under `root`.
pub(crate) fn plugin_config(root: &Path) -> PluginConfig {
    PluginConfig {
        registration_socket: root.join("reg.sock"),
        dra_socket: root.join("dra.sock"),
        checkpoint_file: root.join("plugin").join("checkpoint.json"),
        claim_device_status: true,
        claim_cache: true,
        resync_period: Duration::from_secs(3600),
        // As the resync: the periodic daemon check would run in the middle of measurements.
        mps_check_interval: Duration::from_secs(3600),
        ..PluginConfig::under(root, DRIVER, NODE, Discovery::MockProfile(PROFILE.into()))
    }
}

/// Lays out a driver root with the files of a real 570 driver (every library kerf mounts,
/// with its `.so.1` link, and the tools), so that CDI specs have their real size.
///
/// # Errors
/// A file cannot be created.
pub(crate) fn make_driver_root(root: &Path) -> Result<()> {
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    let bin = root.join("usr/bin");
    for dir in [&lib, &bin] {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
    }
    let version = kerf_core::mock::MOCK_DRIVER_VERSION;
    for stem in kerf_core::driver_root::LIBRARY_STEMS {
        let file = format!("{stem}.{version}");
        let path = lib.join(&file);
        std::fs::write(&path, b"\x7fELF").map_err(|e| Error::io("write", &path, e))?;
        let link = lib.join(format!("{stem}.1"));
        std::os::unix::fs::symlink(&file, &link).map_err(|e| Error::io("symlink", &link, e))?;
    }
    for tool in kerf_core::driver_root::BINARIES {
        let path = bin.join(tool);
        std::fs::write(&path, b"#!/bin/sh\n").map_err(|e| Error::io("write", &path, e))?;
    }
    Ok(())
}

/// Benchmark claim number `n` of series `series` (series keep claim sets apart), as the
/// kubelet names it.
pub(crate) fn numbered_claim(series: u64, n: u64) -> Claim {
    let uid = crate::workload::claim_uid((series << 40) | n);
    Claim::new(NAMESPACE, &format!("claim-{series}-{n}"), &uid)
}

/// A ResourceClaim allocated as kerf's controller writes it: one 10Gi, 10 % MPS slice of
/// GPU `gpu` of `inventory`. Whether the plugin starts an MPS daemon for it depends on its
/// GPU tools ([`NodeLayout::gpu_tools`]).
///
/// # Errors
/// `gpu` is not a GPU of the inventory, or kerf-api refuses the allocation.
pub(crate) fn slice_claim(
    claim: &Claim,
    inventory: &Inventory,
    gpu: usize,
) -> Result<ResourceClaim> {
    let info = inventory
        .gpus
        .get(gpu)
        .ok_or_else(|| Error::Workload(format!("the mock inventory has no GPU {gpu}")))?;
    let placement = ClaimPlacement {
        key: claim.uid.clone(),
        devices: vec![PlacedDevice {
            request: "gpu".into(),
            device: info.device_name(),
            gpu_uuid: info.uuid.clone(),
            slice: Some(SliceSize {
                memory_bytes: 10 * GI,
                compute_percent: 10,
            }),
            sharing: Sharing::Mps,
            time_slice_interval: None,
            enforcement: Enforcement::default(),
        }],
    };
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let allocation = kerf_api::allocation_status(&placement, NODE, DRIVER, now)?;
    Ok(ResourceClaim {
        metadata: ObjectMeta {
            name: Some(claim.name.clone()),
            namespace: Some(NAMESPACE.into()),
            uid: Some(claim.uid.clone()),
            ..ObjectMeta::default()
        },
        spec: k8s_openapi::api::resource::v1::ResourceClaimSpec::default(),
        status: Some(ResourceClaimStatus {
            allocation: Some(allocation),
            ..ResourceClaimStatus::default()
        }),
    })
}

/// Lays out a node under `root` as `layout` says (boot ID, fake driver root) and discovers
/// its mock inventory: the plugin's configuration and GPUs, ready for [`plugin::start`].
///
/// # Errors
/// A file cannot be created, or discovery fails.
pub(crate) fn lay_out(root: &Path, layout: &NodeLayout<'_>) -> Result<(PluginConfig, Inventory)> {
    let mut config = plugin_config(root);
    if let Some(dir) = layout.cdi_dir {
        dir.clone_into(&mut config.cdi_dir);
    }
    if let Some(tools) = layout.gpu_tools {
        config.gpu_tools_root = Some(tools.root().to_owned());
        config.mps_root = tools.mps_root();
    }
    let boot_id = root.join("boot_id");
    std::fs::write(&boot_id, "kerf-bench-boot\n").map_err(|e| Error::io("write", &boot_id, e))?;
    make_driver_root(&config.driver_root)?;
    let inventory = plugin::discover(&config)?;
    Ok((config, inventory))
}

/// Path of the CDI spec a plugin configured by `config` writes for `claim`.
///
/// # Errors
/// The UID makes no valid file name.
pub(crate) fn spec_path(config: &PluginConfig, claim: &Claim) -> Result<PathBuf> {
    let kind = PreparerConfig::cdi_kind_for(&config.driver_name);
    let name = kerf_core::cdi::transient_spec_file_name(&kind, &claim.uid)?;
    Ok(config.cdi_dir.join(name))
}

/// Where a benchmark node keeps what does not live under its root.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct NodeLayout<'a> {
    /// The CDI specs' directory, instead of `<root>/cdi`.
    pub cdi_dir: Option<&'a Path>,
    /// GPU tools that make the plugin enforce MPS slices (start and adopt control daemons);
    /// without them slices are accounting only, as in mock mode without a mock driver root.
    pub gpu_tools: Option<&'a FakeGpuTools>,
}

/// The benchmark node: a running plugin and the claims it can read.
pub(crate) struct BenchNode {
    /// The plugin's configuration.
    pub config: PluginConfig,
    /// The mock inventory.
    pub inventory: Inventory,
    /// The claims the plugin reads.
    pub claim_reader: Arc<MemoryClaimReader>,
    plugin: RunningPlugin,
}

impl BenchNode {
    /// Lays out `root` and starts the plugin there. Must run inside a Tokio runtime.
    ///
    /// # Errors
    /// The files cannot be laid out or the plugin does not start.
    pub(crate) async fn start(root: &Path) -> Result<Self> {
        Self::start_with_cdi_dir(root, None).await
    }

    /// As [`BenchNode::start`], with the CDI specs in `cdi_dir` when given rather than under
    /// `root` (a node keeps them in `/var/run/cdi`, a tmpfs, and its checkpoint on disk).
    ///
    /// # Errors
    /// As [`BenchNode::start`].
    pub(crate) async fn start_with_cdi_dir(root: &Path, cdi_dir: Option<&Path>) -> Result<Self> {
        Self::start_with(
            root,
            &NodeLayout {
                cdi_dir,
                gpu_tools: None,
            },
        )
        .await
    }

    /// As [`BenchNode::start`], laid out as `layout` says.
    ///
    /// # Errors
    /// As [`BenchNode::start`].
    pub(crate) async fn start_with(root: &Path, layout: &NodeLayout<'_>) -> Result<Self> {
        let (config, inventory) = lay_out(root, layout)?;
        let claim_reader = Arc::new(MemoryClaimReader::default());
        let connections = Connections {
            mps_daemon_pods: None,
            device_status: None,
            claim_reader: Arc::clone(&claim_reader) as Arc<dyn ClaimReader>,
            publisher: None,
            events: Arc::new(kerf_kubelet_plugin::claim_events::MemoryClaimEvents::default()),
        };
        let plugin = plugin::start(&config, inventory.clone(), connections).await?;
        Ok(BenchNode {
            config,
            inventory,
            claim_reader,
            plugin,
        })
    }

    /// Adds `count` slice claims of series `series`, spread over the GPUs round-robin.
    ///
    /// # Errors
    /// As [`slice_claim`].
    pub(crate) fn add_claims(&self, series: u64, count: usize) -> Result<Vec<Claim>> {
        let gpus = self.inventory.gpus.len().max(1);
        (0..count)
            .map(|n| {
                let claim = numbered_claim(series, n as u64);
                self.claim_reader
                    .insert(slice_claim(&claim, &self.inventory, n % gpus)?);
                Ok(claim)
            })
            .collect()
    }

    /// Path of the CDI spec the plugin writes for `claim`.
    ///
    /// # Errors
    /// The UID makes no valid file name.
    pub(crate) fn spec_path(&self, claim: &Claim) -> Result<PathBuf> {
        spec_path(&self.config, claim)
    }

    /// Stops the plugin.
    ///
    /// # Errors
    /// A plugin task failed.
    pub(crate) async fn stop(self) -> Result<()> {
        self.plugin.shutdown().await.map_err(Error::from)
    }
}

/// The kubelet's side of the plugin's sockets, with the benchmarks' rule on top of the
/// kubelet's: every claim must be prepared with at least one device.
#[derive(Clone)]
pub(crate) struct Kubelet {
    plugin: RegisteredPlugin,
}

impl Kubelet {
    /// Registers the plugin configured by `config` as the kubelet does, without a limit on
    /// the calls' time (a timer per call would be measured too).
    ///
    /// # Errors
    /// A socket cannot be dialled, a call fails, or the registration is refused.
    pub(crate) async fn connect(config: &PluginConfig) -> Result<Self> {
        let client = KubeletClient::new().call_timeout(None);
        let plugin = client.register(&config.registration_socket).await?;
        Ok(Kubelet { plugin })
    }

    /// One `NodePrepareResources` call for `claims`.
    ///
    /// # Errors
    /// The call fails or breaks the kubelet's rules, or a claim has an error or no device.
    pub(crate) async fn prepare(&self, claims: &[Claim]) -> Result<()> {
        let answer = self.plugin.prepare_response(claims).await?;
        for (uid, outcome) in answer.outcomes() {
            match outcome {
                Ok(0) => return Err(claim_error(uid, "prepared without devices")),
                Ok(_) => {}
                Err(error) => return Err(claim_error(uid, error)),
            }
        }
        Ok(())
    }

    /// One `NodeUnprepareResources` call for `claims`.
    ///
    /// # Errors
    /// The call fails or breaks the kubelet's rules, or a claim has an error.
    pub(crate) async fn unprepare(&self, claims: &[Claim]) -> Result<()> {
        let answer = self.plugin.unprepare_response(claims).await?;
        answer.all_unprepared()?;
        Ok(())
    }

    /// The floor's round trip: `NodePrepareResources` with no claims, over the same socket
    /// and through the same server as a prepare, doing no work.
    ///
    /// # Errors
    /// The call fails.
    pub(crate) async fn empty_prepare(&self) -> Result<()> {
        self.plugin.prepare_response(&[]).await?;
        Ok(())
    }
}

fn claim_error(uid: &str, message: &str) -> Error {
    Error::Claim {
        uid: uid.to_owned(),
        message: message.to_owned(),
    }
}
