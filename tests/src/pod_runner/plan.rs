//! What a pod's spec asks the pod runner to run: per container the local program, its
//! arguments and environment, and the pod's hostPath volumes, checked as the kubelet checks
//! them before it starts a container.
//!
//! Upstream (kubernetes/kubernetes):
//! - `pkg/kubelet/kubelet_pods.go`, `makeEnvironmentVariables`: `env[].value` with `$(VAR)`
//!   references to earlier variables expanded, `valueFrom.fieldRef` through the downward API
//!   (`podFieldSelectorRuntimeValue`); a source that cannot be resolved fails the container
//!   with `CreateContainerConfigError` (`pkg/kubelet/kuberuntime/kuberuntime_container.go`,
//!   `startContainer`, `ErrCreateContainerConfig`);
//! - `pkg/kubelet/container/helpers.go`, `ExpandContainerCommandAndArgs`, and
//!   `third_party/forked/golang/expansion/expand.go`, `Expand`: `$(VAR)` in command and args;
//!   `$$` is a literal `$`; an unknown reference stays as written;
//! - `pkg/volume/hostpath/host_path.go`, `checkType`: `Directory`, `File`, `Socket`,
//!   `CharDevice`, `BlockDevice` must exist as such (`hostPath type check failed: <path> is
//!   not a directory`), `DirectoryOrCreate` creates the directory (0755) and `FileOrCreate`
//!   the file (0644); a failed check keeps the pod in `ContainerCreating` and is retried.
//!
//! What is not emulated: images (a container's `command[0]` names a local program instead),
//! mount namespaces (a hostPath volume mounted at its own path is the same directory; any
//! other mount is only recorded, [`UnemulatedMount`]), every other volume type, `envFrom`,
//! the other downward API fields, resource limits and security contexts.

use std::collections::BTreeMap;
use std::os::unix::fs::FileTypeExt as _;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Container, EnvVar, Pod, Volume};

/// A mount the pod runner cannot emulate: the container sees the host path at its own path,
/// not at `mount_path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnemulatedMount {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The container that mounts it.
    pub container: String,
    /// The volume's name.
    pub volume: String,
    /// The host path (with the mount's `subPath`, if any).
    pub host_path: PathBuf,
    /// Where the container asked to see it.
    pub mount_path: String,
}

/// Why a container waits instead of running: the `waiting` state's reason and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Waiting {
    pub(super) reason: &'static str,
    pub(super) message: String,
}

impl Waiting {
    fn config(message: String) -> Self {
        Self {
            reason: "CreateContainerConfigError",
            message,
        }
    }
}

/// How to start one container as a local process.
#[derive(Debug, Clone)]
pub(super) struct Launch {
    pub(super) program: PathBuf,
    pub(super) args: Vec<String>,
    pub(super) env: Vec<(String, String)>,
    pub(super) working_dir: PathBuf,
}

/// One container of the pod: its name, image and how to run it (or why it cannot run).
#[derive(Debug, Clone)]
pub(super) struct ContainerPlan {
    pub(super) name: String,
    pub(super) image: String,
    pub(super) launch: Result<Launch, Waiting>,
}

/// A hostPath volume to check (or create) before any container starts.
#[derive(Debug, Clone)]
pub(super) struct HostPath {
    volume: String,
    path: PathBuf,
    kind: String,
}

/// What the runner does with one pod.
#[derive(Debug, Clone)]
pub(super) struct PodPlan {
    pub(super) containers: Vec<ContainerPlan>,
    pub(super) host_paths: Vec<HostPath>,
    pub(super) unemulated: Vec<UnemulatedMount>,
    /// A volume the runner cannot provide: every container waits with this.
    pub(super) refused: Option<Waiting>,
}

