//! The pod of one GPU's control daemon, made from the plugin's own pod: the same image,
//! security context and program, so that the daemon has exactly the plugin's privileges and
//! an upgrade of the plugin's image changes both alike (running daemons keep theirs).

use std::collections::BTreeMap;
use std::hash::Hasher as _;
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Container, HostPathVolumeSource, LocalObjectReference, Pod, PodSecurityContext, PodSpec,
    ResourceRequirements, SecurityContext, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kerf_core::mps::{CONTAINER_SHM_DIRECTORY, MpsDirectories};

use crate::error::{Error, Result};

/// Label of every daemon pod's role, beside `app.kubernetes.io/name: kerf`.
pub(super) const COMPONENT_LABEL: &str = "app.kubernetes.io/component";
/// The value of [`COMPONENT_LABEL`] on daemon pods.
pub(super) const COMPONENT: &str = "mps-control-daemon";
/// Label naming the GPU a daemon pod serves.
pub(super) const GPU_LABEL: &str = "gpu.kerf.dev/gpu";
/// The daemon pods' ServiceAccount: no API access (its token is not mounted).
pub(super) const SERVICE_ACCOUNT: &str = "kerf-mps-control-daemon";
/// The container's name.
pub(super) const CONTAINER: &str = "mps-control-daemon";
/// The program's subcommand of `kerf-kubelet-plugin`.
pub(super) const SUBCOMMAND: &str = "mps-control-daemon";
/// How long the kubelet waits after SIGTERM beyond the daemon's own stop timeout: the
/// program sends `quit`, waits the stop timeout, then kills the daemon itself.
const GRACE_MARGIN: Duration = Duration::from_secs(5);

/// What a daemon pod copies from the plugin's pod (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct DaemonPodTemplate {
    /// Namespace of the daemon pods: the plugin's.
    pub namespace: String,
    /// Image of the daemon container.
    pub image: String,
    /// The program (the plugin's `command[0]`).
    pub program: String,
    image_pull_policy: Option<String>,
    image_pull_secrets: Option<Vec<LocalObjectReference>>,
    security_context: Option<SecurityContext>,
    pod_security_context: Option<PodSecurityContext>,
    /// The plugin's hostPath mounts the daemon needs too: the driver root (its tools and
    /// libraries) and `/dev` (the GPU's device nodes).
    host_mounts: Vec<(Volume, VolumeMount)>,
}

impl DaemonPodTemplate {
    /// The template of the plugin's pod `plugin`, whose first container is the plugin, for
    /// daemons run with the tools of `tools_root`; `image` overrides the plugin's image.
    ///
    /// # Errors
    /// [`Error::Config`] when the pod has no namespace, container, image or command.
    pub fn from_plugin_pod(plugin: &Pod, tools_root: &Path, image: Option<String>) -> Result<Self> {
        let name = plugin.metadata.name.as_deref().unwrap_or_default();
        let invalid = |what: &str| Error::Config(format!("plugin pod {name}: {what}"));
        let namespace = plugin
            .metadata
            .namespace
            .clone()
            .ok_or_else(|| invalid("no namespace"))?;
        let spec = plugin.spec.as_ref().ok_or_else(|| invalid("no spec"))?;
        let container = spec
            .containers
            .first()
            .ok_or_else(|| invalid("no container"))?;
        let image = image
            .or_else(|| container.image.clone())
            .ok_or_else(|| invalid("its container has no image (set --mps-daemon-image)"))?;
        let program = container
            .command
            .as_ref()
            .and_then(|c| c.first())
            .cloned()
            .ok_or_else(|| {
                invalid("its container has no command, so the daemon's program is unknown")
            })?;
        Ok(DaemonPodTemplate {
            namespace,
            image,
            program,
            image_pull_policy: container.image_pull_policy.clone(),
            image_pull_secrets: spec.image_pull_secrets.clone(),
            security_context: container.security_context.clone(),
            pod_security_context: spec.security_context.clone(),
            host_mounts: needed_host_mounts(spec, container, tools_root),
        })
    }