/// The environment an image's config gives every container (Docker's default `PATH`), which
/// the pod's own variables may override.
const IMAGE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Plans `pod` with `programs` (image path of `command[0]` → local program).
pub(super) fn plan_pod(pod: &Pod, programs: &BTreeMap<String, PathBuf>) -> PodPlan {
    let spec = pod.spec.clone().unwrap_or_default();
    let volumes = spec.volumes.clone().unwrap_or_default();
    let refused = volumes.iter().find_map(|volume| {
        volume.host_path.is_none().then(|| {
            Waiting::config(format!(
                "pod runner: volume {:?} is {}, which the pod runner cannot provide (hostPath only)",
                volume.name,
                volume_kind(volume)
            ))
        })
    });
    let host_paths = volumes
        .iter()
        .filter_map(|volume| {
            let source = volume.host_path.as_ref()?;
            Some(HostPath {
                volume: volume.name.clone(),
                path: PathBuf::from(&source.path),
                kind: source.type_.clone().unwrap_or_default(),
            })
        })
        .collect();
    let mut unemulated = Vec::new();
    let containers = spec
        .containers
        .iter()
        .map(|container| {
            unemulated.extend(unemulated_mounts(pod, container, &volumes));
            ContainerPlan {
                name: container.name.clone(),
                image: container.image.clone().unwrap_or_default(),
                launch: launch(pod, container, programs),
            }
        })
        .collect();
    PodPlan {
        containers,
        host_paths,
        unemulated,
        refused,
    }
}

/// The volume source's field name, e.g. `emptyDir`.
fn volume_kind(volume: &Volume) -> String {
    serde_json::to_value(volume)
        .ok()
        .and_then(|value| {
            value
                .as_object()?
                .keys()
                .find(|key| key.as_str() != "name")
                .cloned()
        })
        .unwrap_or_else(|| "of no known type".to_owned())
}

fn unemulated_mounts(pod: &Pod, container: &Container, volumes: &[Volume]) -> Vec<UnemulatedMount> {
    let mounts = container.volume_mounts.clone().unwrap_or_default();
    mounts
        .into_iter()
        .filter_map(|mount| {
            let volume = volumes.iter().find(|v| v.name == mount.name)?;
            let source = volume.host_path.as_ref()?;
            let mut host_path = PathBuf::from(&source.path);
            if let Some(sub) = mount.sub_path.as_deref().filter(|s| !s.is_empty()) {
                host_path.push(sub);
            }
            (Path::new(&mount.mount_path) != host_path).then(|| UnemulatedMount {
                namespace: pod.metadata.namespace.clone().unwrap_or_default(),
                pod: pod.metadata.name.clone().unwrap_or_default(),
                container: container.name.clone(),
                volume: mount.name.clone(),
                host_path,
                mount_path: mount.mount_path,
            })
        })
        .collect()
}

fn launch(
    pod: &Pod,
    container: &Container,
    programs: &BTreeMap<String, PathBuf>,
) -> Result<Launch, Waiting> {
    let command = container.command.clone().unwrap_or_default();
    let image = container.image.clone().unwrap_or_default();
    let Some((first, rest)) = command.split_first() else {
        return Err(Waiting::config(format!(
            "pod runner: container {:?} has no command; image {image:?}'s entrypoint is unknown here",
            container.name
        )));
    };
    let Some(program) = programs.get(first) else {
        // The kubelet's nearest state: the image cannot be had (`ErrImagePull`).
        return Err(Waiting {
            reason: "ErrImagePull",
            message: format!(
                "pod runner: no local program for command {first:?} of image {image:?}"
            ),
        });
    };
    if container.env_from.as_ref().is_some_and(|e| !e.is_empty()) {
        return Err(Waiting::config(format!(
            "pod runner: container {:?} uses envFrom, which the pod runner does not resolve",
            container.name
        )));
    }
    let env = environment(pod, container)?;
    let lookup: BTreeMap<&str, &str> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let args = rest
        .iter()
        .chain(container.args.iter().flatten())
        .map(|arg| expand(arg, &lookup))
        .collect();
    Ok(Launch {
        program: program.clone(),
        args,
        working_dir: PathBuf::from(container.working_dir.as_deref().unwrap_or("/")),
        env,
    })
}

/// The container's environment: the image's `PATH`, `HOSTNAME` (the runtime sets it to the
/// pod's name), then the pod's variables in order, each expanded against those before it.
fn environment(pod: &Pod, container: &Container) -> Result<Vec<(String, String)>, Waiting> {
    let mut env: Vec<(String, String)> = vec![
        ("PATH".to_owned(), IMAGE_PATH.to_owned()),
        (
            "HOSTNAME".to_owned(),
            pod.metadata.name.clone().unwrap_or_default(),
        ),
    ];
    for var in container.env.iter().flatten() {
        let value = match var.value_from {
            None => {
                let known: BTreeMap<&str, &str> =
                    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                expand(var.value.as_deref().unwrap_or(""), &known)
            }
            Some(_) => downward_value(pod, container, var)?,
        };
        env.retain(|(name, _)| *name != var.name);
        env.push((var.name.clone(), value));
    }
    Ok(env)
}