    /// The daemon pod of `dirs`' GPU on `node`, with the tools of `tools_root`.
    pub fn pod(&self, node: &str, dirs: &MpsDirectories, tools_root: &Path, stop: Duration) -> Pod {
        let gpu = dirs.gpu_uuid();
        let root = dirs.root();
        let mut mounts = vec![
            host_directory("mps-root", root, root, "DirectoryOrCreate"),
            host_directory(
                "mps-shm",
                &dirs.gpu_shm(),
                Path::new(CONTAINER_SHM_DIRECTORY),
                "Directory",
            ),
        ];
        mounts.extend(self.host_mounts.iter().cloned());
        let (volumes, volume_mounts) = mounts.into_iter().unzip();
        let labels = BTreeMap::from([
            ("app.kubernetes.io/name".to_owned(), "kerf".to_owned()),
            (COMPONENT_LABEL.to_owned(), COMPONENT.to_owned()),
            (GPU_LABEL.to_owned(), gpu.to_owned()),
        ]);
        let grace = stop.saturating_add(GRACE_MARGIN).as_secs();
        Pod {
            metadata: ObjectMeta {
                name: Some(daemon_pod_name(node, gpu)),
                namespace: Some(self.namespace.clone()),
                labels: Some(labels),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.to_owned()),
                restart_policy: Some("Always".to_owned()),
                service_account_name: Some(SERVICE_ACCOUNT.to_owned()),
                automount_service_account_token: Some(false),
                enable_service_links: Some(false),
                priority_class_name: Some("system-node-critical".to_owned()),
                // It serves pods already running on the node: no taint may evict it.
                tolerations: Some(vec![Toleration {
                    operator: Some("Exists".to_owned()),
                    ..Toleration::default()
                }]),
                termination_grace_period_seconds: Some(i64::try_from(grace).unwrap_or(i64::MAX)),
                security_context: self.pod_security_context.clone(),
                image_pull_secrets: self.image_pull_secrets.clone(),
                volumes: Some(volumes),
                containers: vec![self.container(dirs, tools_root, stop, volume_mounts)],
                ..PodSpec::default()
            }),
            status: None,
        }
    }

    fn container(
        &self,
        dirs: &MpsDirectories,
        tools_root: &Path,
        stop: Duration,
        volume_mounts: Vec<VolumeMount>,
    ) -> Container {
        let root = dirs.root();
        Container {
            name: CONTAINER.to_owned(),
            image: Some(self.image.clone()),
            image_pull_policy: self.image_pull_policy.clone(),
            command: Some(vec![self.program.clone()]),
            args: Some(vec![
                SUBCOMMAND.to_owned(),
                format!("--gpu={}", dirs.gpu_uuid()),
                format!("--mps-root={}", root.display()),
                format!("--tools-root={}", tools_root.display()),
                format!("--stop-timeout={}s", stop.as_secs().max(1)),
            ]),
            // The control daemon and its server need little CPU of their own; the server's
            // memory grows with its clients, so there is no limit, whose OOM kill would end
            // every client's CUDA context.
            resources: Some(ResourceRequirements {
                requests: Some(BTreeMap::from([
                    ("cpu".to_owned(), Quantity("10m".to_owned())),
                    ("memory".to_owned(), Quantity("32Mi".to_owned())),
                ])),
                ..ResourceRequirements::default()
            }),
            security_context: self.security_context.clone(),
            // As the plugin's: /dev is the host's, where the default path would be created.
            termination_message_path: Some("/tmp/termination-log".to_owned()),
            termination_message_policy: Some("FallbackToLogsOnError".to_owned()),
            volume_mounts: Some(volume_mounts),
            ..Container::default()
        }
    }
}

/// The name of the daemon pod of `gpu` on `node`: readable (the GPU's first UUID digits) and
/// unique per node and GPU (a hash of both), within the 63 characters of a label value.
pub fn daemon_pod_name(node: &str, gpu: &str) -> String {
    let mut hasher = fnv::FnvHasher::default();
    hasher.write(node.as_bytes());
    hasher.write(b"/");
    hasher.write(gpu.as_bytes());
    let digits: String = gpu
        .trim_start_matches("GPU-")
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(8)
        .collect::<String>()
        .to_ascii_lowercase();
    format!("kerf-mps-{digits}-{:016x}", hasher.finish())
}

/// The plugin's hostPath mounts the daemon needs, with their volumes, renamed so that they
/// cannot clash with the daemon's own: those at or above the tools root (the GPU operator's
/// driver root), inside the tools root's `usr` (a host driver's binaries and libraries) and
/// `/dev`.
fn needed_host_mounts(
    spec: &PodSpec,
    container: &Container,
    tools_root: &Path,
) -> Vec<(Volume, VolumeMount)> {
    let volumes = spec.volumes.as_deref().unwrap_or_default();
    container
        .volume_mounts
        .as_deref()
        .unwrap_or_default()
        .iter()
        .filter(|mount| {
            let path = Path::new(&mount.mount_path);
            path != Path::new("/")
                && (tools_root.starts_with(path)
                    || path.starts_with(tools_root.join("usr"))
                    || path == Path::new("/dev"))
        })
        .filter_map(|mount| {
            let volume = volumes.iter().find(|v| v.name == mount.name)?;
            volume.host_path.as_ref()?;
            let name = format!("plugin-{}", mount.name);
            Some((
                Volume {
                    name: name.clone(),
                    ..volume.clone()
                },
                VolumeMount {
                    name,
                    ..mount.clone()
                },
            ))
        })
        .collect()
}

fn host_directory(name: &str, host: &Path, container: &Path, kind: &str) -> (Volume, VolumeMount) {
    (
        Volume {
            name: name.to_owned(),
            host_path: Some(HostPathVolumeSource {
                path: host.display().to_string(),
                type_: Some(kind.to_owned()),
            }),
            ..Volume::default()
        },
        VolumeMount {
            name: name.to_owned(),
            mount_path: container.display().to_string(),
            ..VolumeMount::default()
        },
    )
}