/// `valueFrom.fieldRef` for the fields the runner knows (`podFieldSelectorRuntimeValue`).
fn downward_value(pod: &Pod, container: &Container, var: &EnvVar) -> Result<String, Waiting> {
    let field = var
        .value_from
        .as_ref()
        .and_then(|from| from.field_ref.as_ref())
        .map(|field| field.field_path.as_str());
    let spec = pod.spec.as_ref();
    let value = match field {
        Some("metadata.name") => pod.metadata.name.clone(),
        Some("metadata.namespace") => pod.metadata.namespace.clone(),
        Some("metadata.uid") => pod.metadata.uid.clone(),
        Some("spec.nodeName") => spec.and_then(|s| s.node_name.clone()),
        Some("spec.serviceAccountName") => spec.and_then(|s| s.service_account_name.clone()),
        _ => {
            return Err(Waiting::config(format!(
                "pod runner: container {:?}: env {:?} has a source the pod runner does not resolve ({})",
                container.name,
                var.name,
                serde_json::to_string(&var.value_from).unwrap_or_default()
            )));
        }
    };
    Ok(value.unwrap_or_default())
}

/// `expansion.Expand`: `$(NAME)` → its value when known, `$$` → `$`, anything else as is.
pub(super) fn expand(input: &str, vars: &BTreeMap<&str, &str>) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(close) = inner.find(')')
        {
            let name = &inner[..close];
            if let Some(value) = vars.get(name) {
                out.push_str(value);
            } else {
                out.push_str("$(");
                out.push_str(name);
                out.push(')');
            }
            rest = &inner[close + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

impl HostPath {
    /// `checkType` of the volume's `type`, creating what `*OrCreate` asks for.
    ///
    /// # Errors
    /// The message the kubelet's mount failure carries.
    pub(super) fn prepare(&self) -> Result<(), String> {
        let failed = |what: &str| {
            format!(
                "MountVolume.SetUp failed for volume {:?} : hostPath type check failed: {} is not a {what}",
                self.volume,
                self.path.display()
            )
        };
        let meta = std::fs::metadata(&self.path);
        match self.kind.as_str() {
            "DirectoryOrCreate" if meta.is_err() => std::fs::create_dir_all(&self.path)
                .map_err(|e| format!("creating {}: {e}", self.path.display())),
            "FileOrCreate" if meta.is_err() => std::fs::File::create(&self.path)
                .map(drop)
                .map_err(|e| format!("creating {}: {e}", self.path.display())),
            "Directory" | "DirectoryOrCreate" => meta
                .ok()
                .filter(std::fs::Metadata::is_dir)
                .map(drop)
                .ok_or_else(|| failed("directory")),
            "File" | "FileOrCreate" => meta
                .ok()
                .filter(std::fs::Metadata::is_file)
                .map(drop)
                .ok_or_else(|| failed("file")),
            "Socket" => check(meta, |t| t.is_socket()).ok_or_else(|| failed("socket file")),
            "CharDevice" => {
                check(meta, |t| t.is_char_device()).ok_or_else(|| failed("character device"))
            }
            "BlockDevice" => {
                check(meta, |t| t.is_block_device()).ok_or_else(|| failed("block device"))
            }
            _ => Ok(()),
        }
    }
}

fn check(
    meta: std::io::Result<std::fs::Metadata>,
    is: impl Fn(std::fs::FileType) -> bool,
) -> Option<()> {
    meta.ok().filter(|m| is(m.file_type())).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expansion_is_the_kubelets() {
        let vars = BTreeMap::from([("A", "x"), ("B", "y")]);
        assert_eq!(expand("$(A)-$(B)", &vars), "x-y");
        assert_eq!(expand("$$(A) $(C) $ $x", &vars), "$(A) $(C) $ $x");
        assert_eq!(expand("$(A", &vars), "$(A");
    }
}
